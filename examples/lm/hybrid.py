"""The language model on data groups whose model is sharded: ``--config.parallelism=hybrid``.

The devices form a ``("batch", "fsdp", "tensor")`` mesh, as Flax's ``lm1b``
lays out its ``('data', 'fsdp', 'tensor')``: inside each data group the model
is sharded over ``fsdp`` and ``tensor`` (the fast links) by logical axis
rules, ``embed`` over ``fsdp`` and ``mlp``, ``heads``, ``vocab`` over
``tensor`` (:data:`RULES`), and the gradients are averaged over ``batch``,
the slow axis between the groups. ``qsgd_jax.data_parallel`` runs the step:
each device compresses its own shard of each gradient, and the parameters and
the optimizer's state keep the model's layout. ``config.average="fp32"`` is
the compiler's own step instead, a plain ``jax.jit`` over the mesh (the
gradients' float32 all-reduce placed by XLA), the baseline the others are
measured against. With ``config.optimizer="diloco"`` each data group is a
worker (``config.diloco_workers`` must be the number of groups).
"""

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax.training.train_state import TrainState
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import qsgd_jax
from examples.lm import diloco

MODEL_AXES = ("fsdp", "tensor")
# Logical axis names of the model's parameters to mesh axes, as Flax lm1b's rules give them.
RULES = (("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor"), ("vocab", "tensor"),
         ("kv", None))


def mesh(config: ml_collections.ConfigDict, axis: str) -> jax.sharding.Mesh:
  """``(data groups, config.fsdp_devices, config.tensor_devices)``, with axes ``(axis, "fsdp",
  "tensor")``, automatic (the compiler shards the model by the parameters' layout)."""
  group = config.fsdp_devices * config.tensor_devices
  if jax.device_count() % group:
    raise ValueError(
        f"config.fsdp_devices * config.tensor_devices = {group} must divide the "
        f"{jax.device_count()} devices: each data group is an equal group of them.")
  return jax.make_mesh((jax.device_count() // group, config.fsdp_devices,
                        config.tensor_devices), (axis, *MODEL_AXES),
                       axis_types=(AxisType.Auto,) * 3)


def param_shardings(model, device_mesh: jax.sharding.Mesh):
  """Each parameter's ``NamedSharding``: its logical axes (the model's annotations) through
  :data:`RULES`."""
  tokens = jax.ShapeDtypeStruct((1, model.context_length), jnp.int32)
  boxed = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
  return nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), device_mesh, RULES)


def group_processes(device_mesh: jax.sharding.Mesh, axis: str) -> list[list[int]]:
  """The processes holding each data group's devices, a list a group along ``axis``:
  ``[[0], [1]]`` where each of 2 processes is a group (``jax.make_mesh`` keeps a process's
  devices together, its first axis over the processes)."""
  groups = np.moveaxis(device_mesh.devices, device_mesh.axis_names.index(axis), 0)
  return [sorted({device.process_index for device in group.flat}) for group in groups]


def state_bytes(state: TrainState) -> dict[str, float]:
  """Bytes one device holds of the parameters and of the optimizer's state (its own shards)."""

  def held(tree) -> float:
    return float(sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree)
                     if isinstance(leaf, jax.Array)))

  return {"param_bytes_per_device": held(state.params),
          "state_bytes_per_device": held(state.opt_state)}


def parallelize(config: ml_collections.ConfigDict, model, tx: optax.GradientTransformation,
                loss_fn: Callable, metrics_of: Callable, learning_rate_fn: optax.Schedule,
                axis: str):
  """``(init, train_step, eval_step, put_batch, compile_programs, mesh)`` on :func:`mesh`.

  The step is ``qsgd_jax.data_parallel``'s (or the compiler's), which reads
  the parameters' layout from the arrays themselves: the loop runs it as it
  is, compiled once by ``compile_programs``, not inside another ``jax.jit``
  (where the layout of automatic mesh axes cannot be read).

  Args:
    config: the run's configuration.
    model: the Flax module, its parameters' axes named (``logical_axes``).
    tx: the optimizer: one that averages over ``axis`` itself, or, with
      ``config.average="fp32"``, one that does not (the compiler averages).
    loss_fn: ``loss_fn(params, batch, apply_fn)``.
    metrics_of: the optimizer state's metrics (what it sent).
    learning_rate_fn: the schedule, for the metrics.
    axis: the data axis.
  """
  device_mesh = mesh(config, axis)
  shardings = param_shardings(model, device_mesh)
  loss = functools.partial(loss_fn, apply_fn=model.apply)
  split = NamedSharding(device_mesh, P(axis))
  local_update = config.optimizer == "diloco"
  if config.average == "fp32" and not local_update:
    tokens = jax.ShapeDtypeStruct((1, model.context_length), jnp.int32)
    param_shapes = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), tokens)["params"])
    init, step = _compilers_step(tx, loss, shardings, param_shapes)
  else:
    init, step, _ = qsgd_jax.data_parallel(loss, tx, device_mesh, axis)

  def create(params):
    params = jax.device_get(params)
    placed = jax.tree.map(jax.device_put, params, shardings)
    opt_state = init(placed)
    if local_update:  # Each data group's own copy, stacked, as the step returns them.
      groups = device_mesh.shape[axis]
      placed = jax.tree.map(
          lambda x, sharding: jax.device_put(
              np.broadcast_to(x, (groups, *x.shape)),
              NamedSharding(device_mesh, P(axis, *sharding.spec))), params, shardings)
    zero = jax.device_put(np.zeros((), np.int32), NamedSharding(device_mesh, P()))
    return TrainState(step=zero, apply_fn=model.apply, params=placed, tx=tx,
                      opt_state=opt_state)

  def stepped(program):
    def train_step(state: TrainState, batch):
      params, opt_state, value = program(state.params, state.opt_state, batch)
      metrics = {"loss": value, "learning_rate": learning_rate_fn(state.step)}
      state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
      return state, metrics | metrics_of(opt_state)
    return train_step

  def compile_programs(state: TrainState, batch):
    if not (local_update and config.diloco_events_on_host):
      compiled = step.lower(state.params, state.opt_state, batch).compile()
      train_step = stepped(compiled)
      return (lambda count: train_step), [compiled]
    # DiLoCo with each step's program chosen on the host: a step between syncs has no sync
    # conditional and no collective of the outer loop.
    program_at, compiled = diloco.programs_by_events(
        config, state,
        lambda events: step.lower(state.params, state.opt_state, batch, events=events).compile())
    return (lambda count: stepped(program_at(count))), compiled

  def eval_step(state: TrainState, batch):
    params = state.opt_state.global_params if local_update else state.params
    tokens = batch["tokens"]
    logits = model.apply({"params": params}, tokens[:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return {"loss": jnp.sum(losses), "count": jnp.float32(losses.size)}

  def put_batch(batch):
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(split, x), batch)

  return create, stepped(step), jax.jit(eval_step), put_batch, compile_programs, device_mesh


def _compilers_step(tx: optax.GradientTransformation, loss: Callable, shardings, param_shapes):
  """``(init, step)`` of float32 data parallel as the compiler runs it: the gradient of the
  whole batch's mean loss, the all-reduce placed by XLA. The state's arrays shaped like the
  params (Adam's moments) are laid out as they are, the rest replicated (as MaxText lays out
  its optimizer's state), and the step keeps both layouts."""
  replicated = NamedSharding(next(iter(jax.tree.leaves(shardings))).mesh, P())
  state_shardings = optax.tree_utils.tree_map_params(
      tx, lambda _, sharding: sharding, jax.eval_shape(tx.init, param_shapes), shardings,
      transform_non_params=lambda _: replicated)

  def step(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return (jax.jit(tx.init, out_shardings=state_shardings),
          jax.jit(step, donate_argnums=(0, 1),
                  out_shardings=(shardings, state_shardings, replicated)))
