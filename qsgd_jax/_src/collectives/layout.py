"""Moving a tree's leaves into a reduction plan's segments and blocks, and back.

The plan (``plan.py``) decides the layout from static shapes; these functions
move the arrays. A segment is its leaves in float32, each zero-padded to
whole runs, end to end (for the reduce-scatter: ``n`` rows, row ``j`` holding
shard ``j`` of each leaf); a block stacks segments as ``[batch, rows,
*element_shape]``, row ``j`` of a two-phase block being the piece for device
``j``.

A block can also stay unwritten, as :class:`BlockParts`: each of its elements
as the slices of the leaves (and the zeros) it is made of, so that an encode
reads the leaves where they lie (``Compressor.encode_concatenated``) rather
than after a copy of the whole gradient laid end to end.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from qsgd_jax._src import axes as axes_lib
from qsgd_jax._src.collectives.plan import REDUCE_SCATTER, ReductionPlan


class BlockParts(NamedTuple):
  """A block, ``[batch, rows, *element_shape]``, as the arrays each element is made of.

  Attributes:
    parts: ``parts[b][j]`` are arrays alike but in their first axis whose
      concatenation along it is element ``(b, j)``: slices of the leaves and
      zeros for the padding (``None`` when ``written`` is given).
    written: the block already written out, from :func:`join`, or ``None``.
  """

  parts: tuple[tuple[tuple[jax.Array, ...], ...], ...] | None
  written: jax.Array | None = None

  @property
  def batch(self) -> int:
    return len(self.parts) if self.written is None else self.written.shape[0]

  @property
  def rows(self) -> int:
    return len(self.parts[0]) if self.written is None else self.written.shape[1]


def segment_parts(plan: ReductionPlan, leaves: list[jax.Array]) -> list[tuple[jax.Array, ...]]:
  """Each segment as its leaves where they lie: arrays whose concatenation is the segment.

  In a segment of runs a leaf is its whole runs, ``float32[num_runs, run]`` (a
  view of the leaf), then its short last run zero-padded, ``[1, run]``; a leaf
  with one scale is its elements, ``float32[size]``. The segment's padding
  at the end is left out (:func:`block_parts` adds it).
  """
  if plan.method == REDUCE_SCATTER:
    raise ValueError(
        "A reduce-scatter segment holds shards of its leaves: use scatter_segment_vectors.")
  out = []
  for segment in plan.segments:
    parts = []
    for i in segment.leaves:
      flat = leaves[i].astype(jnp.float32).reshape(-1)
      parts.extend([flat] if segment.run is None else _runs(flat, segment.run))
    out.append(tuple(parts))
  return out


def _runs(flat: jax.Array, run: int) -> list[jax.Array]:
  """``flat``'s whole runs, ``[num_runs, run]``, then its short last run zero-padded."""
  whole, short = divmod(flat.size, run)
  parts = [flat[: whole * run].reshape(whole, run)] if whole else []
  if short:
    parts.append(jnp.pad(flat[whole * run:], (0, run - short))[None])
  return parts


def block_parts(plan: ReductionPlan, segments: list[tuple[jax.Array, ...]]) -> list[BlockParts]:
  """Each block of the plan, laid out as :func:`join` lays it, from each segment's parts."""
  out = []
  for block in plan.blocks:
    length, row_shape = block.element_shape[0], block.element_shape[1:]
    out.append(BlockParts(tuple(
        tuple(_cut(segments[k], j * length, (j + 1) * length, row_shape)
              for j in range(block.rows))
        for k in block.segments)))
  return out


def _cut(parts: tuple[jax.Array, ...], start: int, stop: int,
         row_shape: tuple[int, ...]) -> tuple[jax.Array, ...]:
  """Rows ``[start, stop)`` of ``parts`` end to end along their first axis, zeros past their end."""
  out, offset = [], 0
  for part in parts:
    low, high = max(start, offset), min(stop, offset + part.shape[0])
    if low < high:
      out.append(jax.lax.slice_in_dim(part, low - offset, high - offset))
    offset += part.shape[0]
  if stop > max(start, offset):
    out.append(jnp.zeros((stop - max(start, offset), *row_shape), jnp.float32))
  return tuple(out)


def written_blocks(plan: ReductionPlan, vectors: list[jax.Array]) -> list[BlockParts]:
  """Each block written out (:func:`join`) from each segment's vector, as :class:`BlockParts`."""
  return [BlockParts(None, block) for block in join(plan, vectors)]


def materialize(block: BlockParts) -> jax.Array:
  """The block written out, ``[batch, rows, *element_shape]``."""
  if block.written is not None:
    return block.written
  return jnp.stack([jnp.stack([_concatenate(parts) for parts in row]) for row in block.parts])


def piece(block: BlockParts, index: jax.Array) -> jax.Array:
  """Row ``index`` of every batch element, ``[batch, *element_shape]``, for a traced ``index``.

  Only that row is written out: a ``switch`` over the rows, each branch the
  concatenation of its own parts. Under ``jax.shard_map`` every branch is
  typed varying over the axes any part varies over (a row of padding alone
  varies over none).
  """
  if block.written is not None:
    return jax.lax.dynamic_index_in_dim(block.written, index, axis=1, keepdims=False)
  varying = sorted({name for row in block.parts for parts in row for part in parts
                    for name in axes_lib.varying_axes(part)})

  def branch(j):
    out = jnp.stack([_concatenate(row[j]) for row in block.parts])
    return axes_lib.as_varying(out, tuple(varying)) if varying else out

  return jax.lax.switch(index, [lambda j=j: branch(j) for j in range(block.rows)])


def _concatenate(parts: tuple[jax.Array, ...]) -> jax.Array:
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def segment_vectors(plan: ReductionPlan, leaves: list[jax.Array]) -> list[jax.Array]:
  """Each segment's ``float32[full_length]``, from the tree's leaves (zero-padded).

  For the reduce-scatter over one axis, the rows of :func:`scatter_segment_vectors`.
  """
  if plan.method == REDUCE_SCATTER:
    return scatter_segment_vectors(plan, {
        i: scatter_rows(plan, i, leaves[i].astype(jnp.float32)) for i in plan.compressed})
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


def scatter_rows(plan: ReductionPlan, i: int, leaf: jax.Array) -> jax.Array:
  """Reduce-scatter: ``[n, shard size]``, row ``j`` shard ``j`` of leaf ``i`` (dimension first).

  ``n`` counts every device of the plan's axes; a tiled leaf is zero-padded
  along the scatter dimension to ``n`` whole shards first.
  """
  rows = jnp.moveaxis(leaf, plan.scatter_dimension, 0)
  if plan.tiled and rows.shape[0] % plan.num_devices:
    padding = plan.num_devices * plan.shard_rows(i) - rows.shape[0]
    rows = jnp.concatenate([rows, jnp.zeros((padding, *rows.shape[1:]), rows.dtype)])
  return rows.reshape(plan.num_devices, -1)


def scatter_segment_vectors(plan: ReductionPlan, rows: dict[int, jax.Array]) -> list[jax.Array]:
  """Each reduce-scatter segment, ``float32[length]``: ``n`` rows (one an outer device) of its
  leaves' shards end to end, from each compressed leaf's ``[n, shard size]``."""
  return [end_to_end([rows[i] for i in segment.leaves], segment.offsets,
                     segment.length // plan.outer_size).reshape(-1)
          for segment in plan.segments]


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
