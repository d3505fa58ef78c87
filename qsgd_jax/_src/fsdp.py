"""FSDP compressed both ways: a differentiable quantized gather of parameter shards.

Fully sharded data parallelism (ZeRO-3) keeps a ``1/N`` shard of every
parameter on each device, all-gathers each layer's parameters just before it
runs (forward, and again in the backward pass under rematerialization), and
reduce-scatters the gradients. :func:`fsdp_gather` compresses all three: its
forward is the quantized all-gather of the shards (``gather.py``), and its
derivative, through a ``jax.custom_vjp``, is the quantized reduce-scatter of
the gradient (``reduction.reduce_scatter``), as ZeRO++ quantizes the weights
(qwZ) and the gradients (qgZ). Over two axes, the forward keeps the payloads
gathered over the slow outer axis as a named value, which
:func:`fsdp_remat_policy` saves, so that the backward pass gathers only over
the fast inner axes (ZeRO++'s hpZ).

:func:`fsdp_shard` lays a parameter tree out for it: leaves whose first
dimension the devices divide are sharded along it, others are flattened and
zero-padded to whole shards (:class:`FlatShard`), and small leaves stay
replicated.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from qsgd_jax._src import axes as axes_lib
from qsgd_jax._src import base, gather, plan, reduction
from qsgd_jax._src.nearest_abs_max import NearestAbsMax
from qsgd_jax._src.qsgd import QSGD

# The name of the payloads gathered over the outer axis (all of them over one
# axis: the device's own), which a rematerialized backward pass gathers from.
SECONDARY_NAME = "qsgd_jax.fsdp_secondary"

# The compressors of fsdp_gather by default: ZeRO++'s 8-bit weights, 4-bit gradients.
DEFAULT_FORWARD = NearestAbsMax(bits=8)
DEFAULT_BACKWARD = QSGD(bits=4)

_SAVE_DOTS_AND_SECONDARY = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    jax.checkpoint_policies.save_only_these_names(SECONDARY_NAME))


def fsdp_remat_policy(primitive, *avals, **params) -> bool:
  """A ``jax.checkpoint`` policy for layers that gather with :func:`fsdp_gather`.

  It saves the outputs of matrix products (as
  ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable`` does) and the
  payloads :func:`fsdp_gather` gathered over the outer axis, and nothing else:
  the decoded weights are not kept from the forward pass to the backward
  pass but gathered again, from those payloads, so that only one layer's
  weights are whole at a time. (JAX's FSDP tutorial saves everything but the
  outputs of ``all_gather``; here the weights come out of a decode after the
  all-gather, which such a policy would keep.) Over ``(outer, inner)`` axes
  the saved payloads are the ``n`` shards of the device's inner position, so
  the backward pass gathers only over the inner axes (hpZ's secondary copy);
  over one axis they are the device's own encoded shard.

  Examples:
    >>> import functools, jax, qsgd_jax
    >>> @functools.partial(jax.checkpoint, policy=qsgd_jax.fsdp_remat_policy)
    ... def layer(w_shard, x):
    ...   return jax.nn.relu(x @ qsgd_jax.fsdp_gather(w_shard, "batch"))
  """
  return _SAVE_DOTS_AND_SECONDARY(primitive, *avals, **params)


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


def fsdp_gather(
    shards,
    axis_name: axes_lib.AxisName,
    *,
    forward: base.Compressor = DEFAULT_FORWARD,
    backward: base.Compressor = DEFAULT_BACKWARD,
    key: jax.Array | int | None = None,
    axis: int = 0,
    min_compressed_size: int = plan.DEFAULT_MIN_COMPRESSED_SIZE,
):
  """The whole parameters from their shards, compressed both ways; differentiable.

  Call it inside ``jax.shard_map`` (or ``jax.pmap``) where a layer uses its
  parameters, in place of ``jax.lax.all_gather(shards, axis_name, tiled=True)``.
  Forward: :func:`~qsgd_jax.quantized_all_gather` with ``forward`` (each
  device encodes its shards once; every device decodes the same bytes, its
  own shard included, so every device computes with bit-identical weights).
  Backward (``jax.grad``): the cotangents of the gathered parameters, each
  device's own, are summed and scattered by the quantized reduce-scatter
  with ``backward`` (:func:`~qsgd_jax.quantized_psum_scatter`): the
  gradient of each shard is the compressed sum over devices, as
  ``jax.lax.all_gather``'s derivative is ``jax.lax.psum_scatter``'s exact one.
  With a loss averaged over the axis (``jax.lax.pmean``, as in JAX's FSDP
  tutorial), that is the averaged gradient's shard, and no other collective
  is needed. Unbiased for an unbiased ``backward`` compressor (the derivative
  is that of the gather, not of its rounding: a straight-through estimate).

  Leaves of ``shards``:

  * an array varying over the axes: this device's shard along ``axis``
    (``jax.lax.all_gather(..., axis=axis, tiled=True)``);
  * a :class:`FlatShard` (from :func:`fsdp_shard`): joined, unpadded and
    reshaped; the padding's gradient is exactly zero;
  * under ``jax.shard_map``, an array replicated over the axes (a small leaf
    that :func:`fsdp_shard` left whole): returned as it is; autodiff sums its
    gradient exactly.

  Gather a layer's parameters just before the layer, inside ``jax.checkpoint``
  (or ``flax.linen.remat``) with :func:`fsdp_remat_policy`, and over a
  ``jax.lax.scan`` of layers, so that only one layer's parameters are whole at
  a time and the backward pass gathers them again. Without a checkpoint,
  autodiff keeps every gathered layer from the forward pass to the backward
  pass: fewer bytes, all the memory.

  Over two axes ``(outer, inner)`` (nodes and the devices within one: hpZ),
  the forward gathers the payloads over the outer axis, then the inner axes;
  what a device holds in between, the payloads of the ``n`` shards of its
  inner position, is named (``SECONDARY_NAME``) and saved by
  :func:`fsdp_remat_policy`, so the backward pass gathers only over the inner
  axes. That secondary copy costs each device ``n`` shards' payloads a layer,
  from the forward pass to the backward pass: with 8-bit weights, ``n / 4``
  float32 shards (on 2 nodes, half a shard). The gradient is summed in
  float32 over the inner axes first and quantized over the outer axis only
  (a ``1/m`` of it): only the forward gather and the gradient's reduce-scatter
  cross the slow outer links.

  Args:
    shards: a pytree of this device's shards (arrays, :class:`FlatShard`).
    axis_name: the mapped axis the parameters are sharded over, or
      ``(outer, inner, ...)`` for a mesh of nodes (``P(("outer", "inner"))``).
    forward: the weights' compressor; :class:`~qsgd_jax.NearestAbsMax` (8-bit,
      rounded to nearest, ZeRO++'s qwZ) by default. Not :class:`~qsgd_jax.OneBit`.
    backward: the gradients' compressor; 4-bit :class:`~qsgd_jax.QSGD`
      (unbiased, stochastic) by default. Not :class:`~qsgd_jax.OneBit`, which
      needs error feedback that a stateless gather has nowhere to keep.
    key: a PRNG key, the same on every device, new every step, for the
      stochastic rounding; ``None`` derives one from this device's shards
      (their bits change every step, and the forward pass and its
      recomputation see the same ones).
    axis: the dimension along which array shards are joined.
    min_compressed_size: leaves whose whole parameter has fewer elements
      travel as they are: gathered bit for bit, reduce-scattered in float32.
      One threshold with :func:`fsdp_shard`'s ``min_sharded_size``: pass
      both the same value (4096 by default), so that every leaf sharded is
      compressed. (A small leaf sharded by hand, a bias under ``jax.pmap`` or
      JAX's tutorial, travels as it is.)

  Returns:
    A pytree like ``shards`` of the whole parameters (a :class:`FlatShard`
    becomes an array of its ``shape``), varying over the axes as
    ``jax.lax.all_gather``'s result is.

  Raises:
    ValueError: a :class:`FlatShard` whose shard does not fit the axes (it
      was sharded over a different mesh), or whose parameter is under
      ``min_compressed_size`` (:func:`fsdp_shard` was given a lower
      ``min_sharded_size``), a leaf replicated over some of the axes but not
      all, or a compressor that cannot be used.

  Examples:
    >>> import functools, jax, jax.numpy as jnp, qsgd_jax
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("batch",))
    >>> w = qsgd_jax.fsdp_shard(jnp.ones((64, 128)), mesh, "batch")
    >>> @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("batch"), P("batch")),
    ...                    out_specs=P())
    ... def loss(w, x):
    ...   return jax.lax.pmean(jnp.sum(x @ qsgd_jax.fsdp_gather(w, "batch")), "batch")
    >>> x = jax.device_put(jnp.ones((jax.device_count(), 64)), w.sharding)
    >>> with jax.set_mesh(mesh):
    ...   g = jax.jit(jax.grad(loss))(w, x)
    >>> g.shape, g.sharding.spec
    ((64, 128), P('batch', None))

  References:
    Wang et al., `ZeRO++: Extremely Efficient Collective Communication for
    Giant Model Training <https://arxiv.org/abs/2306.10209>`_, ICLR 2024;
    Rajbhandari et al., ZeRO, SC 2020.
  """
  owner = "fsdp_gather"
  gather.check_gatherable(forward, owner, "forward")
  gather.check_gatherable(backward, owner, "backward")
  axes = axes_lib.parse(axis_name, owner)
  if axes.is_local:
    raise ValueError(f"{owner}: axis_name must name the axis the parameters are sharded over.")
  num_devices = math.prod(axes.sizes(owner))
  leaves, treedef = jax.tree.flatten(shards, is_leaf=_is_flat)
  internal, flat_shapes = [], []
  for path, leaf in zip(_paths(shards), leaves, strict=True):
    if isinstance(leaf, FlatShard):
      internal.append(_check_flat(leaf, num_devices, path))
      _check_threshold(leaf, path, min_compressed_size)
      flat_shapes.append(leaf.shape)
    elif _replicated(leaf, axes, path, owner):
      continue
    else:  # Joined along axis 0 inside: the plans' layout.
      leaf = jnp.asarray(leaf)
      if not 0 <= axis < leaf.ndim:
        raise ValueError(f"{owner}: leaf {path} of shape {leaf.shape} has no dimension {axis}.")
      internal.append(jnp.moveaxis(leaf, axis, 0))
      flat_shapes.append(None)
  if not internal:  # Every leaf replicated: nothing to gather.
    return shards
  out = list(leaves)
  config = _Config(axes, forward, backward, min_compressed_size, tuple(flat_shapes))
  whole = iter(_gather(config, None if key is None else base.as_key(key), internal))
  for i, leaf in enumerate(leaves):
    if isinstance(leaf, FlatShard):
      out[i] = next(whole)[:math.prod(leaf.shape)].reshape(leaf.shape)
    elif not _replicated(leaf, axes, None, owner):
      out[i] = jnp.moveaxis(next(whole), 0, axis)
  return jax.tree.unflatten(treedef, out)


@dataclasses.dataclass(frozen=True)
class _Config:
  """What the gather's custom derivative needs that is static (hashable).

  Attributes:
    axes: the axes.
    forward, backward: the two compressors.
    min_compressed_size: the size threshold, over the whole parameter.
    flat_shapes: for each gathered leaf, a :class:`FlatShard`'s shape, or
      ``None`` for an array shard (joined along its first dimension).
  """

  axes: axes_lib.Axes
  forward: base.Compressor
  backward: base.Compressor
  min_compressed_size: int
  flat_shapes: tuple[tuple[int, ...] | None, ...]


def _is_flat(x) -> bool:
  return isinstance(x, FlatShard)


def _paths(tree) -> list[str]:
  return [jax.tree_util.keystr(path) or "<root>"
          for path, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_flat)[0]]


def _check_flat(leaf: FlatShard, n: int, path: str) -> jax.Array:
  """The shard of a :class:`FlatShard`, after checking that it was cut for ``n`` devices."""
  shard = jnp.asarray(leaf.shard)
  size = math.prod(leaf.shape)
  if shard.ndim != 1 or shard.shape[0] != -(-size // n):
    raise ValueError(
        f"fsdp_gather: leaf {path} is a FlatShard of shape {leaf.shape} ({size} elements) "
        f"holding {shard.shape} on this device, but {n} devices need [{-(-size // n)}] each: "
        "it was sharded for another mesh or axis. Shard the parameters with "
        "qsgd_jax.fsdp_shard(params, mesh, axis_name) over the axes passed here.")
  return shard


def _check_threshold(leaf: FlatShard, path: str, min_compressed_size: int) -> None:
  """Raises for a :class:`FlatShard` under ``min_compressed_size``: :func:`fsdp_shard` sharded
  it with a lower ``min_sharded_size``, and it would travel in float32, unsaid."""
  size = math.prod(leaf.shape)
  if size < min_compressed_size and jnp.issubdtype(jnp.result_type(leaf.shard), jnp.floating):
    raise ValueError(
        f"fsdp_gather: leaf {path} is a FlatShard of {size} elements, under "
        f"min_compressed_size={min_compressed_size}: fsdp_shard sharded it (its "
        f"min_sharded_size was at most {size}), and it would be gathered and reduce-scattered "
        "in float32. The two take one threshold: pass fsdp_gather the min_sharded_size given "
        "to fsdp_shard as min_compressed_size (both are "
        f"{plan.DEFAULT_MIN_COMPRESSED_SIZE} by default), or shard with a min_sharded_size "
        "above the leaf's size to keep it whole on every device.")


def _replicated(leaf, axes: axes_lib.Axes, path: str | None, owner: str) -> bool:
  """Whether ``leaf`` is typed replicated over every axis (``jax.shard_map``), not a shard."""
  tracked = axes_lib.tracked(axes.names)
  if not tracked:
    return False
  varying = jax.typeof(leaf).manual_axis_type.varying
  missing = [name for name in tracked if name not in varying]
  if missing and len(missing) < len(axes.names) and path is not None:
    raise ValueError(
        f"{owner}: leaf {path} varies over some of the axes {axes.names} but is replicated "
        f"over {missing}: a shard varies over all of them (in_specs P({axes.name!r})), a "
        "replicated leaf over none (P()).")
  return len(missing) == len(axes.names)


def _keys(config: _Config, key, shards: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
  """The forward's and the backward's keys: from ``key``, or from the bits of this device's
  shards (they change every step, and are the same when the forward is recomputed)."""
  if key is None and config.forward.deterministic and config.backward.deterministic:
    key = jax.random.key(0)  # Unused.
  elif key is None:
    fingerprint = jnp.zeros((), jnp.uint32)
    for k, shard in enumerate(shards):
      bits = jax.lax.bitcast_convert_type(shard.astype(jnp.float32), jnp.uint32)
      fingerprint = fingerprint ^ (jnp.sum(bits, dtype=jnp.uint32) * np.uint32(2 * k + 1))
    key = jax.random.fold_in(jax.random.key(0), fingerprint)
  return jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather(config: _Config, key, shards: list[jax.Array]) -> list[jax.Array]:
  """Every shard joined along its first dimension, decoded: the quantized all-gather."""
  return _gather_forward(config, key, shards)[0]


def _gather_forward(config: _Config, key, shards):
  forward_key, backward_key = _keys(config, key, shards)
  gather_plan = gather.make_gather_plan(
      shards, config.axes.name, config.forward, axis=0, tiled=True,
      min_compressed_size=_shard_threshold(config), owner="fsdp_gather")
  words = gather.encode(gather_plan, shards, forward_key)
  if config.axes.inner:  # hpZ: the backward pass gathers from the outer axis's payloads.
    secondary = checkpoint_name(gather.gather_outer(gather_plan, words, replicated=False),
                                SECONDARY_NAME)
    gathered = gather.gather_inner(gather_plan, secondary, replicated=False)
  else:  # Over one axis it gathers again from the device's own payload.
    gathered = gather.gather_outer(gather_plan, checkpoint_name(words, SECONDARY_NAME),
                                   replicated=False)
  return gather.decode(gather_plan, gathered), backward_key


def _shard_threshold(config: _Config) -> int:
  """The size threshold for shards: ``N`` of them reach the one over whole parameters."""
  return -(-config.min_compressed_size // math.prod(config.axes.sizes("fsdp_gather")))


def _gather_backward(config: _Config, backward_key, cotangents):
  """The quantized reduce-scatter of the gathered parameters' cotangents."""
  whole = [ct if shape is None else ct[:math.prod(shape)]
           for ct, shape in zip(cotangents, config.flat_shapes, strict=True)]
  scatter_plan = plan.make_plan(
      whole, config.axes.name, config.backward, method=plan.REDUCE_SCATTER,
      min_compressed_size=config.min_compressed_size, owner="fsdp_gather",
      scatter_dimension=0, tiled=True)
  return None, reduction.reduce_scatter(scatter_plan, whole, backward_key).tree


_gather.defvjp(_gather_forward, _gather_backward)
