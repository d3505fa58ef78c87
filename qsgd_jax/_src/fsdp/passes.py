"""The FSDP gather's two passes, shared by its plain and its 1-bit forms.

:func:`~qsgd_jax.fsdp_gather` and :func:`~qsgd_jax.fsdp_onebit_gather` take
the same shards and gather them the same way; they differ in the
derivative. This layer holds what they share: the static configuration a
custom derivative needs (:class:`GatherConfig`), how each leaf of a shard
tree is taken (an array shard, a :class:`~qsgd_jax.FlatShard`, or a leaf
replicated over the axes, left alone), the forward pass (the quantized
all-gather, with ZeRO++'s secondary copy over two axes) and the backward pass
of the plain gather (the quantized reduce-scatter).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from qsgd_jax._src import axes as axes_lib
from qsgd_jax._src import base
from qsgd_jax._src.collectives import gather, plan, reduction
from qsgd_jax._src.fsdp.shards import FlatShard

# The name of the payloads gathered over the outer axis (all of them over one
# axis: the device's own), which a rematerialized backward pass gathers from.
SECONDARY_NAME = "qsgd_jax.fsdp_secondary"


@dataclasses.dataclass(frozen=True)
class GatherConfig:
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


def is_flat(x) -> bool:
  return isinstance(x, FlatShard)


def paths(tree) -> list[str]:
  return [jax.tree_util.keystr(path) or "<root>"
          for path, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_flat)[0]]


def check_flat(leaf: FlatShard, n: int, path: str) -> jax.Array:
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


def check_threshold(leaf: FlatShard, path: str, min_compressed_size: int) -> None:
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


def replicated(leaf, axes: axes_lib.Axes, path: str | None, owner: str) -> bool:
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


def gather_keys(config: GatherConfig, key, shards: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
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


def gather_forward(config: GatherConfig, key, shards):
  forward_key, backward_key = gather_keys(config, key, shards)
  gather_plan = gather.make_gather_plan(
      shards, config.axes.name, config.forward, axis=0, tiled=True,
      min_compressed_size=shard_threshold(config), owner="fsdp_gather")
  words = gather.encode(gather_plan, shards, forward_key)
  if config.axes.inner:  # hpZ: the backward pass gathers from the outer axis's payloads.
    secondary = checkpoint_name(gather.gather_outer(gather_plan, words, replicated=False),
                                SECONDARY_NAME)
    gathered = gather.gather_inner(gather_plan, secondary, replicated=False)
  else:  # Over one axis it gathers again from the device's own payload.
    gathered = gather.gather_outer(gather_plan, checkpoint_name(words, SECONDARY_NAME),
                                   replicated=False)
  return gather.decode(gather_plan, gathered), backward_key


def shard_threshold(config: GatherConfig) -> int:
  """The size threshold for shards: ``N`` of them reach the one over whole parameters."""
  return -(-config.min_compressed_size // math.prod(config.axes.sizes("fsdp_gather")))


def gather_backward(config: GatherConfig, backward_key, cotangents):
  """The quantized reduce-scatter of the gathered parameters' cotangents."""
  whole = [ct if shape is None else ct[:math.prod(shape)]
           for ct, shape in zip(cotangents, config.flat_shapes, strict=True)]
  scatter_plan = plan.make_plan(
      whole, config.axes.name, config.backward, method=plan.REDUCE_SCATTER,
      min_compressed_size=config.min_compressed_size, owner="fsdp_gather",
      scatter_dimension=0, tiled=True)
  return None, reduction.reduce_scatter(scatter_plan, whole, backward_key).tree
