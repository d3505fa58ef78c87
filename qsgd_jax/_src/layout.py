"""Moving a tree's leaves into a reduction plan's segments and blocks, and back.

The plan (``plan.py``) decides the layout from static shapes; these functions
move the arrays. A segment is its leaves in float32, each zero-padded to
whole runs, end to end (for the reduce-scatter: ``n`` rows, row ``j`` holding
shard ``j`` of each leaf); a block stacks segments as ``[batch, rows,
*element_shape]``, row ``j`` of a two-phase block being the piece for device
``j``.
"""

import math

import jax
import jax.numpy as jnp

from qsgd_jax._src.plan import REDUCE_SCATTER, ReductionPlan


def segment_vectors(plan: ReductionPlan, leaves: list[jax.Array]) -> list[jax.Array]:
  """Each segment's ``float32[full_length]``, from the tree's leaves (zero-padded)."""
  if plan.method == REDUCE_SCATTER:
    return [_shard_rows(plan, segment, leaves) for segment in plan.segments]
  return [end_to_end([leaves[i].astype(jnp.float32).reshape(-1) for i in segment.leaves],
                     segment.offsets, segment.full_length)
          for segment in plan.segments]


def end_to_end(pieces: list[jax.Array], offsets: tuple[int, ...], total: int) -> jax.Array:
  """``pieces`` end to end along their last axis, piece ``k`` from ``offsets[k]`` on.

  Each is zero-padded up to the next one's offset, the last one to ``total``.
  """
  ends = (*offsets[1:], total)
  return jnp.concatenate([
      jnp.pad(piece, [(0, 0)] * (piece.ndim - 1) + [(0, end - offset - piece.shape[-1])])
      for piece, offset, end in zip(pieces, offsets, ends, strict=True)], axis=-1)


def segment_leaves(plan: ReductionPlan, vectors: list[jax.Array]) -> dict[int, jax.Array]:
  """Each compressed leaf, float32 in its output shape, by its index.

  The inverse of :func:`segment_vectors`; for the reduce-scatter, ``vectors``
  are this device's rows, ``float32[length // n]`` a segment, and the leaves
  its shards.
  """
  leaves = {}
  for segment, vector in zip(plan.segments, vectors, strict=True):
    for i, offset in zip(segment.leaves, segment.offsets, strict=True):
      leaves[i] = output_leaf(plan, i, vector[offset : offset + math.prod(plan.output_shape(i))])
  return leaves


def output_leaf(plan: ReductionPlan, i: int, flat: jax.Array) -> jax.Array:
  """Leaf ``i`` in its output shape, from its elements in row order.

  For a tiled reduce-scatter the row order has the scatter dimension first
  (:func:`scatter_rows`); it is moved back.
  """
  shape = plan.output_shape(i)
  if plan.method == REDUCE_SCATTER and plan.tiled:
    d = plan.scatter_dimension
    return jnp.moveaxis(flat.reshape((shape[d], *shape[:d], *shape[d + 1:])), 0, d)
  return flat.reshape(shape)


def scatter_rows(plan: ReductionPlan, leaf: jax.Array) -> jax.Array:
  """Reduce-scatter: ``[n, shard size]``, row ``j`` the leaf's shard ``j`` (dimension first)."""
  return jnp.moveaxis(leaf, plan.scatter_dimension, 0).reshape(plan.outer_size, -1)


def _shard_rows(plan: ReductionPlan, segment, leaves: list[jax.Array]) -> jax.Array:
  """A reduce-scatter segment: its leaves' shards end to end in ``n`` rows, flattened."""
  rows = [scatter_rows(plan, leaves[i].astype(jnp.float32)) for i in segment.leaves]
  return end_to_end(rows, segment.offsets, segment.length // plan.outer_size).reshape(-1)


def join(plan: ReductionPlan, vectors: list[jax.Array]) -> list[jax.Array]:
  """``[batch, rows, *element_shape]`` a block, from each segment's ``float32[length]``."""
  blocks = []
  for block in plan.blocks:
    size = block.rows * block.width
    blocks.append(jnp.stack([
        _pad_end(vectors[k], size).reshape(block.rows, *block.element_shape)
        for k in block.segments]))
  return blocks


def split(plan: ReductionPlan, blocks: list[jax.Array], length=None) -> list[jax.Array]:
  """Inverse of :func:`join`: each segment's vector, padding dropped.

  A block may come as ``[batch, rows, ...]`` or ``[batch, ...]``; each vector
  is cut to ``length(segment)`` elements, by default the segment's length.
  """
  vectors = [None] * len(plan.segments)
  for block, data in zip(plan.blocks, blocks, strict=True):
    for b, k in enumerate(block.segments):
      segment = plan.segments[k]
      vectors[k] = data[b].reshape(-1)[: segment.length if length is None else length(segment)]
  return vectors


def _pad_end(vector: jax.Array, size: int) -> jax.Array:
  """``vector`` zero-padded to ``size`` elements, as a concatenation.

  XLA merges this concatenation into the one that made ``vector`` (the
  segment's leaves end to end); a ``jnp.pad`` of it instead was a second
  copy of the whole segment.
  """
  if vector.size == size:
    return vector
  return jnp.concatenate([vector, jnp.zeros(size - vector.size, vector.dtype)])
