"""Local-update training (``--config.optimizer=diloco``): data parallel inside a worker,
DiLoCo across workers.

The devices form ``config.diloco_workers`` workers of ``n / workers`` devices
each, a mesh of axes ``("workers", "batch")``. Inside a worker each step is
the usual data-parallel one over ``"batch"`` (the fast links): the gradients
averaged as ``config.average`` says, clipped, AdamW. Across workers nothing
travels but, every ``config.sync_every`` steps, each fragment's outer
gradient (how far the worker's parameters moved from the global ones),
averaged over ``"workers"`` as ``config.outer_average`` says, which
``qsgd_jax.diloco``'s outer optimizer (SGD with ``config.outer_learning_rate``
and ``config.outer_momentum``) applies to the global parameters.

Each worker holds its own parameters: every leaf has a leading axis of the
number of workers, laid out along ``"workers"`` (``P("workers")``) and
replicated over the worker's devices. Evaluation reads the global parameters,
the same everywhere.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qsgd_jax
from examples.lm import sparse

WORKERS = "workers"
OUTER_AVERAGES = ("fp32", "bf16", "qsgd8_ef", "qsgd4_ef", "qsgd2_ef", "onebit", "sparseloco")


def outer_average(config: ml_collections.ConfigDict,
                  workers_axis: str = WORKERS) -> optax.GradientTransformation | None:
  """How the outer gradients are averaged over ``workers_axis``, from ``config.outer_average``:
  ``None`` (a float32 ``pmean``) for ``fp32``; error feedback for the quantized ones, so that
  what a round's rounding misses goes into the next round; ``sparseloco``, SparseLoCo's top-k
  of its error feedback (``sparse.py``), with outer SGD at learning rate 1 and no momentum
  (the config's defaults) as SparseLoCo steps."""
  options = dict(key=config.seed, min_compressed_size=config.min_compressed_size)
  match config.outer_average:
    case "fp32":
      return None
    case "bf16":
      return qsgd_jax.compressed_allreduce(qsgd_jax.Cast(jnp.bfloat16), workers_axis, **options)
    case "qsgd8_ef" | "qsgd4_ef" | "qsgd2_ef":
      bits = int(config.outer_average.removeprefix("qsgd").removesuffix("_ef"))
      return qsgd_jax.qsgd(workers_axis, bits=bits, error_feedback=True,
                           bucket_size=config.bucket_size, **options)
    case "onebit":
      return qsgd_jax.onebit_sgd(workers_axis, bucket_size=config.bucket_size, **options)
    case "sparseloco":
      return sparse.sparseloco_average(config, workers_axis)
  raise ValueError(f"config.outer_average must be one of {', '.join(OUTER_AVERAGES)}; got "
                   f"{config.outer_average!r}.")


def optimizer(config: ml_collections.ConfigDict, inner: optax.GradientTransformation,
              axis: str, workers_axis: str = WORKERS) -> optax.GradientTransformation:
  """``qsgd_jax.diloco`` over ``workers_axis``, ``inner`` (a worker's data-parallel AdamW over
  ``axis``, or where a worker's model is sharded (``hybrid.py``), AdamW on its gradient)
  inside; with ``config.outer_split`` the exchange split over ``axis``."""
  momentum = config.outer_momentum or None
  outer = optax.sgd(config.outer_learning_rate, momentum=momentum,
                    nesterov=bool(momentum and config.outer_nesterov))
  return qsgd_jax.diloco(
      inner, workers_axis, sync_every=config.sync_every, outer_optimizer=outer,
      average=outer_average(config, workers_axis), fragments=config.fragments,
      delay=config.fragment_delay,
      alpha=config.fragment_alpha, split_axis=axis if config.outer_split else None)


def mesh(config: ml_collections.ConfigDict, axis: str) -> jax.sharding.Mesh:
  """``(workers, devices a worker)``, with axes ``("workers", axis)``."""
  workers = config.diloco_workers
  if jax.device_count() % workers:
    raise ValueError(f"config.diloco_workers={workers} must divide the {jax.device_count()} "
                     "devices: each worker is an equal group of them.")
  return jax.make_mesh((workers, jax.device_count() // workers), (WORKERS, axis),
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)


def train_step(state: TrainState, batch, learning_rate_fn: optax.Schedule, loss_fn: Callable,
               axis: str, metrics_of: Callable, events: qsgd_jax.DiLoCoEvents | None = None):
  """One step of a worker's device, under ``jax.shard_map`` over ``(WORKERS, axis)``; with
  ``events``, what it does for the outer loop decided on the host."""
  params = jax.tree.map(lambda x: x[0], state.params)  # This worker's copy.
  loss, grads = jax.value_and_grad(loss_fn)(qsgd_jax.as_varying(params, axis), batch,
                                            state.apply_fn)
  updates, opt_state = state.tx.update(grads, state.opt_state, params, events=events)
  params = optax.apply_updates(params, updates)
  state = state.replace(step=state.step + 1, params=jax.tree.map(lambda x: x[None], params),
                        opt_state=opt_state)
  metrics = {"loss": loss, "learning_rate": learning_rate_fn(state.step - 1)}
  metrics = qsgd_jax.as_varying(metrics | metrics_of(opt_state), (WORKERS, axis))
  return state, jax.lax.pmean(metrics, (WORKERS, axis))


def eval_step(state: TrainState, batch, axis: str):
  """Sums of the loss and of the bytes predicted by the global parameters, over all devices."""
  tokens = batch["tokens"]
  global_params = state.opt_state.global_params
  logits = state.apply_fn({"params": global_params}, tokens[:, :-1])
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
  return jax.lax.psum({"loss": jnp.sum(losses), "count": jnp.float32(losses.size)},
                      (WORKERS, axis))


def programs_by_events(config: ml_collections.ConfigDict, state, compile_for: Callable):
  """``(program_at, programs)``: a program for each kind of step of DiLoCo's schedule.

  ``compile_for(events)`` compiles the step for a :func:`qsgd_jax.diloco_events`;
  ``program_at(count)`` is the one to run after ``count`` steps, and ``programs``
  all of them. The loop counts ``state``'s steps, which must be DiLoCo's count.
  """
  count = int(state.opt_state.count)
  if count != int(state.step):
    raise ValueError(f"The state's step {int(state.step)} is not DiLoCo's count {count}: "
                     "the programs are chosen by the step.")
  schedule = dict(sync_every=config.sync_every, fragments=config.fragments,
                  delay=config.fragment_delay)
  # Two rounds hold every kind of step (the first round's only fewer).
  kinds = {qsgd_jax.diloco_events(count, **schedule) for count in range(2 * config.sync_every)}
  compiled = {events: compile_for(events) for events in kinds}
  return (lambda count: compiled[qsgd_jax.diloco_events(count, **schedule)],
          list(compiled.values()))


def parallelize(config: ml_collections.ConfigDict, model, tx: optax.GradientTransformation,
                step: Callable, param_shapes, axis: str):
  """``(init, train_step, eval_step, put_batch, compile_programs)`` of DiLoCo over
  :func:`mesh`'s workers.

  ``train_step`` decides in its program what each step does for the outer
  loop; ``compile_programs`` (``None`` unless ``config.diloco_events_on_host``)
  compiles a program for each kind of step instead (``qsgd_jax.diloco_events``).

  Args:
    config: the run's configuration.
    model: the Flax module.
    tx: :func:`optimizer`'s transformation.
    step: :func:`train_step` with its learning rate, loss and metrics bound.
    param_shapes: the parameters' shapes, one worker's.
    axis: the data-parallel axis inside a worker.
  """
  workers = config.diloco_workers
  device_mesh = mesh(config, axis)
  axes = (WORKERS, axis)
  shard = functools.partial(jax.shard_map, mesh=device_mesh)

  def create(params):
    params = jax.tree.map(lambda x: x[0], params)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    return state.replace(step=jnp.zeros((), jnp.int32),
                         params=jax.tree.map(lambda x: x[None], state.params))

  per_worker = NamedSharding(device_mesh, P(WORKERS))
  stacked = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct((workers, *x.shape), x.dtype, sharding=per_worker),
      param_shapes)
  shapes = jax.eval_shape(
      shard(create, in_specs=(P(WORKERS),), out_specs=P(), check_vma=False), stacked)
  # A worker's parameters and optimizer state are the same on its devices and lie along the
  # workers' axis; what each device holds for itself (an average's residuals inside the
  # worker, a split exchange's part) lies along both axes.
  specs = shapes.replace(
      step=P(), params=jax.tree.map(lambda _: P(WORKERS), shapes.params),
      opt_state=qsgd_jax.state_partition_specs(shapes.opt_state, WORKERS, split_axis=axis))
  split = NamedSharding(device_mesh, P(axes))
  sharded_create = jax.jit(shard(create, in_specs=(P(WORKERS),), out_specs=specs))

  def init(params):
    # Every worker starts from the same parameters.
    copies = jax.tree.map(lambda x: np.broadcast_to(x, (workers, *x.shape)),
                          jax.device_get(params))
    return sharded_create(jax.tree.map(
        lambda x: jax.make_array_from_callback(x.shape, per_worker, lambda index: x[index]),
        copies))

  def put_batch(batch):
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(split, x), batch)

  def train_for(events):
    return jax.jit(shard(functools.partial(step, events=events), in_specs=(specs, P(axes)),
                         out_specs=(specs, P())), donate_argnums=(0,))

  def compile_programs(state, batch):
    return programs_by_events(
        config, state, lambda events: train_for(events).lower(state, batch).compile())

  evaluate = jax.jit(shard(functools.partial(eval_step, axis=axis), in_specs=(specs, P(axes)),
                           out_specs=P()))
  return (init, train_for(None), evaluate, put_batch,
          compile_programs if config.diloco_events_on_host else None)
