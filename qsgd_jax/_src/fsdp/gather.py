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

import functools
import math

import jax
import jax.numpy as jnp

from qsgd_jax._src import axes as axes_lib
from qsgd_jax._src import base
from qsgd_jax._src.collectives import gather, plan
from qsgd_jax._src.compressors.nearest_abs_max import NearestAbsMax
from qsgd_jax._src.compressors.qsgd import QSGD
from qsgd_jax._src.fsdp import passes
from qsgd_jax._src.fsdp.passes import SECONDARY_NAME
from qsgd_jax._src.fsdp.shards import FlatShard

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
  leaves, treedef = jax.tree.flatten(shards, is_leaf=passes.is_flat)
  internal, flat_shapes = [], []
  for path, leaf in zip(passes.paths(shards), leaves, strict=True):
    if isinstance(leaf, FlatShard):
      internal.append(passes.check_flat(leaf, num_devices, path))
      passes.check_threshold(leaf, path, min_compressed_size)
      flat_shapes.append(leaf.shape)
    elif passes.replicated(leaf, axes, path, owner):
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
  config = passes.GatherConfig(axes, forward, backward, min_compressed_size,
                                    tuple(flat_shapes))
  whole = iter(_gather(config, None if key is None else base.as_key(key), internal))
  for i, leaf in enumerate(leaves):
    if isinstance(leaf, FlatShard):
      out[i] = next(whole)[:math.prod(leaf.shape)].reshape(leaf.shape)
    elif not passes.replicated(leaf, axes, None, owner):
      out[i] = jnp.moveaxis(next(whole), 0, axis)
  return jax.tree.unflatten(treedef, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather(config: passes.GatherConfig, key, shards: list[jax.Array]) -> list[jax.Array]:
  """Every shard joined along its first dimension, decoded: the quantized all-gather."""
  return passes.gather_forward(config, key, shards)[0]


_gather.defvjp(passes.gather_forward, passes.gather_backward)
