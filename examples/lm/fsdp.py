"""Fully sharded data parallelism (``--parallelism=fsdp``), compressed both ways.

Each device holds a ``1/N`` shard of every kernel and embedding
(``qsgd_jax.fsdp_shard``) and of AdamW's moments of them; biases and
LayerNorm parameters, under ``config.min_compressed_size`` elements, stay
whole on every device. Each layer gathers its parameters just before it runs
(``models.TransformerLM.gather``, under ``nn.remat``) with
``qsgd_jax.fsdp_gather``: the weights travel as ``config.fsdp_weights`` says,
and the gradient comes back through the gather's derivative, a reduce-scatter
compressed as ``config.average`` says, so that each device gets the averaged
gradient of its own shards and AdamW steps on them. There is no other
collective but the global norm of the clipping and the metrics.

| ``config.fsdp_weights`` | weights' compressor | ``config.average`` | gradients' compressor |
|---|---|---|---|
| ``fp32`` | ``Identity()`` | ``fp32`` | ``Identity()`` |
| ``bf16`` | ``Cast(jnp.bfloat16)`` | ``bf16`` | ``Cast(jnp.bfloat16)`` |
| ``int8``, ``int4`` | ``NearestAbsMax(bits)`` | ``qsgd8``, ``qsgd4`` | ``QSGD(bits)`` |
"""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import PartitionSpec as P

import qsgd_jax

WEIGHTS = ("fp32", "bf16", "int8", "int4")
AVERAGES = ("fp32", "bf16", "qsgd4", "qsgd8")


def compressors(config: ml_collections.ConfigDict) -> tuple[qsgd_jax.Compressor,
                                                            qsgd_jax.Compressor]:
  """The weights' and the gradients' compressors, from ``config.fsdp_weights`` and ``.average``."""
  weights = {"fp32": qsgd_jax.Identity(), "bf16": qsgd_jax.Cast(jnp.bfloat16),
             "int8": qsgd_jax.NearestAbsMax(bits=8), "int4": qsgd_jax.NearestAbsMax(bits=4)}
  gradients = {"fp32": qsgd_jax.Identity(), "bf16": qsgd_jax.Cast(jnp.bfloat16),
               "qsgd4": qsgd_jax.QSGD(bits=4, bucket_size=config.bucket_size),
               "qsgd8": qsgd_jax.QSGD(bits=8, bucket_size=config.bucket_size)}
  return weights[config.fsdp_weights], gradients[config.average]


def gather_fn(config: ml_collections.ConfigDict, axis_name: str):
  """What each layer of the model calls on its parameters' shards."""
  forward, backward = compressors(config)
  return functools.partial(qsgd_jax.fsdp_gather, axis_name=axis_name, forward=forward,
                           backward=backward, min_compressed_size=config.min_compressed_size)


def shard(params, mesh: jax.sharding.Mesh, axis_name: str, config: ml_collections.ConfigDict):
  """``params`` (global arrays, or their shapes under ``jax.eval_shape``) laid out for FSDP."""
  return qsgd_jax.fsdp_shard(params, mesh, axis_name,
                             min_sharded_size=config.min_compressed_size)


def is_sharded(x, axis_name: str) -> bool:
  """Inside ``jax.shard_map``: whether ``x`` is a shard (varies over ``axis_name``)."""
  return axis_name in jax.typeof(x).manual_axis_type.varying


def clip_by_global_norm(max_norm: float, axis_name: str) -> optax.GradientTransformation:
  """``optax.clip_by_global_norm`` of gradients some of whose leaves are shards over the axis.

  The squares of the shards' elements are summed over the devices (one
  ``psum``) and the whole leaves' added once: the norm of the whole gradient,
  the same on every device, which scales every shard alike.
  """

  def update_fn(updates, state, params=None):
    del params
    squares = [(jnp.sum(jnp.square(x.astype(jnp.float32))), is_sharded(x, axis_name))
               for x in jax.tree.leaves(updates)]
    sharded = sum((s for s, along in squares if along), jnp.float32(0))
    whole = sum((s for s, along in squares if not along), jnp.float32(0))
    norm = jnp.sqrt(jax.lax.psum(sharded, axis_name) + whole)
    scale = jnp.where(norm < max_norm, jnp.float32(1), max_norm / norm)
    return jax.tree.map(lambda x: (x * scale).astype(x.dtype), updates), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def out_specs(fn, mesh: jax.sharding.Mesh, axis_name: str, in_specs, *args):
  """``PartitionSpec``s for ``jax.shard_map(fn)``'s result: ``P(axis_name)`` where it varies.

  Traces ``fn`` once under ``jax.shard_map`` on ``args`` (shapes will do)
  and reads which of its results vary over the axis: under FSDP, the shards
  and whatever the optimizer derives from them (AdamW's moments); the rest
  is replicated (``P()``).
  """
  found = []

  def probe(*args):
    result = fn(*args)
    found.append(jax.tree.map(lambda x: P(axis_name) if is_sharded(x, axis_name) else P(),
                              result))
    return jnp.zeros(())

  jax.eval_shape(jax.shard_map(probe, mesh=mesh, in_specs=in_specs, out_specs=P()), *args)
  return found[0]


def loss_and_grads(loss_fn, state, batch, axis_name: str):
  """The loss averaged over the axis, and its gradient with respect to the shards.

  The mean over the devices is taken inside the differentiated function, as
  in JAX's FSDP tutorial: ``fsdp_gather``'s reduce-scatter then sums the
  devices' cotangents into the averaged gradient of each shard, and autodiff
  sums the whole leaves' exactly.
  """
  def mean_loss(params):
    return jax.lax.pmean(loss_fn(params, batch, state.apply_fn), axis_name)

  return jax.value_and_grad(mean_loss)(state.params)
