"""What a step of a communicating transform put on the wire: :class:`CompressionStats`."""

from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class CompressionStats(NamedTuple):
  """What one step of a compressed all-reduce or exchange put on the wire, per device.

  Attributes:
    wire_bits: ``float32[]``, bits this device sent (the accounting of
      :func:`qsgd_jax.wire_bytes`, from the payloads' static shapes); for
      :func:`~qsgd_jax.compressed_allreduce` including the one-float32
      all-reduce that tells every device whether any device's updates were
      non-finite.
    float32_bits: ``float32[]``, the library's one baseline: bits a device
      sends in synchronous data parallel, a float32 all-reduce of the same
      gradients (or, decentralized, parameters) every step over every device
      that computes its own: ``2 (n - 1) / n * 32`` a coordinate, ``n`` the
      devices of the transform's axes (for :func:`~qsgd_jax.diloco`, the
      workers times a worker's devices). Sent every step, also where the
      transform sent nothing.
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
    outer_compression_ratio: ``float32[]``, ``outer_float32_bits /
      outer_wire_bits``: the slow link's own saving, the figure that matters
      with two levels (``compression_ratio`` there also counts the float32
      traffic of the fast inner links).
    outer_float32_bits: ``float32[]``, the part of ``float32_bits`` that
      crosses the outer axis, the all-reduce run hierarchically:
      ``2 (n - 1) / n * 32`` a coordinate over ``inner_size``, ``n`` the
      outer axis's size.

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
  outer_float32_bits: jax.Array


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


class RunStats(NamedTuple):
  """What a run's steps put on the wire, summed per device: :func:`accumulate_stats`.

  Each field is a float64 numpy array of the shape of the stats it sums (a
  scalar, or one entry a device under ``jax.pmap``).

  Attributes:
    steps: steps counted.
    wire_bits: the sum of each step's :attr:`CompressionStats.wire_bits`:
      what the branch each step took sent (a float32 warm-up's steps in
      float32, a compressed step's compressed).
    float32_bits: the sum of each step's
      :attr:`CompressionStats.float32_bits`.
    outer_wire_bits: the sum of each step's
      :attr:`CompressionStats.outer_wire_bits`.
    outer_float32_bits: the sum of each step's
      :attr:`CompressionStats.outer_float32_bits`.

  Examples:
    >>> import numpy as np, qsgd_jax
    >>> step = qsgd_jax.CompressionStats(*map(np.float32, (100, 800, 8, np.nan, 100, 8, 800)))
    >>> run = qsgd_jax.accumulate_stats(None, step)
    >>> run = qsgd_jax.accumulate_stats(run, step._replace(wire_bits=np.float32(800)))
    >>> float(run.wire_bits), float(run.compression_ratio)
    (900.0, 1.7777777777777777)
  """

  steps: np.ndarray
  wire_bits: np.ndarray
  float32_bits: np.ndarray
  outer_wire_bits: np.ndarray
  outer_float32_bits: np.ndarray

  @property
  def compression_ratio(self) -> np.ndarray:
    """``float32_bits / wire_bits``: the run's saving, every step counted as it ran."""
    return self.float32_bits / self.wire_bits

  @property
  def outer_compression_ratio(self) -> np.ndarray:
    """``outer_float32_bits / outer_wire_bits``: the slow link's saving over the run."""
    return self.outer_float32_bits / self.outer_wire_bits


def accumulate_stats(total: RunStats | None, step) -> RunStats:
  """``total`` plus one step's :class:`CompressionStats`: a run's bytes, step by step.

  A transform's stats say what its *last* step sent; a run whose steps
  differ (1-bit Adam's and 0/1 Adam's float32 warm-up, then compressed steps;
  PowerSGD's ``start_iter``) sends their sum. Call this after every step, on
  the host, with the optimizer state: each step's stats are those of the
  branch it took. It reads them to the host (waiting for the step) and sums
  in float64.

  The compiled program's :func:`~qsgd_jax.wire_bytes` adds every branch of
  such a switch instead; :func:`~qsgd_jax.wire_bytes_by_branch` gives each
  branch's.

  Args:
    total: the sum so far, or ``None`` before the first step.
    step: the step's :class:`CompressionStats`, or any optax state holding
      them (as :func:`compression_stats` finds them).

  Returns:
    The new :class:`RunStats`.

  Raises:
    ValueError: ``step`` holds no stats.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> n = jax.local_device_count()
    >>> tx = qsgd_jax.powersgd("batch", start_iter=2)  # Two float32 steps, then rank 1.
    >>> state = jax.pmap(tx.init, axis_name="batch")(jnp.zeros((n, 256, 64)))
    >>> step = jax.pmap(tx.update, axis_name="batch")
    >>> run = None
    >>> for _ in range(4):
    ...   _, state = jax.block_until_ready(step(jnp.ones((n, 256, 64)), state))
    ...   run = qsgd_jax.accumulate_stats(run, state)
    >>> int(run.steps[0]), n == 1 or bool(1.9 < run.compression_ratio[0] < 2)
    (4, True)
  """
  stats = step if isinstance(step, CompressionStats) else compression_stats(step)
  if stats is None:
    raise ValueError(f"accumulate_stats: no CompressionStats in {type(step).__name__}: pass "
                     "the optimizer state of a communicating transform, or its stats.")
  wire, full, outer, outer_full = (np.asarray(x, np.float64) for x in (
      stats.wire_bits, stats.float32_bits, stats.outer_wire_bits, stats.outer_float32_bits))
  step_sums = RunStats(np.ones_like(wire), wire, full, outer, outer_full)
  if total is None:
    return step_sums
  return RunStats(*(np.asarray(a, np.float64) + b for a, b in zip(total, step_sums, strict=True)))


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
      outer_float32_bits=outer_full,
  )


def empty() -> CompressionStats:
  """Stats before any step: every field NaN."""
  return make(jnp.nan, jnp.nan, jnp.nan)
