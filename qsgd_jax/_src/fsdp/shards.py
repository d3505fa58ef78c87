"""Parameters laid out for FSDP: :func:`fsdp_shard` and :class:`FlatShard`.

Float leaves whose first dimension the devices divide are sharded along it,
others are flattened and zero-padded to whole shards (:class:`FlatShard`),
and small leaves stay replicated; each device's shard is placed without a
whole copy of the leaf on any one device.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from qsgd_jax._src import axes as axes_lib
from qsgd_jax._src.collectives import plan


@functools.partial(jax.tree_util.register_dataclass, data_fields=["shard"],
                   meta_fields=["shape"])
@dataclasses.dataclass(frozen=True)
class FlatShard:
  """A parameter the devices do not divide: flattened, zero-padded, and sharded.

  The leaf's ``size`` elements, in row-major order, are zero-padded to
  ``N * ceil(size / N)`` and cut into ``N`` equal shards, one a device:
  :func:`fsdp_gather` joins them, drops the padding and restores ``shape``,
  and its gradient keeps the padding exactly zero, so an optimizer's update
  of it is zero too (for any update that maps a zero gradient of a zero
  parameter to zero: SGD, Adam, weight decay). A pytree node: ``jax.tree``
  functions, optax and ``jax.shard_map`` see ``shard``, a vector.

  Attributes:
    shard: ``[N * ceil(size / N)]`` as a global array sharded over the axis;
      ``[ceil(size / N)]`` on each device inside ``jax.shard_map``.
    shape: the parameter's shape.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> mesh = jax.make_mesh((jax.device_count(),), ("batch",))
    >>> w = qsgd_jax.fsdp_shard({"w": jnp.ones((3, 5001))}, mesh, "batch")["w"]
    >>> w.shape, w.shard.size % jax.device_count(), w.shard.size >= 3 * 5001
    ((3, 5001), 0, True)
  """

  shard: jax.Array
  shape: tuple[int, ...]


def fsdp_shard(tree, mesh: jax.sharding.Mesh, axis_name: axes_lib.AxisName, *,
               min_sharded_size: int = plan.DEFAULT_MIN_COMPRESSED_SIZE):
  """Places a parameter tree on ``mesh`` for FSDP: each device holds a ``1/N`` shard.

  Float leaves of at least ``min_sharded_size`` elements are sharded over
  ``axis_name``: along their first dimension where the ``N`` devices divide
  it (the leaf is unchanged, as ``jax.device_put(leaf, P(axis_name))``
  places it), else as a :class:`FlatShard`. Smaller leaves (scalars, norm
  scales, biases) and integer leaves stay whole on every device: their
  gradients are summed exactly by autodiff, which for so few elements costs
  less than a gather and a reduce-scatter.

  ``min_sharded_size`` and :func:`fsdp_gather`'s ``min_compressed_size`` are
  one threshold (4096 elements by default; pass both the same value): what
  is sharded is gathered compressed, what is not stays whole. A
  :class:`FlatShard` under :func:`fsdp_gather`'s threshold is an error there;
  a leaf sharded along its rows under it travels in float32, as a small leaf
  sharded by hand (``jax.device_put(params, P(axis_name))``, JAX's FSDP
  tutorial) does.

  No device builds a whole leaf to shard it: a leaf on the host (a NumPy
  array, or any array-like with ``shape``, ``dtype`` and slicing) is placed
  with ``jax.make_array_from_callback``, each device given only its shard
  (the rows of the leaf that hold it), so a model larger than one device
  can be laid out from host memory; a ``jax.Array`` is resharded, or
  flattened and padded by one program whose output is sharded.

  Args:
    tree: a pytree of arrays (on the host or on devices), the whole parameters.
    mesh: the device mesh.
    axis_name: the mesh axis to shard over, or ``(outer, inner, ...)``.
    min_sharded_size: float leaves with fewer elements stay replicated.

  Returns:
    A pytree like ``tree`` (with :class:`FlatShard` nodes where needed) of
    global arrays sharded on ``mesh``: pass it to ``jax.shard_map``, whose
    ``in_specs`` are those shardings (``jax.tree.map(lambda x: x.sharding.spec,
    shards)``), and gather it there with :func:`fsdp_gather`.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> mesh = jax.make_mesh((jax.device_count(),), ("batch",))
    >>> shards = qsgd_jax.fsdp_shard({"w": jnp.ones((3, 5000)), "b": jnp.ones(5)}, mesh, "batch")
    >>> shards["w"].shape, shards["b"].sharding.spec
    ((3, 5000), P())
  """
  names = axes_lib.parse(axis_name, "fsdp_shard").names
  if not names:
    raise ValueError("fsdp_shard: axis_name must name a mesh axis, got None.")
  for name in names:
    if name not in mesh.shape:
      raise ValueError(f"fsdp_shard: axis {name!r} is not an axis of the mesh {dict(mesh.shape)}.")
  n = math.prod(mesh.shape[name] for name in names)
  sharded = NamedSharding(mesh, P(names if len(names) > 1 else names[0]))
  replicated = NamedSharding(mesh, P())

  def place(leaf):
    shape = tuple(np.shape(leaf))
    dtype = jax.dtypes.canonicalize_dtype(jnp.result_type(leaf))
    if math.prod(shape) < min_sharded_size or not jnp.issubdtype(dtype, jnp.floating):
      return jax.device_put(leaf, replicated)
    flat = not (shape and shape[0] % n == 0)
    if isinstance(leaf, jax.Array):  # On devices, or traced: each device computes its shard.
      return _shard_on_devices(leaf, sharded, n, flat)
    if flat:
      padded = (n * -(-math.prod(shape) // n),)
      return FlatShard(jax.make_array_from_callback(
          padded, sharded, lambda index: _flat_part(leaf, index[0], padded[0], dtype)), shape)
    return jax.make_array_from_callback(
        shape, sharded, lambda index: np.asarray(leaf[index], dtype))

  return jax.tree.map(place, tree)


def _shard_on_devices(leaf: jax.Array, sharded: NamedSharding, n: int, flat: bool):
  """``leaf`` laid out on ``sharded``: resharded, or padded by one program whose output is
  sharded, so that no device makes a whole copy of the leaf (or of its padded form) that
  it did not hold before. (The ``device_put`` after it moves nothing; under tracing,
  ``jax.eval_shape`` included, it gives the result its sharding.)"""
  if not flat:
    return jax.device_put(leaf, sharded)

  def pad(x):
    x = x.reshape(-1)
    return jnp.concatenate([x, jnp.zeros(-x.size % n, x.dtype)])

  return FlatShard(jax.device_put(jax.jit(pad, out_shardings=sharded)(leaf), sharded),
                   tuple(leaf.shape))


def _flat_part(leaf, index: slice, padded: int, dtype) -> np.ndarray:
  """Elements ``index`` of ``leaf`` (on the host) flattened and zero-padded to ``padded``,
  read as the rows of ``leaf`` that hold them rather than as the whole leaf."""
  shape = np.shape(leaf)
  start, stop, _ = index.indices(padded)
  if not shape:  # A scalar: its one element.
    values = np.asarray(leaf, dtype).reshape(1)[start:stop]
  else:
    row = math.prod(shape[1:])
    first, last = start // row, min(-(-stop // row), shape[0])
    offset = start - first * row
    values = np.asarray(leaf[first:last], dtype).reshape(-1)[offset:offset + stop - start]
  return np.concatenate([values, np.zeros(stop - start - values.size, dtype)])
