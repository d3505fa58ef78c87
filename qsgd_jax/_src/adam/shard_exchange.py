"""The compressed Adams' 1-bit exchange, on each device's own shards of the compressed leaves.

Under ``jax.pmap``, or a ``jax.shard_map`` manual over every mesh axis, a
device holds whole leaves, and the exchange takes them whole, as DeepSpeed
does. On a mesh whose model is sharded over other axes (``fsdp``,
``tensor``), a leaf is laid out over them and a device holds its shards
only: the compressed leaves are grouped by the mesh axes they are laid out
over (:func:`qsgd_jax._src.shards.group`; a leaf whole over some of them
laid out over those too, :func:`qsgd_jax._src.shards.spread`, so that each
device sends its part of it), and each group's exchange runs on
each device's own shards, in a ``jax.shard_map`` manual over the group's
axes. DeepSpeed's chunks are then cut from a device's shards, never from a
whole leaf, so nothing is gathered over those axes, and what crosses the
averaged axis is each shard's signs and scales.

Each group keeps its own worker and server errors, each device's own: the
state holds them as a tuple of one array a group (one group, of no axes,
under ``jax.pmap`` and plain data parallel; none when nothing is
compressed). One array for every group cannot be: the groups' errors are
laid out over different mesh axes (a leaf replicated over ``tensor`` has
the same error on each device of it, a leaf sharded over it one a device).
"""

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qsgd_jax._src import axes as axes_lib
from qsgd_jax._src import shards
from qsgd_jax._src.adam import common, sign_exchange


@dataclasses.dataclass(frozen=True)
class ExchangePlan:
  """The groups of compressed leaves, and each one's layout of its shards' chunks.

  Attributes:
    groups: the compressed leaves by the mesh axes they are laid out over;
      ``members`` index the compressed leaves, in tree order.
    layouts: each group's :class:`~qsgd_jax._src.adam.sign_exchange.SignLayout`
      of one device's shards (with inner axes, its ``1 / m`` share of each).
    shard_counts: the devices over each group's axes (1 for none).
  """

  groups: tuple[shards.ShardGroup, ...]
  layouts: tuple[sign_exchange.SignLayout, ...]
  shard_counts: tuple[int, ...]

  def worker_error_shapes(self) -> tuple[tuple[int, int], ...]:
    """Each group's worker error, ``(shards * n, width)``: the devices' of a group's axes
    end to end."""
    return tuple((count * layout.num_devices, layout.width)
                 for layout, count in zip(self.layouts, self.shard_counts, strict=True))

  def server_error_shapes(self) -> tuple[tuple[int], ...]:
    """Each group's server error, ``(shards * width,)``."""
    return tuple((count * layout.width,)
                 for layout, count in zip(self.layouts, self.shard_counts, strict=True))

  def wire_bits(self) -> float:
    """Bits one device sends over the outer axis: each group's two rounds."""
    return sum(layout.wire_bits() for layout in self.layouts)


class GroupsExchanged(NamedTuple):
  """What :func:`exchange` returns.

  Attributes:
    vectors: the 1-bit averages, one a compressed leaf, laid out as the
      leaves are; the same on every device of the averaged axes.
    worker_error: one a group, each device's new worker error.
    server_error: one a group, each device's new server error.
    all_finite: ``bool[]``, whether every device's vectors were finite, the
      same on every device of every shard.
  """

  vectors: list[jax.Array]
  worker_error: tuple[jax.Array, ...]
  server_error: tuple[jax.Array, ...]
  all_finite: jax.Array


def make_plan(compressed: list, sizes: tuple[int, ...], owner: str) -> ExchangePlan:
  """The :class:`ExchangePlan` of the compressed leaves (arrays, traced or not), each laid
  out as :func:`qsgd_jax._src.shards.spread` will lay it out for the exchange.

  Args:
    compressed: the compressed leaves, in tree order.
    sizes: the averaged axes' sizes, outer first (empty for one device).
    owner: the optimizer, named in errors.
  """
  n = sizes[0] if sizes else 1
  m = math.prod(sizes[1:])
  groups = shards.group(compressed, owner, [shards.spread_spec(x) for x in compressed])
  mesh = jax.sharding.get_abstract_mesh()
  layouts, counts = [], []
  for group in groups:
    shapes = [shards.local_shape(jnp.shape(compressed[i]), spec)
              for i, spec in zip(group.members, group.specs, strict=True)]
    layouts.append(_layout(shapes, n, m))
    counts.append(math.prod(mesh.shape[name] for name in group.axes))
  return ExchangePlan(groups, tuple(layouts), tuple(counts))


def initial_errors(params, leaves: common.Leaves, reduction_axes: axes_lib.Axes, axis_size,
                   owner: str):
  """``init``'s compressed leaves of ``params`` (those ``leaves`` says are) and their zero
  worker and server errors, one a group (empty tuples when nothing is compressed).

  The errors are each device's own: typed varying over the averaged axes
  where ``init`` runs inside ``jax.shard_map``, as the exchange's new errors
  are, so that an update in the same mapped function finds the same types in
  both branches of its switch. The axes' sizes are read where they are
  bound, else from ``axis_size``.

  Returns:
    ``(compressed, worker_error, server_error)``.
  """
  flat = jax.tree.leaves(params)
  compressed = [flat[i] for i in leaves.compressed]
  sizes = common.mapped_sizes(reduction_axes, axis_size, owner)
  exchange_plan = make_plan(compressed, sizes, owner)
  spread, _ = shards.spread(compressed)
  worker, server = [], []
  for group, layout in zip(exchange_plan.groups, exchange_plan.layouts, strict=True):

    def zeros(leaves, per_device, shared, layout=layout):
      del per_device, shared
      return leaves, (jnp.zeros(layout.worker_error_shape().shape, jnp.float32),
                      jnp.zeros(layout.server_error_shape().shape, jnp.float32)), ()

    _, (worker_error, server_error), _ = shards.own_shards(
        zeros, group.axes, group.specs, [spread[i] for i in group.members])
    worker.append(worker_error)
    server.append(server_error)
  errors = (tuple(worker), tuple(server))
  if not reduction_axes.is_local and worker:
    try:
      errors = axes_lib.as_varying(errors, reduction_axes.name)
    except NameError:  # init outside the mapped function, sized by axis_size.
      pass
  return (compressed, *errors)


def check_error_shapes(owner: str, worker_error, exchange_plan: ExchangePlan) -> None:
  """Raises ``ValueError`` where the state's worker errors are not the plan's shapes."""
  expected = exchange_plan.worker_error_shapes()
  if not isinstance(worker_error, tuple):
    raise ValueError(
        f"{owner}: the state's worker_error is one array, shaped "
        f"{getattr(worker_error, 'shape', None)}; it is a tuple of one array a group of "
        f"compressed leaves ({len(expected)} here). A state saved before the errors were "
        "kept a group holds the only group's: pass it as state._replace(worker_error="
        "(state.worker_error,), server_error=(state.server_error,)).")
  held = tuple(tuple(e.shape) for e in worker_error)
  if held == expected:
    return
  n = exchange_plan.layouts[0].num_devices if exchange_plan.layouts else 1
  devices = (f"{held[0][0] // exchange_plan.shard_counts[0]} devices"
             if held and exchange_plan.shard_counts else "no compressed leaf")
  raise ValueError(
      f"{owner}: the state's worker_error has shapes {held}, this step needs {expected} (one "
      "float32[shards * n, width] a group of compressed leaves laid out over the same mesh "
      f"axes): the state was made for {devices} on the compressed axis and this step runs "
      f"on {n}, or for another parameter tree or layout over the mesh. Initialize the "
      "optimizer for this mesh, or carry the state over with "
      "qsgd_jax.resize_state(..., drop=True).")


def exchange(exchange_plan: ExchangePlan, vectors: list, worker_error: tuple,
             server_error: tuple, reduction_axes: axes_lib.Axes,
             sizes: tuple[int, ...]) -> GroupsExchanged:
  """The 1-bit average over every averaged axis of the compressed leaves' ``vectors``.

  Args:
    exchange_plan: the compressed leaves' :class:`ExchangePlan`.
    vectors: this device's vectors, one a compressed leaf, laid out as it is.
    worker_error, server_error: this device's errors, one a group.
    reduction_axes: the averaged axes.
    sizes: their sizes, outer first (empty for one device).

  Returns:
    A :class:`GroupsExchanged`.
  """
  vectors, specs = shards.spread(vectors)
  out, worker, server = list(vectors), [], []
  nonfinite = jnp.float32(0)
  for group, group_worker, group_server in zip(exchange_plan.groups, worker_error,
                                               server_error, strict=True):
    averages, (new_worker, new_server), group_nonfinite = shards.own_shards(
        functools.partial(_own_shards_exchange, reduction_axes=reduction_axes, sizes=sizes,
                          shard_axes=group.axes),
        group.axes, group.specs, [vectors[i] for i in group.members],
        (group_worker, group_server))
    for i, average in zip(group.members, averages, strict=True):
      out[i] = average
    worker.append(new_worker)
    server.append(new_server)
    nonfinite = nonfinite + group_nonfinite
  return GroupsExchanged(shards.gather_back(out, specs), tuple(worker), tuple(server),
                         nonfinite == 0)


def _own_shards_exchange(vectors, errors, shared, *, reduction_axes, sizes, shard_axes):
  """One group's exchange on this device's shards; how many shards were not finite, the
  same on every device of the group's axes."""
  del shared
  out = _exchange_on_device(vectors, *errors, reduction_axes, sizes)
  nonfinite = jnp.logical_not(out.all_finite).astype(jnp.float32)
  if shard_axes:  # Every shard of every leaf skips together.
    nonfinite = jax.lax.psum(nonfinite, shard_axes)
  return out.vectors, (out.worker_error, out.server_error), nonfinite


def _layout(shapes, n: int, m: int) -> sign_exchange.SignLayout:
  """The exchange's layout, over ``n`` devices, of vectors of ``shapes`` cut in ``m`` shares."""
  return sign_exchange.sign_layout([-(-math.prod(shape) // m) for shape in shapes], n)


def _inner_name(reduction_axes: axes_lib.Axes):
  inner = reduction_axes.inner
  return inner if len(inner) > 1 else inner[0]


def _exchange_on_device(vectors: list[jax.Array], worker_error: jax.Array,
                        server_error: jax.Array, reduction_axes: axes_lib.Axes,
                        sizes: tuple[int, ...]) -> sign_exchange.Exchanged:
  """The 1-bit average over every averaged axis of this device's ``vectors``, whole.

  Over one axis, DeepSpeed's exchange of each vector whole. With inner axes
  (``m`` devices a node), each vector is zero-padded to a multiple of ``m``
  and reduce-scattered over the inner axes in float32, so that each device of
  a node holds the node's mean of one ``1/m`` share; the shares are averaged
  over the outer axis by the 1-bit exchange (a scale a share), and
  all-gathered over the inner axes. The outer links carry ``1/m`` of each
  vector's signs a device.

  Returns:
    :class:`~qsgd_jax._src.adam.sign_exchange.Exchanged`, its ``vectors`` the
    averages in the vectors' shapes, the same on every device.
  """
  n = sizes[0] if sizes else 1
  m = math.prod(sizes[1:])
  shapes = [v.shape for v in vectors]
  flat = [v.reshape(-1).astype(jnp.float32) for v in vectors]
  layout = _layout(shapes, n, m)
  if m > 1:
    inner = _inner_name(reduction_axes)
    rows = jnp.concatenate(
        [jnp.pad(v, (0, m * share - v.shape[0])).reshape(m, share)
         for v, share in zip(flat, layout.sizes, strict=True)], axis=1)
    rows = axes_lib.as_varying(rows, inner)
    mine = jax.lax.psum_scatter(rows, inner, scatter_dimension=0) / np.float32(m)
    flat = list(jnp.split(mine, np.cumsum(layout.sizes)[:-1]))
  out = sign_exchange.exchange(flat, worker_error, server_error, layout, reduction_axes.outer)
  averages = out.vectors
  if m > 1:
    # Each share's finiteness travels with it, as a last element that is NaN if not.
    flag = jnp.where(out.all_finite, np.float32(0), np.float32(np.nan))[None]
    gathered = axes_lib.all_gather_replicated(jnp.concatenate([*averages, flag]), inner)
    averages = [part.reshape(-1) for part in jnp.split(
        gathered[:, :-1], np.cumsum(layout.sizes)[:-1], axis=1)]
    out = out._replace(all_finite=jnp.all(jnp.isfinite(gathered[:, -1])))
  return out._replace(vectors=[a[:math.prod(shape)].reshape(shape)
                               for a, shape in zip(averages, shapes, strict=True)])
