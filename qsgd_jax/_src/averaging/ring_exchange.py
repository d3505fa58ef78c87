"""One step's exchange of low-precision decentralized SGD, on each device's own shards.

Each worker's differences are joined into Bagua's buckets, encoded, sent to
both ring neighbours in one ``uint32`` buffer and decoded, by
:func:`exchange_on_shards`. Under ``jax.pmap``, or a ``jax.shard_map``
manual over every mesh axis, it takes whole leaves. On a mesh whose model is
sharded over other axes, :func:`~qsgd_jax.low_precision_decentralized` runs
it once a group of leaves laid out over the same mesh axes, in a
``jax.shard_map`` manual over those axes: the buckets are then of a device's
own shards, and each device sends its shards to the devices holding the
same shards in the neighbouring workers.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from qsgd_jax._src import base, serialize, shards
from qsgd_jax._src.collectives import layout, plan


class Ring(NamedTuple):
  """What an exchange needs to know of the optimizer and the ring.

  Attributes:
    compressor: the :class:`~qsgd_jax.Compressor` of the differences.
    bucket_bytes: Bagua's bucket size, or ``None`` for one bucket.
    ring_axis: the axis the workers (or nodes) lie along.
    size: the workers along it.
    local_axes: in hierarchical mode, the axes of a node's devices.
    local_size: the devices of a node (1 without).
  """

  compressor: base.Compressor
  bucket_bytes: int | None
  ring_axis: str
  size: int
  local_axes: tuple[str, ...]
  local_size: int


class Moved(NamedTuple):
  """What :func:`exchange` returns.

  Attributes:
    updates: each leaf's decoded difference, float32 (this worker's update).
    lefts: each leaf's left replica, moved by its peer's decoded difference.
    rights: likewise, the right replica.
    ring_bits: ``float32[]``, the bits a device sent to other workers (nodes).
    node_bits: ``float32[]``, the bits it sent inside its node.
    elements: the elements of a device's own shards of the leaves.
  """

  updates: list[jax.Array]
  lefts: list[jax.Array]
  rights: list[jax.Array]
  ring_bits: jax.Array
  node_bits: jax.Array
  elements: int


def exchange(differences: list, lefts: list, rights: list, key: jax.Array, ring: Ring) -> Moved:
  """Each leaf's difference quantized and sent to both neighbours, a group of leaves laid out
  over the same mesh axes at a time (one group, of every leaf, without a sharded model).

  Args:
    differences: this worker's differences, one a leaf.
    lefts, rights: its replicas of its neighbours' models, one a leaf.
    key: this worker's key for the step.
    ring: the :class:`Ring`.
  """
  groups = shards.group(differences, "qsgd_jax.low_precision_decentralized")
  keys = [key] if len(groups) < 2 else list(jax.random.split(key, len(groups)))
  updates, new_lefts, new_rights = list(differences), list(lefts), list(rights)
  ring_bits = node_bits = jnp.float32(0)
  for group, group_key in zip(groups, keys, strict=True):
    count = len(group.members)
    out, _, (group_ring, group_node) = shards.own_shards(
        functools.partial(exchange_on_shards, ring=ring, shard_axes=group.axes),
        group.axes, group.specs * 3,
        [tree[i] for tree in (differences, lefts, rights) for i in group.members],
        shared=(group_key,))
    for k, i in enumerate(group.members):
      updates[i], new_lefts[i], new_rights[i] = out[k], out[count + k], out[2 * count + k]
    ring_bits, node_bits = ring_bits + group_ring, node_bits + group_node
  elements = sum(math.prod(shards.local_shape(jnp.shape(differences[i]), spec))
                 for group in groups for i, spec in zip(group.members, group.specs, strict=True))
  return Moved(updates, new_lefts, new_rights, ring_bits, node_bits, elements)


def exchange_on_shards(leaves, per_device, shared, *, ring: Ring, shard_axes: tuple[str, ...]):
  """This worker's quantized differences, sent to its neighbours, and their replicas moved.

  Args:
    leaves: the differences, then the left replicas, then the right ones:
      one a leaf of the group each, this device's shards.
    per_device: unused (``()``).
    shared: ``(key,)``, this worker's key for the group.
    ring: the :class:`Ring`.
    shard_axes: the group's mesh axes (manual here), if any.

  Returns:
    The decoded differences (the updates) and both replicas moved by their
    peers' decoded differences, as ``leaves`` came; ``()``; and the bits a
    device sent to other nodes and inside its node, ``float32[]`` each.
  """
  del per_device
  (key,) = shared
  if shard_axes:  # Each shard its own draws, as each worker has.
    key = jax.random.fold_in(key, jax.lax.axis_index(shard_axes))
  count = len(leaves) // 3
  differences, lefts, rights = leaves[:count], leaves[count:2 * count], leaves[2 * count:]
  compressor = ring.compressor
  buckets = _buckets([x.size * x.dtype.itemsize for x in lefts], ring.bucket_bytes)
  arrays = _arrays([x.shape for x in lefts], buckets, compressor)
  payloads = [compressor.encode(jax.random.fold_in(key, b), _joined(array, differences))
              for b, array in enumerate(arrays)]
  templates = [jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), p)
               for p in payloads]
  # All buckets travel as one uint32 buffer: one ppermute a direction.
  words = jnp.concatenate([serialize.to_words(p) for p in payloads])
  from_left, from_right, ring_bits, node_bits = _ring_exchange(words, ring)

  def as_leaves(decoded_arrays):
    out = [None] * count
    for array, decoded in zip(arrays, decoded_arrays, strict=True):
      flat = decoded.reshape(-1)
      for k, start in zip(array.leaves, array.offsets, strict=True):
        out[k] = flat[start : start + lefts[k].size].reshape(lefts[k].shape)
    return out

  def received(buffer):
    decoded, start = [], 0
    for template in templates:
      width = serialize.num_words(template)
      decoded.append(compressor.decode(
          serialize.from_words(buffer[start : start + width], template)))
      start += width
    return as_leaves(decoded)

  own = as_leaves([compressor.decode(p) for p in payloads])
  moved_lefts = [left + step.astype(left.dtype)
                 for left, step in zip(lefts, received(from_left), strict=True)]
  moved_rights = [right + step.astype(right.dtype)
                  for right, step in zip(rights, received(from_right), strict=True)]
  return own + moved_lefts + moved_rights, (), (jnp.float32(ring_bits), jnp.float32(node_bits))


def _buckets(leaf_bytes: list[int], bucket_bytes: int | None) -> list[list[int]]:
  """Bagua's bucketing: whole leaves, in order, until a bucket holds ``bucket_bytes`` or more."""
  if bucket_bytes is None:
    return [list(range(len(leaf_bytes)))]
  buckets, current, filled = [], [], 0
  for k, size in enumerate(leaf_bytes):
    current.append(k)
    filled += size
    if filled >= bucket_bytes:
      buckets.append(current)
      current, filled = [], 0
  return [*buckets, current] if current else buckets


def _ring_exchange(words, ring: Ring):
  """Sends ``words`` to both ring neighbours.

  Worker ``i`` sends to ``i + 1`` along ``to_right``, so what arrives came
  from its left peer; with two workers the one message serves as both. In
  hierarchical mode each device of a node sends its piece of the buffer and
  an ``all_gather`` over the local axes joins the pieces received.

  Returns:
    What came from the left and from the right, and the bits a device sent
    to other nodes and inside its node.
  """
  size, ring_axis, local_axes, local_size = ring.size, ring.ring_axis, ring.local_axes, (
      ring.local_size)
  to_right = [(i, (i + 1) % size) for i in range(size)]
  to_left = [(i, (i - 1) % size) for i in range(size)]
  messages = 1 if size == 2 else 2
  if not local_axes:
    from_left = jax.lax.ppermute(words, ring_axis, to_right)
    from_right = from_left if size == 2 else jax.lax.ppermute(words, ring_axis, to_left)
    return from_left, from_right, messages * 32 * words.size, 0.0
  piece = math.ceil(words.size / local_size)
  padded = jnp.pad(words, (0, piece * local_size - words.size))
  mine = jax.lax.dynamic_slice_in_dim(padded, jax.lax.axis_index(local_axes) * piece, piece)

  def receive(permutation):
    pieces = jax.lax.ppermute(mine, ring_axis, permutation)
    return jax.lax.all_gather(pieces, local_axes, tiled=True)[: words.size]

  from_left = receive(to_right)
  from_right = from_left if size == 2 else receive(to_left)
  # Each message: the piece to the neighbouring node, then inside the node the
  # all-gather's (k - 1) / k of the k pieces.
  return from_left, from_right, messages * 32 * piece, messages * 32 * piece * (local_size - 1)


class _Array(NamedTuple):
  """Leaves of one bucket encoded together: end to end, each padded to whole runs.

  Attributes:
    leaves: the leaves' indices.
    offsets: each leaf's first element.
    run: the compressor's bucket length for these leaves
      (:meth:`~qsgd_jax.Compressor.bucket_length`), or ``None`` where one scale
      spans the array, as Bagua's one minimum and maximum span its bucket.
    length: elements, padding included.
  """

  leaves: tuple[int, ...]
  offsets: tuple[int, ...]
  run: int | None
  length: int


def _arrays(shapes, buckets: list[list[int]], compressor: base.Compressor) -> list[_Array]:
  """The arrays each bucket is encoded as: its leaves by run length, no run across two."""
  arrays = []
  for bucket in buckets:
    by_run = {}
    for k in bucket:
      by_run.setdefault(compressor.bucket_length(shapes[k]), []).append(k)
    for run, members in by_run.items():
      offsets, end = plan.padded_offsets([math.prod(shapes[k]) for k in members], run or 1)
      arrays.append(_Array(tuple(members), offsets, run, end))
  return arrays


def _joined(array: _Array, leaves: list[jax.Array]) -> jax.Array:
  """The array's leaves in float32, end to end, as ``[runs, run]`` (or a vector)."""
  joined = layout.end_to_end([leaves[k].astype(jnp.float32).reshape(-1) for k in array.leaves],
                             array.offsets, array.length)
  return joined if array.run is None else joined.reshape(-1, array.run)
