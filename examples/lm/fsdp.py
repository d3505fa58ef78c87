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

``--optimizer=onebit_adam`` is 1-bit Adam under FSDP: each layer gathers with
``qsgd_jax.fsdp_onebit_gather``, whose gradient is reduce-scattered as
``config.average`` says for the first ``config.freeze_step`` steps, then in
one bit an element with each device's worker error (a buffer a layer, kept
in the optimizer's state: ``fsdp_onebit_adam(..., worker_errors=)``), and
``qsgd_jax.fsdp_onebit_adam`` steps on the shards with the variance frozen
from then on.
"""


import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax.training.train_state import TrainState
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
  """What each layer of the model calls on its variables: its parameters gathered."""
  forward, backward = compressors(config)

  def gather(variables):
    return {**variables, "params": qsgd_jax.fsdp_gather(
        variables["params"], axis_name, forward=forward, backward=backward,
        min_compressed_size=config.min_compressed_size)}

  return gather


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


ERROR_COLLECTION = "fsdp_error"


def worker_errors(shards, config: ml_collections.ConfigDict, axis_name: str) -> dict:
  """The zero worker errors of each top-level layer with a leaf that goes 1-bit."""
  errors = {name: qsgd_jax.fsdp_onebit_error(layer, axis_name,
                                             min_compressed_size=config.min_compressed_size)
            for name, layer in shards.items()}
  return {name: {"worker_error": error} for name, error in errors.items() if error.shape[1]}


def onebit_gather_fn(config: ml_collections.ConfigDict, axis_name: str, compress: jax.Array):
  """What each layer calls on its variables under 1-bit Adam: the parameters gathered,
  their gradient 1-bit with the layer's worker error where ``compress``."""
  forward, warm_up = compressors(config)

  def gather(variables):
    options = dict(min_compressed_size=config.min_compressed_size)
    if ERROR_COLLECTION in variables:
      error = variables[ERROR_COLLECTION]["worker_error"]
    else:  # Nothing 1-bit in this layer.
      error = qsgd_jax.fsdp_onebit_error(variables["params"], axis_name, **options)
    return {**variables, "params": qsgd_jax.fsdp_onebit_gather(
        variables["params"], error, axis_name, compress=compress, forward=forward,
        warm_up=warm_up, **options)}

  return gather


def onebit_loss_and_grads(loss_fn, model, state: TrainState, batch, axis_name: str,
                          config: ml_collections.ConfigDict):
  """:func:`loss_and_grads` under 1-bit Adam, and the new worker errors.

  The errors and the switch to 1-bit come from the optimizer's state
  (``qsgd_jax.fsdp_onebit_step_inputs``: the gradient goes 1-bit from step
  ``config.freeze_step`` on, by the optimizer's count, the same on every
  device).
  """
  worker_error, compress = qsgd_jax.fsdp_onebit_step_inputs(state.opt_state)
  onebit_model = model.clone(gather=onebit_gather_fn(config, axis_name, compress),
                             gather_collections=("params", ERROR_COLLECTION))

  def mean_loss(params, worker_error):
    def apply_fn(variables, tokens):
      return onebit_model.apply({**variables, ERROR_COLLECTION: worker_error}, tokens)
    return jax.lax.pmean(loss_fn(params, batch, apply_fn), axis_name)

  loss, (grads, worker_error) = jax.value_and_grad(mean_loss, argnums=(0, 1))(
      state.params, worker_error)
  return loss, grads, worker_error


def onebit_adam(config: ml_collections.ConfigDict, learning_rate_fn: optax.Schedule, *,
                axis_name: str, weight_decay_mask) -> optax.GradientTransformation:
  """``qsgd_jax.fsdp_onebit_adam`` on the shards, clipped by the whole gradient's norm; the
  variance of the shards (the leaves that go 1-bit) freezes."""
  clip = ([clip_by_global_norm(config.grad_clip_norm, axis_name)]
          if config.grad_clip_norm > 0 else [])
  return optax.chain(*clip, qsgd_jax.fsdp_onebit_adam(
      learning_rate_fn, freeze_step=int(config.freeze_step), b1=config.b1, b2=config.b2,
      eps=config.eps, weight_decay=config.weight_decay, mask=weight_decay_mask,
      frozen_mask=lambda params: jax.tree.map(lambda x: is_sharded(x, axis_name), params),
      worker_errors=lambda shards: worker_errors(shards, config, axis_name)))
