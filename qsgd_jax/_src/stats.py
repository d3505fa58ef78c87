"""What a step of a communicating transform put on the wire: :class:`CompressionStats`."""

from typing import NamedTuple

import jax
import jax.numpy as jnp


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
      every payload were Elias-coded (the smaller of the sparse and dense
      variants per bucket), estimated from each device's first-phase
      payloads and averaged over the axis (one scalar ``pmean``, counted
      in ``wire_bits``); NaN for other compressors or when not tracked.
  """

  wire_bits: jax.Array
  float32_bits: jax.Array
  compression_ratio: jax.Array
  elias_bits: jax.Array


def compression_stats(opt_state) -> CompressionStats | None:
  """The :class:`CompressionStats` inside an optax state, wherever they sit.

  Args:
    opt_state: any optax state, e.g. of an ``optax.chain``,
      ``optax.MultiSteps`` or ``optax.inject_hyperparams`` holding a
      :func:`~qsgd_jax.compressed_allreduce` or a
      :func:`~qsgd_jax.low_precision_decentralized`.

  Returns:
    The first stats found (depth first), or ``None`` if there are none.
  """
  found = [
      node for node in jax.tree.leaves(
          opt_state, is_leaf=lambda node: isinstance(node, CompressionStats))
      if isinstance(node, CompressionStats)
  ]
  return found[0] if found else None


def make(wire_bits, full_bits, elias_bits) -> CompressionStats:
  """Stats from bit counts (Python numbers or traced scalars), with their ratio."""
  wire = jnp.asarray(wire_bits, jnp.float32)
  full = jnp.asarray(full_bits, jnp.float32)
  return CompressionStats(
      wire_bits=wire,
      float32_bits=full,
      compression_ratio=full / wire,
      elias_bits=jnp.asarray(elias_bits, jnp.float32),
  )
