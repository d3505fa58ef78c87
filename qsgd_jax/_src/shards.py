"""Each device's own shard of leaves laid out over mesh axes beyond a transform's own.

On a mesh whose model is sharded over fast axes (``fsdp``, ``tensor``) inside
each data group, an average over the slow ``data`` axis runs inside a
``jax.shard_map`` manual over ``data`` alone. There each leaf is whole over
the other axes, and a compressor that flattens leaves into buckets would make
the compiler gather every leaf over them first. This module reads, from the
leaves' explicit sharding types (``jax.typeof(leaf).sharding``), the axes
each leaf is laid out over (its *shard axes*), groups the leaves by them, and
runs a function on each device's own shards of a group: a ``jax.shard_map``
manual over the group's axes, nested in the caller's, so that what is
compressed and sent is the device's own and no bucket spans two shards.

A leaf laid out over no axis beyond the transform's own is in the group of
no axes, run as it is: under ``jax.pmap``, or a ``jax.shard_map`` manual over
every mesh axis, every leaf is, and nothing changes.

A leaf whole over an explicit axis (a LayerNorm scale over ``tensor``, or
any leaf the model does not shard) is the same on every device along it:
exchanged as it is, each of them sends all of it over the slow axis.
:func:`spread` lays such a leaf out over those axes too, where one of its
dimensions divides among them, so that each device sends its own part; what
comes back is gathered over the fast axes by :func:`gather_back`.
"""

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P


class ShardGroup(NamedTuple):
  """Leaves laid out over the same mesh axes.

  Attributes:
    axes: the mesh axes the group's leaves are laid out over, in the mesh's
      order; empty for leaves whole on every device.
    members: the leaves' indices (in the order of the leaves grouped).
    specs: each member's ``PartitionSpec`` over ``axes``, one an array
      dimension.
  """

  axes: tuple[str, ...]
  members: tuple[int, ...]
  specs: tuple[P, ...]


def group(leaves: Sequence[Any], owner: str,
          specs: Sequence[P] | None = None) -> tuple[ShardGroup, ...]:
  """The leaves grouped by the mesh axes they are laid out over, beyond the manual ones.

  Args:
    leaves: arrays (traced or not) or ``jax.ShapeDtypeStruct``.
    owner: the caller, named in errors.
    specs: each leaf's ``PartitionSpec`` if not its own (:func:`spec_of`):
      :func:`spread_spec`'s, to plan an exchange of leaves spread later.

  Returns:
    The groups, those of fewer axes first (a group of no axes first of all);
    none for no leaves.

  Raises:
    ValueError: a mesh axis of more than one device is neither manual nor
      explicit (its layout is the compiler's, unknown here).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty:
    unknown = [name for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
               if kind == AxisType.Auto and mesh.shape[name] > 1]
    if unknown:
      raise ValueError(
          f"{owner}: the mesh axes {tuple(unknown)} are neither manual here nor explicit: "
          "their layout is the compiler's (AxisType.Auto), so each device's own shard of a "
          "leaf cannot be found, and a compressed average would gather every leaf over them "
          "first. Run the update under jax.sharding.explicit_axes(update, axes="
          f"{tuple(unknown)!r}, in_sharding=...) given the leaves' PartitionSpecs (as "
          "qsgd_jax.data_parallel does), make those mesh axes AxisType.Explicit, or make the "
          "jax.shard_map manual over them too.")
  by_axes: dict[tuple[str, ...], list[tuple[int, P]]] = {}
  for i, leaf in enumerate(leaves):
    spec = spec_of(leaf) if specs is None else specs[i]
    used = {name for entry in spec for name in _names(entry)}
    shard_axes = tuple(name for name in mesh.axis_names if name in used) if used else ()
    by_axes.setdefault(shard_axes, []).append((i, spec))
  return tuple(
      ShardGroup(axes=shard_axes, members=tuple(i for i, _ in found),
                 specs=tuple(spec for _, spec in found))
      for shard_axes, found in sorted(by_axes.items(), key=lambda item: (len(item[0]), item[0])))


def spec_of(leaf) -> P:
  """``leaf``'s ``PartitionSpec`` over explicit mesh axes, one entry a dimension (``None``
  where a dimension is whole); all ``None`` outside explicit sharding."""
  sharding = getattr(jax.typeof(leaf), "sharding", None)
  spec = tuple(getattr(sharding, "spec", ()) or ())
  ndim = len(jax.typeof(leaf).shape)
  return P(*spec, *([None] * (ndim - len(spec))))


def local_shape(shape: Sequence[int], spec: P) -> tuple[int, ...]:
  """The shape of one device's shard of an array of ``shape`` laid out by ``spec``, over
  the mesh set now (``jax.sharding.get_abstract_mesh``)."""
  mesh = jax.sharding.get_abstract_mesh()
  return tuple(size // math.prod(mesh.shape[name] for name in _names(entry))
               for size, entry in zip(shape, spec, strict=True))


def own_shards(fn: Callable, shard_axes: tuple[str, ...], specs: Sequence[P], leaves,
               per_device=(), shared=()):
  """``fn(leaves, per_device, shared)`` on this device's own shards, with ``shard_axes``
  manual.

  Args:
    fn: returns ``(leaves, per_device, shared)``: the leaves as it was given
      them, and pytrees of per-device and of shared arrays (not necessarily
      those it was given), ``shared`` typed invariant over ``shard_axes``
      (reduce what differs from shard to shard over them).
    shard_axes: the mesh axes to make manual; none calls ``fn`` as it is.
    specs: each leaf's ``PartitionSpec`` over ``shard_axes``.
    leaves: a list of arrays, laid out by ``specs``.
    per_device: a pytree of arrays of one or more dimensions, each device's
      own along all of ``shard_axes`` (its first dimension split over them).
    shared: a pytree of arrays the same on every device of ``shard_axes``.

  Returns:
    What ``fn`` returns, laid out as its inputs were.
  """
  if not shard_axes:
    return fn(leaves, per_device, shared)
  # Prefixes: one spec lays out every array of per_device (and of shared), whatever trees
  # fn takes and returns there.
  specs = (list(specs), P(shard_axes), P())
  return jax.shard_map(fn, in_specs=specs, out_specs=specs,
                       axis_names=set(shard_axes))(list(leaves), per_device, shared)


def spread(leaves: Sequence[Any]) -> tuple[list, list[P]]:
  """The leaves laid out also over the explicit mesh axes they are whole over, where they can
  be (by :func:`spread_spec`); and their specs before.

  ``jax.sharding.reshard``: on each device a slice of what it holds, nothing
  sent.

  Returns:
    ``(leaves, specs)``: the leaves, each laid out anew or as it was, and
    each one's ``PartitionSpec`` as it was (for :func:`gather_back`).
  """
  out, before = [], []
  for leaf in leaves:
    spec = spec_of(leaf)
    before.append(spec)
    wider = spread_spec(leaf)
    out.append(leaf if wider == spec else jax.sharding.reshard(leaf, wider))
  return out, before


def spread_spec(leaf) -> P:
  """How :func:`spread` lays ``leaf`` (an array or a ``jax.ShapeDtypeStruct``) out.

  A float leaf whole over explicit axes ``A`` (each of more than one device)
  is laid out over them along the dimension whose length on a device is the
  largest that their device count ``|A|`` divides (the first of equals; their
  names after the mesh axes that dimension is already laid out over). A leaf
  with no such dimension (a scalar), any other leaf, and every leaf outside
  explicit sharding, keeps its spec.
  """
  spec = spec_of(leaf)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not jax.numpy.issubdtype(jax.typeof(leaf).dtype, jax.numpy.floating):
    return spec
  used = {name for entry in spec for name in _names(entry)}
  whole_over = tuple(name for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
                     if kind == AxisType.Explicit and mesh.shape[name] > 1 and name not in used)
  count = math.prod(mesh.shape[name] for name in whole_over)
  shard = local_shape(jax.typeof(leaf).shape, spec)
  fits = [d for d in range(len(shard)) if shard[d] % count == 0]
  if not whole_over or not fits:
    return spec
  d = max(fits, key=lambda i: (shard[i], -i))
  entries = list(spec)
  entries[d] = (*_names(entries[d]), *whole_over)
  return P(*entries)


def spread_shape(leaf) -> tuple[int, ...]:
  """The shape of one device's part of ``leaf`` (an array or a ``jax.ShapeDtypeStruct``) as
  :func:`spread` lays it out: what a device encodes and sends of it."""
  return local_shape(jax.typeof(leaf).shape, spread_spec(leaf))


def gather_back(leaves: Sequence[Any], specs: Sequence[P]) -> list:
  """Each leaf laid out by its spec in ``specs`` again, as :func:`spread` found it.

  One all-gather over the axes :func:`spread` added, for all the leaves it
  spread over the same axes in the same dtype, typed varying over the same
  manual axes (their pieces flattened and joined): a collective for each such
  set rather than one a leaf, most of which would gather a LayerNorm's few
  hundred elements. A leaf it left is returned as it is.
  """
  out = list(leaves)
  by_gather: dict[tuple, list[tuple[int, int, tuple[str, ...]]]] = {}
  for i, (leaf, spec) in enumerate(zip(leaves, specs, strict=True)):
    now = spec_of(leaf)
    if now == spec:
      continue
    (d, added), = [(d, _names(now[d])[len(_names(spec[d])):]) for d in range(len(spec))
                   if now[d] != spec[d]]
    # Leaves typed varying over different manual axes are gathered apart, each keeping its own.
    manual = jax.typeof(leaf).manual_axis_type
    varying = frozenset(manual.varying) if manual is not None else frozenset()
    by_gather.setdefault((added, jax.typeof(leaf).dtype, varying), []).append((i, d, now))
  for (added, _, _), members in by_gather.items():
    laid_out_over = {name for _, _, now in members for entry in now for name in _names(entry)}
    gathered = jax.shard_map(
        functools.partial(_gather_pieces, added, [d for _, d, _ in members]),
        in_specs=([now for _, _, now in members],),
        out_specs=[specs[i] for i, _, _ in members],
        axis_names=laid_out_over)([leaves[i] for i, _, _ in members])
    for (i, _, _), leaf in zip(members, gathered, strict=True):
      out[i] = leaf
  return out


def map_spread(fn: Callable, columns: Sequence[Sequence[Any]], owner: str, shared=()):
  """``fn`` on each device's own parts of parallel lists of leaves, spread, then gathered back.

  The way of a transform whose state is laid out as the leaves it averages
  (error feedback, a momentum) and whose exchange is in one piece a device:
  the leaves are spread (:func:`spread`), grouped by the axes they are then
  laid out over (:func:`group`), and ``fn`` runs on each group's shards with
  those axes manual (:func:`own_shards`); what it returns is gathered back
  (:func:`gather_back`, one collective for all), laid out as ``columns``.
  Outside explicit sharding this is ``fn`` on all the leaves at once.

  Args:
    fn: ``fn(members, columns, shared) -> (columns, ok)``: given the indices
      of a group's leaves, a list a column of this device's parts of them and
      ``shared``, returns a list a column of arrays of those parts' shapes
      (as many columns as ``columns``) and ``ok``, a ``bool[]``, its parts'.
    columns: lists of leaves, the ``i``-th of each of the same shape and
      layout.
    owner: the caller, named in errors.
    shared: a pytree of arrays the same on every device of the model axes:
      any array ``fn`` needs (a traced learning rate) comes in here, not from
      its closure (``jax.shard_map`` does not close over explicitly sharded
      values).

  Returns:
    ``(columns, ok)``: ``fn``'s columns, each leaf laid out as in
    ``columns``, and ``ok`` of every part on every device, ``bool[]``.
  """
  spread_columns = [spread(column) for column in columns]
  specs = spread_columns[0][1]
  out = [list(column) for column, _ in spread_columns]
  ok = jax.numpy.bool_(True)
  for part in group(out[0], owner):
    results, _, parts_ok = own_shards(
        functools.partial(_on_parts, fn, len(columns), part.members, part.axes), part.axes,
        part.specs * len(columns), [column[i] for column in out for i in part.members], (),
        shared)
    count = len(part.members)
    for c, column in enumerate(out):
      for j, i in enumerate(part.members):
        column[i] = results[c * count + j]
    ok = ok & parts_ok
  gathered = gather_back([leaf for column in out for leaf in column], specs * len(columns))
  width = len(specs)
  return [gathered[c * width:(c + 1) * width] for c in range(len(columns))], ok


def _on_parts(fn: Callable, num_columns: int, members: tuple[int, ...],
              axes: tuple[str, ...], leaves: list, per_device, shared):
  """:func:`map_spread`'s ``fn`` for :func:`own_shards`: its columns end to end in one list."""
  del per_device
  count = len(members)
  given = [leaves[c * count:(c + 1) * count] for c in range(num_columns)]
  results, parts_ok = fn(members, given, shared)
  if axes:  # Every part of a leaf must say so: the same ok on every device of axes.
    parts_ok = jax.lax.pmin(parts_ok.astype(jax.numpy.int32), axes) > 0
  return [leaf for column in results for leaf in column], (), parts_ok


def _gather_pieces(axes: tuple[str, ...], dims: Sequence[int], pieces: list) -> list:
  """Each device's pieces, each laid out over ``axes`` along its dimension in ``dims``, whole
  again: one all-gather of them all, joined, then each piece's ``len(axes)`` parts put back
  along its dimension in the order of the devices along ``axes``."""
  joined = jax.numpy.concatenate([piece.reshape(-1) for piece in pieces])
  parts = jax.lax.all_gather(joined, axes, to="invarying")  # [devices along axes, joined]
  out, start = [], 0
  for piece, d in zip(pieces, dims, strict=True):
    of_piece = parts[:, start:start + piece.size].reshape(parts.shape[0], *piece.shape)
    whole = list(piece.shape)
    whole[d] *= parts.shape[0]
    out.append(jax.numpy.moveaxis(of_piece, 0, d).reshape(whole))
    start += piece.size
  return out


def _names(entry) -> tuple[str, ...]:
  """The mesh axes of one entry of a ``PartitionSpec``."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)
