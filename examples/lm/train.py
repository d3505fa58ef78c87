"""Data-parallel training of a byte-level transformer whose gradient average is compressed.

The training step is the usual data-parallel one with one change: there is no
``lax.pmean(grads, 'batch')``. Each device differentiates the loss of its own
share of the batch with respect to its own (varying) copy of the parameters,
and the optimizer averages the gradients: for AdamW, the first transform of
its chain averages them as ``config.average`` says (see
:func:`gradient_averaging`), then the averaged gradient is clipped and AdamW
steps. An optimizer that communicates by itself (a compressed Adam) takes the
devices' own gradients in its ``update`` and plugs in beside AdamW in
:data:`OPTIMIZERS`. The step runs under ``jax.pmap`` or ``jax.shard_map``, or
is a ``jax.jit`` step over a mesh made by ``qsgd_jax.data_parallel``
(``config.parallelism``). With ``fsdp``, parameters and AdamW's moments are
sharded over the devices instead, and the gradient is averaged by the
compressed reduce-scatter of ``qsgd_jax.fsdp_gather`` (``fsdp.py``). With
``hybrid``, the model is sharded over ``fsdp`` and ``tensor`` axes inside each
data group, by logical axis rules, and the gradients are averaged over the
data axis between groups (``hybrid.py``).

The state is checkpointed with orbax every ``config.checkpoint_every_steps``
steps and at the end, into ``workdir/checkpoints``; a run started in a
workdir that has checkpoints resumes from the latest, its data where it was.
"""

import contextlib
import functools
import json
import math
import pathlib
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
import tqdm
from flax.training.train_state import TrainState
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import qsgd_jax
from examples.lm import diloco as diloco_lib
from examples.lm import fsdp, hybrid, input_pipeline, models, sparse

AXIS = "batch"
AVERAGES = ("fp32", "bf16", "qsgd4", "qsgd8", "qsgd4_ef", "onebit", "powersgd", "topk_ef")
PARALLELISMS = ("pmap", "shard_map", "jit", "fsdp", "hybrid")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def create_model(config: ml_collections.ConfigDict) -> models.TransformerLM:
  """The transformer ``config`` describes."""
  return models.TransformerLM(
      num_layers=config.num_layers, width=config.width, num_heads=config.num_heads,
      context_length=config.context_length, dtype=DTYPES[config.dtype],
      logical_axes=config.parallelism == "hybrid")


def initialized(key: jax.Array, model: models.TransformerLM):
  """The model's initial ``params``."""
  tokens = jnp.zeros((1, model.context_length), jnp.int32)
  return nn.unbox(_jitted_init(model)(key, tokens)["params"])


@functools.cache
def _jitted_init(model):
  # One compiled initializer for equal models (linen modules compare by their fields).
  return jax.jit(model.init)


def create_learning_rate_fn(config: ml_collections.ConfigDict, num_steps: int) -> optax.Schedule:
  """Linear warm-up from 0 to ``learning_rate``, then cosine decay to its final fraction."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.learning_rate,
      warmup_steps=min(config.warmup_steps, num_steps - 1), decay_steps=num_steps,
      end_value=config.learning_rate * config.final_learning_rate_fraction)


def weight_decay_mask(params):
  """``True`` for the dense kernels; biases, LayerNorm parameters and embeddings are not decayed.

  ``params`` may hold FSDP's ``qsgd_jax.FlatShard`` nodes: a leaf's name is its last dict key.
  """
  return jax.tree_util.tree_map_with_path(
      lambda path, _: [entry.key for entry in path
                       if isinstance(entry, jax.tree_util.DictKey)][-1] == "kernel", params)


def gradient_averaging(config: ml_collections.ConfigDict) -> optax.GradientTransformation | None:
  """The transform that averages the gradients over ``AXIS``, as ``config.average`` says.

  ``fp32`` and ``bf16`` go through the library too, so that every mode
  reports what it sends the same way (:func:`qsgd_jax.compression_stats`),
  but for ``fp32`` under ``hybrid`` parallelism: there the compiler averages,
  the baseline the hybrid modes are measured against, and this is ``None``.
  ``qsgd4_ef`` keeps each device's quantization residual and adds it to its
  next gradient (error feedback); ``onebit`` always does.
  """
  options = dict(key=config.seed, min_compressed_size=config.min_compressed_size)
  qsgd_options = dict(bucket_size=config.bucket_size, track_elias=config.track_elias, **options)
  match config.average:
    case "fp32" if config.parallelism == "hybrid":
      return None
    case "fp32":
      return qsgd_jax.compressed_allreduce(qsgd_jax.Identity(), AXIS, **options)
    case "bf16":
      return qsgd_jax.compressed_allreduce(qsgd_jax.Cast(jnp.bfloat16), AXIS, **options)
    case "qsgd4" | "qsgd8":
      return qsgd_jax.qsgd(AXIS, bits=int(config.average.removeprefix("qsgd")), **qsgd_options)
    case "qsgd4_ef":
      return qsgd_jax.qsgd(AXIS, bits=4, error_feedback=True, **qsgd_options)
    case "onebit":
      return qsgd_jax.onebit_sgd(AXIS, bucket_size=config.bucket_size, **options)
    case "powersgd":
      views = {"layer": models.powersgd_matrix_view, "last_axis": _last_axis_view}
      if config.powersgd_matrix_view not in views:
        raise ValueError(_not_one_of(config, "powersgd_matrix_view", tuple(views)))
      return qsgd_jax.powersgd(AXIS, rank=config.powersgd_rank,
                               start_iter=config.powersgd_start_iter, seed=config.seed,
                               matrix_view=views[config.powersgd_matrix_view],
                               total_steps=config.num_train_steps)
    case "topk_ef":
      return sparse.topk_average(config, AXIS)
  raise ValueError(_not_one_of(config, "average", AVERAGES))


def _last_axis_view(path, shape) -> tuple[int, int]:
  """PowerSGD's view before ``matrix_view``: a kernel's last axis alone is its output."""
  del path
  return math.prod(shape[:-1]), shape[-1]


def averaged_adamw(config: ml_collections.ConfigDict,
                   learning_rate_fn: optax.Schedule) -> optax.GradientTransformation:
  """AdamW on the gradients averaged by :func:`gradient_averaging`, clipped by global norm.

  Clipping comes after the average: it bounds the step of the averaged
  gradient, the same on every device (clipping each device's own gradient
  instead would be a different, per-device operation). Under FSDP the
  gradients come averaged already, as shards: AdamW steps on the shards,
  clipped by the whole gradient's norm.
  """
  if config.parallelism == "fsdp":
    average, clip_by_global_norm = [], functools.partial(fsdp.clip_by_global_norm,
                                                         axis_name=AXIS)
  else:
    average = [gradient_averaging(config)] if gradient_averaging(config) else []
    clip_by_global_norm = optax.clip_by_global_norm
  clip = [clip_by_global_norm(config.grad_clip_norm)] if config.grad_clip_norm > 0 else []
  return optax.chain(
      *average,
      *clip,
      optax.adamw(learning_rate_fn, b1=config.b1, b2=config.b2, eps=config.eps,
                  weight_decay=config.weight_decay, mask=weight_decay_mask),
  )


def onebit_adam(config: ml_collections.ConfigDict,
                learning_rate_fn: optax.Schedule) -> optax.GradientTransformation:
  """DeepSpeed's 1-bit Adam: AdamW on the float32 mean gradient for ``config.freeze_step``
  steps (or until its variance settles, ``"auto"``), then the variance frozen and the
  momenta averaged in one bit.

  Data-parallel, :func:`qsgd_jax.onebit_adam`, which averages the devices' own gradients
  itself (``config.average`` does not apply), after :func:`local_clipping`. Under FSDP,
  ``fsdp.onebit_adam``: the gradients' reduce-scatter goes 1-bit, and Adam steps on the
  shards, clipped by the whole averaged gradient's norm.
  """
  if config.parallelism == "fsdp":
    return fsdp.onebit_adam(config, learning_rate_fn, axis_name=AXIS,
                            weight_decay_mask=weight_decay_mask)
  return optax.chain(*local_clipping(config), qsgd_jax.onebit_adam(
      learning_rate_fn, AXIS, freeze_step=_freeze_step(config), b1=config.b1, b2=config.b2,
      eps=config.eps, weight_decay=config.weight_decay, mask=weight_decay_mask,
      min_compressed_size=config.min_compressed_size, axis_size=_data_groups(config)))


def _data_groups(config: ml_collections.ConfigDict) -> int:
  """The devices the compressed Adams average over: every one, or under ``hybrid`` one a data
  group (the model's axes are the group's)."""
  if config.parallelism == "hybrid":
    return jax.device_count() // (config.fsdp_devices * config.tensor_devices)
  return jax.device_count()


def local_clipping(config: ml_collections.ConfigDict) -> list[optax.GradientTransformation]:
  """Each device's own gradient clipped to ``config.grad_clip_norm`` (none if 0).

  An optimizer that averages for itself sees only its device's gradient, so
  that is what can be clipped before it; DeepSpeed does the same with 1-bit
  Adam (the engine turns its gradient all-reduce off and clips each rank's
  gradient by its own norm when ``gradient_clipping`` is set). A device's
  gradient is noisier than the mean, so its norm is larger and it is clipped
  more often than AdamW's averaged one.
  """
  return [optax.clip_by_global_norm(config.grad_clip_norm)] if config.grad_clip_norm > 0 else []


def zero_one_adam(config: ml_collections.ConfigDict,
                  learning_rate_fn: optax.Schedule) -> optax.GradientTransformation:
  """DeepSpeed's 0/1 Adam (:func:`qsgd_jax.zero_one_adam`): 1-bit gradient averages between
  float32 variance updates at doubling intervals, the variance frozen after
  ``config.freeze_step``. Its local steps would give each device a model of its own; the
  example keeps one replicated model, so ``local_step_clipper=1``: every frozen step
  synchronizes (with DeepSpeed's defaults the first local step comes after 32,678 of them).
  After :func:`local_clipping`."""
  return optax.chain(*local_clipping(config), qsgd_jax.zero_one_adam(
      learning_rate_fn, AXIS, var_freeze_step=_freeze_step(config), b1=config.b1, b2=config.b2,
      eps=config.eps, weight_decay=config.weight_decay, mask=weight_decay_mask,
      local_step_clipper=1, min_compressed_size=config.min_compressed_size,
      axis_size=_data_groups(config)))


def diloco(config: ml_collections.ConfigDict,
           learning_rate_fn: optax.Schedule) -> optax.GradientTransformation:
  """DiLoCo across ``config.diloco_workers`` workers (``diloco.py``), each worker's devices
  training data-parallel with :func:`averaged_adamw` (over ``AXIS``) between syncs."""
  if config.parallelism == "hybrid":
    # A worker is a data group, its model sharded over its devices: AdamW on its gradient,
    # averaged by nothing, DiLoCo over the data axis.
    inner_config = config.copy_and_resolve_references()
    inner_config.average = "fp32"
    return diloco_lib.optimizer(config, averaged_adamw(inner_config, learning_rate_fn), AXIS,
                                workers_axis=AXIS)
  return diloco_lib.optimizer(config, averaged_adamw(config, learning_rate_fn), AXIS)


def demo(config: ml_collections.ConfigDict,
         learning_rate_fn: optax.Schedule) -> optax.GradientTransformation:
  """DeMo (``sparse.demo``): each device's momentum, its top DCT components all-gathered, a
  sign step; it averages for itself (``config.average`` does not apply)."""
  return sparse.demo(config, learning_rate_fn, AXIS, weight_decay_mask)


def _freeze_step(config: ml_collections.ConfigDict) -> int | str:
  """``config.freeze_step``: ``"auto"``, or a step (a string from ``--config.freeze_step=60``)."""
  return "auto" if config.freeze_step == "auto" else int(config.freeze_step)


# Each optimizer, by name: ``(config, learning_rate_fn) -> optax.GradientTransformation`` whose
# ``update(grads, state, params)`` takes each device's own gradients over AXIS (it must average
# them: communicate) and returns updates that are the same on every device. AdamW averages
# with ``config.average`` first; the compressed Adams average for themselves. Under FSDP,
# ``update`` takes the averaged gradients of the shards.
OPTIMIZERS: dict[str, Callable[[ml_collections.ConfigDict, optax.Schedule],
                               optax.GradientTransformation]] = {
    "adamw": averaged_adamw,
    "onebit_adam": onebit_adam,
    "zero_one_adam": zero_one_adam,
    "diloco": diloco,
    "demo": demo,
}


def create_optimizer(config: ml_collections.ConfigDict,
                     learning_rate_fn: optax.Schedule) -> optax.GradientTransformation:
  """The optimizer ``config.optimizer`` names in :data:`OPTIMIZERS`."""
  _check_choice(config, "optimizer", tuple(OPTIMIZERS))
  return OPTIMIZERS[config.optimizer](config, learning_rate_fn)


def loss_fn(params, batch, apply_fn) -> jax.Array:
  """Mean cross-entropy, in nats a byte, of predicting each next byte of ``batch["tokens"]``."""
  tokens = batch["tokens"]
  logits = apply_fn({"params": params}, tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def diloco_metrics(opt_state: qsgd_jax.DiLoCoState) -> dict[str, jax.Array]:
  """What a DiLoCo step sent across workers (zero but at a fragment's exchange) and, inside
  a worker, what its gradient average sent (and a split exchange's gather of the parts)."""
  stats = qsgd_jax.compression_stats(opt_state)
  inner = qsgd_jax.compression_stats(opt_state.inner_state)  # None: a worker's model sharded.
  gathered = stats.wire_bits - stats.outer_wire_bits
  inner_bits = 0.0 if inner is None else inner.wire_bits[0]
  return wire_metrics(opt_state) | {"wire_bytes": stats.outer_wire_bits / 8,
                                    "inner_wire_bytes": (inner_bits + gathered) / 8}


def wire_metrics(opt_state) -> dict[str, jax.Array]:
  """What the optimizer's gradient averaging sent in the last step, in bytes, if it says."""
  stats = qsgd_jax.compression_stats(opt_state)
  if stats is None:
    return {}
  return {
      "wire_bytes": stats.wire_bits / 8,
      "fp32_wire_bytes": stats.float32_bits / 8,
      "elias_wire_bytes": stats.elias_bits / 8,
  }


def freeze_metrics(opt_state) -> dict[str, jax.Array]:
  """The compressed Adams' freeze step: given, or chosen by ``"auto"`` (``2**31 - 1`` before)."""
  freeze_count = optax.tree.get(opt_state, "freeze_count")
  # float32 for the pmean: 8 copies of int32 2**31 - 1 would overflow the sum.
  return {} if freeze_count is None else {"freeze_step": freeze_count.astype(jnp.float32)}


def train_step(state: TrainState, batch, learning_rate_fn: optax.Schedule):
  """One step on one device's share of the batch; call it under pmap or shard_map."""
  # Each device's own gradient: under shard_map, that of its own (varying) copy of the params.
  loss, grads = jax.value_and_grad(loss_fn)(
      qsgd_jax.as_varying(state.params, AXIS), batch, state.apply_fn)
  # No lax.pmean(grads, AXIS) here: the optimizer averages them.
  state = state.apply_gradients(grads=grads)
  metrics = {"loss": loss, "learning_rate": learning_rate_fn(state.step - 1)}
  metrics |= wire_metrics(state.opt_state) | freeze_metrics(state.opt_state)
  return state, jax.lax.pmean(metrics, AXIS)


def fsdp_train_step(state: TrainState, batch, learning_rate_fn: optax.Schedule):
  """One FSDP step on one device's share of the batch and its shards; call it under shard_map."""
  loss, grads = fsdp.loss_and_grads(loss_fn, state, batch, AXIS)  # grads: averaged, shards.
  state = state.apply_gradients(grads=grads)
  return state, {"loss": loss, "learning_rate": learning_rate_fn(state.step - 1)}


def fsdp_onebit_train_step(state: TrainState, batch, learning_rate_fn: optax.Schedule,
                           model: models.TransformerLM, config: ml_collections.ConfigDict):
  """:func:`fsdp_train_step` under 1-bit Adam: the new worker errors go to the optimizer."""
  loss, grads, worker_error = fsdp.onebit_loss_and_grads(loss_fn, model, state, batch, AXIS,
                                                         config)
  updates, opt_state = state.tx.update(grads, state.opt_state, state.params,
                                       worker_error=worker_error)
  state = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                        opt_state=opt_state)
  return state, {"loss": loss, "learning_rate": learning_rate_fn(state.step - 1)}


def jit_train_step(state: TrainState, batch, learning_rate_fn: optax.Schedule,
                   data_parallel_step: Callable):
  """One step over the whole batch, under ``jax.jit``; ``data_parallel_step`` from data_parallel.

  ``data_parallel_step`` differentiates :func:`loss_fn` on each device's share
  and applies the averaged updates; its loss comes back averaged.
  """
  params, opt_state, loss = data_parallel_step(state.params, state.opt_state, batch)
  metrics = {"loss": loss, "learning_rate": learning_rate_fn(state.step)}
  state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
  return state, metrics | wire_metrics(opt_state)


def eval_step(state: TrainState, batch):
  """Sums of the loss (nats) and of the bytes predicted, over all devices' shares."""
  tokens = batch["tokens"]
  logits = state.apply_fn({"params": state.params}, tokens[:, :-1])
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
  return jax.lax.psum({"loss": jnp.sum(losses), "count": jnp.float32(losses.size)}, AXIS)


class Mapped(NamedTuple):
  """The per-device functions, mapped over ``AXIS`` by pmap or shard_map.

  Attributes:
    init: ``params -> state``: the initial ``TrainState`` on every device,
      from the params on the host (the same on every process).
    train_step: ``(state, batch) -> (state, metrics)``; donates ``state``.
    eval_step: ``(state, batch) -> sums``.
    put_batch: this process's numpy batch onto its devices.
    compile_programs: ``(state, batch) -> (program_at, programs)``, where the
      host chooses each step's program (DiLoCo's ``diloco_events_on_host``), or
      the step reads the parameters' layout from them (``hybrid``):
      ``program_at(count)`` is the step to run after ``count`` steps, and
      ``programs`` the compiled programs it runs, compiled for these
      arguments' shapes; ``None`` where ``train_step`` serves every step.
    mesh: with ``hybrid`` parallelism, its mesh: the summary then splits the
      bytes a step sends by whether they cross the data axis.
  """

  init: Callable
  train_step: Callable
  eval_step: Callable
  put_batch: Callable
  compile_programs: Callable | None = None
  mesh: jax.sharding.Mesh | None = None


def parallelize(config, model, tx, learning_rate_fn) -> Mapped:
  """The mapped functions of ``config.parallelism``.

  Under shard_map and jit the state is replicated (``P()``) except for the
  per-device parts of the optimizer's state, such as error-feedback residuals
  (:func:`qsgd_jax.state_partition_specs`). The jit step is
  :func:`jit_train_step`; evaluation runs under shard_map. Under fsdp the
  parameters are ``qsgd_jax.fsdp_shard``'s shards, the model gathers them
  layer by layer, and the optimizer's state is sharded as they are.
  """
  fsdp_parallel = config.parallelism == "fsdp"
  onebit_fsdp = fsdp_parallel and config.optimizer == "onebit_adam"
  if fsdp_parallel:
    model = model.clone(gather=fsdp.gather_fn(config, AXIS))

  def create(params):
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    # A strongly typed step, as a restored checkpoint's: the compiled steps serve both.
    return state.replace(step=jnp.zeros((), jnp.int32))

  if onebit_fsdp:
    step = functools.partial(fsdp_onebit_train_step, learning_rate_fn=learning_rate_fn,
                             model=model, config=config)
  else:
    step = functools.partial(fsdp_train_step if fsdp_parallel else train_step,
                             learning_rate_fn=learning_rate_fn)

  if config.parallelism == "hybrid":
    metrics_of = diloco_metrics if config.optimizer == "diloco" else wire_metrics
    return Mapped(*hybrid.parallelize(config, model, tx, loss_fn, metrics_of, learning_rate_fn,
                                      AXIS))

  if config.optimizer == "diloco":
    step = functools.partial(diloco_lib.train_step, learning_rate_fn=learning_rate_fn,
                             loss_fn=loss_fn, axis=AXIS, metrics_of=diloco_metrics)
    return Mapped(*diloco_lib.parallelize(config, model, tx, step, _param_shapes(model), AXIS))

  if config.parallelism == "pmap":
    # pmap's own layout: the leading axis split over this process's devices.
    devices = NamedSharding(Mesh(np.array(jax.local_devices()), (AXIS,)), P(AXIS))

    def put_batch(batch):
      return jax.device_put(
          jax.tree.map(lambda x: x.reshape((jax.local_device_count(), -1, *x.shape[1:])), batch),
          devices,
      )

    mapped_create = jax.pmap(create, AXIS)

    def init(params):
      # A copy for each local device, stacked on the host: nothing to compile.
      count = jax.local_device_count()
      copies = jax.tree.map(lambda x: np.broadcast_to(x, (count, *x.shape)),
                            jax.device_get(params))
      return mapped_create(jax.device_put(copies, devices))

    return Mapped(
        init=init,
        train_step=jax.pmap(step, AXIS, donate_argnums=(0,)),
        eval_step=jax.pmap(eval_step, AXIS),
        put_batch=put_batch,
    )

  mesh = jax.make_mesh((jax.device_count(),), (AXIS,),
                       axis_types=(jax.sharding.AxisType.Explicit,))
  replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
  shard = functools.partial(jax.shard_map, mesh=mesh)

  def replicate(params):
    # Every process holds the same initial values; each gives its own devices their copies.
    return jax.tree.map(
        lambda x: jax.make_array_from_callback(x.shape, replicated, lambda index: x[index]),
        jax.device_get(params))

  if fsdp_parallel:
    shard_shapes = jax.eval_shape(lambda p: fsdp.shard(p, mesh, AXIS, config),
                                  _param_shapes(model))
    param_specs = jax.tree.map(lambda x: x.sharding.spec, shard_shapes)
    specs = fsdp.out_specs(create, mesh, AXIS, (param_specs,), shard_shapes)
  else:
    param_specs = P()
    specs = _state_specs(jax.eval_shape(create, _param_shapes(model)))

  def put_batch(batch):
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(split, x), batch)

  if config.parallelism == "jit":
    data_parallel = qsgd_jax.data_parallel(
        functools.partial(loss_fn, apply_fn=model.apply), tx, mesh, AXIS)

    def init(params):
      params = replicate(params)
      zero = jax.make_array_from_callback((), replicated, lambda index: np.zeros((), np.int32))
      return TrainState(step=zero, apply_fn=model.apply, params=params, tx=tx,
                        opt_state=data_parallel.init(params))

    train = jax.jit(functools.partial(jit_train_step, learning_rate_fn=learning_rate_fn,
                                      data_parallel_step=data_parallel.step),
                    donate_argnums=(0,))
  else:
    sharded_create = jax.jit(shard(create, in_specs=(param_specs,), out_specs=specs))

    def init(params):
      params = replicate(params)
      return sharded_create(fsdp.shard(params, mesh, AXIS, config) if fsdp_parallel else params)

    train = jax.jit(shard(step, in_specs=(specs, P(AXIS)), out_specs=(specs, P())),
                    donate_argnums=(0,))
  return Mapped(
      init=init,
      train_step=train,
      eval_step=jax.jit(shard(eval_step, in_specs=(specs, P(AXIS)), out_specs=P())),
      put_batch=put_batch,
  )


class Programs(NamedTuple):
  """What a run of one config computes with: its model, schedule, optimizer and functions."""

  model: models.TransformerLM
  learning_rate_fn: optax.Schedule
  tx: optax.GradientTransformation
  mapped: Mapped


def programs(config: ml_collections.ConfigDict) -> Programs:
  """The model, schedule, optimizer and :func:`parallelize`'s functions of ``config``.

  Built once a process for equal configs, so that a second run of a config
  in the same process (a run resumed there, as in the tests) reuses the
  compiled steps.
  """
  _check_config(config)
  return _programs(config.to_json())


@functools.cache
def _programs(config_json: str) -> Programs:
  config = ml_collections.ConfigDict(json.loads(config_json))
  model = create_model(config)
  learning_rate_fn = create_learning_rate_fn(config, config.num_train_steps)
  tx = create_optimizer(config, learning_rate_fn)
  return Programs(model, learning_rate_fn, tx, parallelize(config, model, tx, learning_rate_fn))


def _param_shapes(model: models.TransformerLM):
  tokens = jax.ShapeDtypeStruct((1, model.context_length), jnp.int32)
  return jax.eval_shape(model.clone(gather=None).init, jax.random.key(0), tokens)["params"]


def _state_specs(shapes: TrainState) -> TrainState:
  """``PartitionSpec``s of the state under shard_map."""
  return shapes.replace(
      step=P(),
      params=jax.tree.map(lambda _: P(), shapes.params),
      opt_state=qsgd_jax.state_partition_specs(shapes.opt_state, AXIS),
  )


def wire_bytes_from_hlo(compiled_step) -> dict[str, float]:
  """Bytes one device sends per step, by kind of collective, read from the compiled step.

  It counts every collective, whatever sends it: for any optimizer, what a
  step puts on the wire (the gradients' exchange, plus the metrics' means).
  """
  by_kind: dict[str, float] = {}
  for collective in qsgd_jax.collectives_in_hlo(compiled_step.as_text()):
    by_kind[collective.kind] = by_kind.get(collective.kind, 0.0) + collective.bytes_sent
  return by_kind


def hlo_wire_bytes(programs) -> tuple[dict[str, float], dict[str, Any]]:
  """Bytes one device sends per step, read from the compiled programs of a step.

  One program (every kind of step a branch of its conditionals), or one for
  each kind of step, chosen on the host, which then count as the branches of
  one conditional over them. Returns the bytes by kind of collective, every
  branch added, and :func:`qsgd_jax.wire_bytes_by_branch`'s ``unconditional``,
  ``conditionals``, ``least`` and ``most``.
  """
  by_kinds = [wire_bytes_from_hlo(program) for program in programs]
  if len(programs) == 1:
    by_branch = qsgd_jax.wire_bytes_by_branch(programs[0].as_text())
    return by_kinds[0], {"unconditional": by_branch.unconditional,
                         "conditionals": [list(c) for c in by_branch.conditionals],
                         "least": by_branch.least, "most": by_branch.most}
  def every_branch_added(sent):  # What every program sends, and each one's more.
    return min(sent) + sum(x - min(sent) for x in sent)

  by_kind = {kind: every_branch_added([b.get(kind, 0.0) for b in by_kinds])
             for kind in set().union(*by_kinds)}
  totals = [sum(b.values()) for b in by_kinds]
  least = min(totals)
  return by_kind, {"unconditional": least, "conditionals": [[t - least for t in totals]],
                   "least": least, "most": max(totals)}


def hybrid_metrics(programs, mesh: jax.sharding.Mesh, state: TrainState) -> dict[str, Any]:
  """On a mesh of data groups (``hybrid``): the fewest and most bytes a step sends across the
  data axis (the slow links between groups) and inside a group, read from the compiled
  programs, the bytes a device holds of the parameters and of the optimizer's state, and the
  processes holding each group's devices (``data_group_processes``)."""
  found = {}
  for where in ("across", "inside"):
    least, most = [], []
    for program in programs:
      text = program.as_text()
      across = qsgd_jax.wire_bytes_by_branch(text, mesh=mesh, across=AXIS)
      whole = qsgd_jax.wire_bytes_by_branch(text)
      least.append(across.least if where == "across" else whole.least - across.least)
      most.append(across.most if where == "across" else whole.most - across.most)
    found[f"hlo_{where}_data_bytes_least"] = min(least)
    found[f"hlo_{where}_data_bytes_most"] = max(most)
  return (found | hybrid.state_bytes(state)
          | {"data_group_processes": hybrid.group_processes(mesh, AXIS)})


def checkpoint_manager(workdir: pathlib.Path, config):
  """Orbax's manager of ``workdir/checkpoints``, or a null context if checkpoints are off.

  It saves every ``config.checkpoint_every_steps`` steps (and, when forced, at
  the end) and keeps the latest two; ``config.checkpoint_every_steps <= 0``
  turns checkpoints, and resuming, off. Use it in a ``with`` statement: leaving
  it waits for the saves in flight.
  """
  if config.checkpoint_every_steps <= 0:
    return contextlib.nullcontext()
  return ocp.CheckpointManager(
      (workdir / "checkpoints").absolute(),
      options=ocp.CheckpointManagerOptions(
          save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(
              config.checkpoint_every_steps),
          preservation_policy=ocp.checkpoint_managers.LatestN(2),
      ),
  )


def restore_checkpoint(checkpoints, state: TrainState) -> tuple[TrainState, int]:
  """The latest checkpoint's state and step, or ``state`` and 0 if there is none.

  ``state`` is the freshly initialized state: its arrays' shapes, dtypes and
  shardings are the restore target, so each array comes back laid out as
  training lays it out (per-device residuals on their devices).
  """
  step = checkpoints.latest_step() if checkpoints is not None else None
  if step is None:
    return state, 0
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  return checkpoints.restore(step, args=ocp.args.StandardRestore(target)), step


def evaluate(mapped: Mapped, state: TrainState, config, num_batches: int) -> dict[str, float]:
  """The mean loss over the held-out bytes, in nats a byte."""
  loss = count = 0.0
  for batch in input_pipeline.eval_batches(config, num_batches):
    sums = mapped.eval_step(state, mapped.put_batch(batch))
    loss, count = loss + _scalar(sums["loss"]), count + _scalar(sums["count"])
  return {"eval_loss": loss / count}


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains, evaluates, and writes ``metrics.jsonl`` and ``summary.json`` into ``workdir``.

  Args:
    config: hyperparameters, e.g. from ``configs/default.py``.
    workdir: where the metrics and checkpoints go (created if needed); a run
      resumes from the latest checkpoint there.

  Returns:
    The summary: ``steps``, ``first_step`` (the checkpoint's step the run
    resumed from, or 0), ``eval_loss`` (held-out nats a byte at the end),
    ``final_train_loss`` (the mean of the last logging window), the
    held-out text's entropies given 0, 1 and 2 bytes of context (what models
    that see no more could reach), ``wire_bytes_per_step`` (what one device
    sends for the gradients each step, as the optimizer's state reports it;
    ``None`` if it does not), ``fp32_allreduce_bytes_per_step`` (a float32
    all-reduce of the gradients), ``hlo_wire_bytes_per_step`` (every
    collective of the compiled step, every branch of a switch included),
    ``hlo_wire_bytes_by_branch`` (``unconditional``, what every step sends,
    ``conditionals``, each switch's branches' bytes, ``least`` and ``most``,
    the fewest and most a step sends: :func:`qsgd_jax.wire_bytes_by_branch`),
    tokens a second and timings.
  """
  model, _, _, mapped = programs(config)
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  is_main = jax.process_index() == 0

  num_steps = config.num_train_steps
  num_eval_batches = input_pipeline.num_eval_batches(config)
  tokens_per_step = config.batch_size * config.context_length

  params = initialized(jax.random.key(config.seed), model)
  num_params = sum(x.size for x in jax.tree.leaves(params))
  num_devices = jax.device_count()
  fp32_bytes = 2 * (num_devices - 1) / num_devices * 4 * num_params  # A float32 all-reduce's.
  state = mapped.init(params)
  with checkpoint_manager(workdir, config) as checkpoints:
    state, first_step = restore_checkpoint(checkpoints, state)
    train_records = _metrics_before(workdir / "metrics.jsonl", first_step) if is_main else []

    batches = map(mapped.put_batch, input_pipeline.train_batches(config, first_step))
    batch = next(batches)
    start = time.perf_counter()
    if mapped.compile_programs is None:
      compiled_step = mapped.train_step.lower(state, batch).compile()
      # pmap's compiled program takes global arrays: across processes, call pmap itself.
      multiprocess_pmap = config.parallelism == "pmap" and jax.process_count() > 1
      train_step = mapped.train_step if multiprocess_pmap else compiled_step
      compiled_programs = [compiled_step]
      program_at = lambda count: train_step  # noqa: E731
    else:
      program_at, compiled_programs = mapped.compile_programs(state, batch)
    hlo_bytes, by_branch = hlo_wire_bytes(compiled_programs)
    layout_metrics = (hybrid_metrics(compiled_programs, mapped.mesh, state)
                      if mapped.mesh is not None else {})
    compile_seconds = time.perf_counter() - start
    # XLA's CPU collectives give up after a while: one step at a time there.
    block_every_step = jax.default_backend() == "cpu"

    metrics_file = (workdir / "metrics.jsonl").open("a") if is_main else None
    # Training seconds leave out evaluations and checkpoints; wall seconds count everything
    # since the loop began.
    loop_start = time.perf_counter()
    window, window_start, window_seconds, train_seconds = [], loop_start, 0.0, 0.0
    eval_metrics: dict[str, float] = {}
    progress = tqdm.trange(first_step, num_steps, initial=first_step, total=num_steps,
                           desc=f"{config.optimizer} {config.average}", disable=not is_main)
    if is_main:
      progress.write(
          f"{num_params:,} parameters; the compiled step sends {sum(hlo_bytes.values()):,.0f} "
          f"bytes a device (a float32 all-reduce of the gradients: {fp32_bytes:,.0f}).")
    for step in progress:
      state, metrics = program_at(step)(state, batch)
      if block_every_step:
        jax.block_until_ready((state, metrics))
      window.append(metrics)
      if step + 1 < num_steps:
        batch = next(batches)
      done = step + 1
      if done % config.log_every_steps == 0 or done == num_steps:
        records = [{name: _scalar(value) for name, value in m.items()} for m in window]
        elapsed = window_seconds + time.perf_counter() - window_start
        train_seconds += elapsed
        for offset, record in enumerate(records):
          record["step"] = done - len(records) + offset + 1
          record["steps_per_second"] = len(records) / elapsed
          record["tokens_per_second"] = len(records) * tokens_per_step / elapsed
          if record.get("wire_bytes"):  # One device sends nothing: no ratio.
            record["compression_ratio"] = record["fp32_wire_bytes"] / record["wire_bytes"]
          if not math.isfinite(record.get("elias_wire_bytes", 0.0)):  # Not measured.
            del record["elias_wire_bytes"]
          record["train_seconds"] = train_seconds
          record["wall_seconds"] = time.perf_counter() - loop_start
          _write(metrics_file, record)
        progress.set_postfix(loss=f"{records[-1]['loss']:.3f}",
                             tokens_per_second=f"{len(records) * tokens_per_step / elapsed:,.0f}")
        train_records += records
        window, window_seconds = [], 0.0
        window_start = time.perf_counter()
      if done % config.eval_every_steps == 0 or done == num_steps:
        window_seconds += time.perf_counter() - window_start
        eval_metrics = evaluate(mapped, state, config, num_eval_batches)
        _write(metrics_file, {"step": done, **eval_metrics,
                              "train_seconds": train_seconds + window_seconds,
                              "wall_seconds": time.perf_counter() - loop_start})
        if is_main:
          progress.write(f"step {done}: held-out loss {eval_metrics['eval_loss']:.4f} nats/byte")
        window_start = time.perf_counter()
      if checkpoints is not None:
        window_seconds += time.perf_counter() - window_start
        checkpoints.save(done, args=ocp.args.StandardSave(state), force=done == num_steps)
        window_start = time.perf_counter()
    progress.close()
    if metrics_file is not None:
      metrics_file.close()
    if not eval_metrics:  # Resumed where the run had ended: nothing trained.
      eval_metrics = evaluate(mapped, state, config, num_eval_batches)

  # The last logging window: the steps after the last multiple of log_every_steps.
  last_window_start = (num_steps - 1) // config.log_every_steps * config.log_every_steps
  last_window = [r for r in train_records if r["step"] > last_window_start]
  last = last_window[-1]
  held_out = input_pipeline.corpus(config).held_out
  summary = {
      "optimizer": config.optimizer,
      "average": config.average,
      "parallelism": config.parallelism,
      "dtype": config.dtype,
      "num_devices": num_devices,
      "num_processes": jax.process_count(),
      "num_params": num_params,
      "steps": num_steps,
      "first_step": first_step,
      **eval_metrics,
      "final_train_loss": float(np.mean([r["loss"] for r in last_window])),
      **{f"entropy_given_{order}_bytes": input_pipeline.conditional_entropy(held_out, order)
         for order in range(3)},
      "wire_bytes_per_step": last.get("wire_bytes"),
      **{f"mean_{name}_per_step": _mean_of(train_records, name)
         for name in ("wire_bytes", "inner_wire_bytes")},
      "fp32_allreduce_bytes_per_step": fp32_bytes,
      "compression_ratio": last.get("compression_ratio"),
      "freeze_step": _freeze_step_taken(last.get("freeze_step")),
      "elias_wire_bytes_per_step": _finite_or_none(last.get("elias_wire_bytes")),
      "hlo_wire_bytes_per_step": sum(hlo_bytes.values()),
      "hlo_wire_bytes_by_collective": hlo_bytes,
      "hlo_wire_bytes_by_branch": by_branch,
      **layout_metrics,
      "tokens_per_second": ((num_steps - first_step) * tokens_per_step / train_seconds
                            if train_seconds else None),
      "steps_per_second": (num_steps - first_step) / train_seconds if train_seconds else None,
      "train_seconds": train_seconds,
      "compile_seconds": compile_seconds,
  }
  if is_main:
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
  return summary


def _mean_of(records: list[dict[str, Any]], name: str) -> float | None:
  """The mean of ``name`` over the steps that report it (``None`` if none does): over a run
  whose steps send different bytes (DiLoCo's syncs, a compressed Adam's freeze), the bytes a
  step sends on average."""
  values = [r[name] for r in records if name in r]
  return float(np.mean(values)) if values else None


def _freeze_step_taken(freeze_count: float | None) -> int | None:
  """The step a compressed Adam froze its variance at; ``None`` if not frozen or no such Adam."""
  if freeze_count is None or freeze_count >= 2**31 - 1:
    return None
  return int(freeze_count)


def _not_one_of(config, field: str, allowed: tuple[str, ...]) -> str:
  return f"config.{field} must be one of {', '.join(allowed)}; got {config[field]!r}."


def _check_choice(config, field: str, allowed: tuple[str, ...]) -> None:
  if config[field] not in allowed:
    raise ValueError(_not_one_of(config, field, allowed))


def _check_config(config) -> None:
  _check_choice(config, "optimizer", tuple(OPTIMIZERS))
  _check_choice(config, "average", AVERAGES)
  _check_choice(config, "parallelism", PARALLELISMS)
  if config.optimizer == "diloco" and config.parallelism not in ("shard_map", "hybrid"):
    raise ValueError("config.optimizer diloco runs under parallelism shard_map (over a mesh of "
                     "workers and their devices, diloco.py) or hybrid (a worker a data group); "
                     f"got {config.parallelism!r}.")
  if config.parallelism == "hybrid":
    _check_hybrid(config)
  if config.parallelism == "fsdp":
    _check_choice(config, "fsdp_weights", fsdp.WEIGHTS)
    if config.average not in fsdp.AVERAGES:
      raise ValueError(
          f"config.average must be one of {', '.join(fsdp.AVERAGES)} under parallelism fsdp "
          f"(its reduce-scatter, fsdp_gather's derivative, keeps no error-feedback residual); "
          f"got {config.average!r}.")
    if config.optimizer == "zero_one_adam":
      raise ValueError("config.optimizer zero_one_adam does not run under parallelism fsdp; use "
                       "onebit_adam (qsgd_jax.fsdp_onebit_adam) or adamw.")
    if config.optimizer == "onebit_adam" and config.freeze_step == "auto":
      raise ValueError("config.freeze_step must be a step under parallelism fsdp with "
                       "onebit_adam (fsdp_onebit_adam has no 'auto'); e.g. "
                       "--config.freeze_step=60.")
  _check_choice(config, "dtype", tuple(DTYPES))
  if config.width % config.num_heads:
    raise ValueError(f"config.width {config.width} must be a multiple of config.num_heads "
                     f"{config.num_heads}.")
  for field in ("num_train_steps", "log_every_steps", "eval_every_steps"):
    if config[field] <= 0:
      raise ValueError(f"config.{field} must be positive, got {config[field]}.")


def _check_hybrid(config) -> None:
  group = config.fsdp_devices * config.tensor_devices
  if config.optimizer == "diloco" and config.diloco_workers * group != jax.device_count():
    raise ValueError(
        f"config.diloco_workers={config.diloco_workers} must be the number of data groups, "
        f"{jax.device_count()} devices / (fsdp_devices * tensor_devices = {group}), under "
        "parallelism hybrid: a worker is a data group.")
  if config.optimizer == "diloco" and config.outer_split:
    raise ValueError("config.outer_split does not apply under parallelism hybrid: a worker's "
                     "devices already hold a shard each of the model and its outer gradient.")
  if config.average not in ("fp32", "bf16", "qsgd4", "qsgd8", "qsgd4_ef", "onebit"):
    raise ValueError(f"config.average {config.average!r} does not run under parallelism "
                     "hybrid; use fp32 (the compiler's), bf16, qsgd4, qsgd8, qsgd4_ef or onebit.")


def _metrics_before(path: pathlib.Path, first_step: int) -> list[dict[str, Any]]:
  """Keeps the records of steps up to ``first_step`` in ``path``; returns those of training.

  A run resumed from a checkpoint logs the steps after it again: the records a
  previous run wrote for them go.
  """
  kept = []
  if first_step and path.exists():
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    kept = [record for record in kept if record["step"] <= first_step]
  path.write_text("".join(json.dumps(record) + "\n" for record in kept))
  return [record for record in kept if "loss" in record]


def _scalar(value) -> float:
  """A metric as a Python float: one device's copy of a replicated value."""
  if isinstance(value, jax.Array):
    value = value.addressable_data(0)
  return float(np.asarray(value).reshape(-1)[0])


def _finite_or_none(value: float | None) -> float | None:
  return value if value is not None and math.isfinite(value) else None


def _write(file, record: dict[str, Any]) -> None:
  if file is not None:
    file.write(json.dumps(record) + "\n")
    file.flush()
