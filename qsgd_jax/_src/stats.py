"""What a step of a communicating transform put on the wire: :class:`CompressionStats`."""

from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp

from qsgd_jax._src.plan import ReductionPlan
from qsgd_jax._src.reduction import Reduction


class CompressionStats(NamedTuple):
  """What one step of a compressed all-reduce or exchange put on the wire, per device.

  Attributes:
    wire_bits: ``float32[]``, bits this device sent (the accounting of
      :func:`qsgd_jax.wire_bytes`, from the payloads' static shapes); for
      :func:`~qsgd_jax.compressed_allreduce` including the one-float32
      all-reduce that tells every device whether any device's updates were
      non-finite.
    float32_bits: ``float32[]``, bits a float32 all-reduce of the same
      gradients (or, decentralized, parameters) would send:
      ``2 (n - 1) / n * 32`` a coordinate.
    compression_ratio: ``float32[]``, ``float32_bits / wire_bits``.
    elias_bits: ``float32[]``, for QSGD, ``wire_bits`` as it would be if
      every payload the step sent were Elias-coded (the smaller of the sparse
      and dense variants per bucket), float32 traffic unchanged. Averaged
      over the axis (one scalar ``pmean``, counted in ``wire_bits`` on the
      steps that measure it). Measured only
      when asked for (``track_elias``), every step or every ``k`` steps and
      held in between; NaN until first measured, when not asked for, and for
      other compressors or the ``"psum"`` method.
    outer_wire_bits: ``float32[]``, the part of ``wire_bits`` that crosses
      the outer axis of a two-level ``axis_name=(outer, inner)``: the slow
      links between nodes (all of it for one axis). A collective over every
      axis counts ``1 / inner_size`` of its bits, what crosses the outer axis
      when it runs hierarchically.
    outer_compression_ratio: ``float32[]``, what a float32 all-reduce would
      send across the outer axis, run hierarchically
      (``2 (n - 1) / n * 32`` a coordinate over ``inner_size``), over
      ``outer_wire_bits``: the slow link's own saving, the figure that
      matters with two levels (``compression_ratio`` there also counts the
      float32 traffic of the fast inner links).

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> n = jax.local_device_count()
    >>> tx = qsgd_jax.qsgd("batch", bits=4)
    >>> state = jax.pmap(tx.init, axis_name="batch")(jnp.zeros((n, 8192)))
    >>> _, state = jax.pmap(tx.update, axis_name="batch")(jnp.ones((n, 8192)), state)
    >>> stats = qsgd_jax.compression_stats(state)
    >>> bool(stats.wire_bits[0] < stats.float32_bits[0] / 6)
    True
  """

  wire_bits: jax.Array
  float32_bits: jax.Array
  compression_ratio: jax.Array
  elias_bits: jax.Array
  outer_wire_bits: jax.Array
  outer_compression_ratio: jax.Array


def compression_stats(opt_state) -> CompressionStats | None:
  """The :class:`CompressionStats` inside an optax state, wherever they sit.

  Args:
    opt_state: any optax state, e.g. of an ``optax.chain``,
      ``optax.MultiSteps`` or ``optax.inject_hyperparams`` holding a
      :func:`~qsgd_jax.compressed_allreduce` or a
      :func:`~qsgd_jax.low_precision_decentralized`; also a Flax NNX
      ``nnx.Optimizer``, its ``opt_state`` (arrays in ``nnx.OptArray``
      variables) or its ``nnx.State`` (states as mappings of their fields).

  Returns:
    The first stats found (depth first), their fields arrays (variables
    unwrapped), or ``None`` if there are none.

  Examples:
    >>> import jax.numpy as jnp, optax, qsgd_jax
    >>> params = jnp.zeros(8192)
    >>> stats = qsgd_jax.compression_stats(
    ...     optax.chain(qsgd_jax.qsgd("batch"), optax.adam(1e-3)).init(params))
    >>> type(stats).__name__
    'CompressionStats'
    >>> qsgd_jax.compression_stats(optax.adam(1e-3).init(params)) is None
    True
  """
  found = [node for node in jax.tree.leaves(opt_state, is_leaf=is_stats) if is_stats(node)]
  if not found:
    return None
  fields = found[0]._asdict() if isinstance(found[0], CompressionStats) else found[0]
  return CompressionStats(**{name: _only_leaf(fields[name]) for name in CompressionStats._fields})


def is_stats(node) -> bool:
  """Whether ``node`` is a :class:`CompressionStats`, or a mapping of its fields (Flax NNX)."""
  return isinstance(node, CompressionStats) or (
      isinstance(node, Mapping) and set(node) == set(CompressionStats._fields))


def _only_leaf(value):
  """The array in ``value``: itself, or the one leaf of a wrapper such as an NNX variable."""
  (leaf,) = jax.tree.leaves(value)
  return leaf


def make(wire_bits, full_bits, elias_bits, outer_wire_bits=None,
         outer_full_bits=None) -> CompressionStats:
  """Stats from bit counts (Python numbers or traced scalars), with their ratios.

  The outer link's counts default to the totals (one axis).
  """
  wire = jnp.asarray(wire_bits, jnp.float32)
  full = jnp.asarray(full_bits, jnp.float32)
  outer = wire if outer_wire_bits is None else jnp.asarray(outer_wire_bits, jnp.float32)
  outer_full = full if outer_full_bits is None else jnp.asarray(outer_full_bits, jnp.float32)
  return CompressionStats(
      wire_bits=wire,
      float32_bits=full,
      compression_ratio=full / wire,
      elias_bits=jnp.asarray(elias_bits, jnp.float32),
      outer_wire_bits=outer,
      outer_compression_ratio=outer_full / outer,
  )


def empty() -> CompressionStats:
  """Stats before any step: every field NaN."""
  return make(jnp.nan, jnp.nan, jnp.nan)


def elias_wire_bits(plan: ReductionPlan, sent: Reduction) -> jax.Array:
  """Bits this device sent in ``plan``, were every payload Elias-coded.

  Each collective that carries QSGD payloads (the two-phase all-to-all and
  all-gather, the all-gather method's all-gather) counts ``bytes_sent``
  scaled by the Elias size of the payloads it carried over their
  fixed-width size: this device's pieces for the all-to-all, every device's
  payloads for an all-gather. Every other collective (float32 leaves, inner
  axes) counts as it is.

  Args:
    plan: a plan for a :class:`~qsgd_jax.QSGD` compressor.
    sent: what :func:`~qsgd_jax._src.reduction.reduce` returned for it.

  Returns:
    A float32 scalar, this device's own estimate.
  """
  elias_bits = jax.vmap(jax.vmap(plan.compressor.elias_bits))
  total = jnp.float32(0)
  for collective in plan.collectives:
    bits = 8 * collective.bytes_sent
    if collective.carries in sent.payloads:
      coded = sum(jnp.sum(elias_bits(p).smaller)
                  for p in sent.payloads[collective.carries])
      bits = bits * coded / (8 * collective.result_bytes)
    total += bits
  return total
