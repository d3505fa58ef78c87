"""Data-parallel ResNet training whose gradient all-reduce is quantized by qsgd_jax.

The training step is the usual data-parallel one, with one change: the
``lax.pmean(grads, 'batch')`` line is gone, and the first transform of the optax
chain averages the gradients instead, compressing what it sends (see
``create_optimizer``). BatchNorm averages its batch statistics over the same
axis, and the metrics are averaged with ``lax.pmean``. The step runs under
``jax.pmap`` or ``jax.shard_map``, or is a ``jax.jit`` step over a mesh made by
``qsgd_jax.data_parallel`` (``config.parallelism``).

The state is checkpointed with orbax every ``config.checkpoint_every_steps``
steps and at the end, into ``workdir/checkpoints``, each with a manifest of
checksums (``examples/checkpoints.py``); a run started in a workdir that has
checkpoints resumes from the newest that passes verification, its data where
it was, on this run's device count. A non-finite training loss stops the run
before a checkpoint holds it, unless ``config.skip_nonfinite_steps`` says to
skip such steps.
"""

import contextlib
import functools
import json
import math
import pathlib
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import tqdm
from absl import logging
from flax import jax_utils
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import qsgd_jax
from examples import checkpoints as checkpointing
from examples.imagenet import input_pipeline, models

AXIS = "batch"
COMPRESSIONS = ("fp32", "bf16", "qsgd4", "qsgd8", "minmax8", "onebit", "powersgd",
                "decentralized8", "topk_ef", "dgc")
PARALLELISMS = ("pmap", "shard_map", "jit")


class TrainState(train_state.TrainState):
  batch_stats: Any


class RunError(Exception):
  """The run cannot go on; the message is one line: what happened, and what to do."""


class NonFiniteLossError(RunError):
  """A training loss was NaN or infinite (more often in a row than the config skips)."""


def create_model(config: ml_collections.ConfigDict, num_classes: int):
  """The ResNet named by ``config.model``, BatchNorm shared over the ``AXIS`` devices."""
  model_cls = getattr(models, config.model)
  dtype = jnp.bfloat16 if config.half_precision else jnp.float32
  return model_cls(num_classes=num_classes, dtype=dtype, axis_name=AXIS)


def initialized(key: jax.Array, image_shape: tuple[int, ...], model):
  """The model's initial ``params`` and ``batch_stats``."""
  variables = _jitted_init(model)(key, jnp.ones((1, *image_shape), model.dtype))
  return variables["params"], variables["batch_stats"]


@functools.cache
def _jitted_init(model):
  # One compiled initializer for equal models (linen modules compare by their fields):
  # runs after the first in a process, such as compare.py's, skip its long compilation.
  return jax.jit(functools.partial(model.init, train=False))


def create_learning_rate_fn(config: ml_collections.ConfigDict, steps_per_epoch: int,
                            num_steps: int) -> optax.Schedule:
  """Linear warm-up to ``learning_rate * batch_size / 256``, then cosine decay to zero."""
  peak = config.learning_rate * config.batch_size / 256
  warmup_steps = min(int(config.warmup_epochs * steps_per_epoch), num_steps - 1)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak, warmup_steps=warmup_steps, decay_steps=num_steps
  )


def gradient_averaging(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """The transform that averages gradients over ``AXIS``, as ``config.compression`` says.

  Identity and Cast go through the library too, so that every mode reports
  what it sends the same way (:func:`qsgd_jax.compression_stats`).
  """
  options = dict(key=config.seed, min_compressed_size=config.min_compressed_size)
  match config.compression:
    case "fp32":
      return qsgd_jax.compressed_allreduce(qsgd_jax.Identity(), AXIS, **options)
    case "bf16":
      return qsgd_jax.compressed_allreduce(qsgd_jax.Cast(jnp.bfloat16), AXIS, **options)
    case "qsgd4" | "qsgd8":
      bits = int(config.compression.removeprefix("qsgd"))
      return qsgd_jax.qsgd(AXIS, bits=bits, bucket_size=config.bucket_size,
                           track_elias=config.track_elias, **options)
    case "minmax8":
      return qsgd_jax.compressed_allreduce(qsgd_jax.MinMax(bits=8), AXIS, **options)
    case "onebit":
      return qsgd_jax.onebit_sgd(AXIS, bucket_size=config.bucket_size, **options)
    case "powersgd":
      return qsgd_jax.powersgd(AXIS, rank=config.powersgd_rank,
                               start_iter=config.powersgd_start_iter, seed=config.seed)
    case "topk_ef":
      topk = qsgd_jax.TopK(density=config.topk_density, chunk=config.topk_chunk,
                           value_bits=config.topk_value_bits or None)
      return qsgd_jax.compressed_allreduce(topk, AXIS, key=config.seed, error_feedback=True,
                                           min_compressed_size=config.topk_min_compressed_size,
                                           warmup_steps=config.topk_warmup_steps)
  raise ValueError(f"No all-reduce for compression {config.compression!r}.")


def create_optimizer(config: ml_collections.ConfigDict,
                     learning_rate_fn: optax.Schedule) -> optax.GradientTransformation:
  """SGD with Nesterov momentum and weight decay, after the gradients are averaged.

  ``decentralized8`` has no all-reduce: every device takes its own SGD step and
  exchanges 8-bit differences of its model with its two ring neighbours, in
  Bagua's buckets and with Bagua's quantizer (the library's defaults). ``dgc``
  is Deep Gradient Compression (``qsgd_jax.dgc``): the momentum goes into each
  device's accumulated velocity, whose top ``config.topk_density`` of each chunk
  is sent, and the kernels' weight decay with it.

  With ``config.skip_nonfinite_steps = k > 0`` the SGD step is wrapped in
  ``optax.apply_if_finite(..., k)``, after the averaging: a NaN or inf on any
  device makes the averaged gradient non-finite on every device, so all skip
  the step together (decentralized workers skip their own).
  """
  is_kernel = functools.partial(jax.tree.map, lambda x: x.ndim > 1)
  local_step = optax.chain(
      optax.add_decayed_weights(config.weight_decay, mask=is_kernel),
      optax.sgd(learning_rate_fn, momentum=config.momentum, nesterov=config.nesterov),
  )
  if config.skip_nonfinite_steps:
    local_step = optax.apply_if_finite(local_step, config.skip_nonfinite_steps)
  if config.compression == "decentralized8":
    return qsgd_jax.low_precision_decentralized(local_step, AXIS, key=config.seed)
  if config.compression == "dgc":
    # The paper's warm-up, each stage a quarter of the last one's density, down to the target.
    stages = [0.25 / 4**k for k in range(4) if 0.25 / 4**k > config.topk_density]
    return qsgd_jax.dgc(learning_rate_fn, AXIS, density=config.topk_density,
                        chunk=config.topk_chunk, momentum=config.momentum,
                        nesterov=config.nesterov, weight_decay=config.weight_decay,
                        mask=is_kernel,
                        warmup_densities=stages if config.topk_warmup_steps else (),
                        warmup_steps=config.topk_warmup_steps)
  return optax.chain(gradient_averaging(config), local_step)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def loss_fn(params, batch, batch_stats, apply_fn):
  """One device's mean loss, and its ``(accuracy, new batch_stats)``."""
  logits, updated = apply_fn(
      {"params": params, "batch_stats": batch_stats},
      batch["image"], train=True, mutable=["batch_stats"],
  )
  accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
  return cross_entropy(logits, batch["label"]).mean(), (accuracy, updated["batch_stats"])


def wire_metrics(opt_state) -> dict[str, jax.Array]:
  """What the optimizer's gradient averaging sent in the last step, in bytes."""
  stats = qsgd_jax.compression_stats(opt_state)
  if stats is None:
    return {}
  return {
      "wire_bytes": stats.wire_bits / 8,
      "fp32_wire_bytes": stats.float32_bits / 8,
      "elias_wire_bytes": stats.elias_bits / 8,
  }


def train_step(state: TrainState, batch, learning_rate_fn: optax.Schedule,
               skips_nonfinite: bool = False):
  """One step on one device's share of the batch; call it under pmap or shard_map.

  With ``skips_nonfinite``, a step whose mean loss is not finite keeps the
  BatchNorm statistics too, as the optimizer keeps the params.
  """
  grad_fn = jax.value_and_grad(functools.partial(loss_fn, apply_fn=state.apply_fn), has_aux=True)
  # Each device's own gradient: under shard_map, that of its own (varying) copy of the params.
  (loss, (accuracy, batch_stats)), grads = grad_fn(
      qsgd_jax.as_varying(state.params, AXIS), batch, state.batch_stats)
  if skips_nonfinite:
    batch_stats = _kept_if_nonfinite(jax.lax.pmean(loss, AXIS), batch_stats, state.batch_stats)
  # No lax.pmean(grads, AXIS) here: the optimizer's first transform averages them.
  state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
  metrics = {"loss": loss, "accuracy": accuracy, "learning_rate": learning_rate_fn(state.step - 1)}
  return state, jax.lax.pmean(metrics | wire_metrics(state.opt_state), AXIS)


def jit_train_step(state: TrainState, batch, learning_rate_fn: optax.Schedule,
                   data_parallel_step: Callable, skips_nonfinite: bool = False):
  """One step over the whole batch, under ``jax.jit``; ``data_parallel_step`` from data_parallel.

  ``data_parallel_step`` differentiates :func:`loss_fn` on each device's share
  and applies the averaged updates; its loss and accuracy come back averaged.
  ``skips_nonfinite`` as in :func:`train_step`.
  """
  params, opt_state, (loss, (accuracy, batch_stats)) = data_parallel_step(
      state.params, state.opt_state, batch, state.batch_stats)
  if skips_nonfinite:
    batch_stats = _kept_if_nonfinite(loss, batch_stats, state.batch_stats)
  metrics = {"loss": loss, "accuracy": accuracy, "learning_rate": learning_rate_fn(state.step)}
  state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                        batch_stats=batch_stats)
  return state, metrics | wire_metrics(opt_state)


def _kept_if_nonfinite(mean_loss: jax.Array, new, old):
  return jax.tree.map(lambda n, o: jnp.where(jnp.isfinite(mean_loss), n, o), new, old)


def eval_step(state: TrainState, batch, average_params: bool):
  """Sums of loss, correct predictions and examples over all devices' shares.

  With ``average_params`` (decentralized training, where every device holds
  its own model) the average of the devices' models is evaluated.
  """
  params = state.params
  if average_params:
    params = qsgd_jax.averaged_params(params, AXIS)
  logits = state.apply_fn(
      {"params": params, "batch_stats": state.batch_stats}, batch["image"], train=False
  )
  mask = batch["mask"]
  sums = {
      "loss": jnp.sum(cross_entropy(logits, batch["label"]) * mask),
      "correct": jnp.sum((jnp.argmax(logits, -1) == batch["label"]) * mask),
      "count": jnp.sum(mask),
  }
  sums = jax.lax.psum(sums, AXIS)
  if average_params:
    sums["consensus_distance"] = qsgd_jax.consensus_distance(state.params, AXIS)
  return sums


class Mapped(NamedTuple):
  """The per-device functions, mapped over ``AXIS`` by pmap or shard_map.

  Attributes:
    train_step: ``(state, batch) -> (state, metrics)``; donates ``state``.
    eval_step: ``(state, batch) -> sums``.
    put_batch: this process's numpy batch onto its devices.
  """

  train_step: Callable
  eval_step: Callable
  put_batch: Callable


def parallelize(config, model, tx, learning_rate_fn, params, batch_stats):
  """The mapped functions, and the initial state on every device.

  Under shard_map and jit the state is replicated (``P()``) except for the
  compressor's per-device residuals (:func:`qsgd_jax.state_partition_specs`).
  Decentralized training keeps one model per device: there the whole state is
  stacked along a leading device axis (``P(AXIS)``), as pmap keeps it anyway.
  The jit step is :func:`jit_train_step`; evaluation runs under shard_map.

  Returns:
    ``(mapped, state)``: a :class:`Mapped` and the initial :class:`TrainState`.
  """
  per_device = config.compression == "decentralized8"
  stacked = per_device and config.parallelism == "shard_map"

  def unstack(tree):
    return jax.tree.map(lambda x: x[0], tree) if stacked else tree

  def stack(tree):
    return jax.tree.map(lambda x: jnp.asarray(x)[None], tree) if stacked else tree

  def init(params, batch_stats):
    return stack(TrainState.create(apply_fn=model.apply, params=params, tx=tx,
                                   batch_stats=batch_stats))

  def step(state, batch):
    state, metrics = train_step(unstack(state), batch, learning_rate_fn,
                                skips_nonfinite=config.skip_nonfinite_steps > 0)
    return stack(state), metrics

  def evaluate(state, batch):
    return eval_step(unstack(state), batch, average_params=per_device)

  if config.parallelism == "pmap":
    # pmap's own layout: the leading axis split over this process's devices.
    devices = NamedSharding(Mesh(np.array(jax.local_devices()), (AXIS,)), P(AXIS))

    def put_batch(batch):
      return jax.device_put(
          jax.tree.map(lambda x: x.reshape((jax.local_device_count(), -1, *x.shape[1:])), batch),
          devices,
      )

    state = jax.pmap(init, AXIS)(jax_utils.replicate(params), jax_utils.replicate(batch_stats))
    mapped = Mapped(
        train_step=jax.pmap(step, AXIS, donate_argnums=(0,)),
        eval_step=jax.pmap(evaluate, AXIS),
        put_batch=put_batch,
    )
    return mapped, state

  mesh = jax.make_mesh((jax.device_count(),), (AXIS,),
                       axis_types=(jax.sharding.AxisType.Explicit,))
  replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
  # Every process holds the same initial values; each gives its own devices their copies.
  params, batch_stats = jax.tree.map(
      lambda x: jax.make_array_from_callback(x.shape, replicated, lambda index: x[index]),
      jax.device_get((params, batch_stats)),
  )
  shard = functools.partial(jax.shard_map, mesh=mesh)

  def put_batch(batch):
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(split, x), batch)

  if config.parallelism == "jit":
    data_parallel = qsgd_jax.data_parallel(
        functools.partial(loss_fn, apply_fn=model.apply), tx, mesh, AXIS, has_aux=True)
    zero = jax.make_array_from_callback((), replicated, lambda index: np.zeros((), np.int32))
    state = TrainState(step=zero, apply_fn=model.apply, params=params, tx=tx,
                       opt_state=data_parallel.init(params), batch_stats=batch_stats)
    specs = _state_specs(state, stacked)
    train = jax.jit(functools.partial(jit_train_step, learning_rate_fn=learning_rate_fn,
                                      data_parallel_step=data_parallel.step,
                                      skips_nonfinite=config.skip_nonfinite_steps > 0),
                    donate_argnums=(0,))
  else:
    specs = _state_specs(jax.eval_shape(init, params, batch_stats), stacked)
    state = jax.jit(shard(init, in_specs=(P(), P()), out_specs=specs))(params, batch_stats)
    train = jax.jit(shard(step, in_specs=(specs, P(AXIS)), out_specs=(specs, P())),
                    donate_argnums=(0,))
  mapped = Mapped(
      train_step=train,
      eval_step=jax.jit(shard(evaluate, in_specs=(specs, P(AXIS)), out_specs=P())),
      put_batch=put_batch,
  )
  return mapped, state


def _state_specs(shapes: TrainState, stacked: bool) -> TrainState:
  """``PartitionSpec``s of the state under shard_map."""
  if stacked:
    return jax.tree.map(lambda _: P(AXIS), shapes)
  replicated = functools.partial(jax.tree.map, lambda _: P())
  return shapes.replace(
      step=P(),
      params=replicated(shapes.params),
      batch_stats=replicated(shapes.batch_stats),
      opt_state=qsgd_jax.state_partition_specs(shapes.opt_state, AXIS),
  )


def wire_bytes_from_hlo(hlo_text: str) -> dict[str, float]:
  """Bytes one device sends per step, by kind of collective, read from the compiled step's
  text.

  Besides the gradients' exchange, the step all-reduces BatchNorm's batch
  statistics (and their gradients) and the metrics.
  """
  by_kind: dict[str, float] = {}
  for collective in qsgd_jax.collectives_in_hlo(hlo_text):
    by_kind[collective.kind] = by_kind.get(collective.kind, 0.0) + collective.bytes_sent
  return by_kind


# The settings that shape the saved state besides the device count: a checkpoint
# saved with others is refused rather than half restored.
_STATE_SETTINGS = ("model", "compression", "parallelism", "min_compressed_size", "bucket_size",
                   "skip_nonfinite_steps")


def checkpoint_manager(workdir: pathlib.Path, config):
  """The verified checkpoints of ``workdir/checkpoints``, or a null context if they are off.

  It saves every ``config.checkpoint_every_steps`` steps (and, when forced, at
  the end), each with its manifest of checksums, and keeps the latest two;
  ``config.checkpoint_every_steps <= 0`` turns checkpoints, and resuming, off.
  Use it in a ``with`` statement: leaving it waits for the saves in flight.
  """
  if config.checkpoint_every_steps <= 0:
    return contextlib.nullcontext()
  settings = {name: config[name] for name in _STATE_SETTINGS}
  settings["skip_nonfinite_steps"] = bool(settings["skip_nonfinite_steps"])  # Its state's shape.
  return checkpointing.VerifiedCheckpoints(workdir / "checkpoints", config.checkpoint_every_steps,
                                           keep=2, settings=settings)


def restore_checkpoint(checkpoints, state: TrainState, config) -> tuple[TrainState, int]:
  """The newest good checkpoint's state and step, or ``state`` and 0 if there is none.

  ``state`` is the freshly initialized state: its arrays' shapes, dtypes and
  shardings are the restore target, so each array comes back laid out as
  training lays it out. A checkpoint saved on another device count has its
  per-device state redistributed (:func:`qsgd_jax.resize_state`; with
  ``config.drop_residuals_when_resized``, error-feedback residuals start at
  zero instead).

  Raises:
    RunError: no checkpoint passes verification, or the newest good one was
      saved with other settings or cannot be laid out for this device count.
  """
  stacked = (config.parallelism == "pmap"
             or (config.parallelism == "shard_map" and config.compression == "decentralized8"))
  try:
    return checkpointing.resume(checkpoints, state, stacked=stacked,
                                drop_residuals=config.drop_residuals_when_resized)
  except checkpointing.CheckpointError as error:
    raise RunError(str(error)) from None


def evaluate(mapped: Mapped, state: TrainState, config, num_batches: int) -> dict[str, float]:
  """Loss and accuracy on the evaluation split, padding left out."""
  totals: dict[str, float] = {}
  for batch in input_pipeline.eval_batches(config, num_batches):
    sums = mapped.eval_step(state, mapped.put_batch(batch))
    for name, value in sums.items():
      totals[name] = totals.get(name, 0.0) + _scalar(value)
  metrics = {"eval_loss": totals["loss"] / totals["count"],
             "eval_accuracy": totals["correct"] / totals["count"]}
  if "consensus_distance" in totals:
    metrics["consensus_distance"] = totals["consensus_distance"] / num_batches
  return metrics


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains, evaluates, and writes ``metrics.jsonl`` and ``summary.json`` into ``workdir``.

  Args:
    config: hyperparameters, e.g. from ``configs/default.py``.
    workdir: where the metrics and checkpoints go (created if needed); a run
      resumes from the latest checkpoint there.

  Returns:
    The summary: ``steps``, ``first_step`` (the checkpoint's step the run
    resumed from, or 0), ``final_train_loss`` (the mean of the last logging
    window), ``eval_accuracy``, ``wire_bytes_per_step`` (what one device sends
    for the gradients each step), ``fp32_wire_bytes_per_step`` (the same for a
    float32 all-reduce), their ratio, the bytes read from the compiled HLO
    (``hlo_wire_bytes_per_step``, every branch of its conditionals added;
    ``hlo_wire_bytes_least`` and ``_most``, the lightest and heaviest step:
    a warm-up's compressed step and its float32 one), and timings of this
    process's steps.

  Raises:
    RunError: the run cannot go on (a :class:`NonFiniteLossError`, or no
      checkpoint to resume from that passes verification and fits); its
      message is one line.
  """
  _check_config(config)
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  is_main = jax.process_index() == 0

  info = input_pipeline.dataset_info(config)
  steps_per_epoch = info.num_train_examples // config.batch_size
  num_steps = (config.num_train_steps if config.num_train_steps > 0
               else int(config.num_epochs * steps_per_epoch))
  eval_every = config.eval_every_steps if config.eval_every_steps > 0 else steps_per_epoch
  num_eval_batches = input_pipeline.num_eval_batches(config, info)

  model = create_model(config, info.num_classes)
  learning_rate_fn = create_learning_rate_fn(config, steps_per_epoch, num_steps)
  tx = create_optimizer(config, learning_rate_fn)
  params, batch_stats = initialized(jax.random.key(config.seed), info.image_shape, model)
  num_params = sum(x.size for x in jax.tree.leaves(params))
  mapped, state = parallelize(config, model, tx, learning_rate_fn, params, batch_stats)
  with checkpoint_manager(workdir, config) as checkpoints:
    state, first_step = restore_checkpoint(checkpoints, state, config)
    train_records = _metrics_before(workdir / "metrics.jsonl", first_step) if is_main else []
    logging.info("Training from step %d of %d.", first_step, num_steps)

    batches = map(mapped.put_batch, input_pipeline.train_batches(config, first_step))
    batch = next(batches)
    start = time.perf_counter()
    compiled_step = mapped.train_step.lower(state, batch).compile()
    # pmap's compiled program takes global arrays: across processes, call pmap itself.
    multiprocess_pmap = config.parallelism == "pmap" and jax.process_count() > 1
    train_step = mapped.train_step if multiprocess_pmap else compiled_step
    hlo_text = compiled_step.as_text()
    hlo_bytes = wire_bytes_from_hlo(hlo_text)
    by_branch = qsgd_jax.wire_bytes_by_branch(hlo_text)
    compile_seconds = time.perf_counter() - start
    num_devices = jax.device_count()
    # XLA's CPU collectives give up after a while: one step at a time there.
    block_every_step = jax.default_backend() == "cpu"

    metrics_file = (workdir / "metrics.jsonl").open("a") if is_main else None
    # Training seconds leave out evaluations and checkpoints; wall seconds count everything
    # since the loop began.
    loop_start = time.perf_counter()
    window, window_start, window_seconds, train_seconds = [], loop_start, 0.0, 0.0
    eval_metrics: dict[str, float] = {}
    # Losses not yet read on the host, and the non-finite ones: each is read before the
    # state after it is logged, evaluated or saved.
    unread, nonfinite = [], NonFinite(config.skip_nonfinite_steps)
    progress = tqdm.trange(first_step, num_steps, initial=first_step, total=num_steps,
                           desc=config.compression, disable=not is_main)
    for step in progress:
      state, metrics = train_step(state, batch)
      if block_every_step:
        jax.block_until_ready((state, metrics))
      window.append(metrics)
      unread.append(metrics["loss"])
      if step + 1 < num_steps:
        batch = next(batches)
      done = step + 1
      saving = checkpoints is not None and (done == num_steps or checkpoints.should_save(done))
      if (saving or done % config.log_every_steps == 0 or done % eval_every == 0
          or done == num_steps):
        nonfinite.read(unread, last_step=done)
        unread = []
      if done % config.log_every_steps == 0 or done == num_steps:
        records = [{name: _scalar(value) for name, value in m.items()} for m in window]
        elapsed = window_seconds + time.perf_counter() - window_start
        train_seconds += elapsed
        for offset, record in enumerate(records):
          record["step"] = done - len(records) + offset + 1
          record["steps_per_second"] = len(records) / elapsed
          record["compression_ratio"] = record["fp32_wire_bytes"] / record["wire_bytes"]
          record["train_seconds"] = train_seconds
          record["wall_seconds"] = time.perf_counter() - loop_start
          _write(metrics_file, record)
        progress.set_postfix(loss=f"{records[-1]['loss']:.3f}",
                             accuracy=f"{records[-1]['accuracy']:.3f}",
                             steps_per_second=f"{len(records) / elapsed:.1f}")
        train_records += records
        window, window_seconds = [], 0.0
        window_start = time.perf_counter()
      if done % eval_every == 0 or done == num_steps:
        window_seconds += time.perf_counter() - window_start
        eval_metrics = evaluate(mapped, state, config, num_eval_batches)
        _write(metrics_file, {"step": done, **eval_metrics,
                              "train_seconds": train_seconds + window_seconds,
                              "wall_seconds": time.perf_counter() - loop_start})
        window_start = time.perf_counter()
      if saving:
        window_seconds += time.perf_counter() - window_start
        checkpoints.save(done, state, force=done == num_steps)
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
  summary = {
      "compression": config.compression,
      "parallelism": config.parallelism,
      "model": config.model,
      "dataset": config.dataset,
      "num_devices": num_devices,
      "num_processes": jax.process_count(),
      "num_params": num_params,
      "steps": num_steps,
      "first_step": first_step,
      "final_train_loss": float(np.mean([r["loss"] for r in last_window])),
      "final_train_accuracy": float(np.mean([r["accuracy"] for r in last_window])),
      **eval_metrics,
      "wire_bytes_per_step": last["wire_bytes"],
      "fp32_wire_bytes_per_step": last["fp32_wire_bytes"],
      "compression_ratio": last["compression_ratio"],
      "elias_wire_bytes_per_step": _finite_or_none(last.get("elias_wire_bytes")),
      "hlo_wire_bytes_per_step": sum(hlo_bytes.values()),
      "hlo_wire_bytes_by_collective": hlo_bytes,
      # A warm-up's conditional sends one branch a step: its lightest and heaviest steps.
      "hlo_wire_bytes_least": by_branch.least,
      "hlo_wire_bytes_most": by_branch.most,
      "skipped_nonfinite_steps": nonfinite.skipped,
      "steps_per_second": (num_steps - first_step) / train_seconds if train_seconds else None,
      "train_seconds": train_seconds,
      "compile_seconds": compile_seconds,
  }
  if is_main:
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
  return summary


def _check_config(config) -> None:
  if config.compression not in COMPRESSIONS:
    raise ValueError(f"config.compression must be one of {COMPRESSIONS}, "
                     f"got {config.compression!r}.")
  if config.parallelism not in PARALLELISMS:
    raise ValueError(f"config.parallelism must be one of {PARALLELISMS}, "
                     f"got {config.parallelism!r}.")
  if config.parallelism == "jit" and config.compression == "decentralized8":
    raise ValueError("config.compression 'decentralized8' keeps one model per device, but "
                     "config.parallelism 'jit' replicates the params: use 'pmap' or 'shard_map'.")


class NonFinite:
  """Counts non-finite training losses, and stops the run at one too many.

  Args:
    skip: consecutive non-finite steps the optimizer skips
      (``config.skip_nonfinite_steps``); one more stops the run, and with 0 the
      first does.
  """

  def __init__(self, skip: int):
    self.skip = skip
    self.in_a_row = 0
    self.skipped = 0

  def read(self, losses: list, last_step: int) -> None:
    """Reads the losses of the steps up to ``last_step``.

    Raises:
      NonFiniteLossError: at the first loss past the skips, naming its step.
    """
    for offset, loss in enumerate(losses):
      value, step = _scalar(loss), last_step - len(losses) + offset + 1
      if math.isfinite(value):
        self.in_a_row = 0
        continue
      self.in_a_row += 1
      if self.in_a_row > self.skip:
        if self.skip:
          raise NonFiniteLossError(
              f"Non-finite training loss ({value}) at step {step}, {self.in_a_row} steps in a "
              f"row, more than config.skip_nonfinite_steps={self.skip}: stopping before a "
              "checkpoint holds it.")
        raise NonFiniteLossError(
            f"Non-finite training loss ({value}) at step {step}: stopping before a checkpoint "
            "holds it. Lower the learning rate, or set config.skip_nonfinite_steps to skip "
            "such steps.")
      self.skipped += 1


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
