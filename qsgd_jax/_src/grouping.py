"""Batching many leaves into a few blocks, so that a few encodes cover a whole tree.

Encoding every leaf of a gradient tree on its own makes a program that grows
with the tree: ResNet-50's 161 leaves took half a minute to compile. A
:class:`Layout` puts the leaves into a few blocks with a leading batch axis,
each encoded by one ``jax.vmap`` of ``encode``, and takes them apart again:

* A compressor with a fixed ``bucket_size`` quantizes every bucket on its
  own. Each leaf is padded with zeros to whole buckets and all leaves are laid
  side by side along their last axis, in one block with a batch axis of 1:
  every bucket is quantized exactly as it would be alone (only the random
  draws differ).
* Any other compressor (``bucket_size=None``: one bucket a leaf; or no
  buckets) sees each leaf alone: leaves of one shape and dtype are stacked in
  one block, which the ``vmap`` encodes leaf by leaf. A tree has few distinct
  shapes, so this is still a few encodes.

Either way the wire format of each leaf is what the compressor defines; only
the number of encodes in the program changes.
"""

import dataclasses
import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from qsgd_jax._src import base


def fixed_bucket_size(compressor: base.Compressor) -> int | None:
  """The compressor's ``bucket_size`` where it is a fixed number of elements, else None."""
  bucket = getattr(compressor, "bucket_size", None)
  return bucket if isinstance(bucket, int) and not isinstance(bucket, bool) else None


@dataclasses.dataclass(frozen=True)
class Layout:
  """Which arrays go in which block, and how.

  Attributes:
    groups: the indices of the arrays in each block.
    lengths: each array's last-axis length in its block: padded to whole
      buckets when ``side_by_side``.
    side_by_side: a block is its arrays, zero-padded to ``lengths``,
      concatenated along the last axis, with a leading batch axis of 1.
      Otherwise a block stacks its arrays (of one shape and dtype) along a new
      leading axis.
  """

  groups: tuple[tuple[int, ...], ...]
  lengths: tuple[int, ...]
  side_by_side: bool

  def block_sizes(self) -> list[tuple[int, int]]:
    """``(batch, length)`` of each block: how many elements, and an element's last-axis length."""
    if self.side_by_side:
      return [(1, sum(self.lengths[k] for k in group)) for group in self.groups]
    return [(len(group), self.lengths[group[0]]) for group in self.groups]

  def join(self, arrays: Sequence[jax.Array]) -> list[jax.Array]:
    """One ``[batch, ...]`` block a group, from arrays laid out as :func:`layout` saw them."""
    if not self.side_by_side:
      return [jnp.stack([arrays[k] for k in group]) for group in self.groups]

    def padded(k):
      width = self.lengths[k] - arrays[k].shape[-1]
      return jnp.pad(arrays[k], [(0, 0)] * (arrays[k].ndim - 1) + [(0, width)])

    return [jnp.concatenate([padded(k) for k in group], axis=-1)[None] for group in self.groups]

  def split(self, blocks: Sequence[jax.Array]) -> list[jax.Array]:
    """Inverse of :meth:`join`, each array with its padding (``[..., lengths[k]]``)."""
    out = [None] * len(self.lengths)
    for block, group in zip(blocks, self.groups, strict=True):
      if not self.side_by_side:
        for i, k in enumerate(group):
          out[k] = block[i]
        continue
      starts = itertools.accumulate((self.lengths[k] for k in group), initial=0)
      for k, start in zip(group, starts, strict=False):
        out[k] = jax.lax.slice_in_dim(block[0], start, start + self.lengths[k], axis=-1)
    return out


def layout(compressor: base.Compressor, arrays: Sequence) -> Layout:
  """The :class:`Layout` of ``arrays`` (anything with ``shape`` and ``dtype``) for ``compressor``.

  Side by side, the arrays must agree on every axis but the last.
  """
  bucket = fixed_bucket_size(compressor)
  last = [a.shape[-1] if a.shape else 1 for a in arrays]
  if bucket is not None:
    return Layout(groups=(tuple(range(len(arrays))),),
                  lengths=tuple(-(-m // bucket) * bucket for m in last), side_by_side=True)
  by_kind = {}
  for k, a in enumerate(arrays):
    by_kind.setdefault((tuple(a.shape), jnp.dtype(a.dtype)), []).append(k)
  return Layout(groups=tuple(map(tuple, by_kind.values())), lengths=tuple(last),
                side_by_side=False)


def encode_blocks(compressor: base.Compressor, key: jax.Array, blocks: Sequence[jax.Array],
                  batch_dims: int = 1) -> list[base.Payload]:
  """Encodes each ``[batch..., ...]`` block, every element under its own key.

  Args:
    compressor: the compressor.
    key: a PRNG key; block ``g`` folds in ``g``, then splits over its batch.
    blocks: from :meth:`Layout.join`, perhaps with more batch axes.
    batch_dims: how many leading axes to map ``encode`` over.

  Returns:
    One batched :class:`~qsgd_jax.Payload` a block.
  """
  encode = compressor.encode
  for _ in range(batch_dims):
    encode = jax.vmap(encode)
  return [encode(jax.random.split(jax.random.fold_in(key, g), block.shape[:batch_dims]), block)
          for g, block in enumerate(blocks)]


def decode_blocks(compressor: base.Compressor, payloads: Sequence[base.Payload],
                  batch_dims: int = 1) -> list[jax.Array]:
  """Decodes each batched payload of :func:`encode_blocks`."""
  decode = compressor.decode
  for _ in range(batch_dims):
    decode = jax.vmap(decode)
  return [decode(payload) for payload in payloads]
