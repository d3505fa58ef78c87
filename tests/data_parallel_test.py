"""Tests of qsgd_jax.data_parallel: the jax.jit + NamedSharding loop, converted.

The reference loop is the data-parallel one of JAX's sharding tutorials:
parameters replicated with ``NamedSharding(mesh, P())``, the batch split with
``NamedSharding(mesh, P("batch"))``, and a jitted step of
``value_and_grad``, ``tx.update`` and ``optax.apply_updates``.
"""

import doctest
import functools
import pathlib
import subprocess
import sys
import textwrap
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import apply_step, assert_replicas_identical, backend_compiles, host_arrays
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qsgd_jax
from qsgd_jax._src.training import data_parallel as data_parallel_module

AXIS = "batch"
NUM_DEVICES = 8
NUM_STEPS = 3

# Least squares: "w" (8192 elements) is sent compressed, "b" (128) in float32.
PARAMS = {"w": jnp.zeros((64, 128)), "b": jnp.zeros((128,))}
INPUTS = jax.random.normal(jax.random.key(0), (NUM_STEPS, NUM_DEVICES * 16, 64))
TARGETS = INPUTS @ jax.random.normal(jax.random.key(1), (64, 128))  # A new batch a step.


def loss_fn(params, batch):
  inputs, targets = batch
  return jnp.mean((inputs @ params["w"] + params["b"] - targets) ** 2)


def make_optimizer(axis_name=AXIS, axis_size=None):
  # Every residual: each device's own, and each chunk owner's.
  return optax.chain(
      qsgd_jax.onebit_sgd(axis_name, error_feedback="both", axis_size=axis_size),
      optax.sgd(0.05, momentum=0.9))


def _mesh():
  return jax.make_mesh((NUM_DEVICES,), (AXIS,))


def _batch(mesh, step):
  return jax.device_put((INPUTS[step], TARGETS[step]), NamedSharding(mesh, P(AXIS)))


def _device_copies(tree):
  """``[devices, ...]`` for every leaf: what each device holds of it."""
  return jax.tree.map(
      lambda x: np.stack([np.asarray(shard.data) for shard in x.addressable_shards]), tree)


_TRACES = []


def _counted_loss(params, batch):
  _TRACES.append(None)
  return loss_fn(params, batch)


@functools.cache
def _converted():
  """The tutorial's loop with data_parallel: ``(mesh, init, train_step, abstract_state)``."""
  mesh = _mesh()
  tx = make_optimizer()  # Changed: the optimizer's chain starts with onebit_sgd.
  return mesh, *qsgd_jax.data_parallel(_counted_loss, tx, mesh)  # Changed: the step.


def _train_converted(num_steps=NUM_STEPS):
  mesh, init, train_step, _ = _converted()
  params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
  opt_state = init(params)  # Changed: was tx.init(params).
  losses = []
  for step in range(num_steps):
    params, opt_state, loss = jax.block_until_ready(
        train_step(params, opt_state, _batch(mesh, step)))
    assert_replicas_identical(_device_copies(params))
    losses.append(float(loss))
  return params, opt_state, losses


def _train_by_hand():
  """The same steps with jax.shard_map written out, as in transforms_test.py."""
  mesh = _mesh()
  tx = make_optimizer(axis_size=NUM_DEVICES)  # eval_shape runs init outside the mesh.
  specs = qsgd_jax.state_partition_specs(jax.eval_shape(tx.init, PARAMS), AXIS)
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

  def device_step(params, opt_state, batch):
    local = jax.tree.map(lambda p: jax.lax.pcast(p, AXIS, to="varying"), params)
    loss, grads = jax.value_and_grad(loss_fn)(local, batch)
    return (*apply_step(tx, params, opt_state, grads), jax.lax.pmean(loss, AXIS))

  step = jax.jit(jax.shard_map(device_step, mesh=mesh, in_specs=(P(), specs, P(AXIS)),
                               out_specs=(P(), specs, P())))
  params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
  opt_state = init(params)
  losses = []
  for step_index in range(NUM_STEPS):
    params, opt_state, loss = step(params, opt_state, _batch(mesh, step_index))
    losses.append(float(loss))
  return params, opt_state, losses


def _train_pmap():
  tx = make_optimizer()

  def device_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    return (*apply_step(tx, params, opt_state, grads), jax.lax.pmean(loss, AXIS))

  step = jax.pmap(device_step, axis_name=AXIS)
  params = jax.tree.map(lambda x: jnp.broadcast_to(x, (NUM_DEVICES, *x.shape)), PARAMS)
  opt_state = jax.pmap(tx.init, axis_name=AXIS)(params)
  losses = []
  for step_index in range(NUM_STEPS):
    batch = (INPUTS[step_index].reshape(NUM_DEVICES, -1, 64),
             TARGETS[step_index].reshape(NUM_DEVICES, -1, 128))
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(float(loss[0]))
  return jax.tree.map(lambda x: x[0], params), opt_state, losses


@pytest.mark.slow
def test_converted_loop_trains_as_shard_map_by_hand_and_as_pmap():
  params, opt_state, losses = _train_converted()
  assert losses[-1] < losses[0]
  assert float(qsgd_jax.compression_stats(opt_state).compression_ratio) > 5
  for other_params, other_state, other_losses in (_train_by_hand(), _train_pmap()):
    chex.assert_trees_all_equal(host_arrays(params), host_arrays(other_params))
    np.testing.assert_array_equal(losses, other_losses)
    # The residuals too: device i's own lie at [i] along the axis (pmap stacks them).
    for ours, theirs in zip(opt_state[0].local_error + opt_state[0].chunk_error,
                            other_state[0].local_error + other_state[0].chunk_error,
                            strict=True):
      np.testing.assert_array_equal(np.asarray(ours).reshape(-1),
                                    np.asarray(theirs).reshape(-1))


def test_steps_after_the_first_do_not_recompile():
  mesh, init, train_step, _ = _converted()
  params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
  params, opt_state, _ = jax.block_until_ready(train_step(params, init(params), _batch(mesh, 0)))
  traces = len(_TRACES)
  with backend_compiles() as compiles:
    for step in range(1, NUM_STEPS):
      params, opt_state, _ = jax.block_until_ready(
          train_step(params, opt_state, _batch(mesh, step)))
  assert not compiles
  assert len(_TRACES) == traces


def test_a_numpy_batch_is_split_over_the_mesh():
  mesh, init, train_step, _ = _converted()
  params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
  opt_state = init(params)
  on_mesh = train_step(params, opt_state, _batch(mesh, 0))
  as_numpy = train_step(params, opt_state, (np.asarray(INPUTS[0]), np.asarray(TARGETS[0])))
  chex.assert_trees_all_equal(host_arrays(as_numpy), host_arrays(on_mesh))


def test_abstract_state_is_what_init_and_step_return():
  mesh, init, train_step, abstract_state = _converted()
  params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
  abstract = abstract_state(params)
  opt_state = init(params)
  _, stepped, _ = train_step(params, opt_state, _batch(mesh, 0))
  for state in (opt_state, stepped):
    assert jax.tree.structure(state) == jax.tree.structure(abstract)
    for array, expected in zip(jax.tree.leaves(state), jax.tree.leaves(abstract), strict=True):
      assert (array.shape, array.dtype) == (expected.shape, expected.dtype)
      assert isinstance(expected.sharding, NamedSharding)
      assert array.sharding.is_equivalent_to(expected.sharding, array.ndim)
  # The residuals lie along the axis: each device's own, [devices * 8192] for "w".
  assert abstract[0].local_error[0].sharding.spec == P(AXIS)
  assert abstract[0].local_error[0].shape == (NUM_DEVICES * 64 * 128,)
  assert abstract[0].count.sharding.spec == P()


def _aux_loss(params, batch, key):
  """The loss, and what each device saw: its index, a per-device draw, its batch size."""
  device = jax.lax.axis_index(AXIS)
  noise = jax.random.normal(jax.random.fold_in(key, device))
  return loss_fn(params, batch), {"device": device, "noise": noise,
                                  "examples": jnp.int32(batch[0].shape[0])}


@pytest.mark.slow
def test_aux_extra_arguments_and_donation():
  mesh = _mesh()
  tx = optax.chain(qsgd_jax.qsgd(AXIS, method="psum"), optax.sgd(0.05))
  init, train_step, _ = qsgd_jax.data_parallel(_aux_loss, tx, mesh, has_aux=True, donate=True)
  # From host copies: device_put may share PARAMS' buffer, which donation would delete.
  params = jax.device_put(host_arrays(PARAMS), NamedSharding(mesh, P()))
  opt_state = init(params)
  key = jax.random.key(7)
  new_params, _, (loss, aux) = train_step(params, opt_state, _batch(mesh, 0), key)
  # Donated (the stats, which the step does not read, are left alone).
  assert all(leaf.is_deleted() for leaf in jax.tree.leaves((params, opt_state[0].key)))
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(new_params))
  assert float(loss) == pytest.approx(float(loss_fn(PARAMS, (INPUTS[0], TARGETS[0]))), rel=1e-5)
  # What differs per device is averaged (integers as lax.pmean averages them); the rest kept.
  assert float(aux["device"]) == (NUM_DEVICES - 1) / 2
  draws = [jax.random.normal(jax.random.fold_in(key, i)) for i in range(NUM_DEVICES)]
  assert float(aux["noise"]) == pytest.approx(float(np.mean(draws)), abs=1e-6)
  assert aux["examples"].dtype == jnp.int32 and int(aux["examples"]) == 16


def _weighted_loss(params, batch):
  return batch["weight"] * loss_fn(params, (batch["x"], batch["y"])) + 0 * batch["step"]


def test_scalar_batch_leaves_reach_every_device_whole():
  mesh = _mesh()
  init, train_step, _ = qsgd_jax.data_parallel(_weighted_loss, make_optimizer(), mesh)
  params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
  batch = {"x": INPUTS[0], "y": TARGETS[0], "weight": jnp.float32(0.5), "step": 3}
  new_params, _, loss = jax.block_until_ready(train_step(params, init(params), batch))
  assert float(loss) == pytest.approx(
      0.5 * float(loss_fn(PARAMS, (INPUTS[0], TARGETS[0]))), rel=1e-5)
  assert_replicas_identical(_device_copies(new_params))


# optax.MultiSteps of each library transform whose state holds per-device arrays.
_MULTI_STEPS_INNER = {
    "qsgd": lambda: optax.chain(
        qsgd_jax.qsgd(AXIS, error_feedback=True, axis_size=NUM_DEVICES), optax.sgd(0.05)),
    "onebit_sgd": lambda: optax.chain(
        qsgd_jax.onebit_sgd(AXIS, error_feedback="both", axis_size=NUM_DEVICES),
        optax.sgd(0.05)),
    "powersgd": lambda: optax.chain(qsgd_jax.powersgd(AXIS, start_iter=2), optax.sgd(0.05)),
    "onebit_adam": lambda: qsgd_jax.onebit_adam(
        1e-3, AXIS, freeze_step=1, axis_size=NUM_DEVICES),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_MULTI_STEPS_INNER))
def test_multi_steps_runs_under_data_parallel_as_under_shard_map_by_hand(name):
  mesh = _mesh()
  tx = optax.MultiSteps(_MULTI_STEPS_INNER[name](), every_k_schedule=2)
  specs = qsgd_jax.state_partition_specs(jax.eval_shape(tx.init, PARAMS), AXIS)
  assert jax.tree.leaves(specs.acc_grads) == [P(AXIS), P(AXIS)]  # Each device's own sum.
  assert specs.mini_step == specs.gradient_step == P()

  def device_step(params, opt_state, batch):
    local = qsgd_jax.as_varying(params, AXIS)
    return apply_step(tx, params, opt_state, jax.grad(loss_fn)(local, batch))

  by_hand = jax.jit(jax.shard_map(device_step, mesh=mesh, in_specs=(P(), specs, P(AXIS)),
                                  out_specs=(P(), specs)))
  init, train_step, _ = qsgd_jax.data_parallel(loss_fn, tx, mesh)
  params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
  converted = (params, init(params))
  manual = (params, jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(),
                                          out_specs=specs))(params))
  for step in range(NUM_STEPS):
    converted = jax.block_until_ready(train_step(*converted, _batch(mesh, step))[:2])
    manual = jax.block_until_ready(by_hand(*manual, _batch(mesh, step)))
  chex.assert_trees_all_equal(host_arrays(converted), host_arrays(manual))
  assert int(converted[1].gradient_step) == 1  # Steps 0 and 1 applied once; 2 accumulated.
  assert np.asarray(converted[0]["w"]).any()
  assert_replicas_identical(_device_copies(converted[0]))


class _LastGradientState(NamedTuple):
  last: dict  # Each device's own gradient of the previous step, like the params.


def _remember_gradients(reduce=lambda grads: grads):
  """A transform the library does not know, whose state is per device."""
  return optax.GradientTransformation(
      lambda params: _LastGradientState(reduce(jax.tree.map(jnp.zeros_like, params))),
      lambda updates, state, params=None: (updates, _LastGradientState(reduce(updates))))


def test_data_parallel_lays_out_per_device_arrays_of_states_it_does_not_know():
  mesh = _mesh()
  tx = optax.chain(_remember_gradients(), make_optimizer())
  init, train_step, abstract_state = qsgd_jax.data_parallel(loss_fn, tx, mesh)
  params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
  assert abstract_state(params)[0].last["w"].sharding.spec == P(AXIS)
  _, opt_state, _ = jax.block_until_ready(train_step(params, init(params), _batch(mesh, 0)))
  last = _device_copies(opt_state[0].last["b"]).reshape(NUM_DEVICES, -1)
  assert not np.array_equal(last[0], last[1])  # Each device's own gradient.


def test_a_per_device_scalar_in_a_state_it_does_not_know_is_a_value_error():
  mesh = _mesh()
  tx = optax.chain(_remember_gradients(lambda tree: jnp.sum(tree["b"])), make_optimizer())
  init, _, _ = qsgd_jax.data_parallel(loss_fn, tx, mesh)
  with pytest.raises(ValueError, match=r"state\[0\]\.last, a scalar in a _LastGradientState"):
    init(jax.device_put(PARAMS, NamedSharding(mesh, P())))


def test_multi_steps_of_a_scalar_parameter_is_a_value_error():
  tx = optax.MultiSteps(optax.chain(qsgd_jax.qsgd(AXIS), optax.sgd(0.1)), 2)
  shapes = jax.eval_shape(tx.init, {"w": jnp.zeros(8192), "temperature": jnp.zeros(())})
  with pytest.raises(ValueError, match=r"acc_grads\['temperature'\] is a scalar"):
    qsgd_jax.state_partition_specs(shapes, AXIS)


def test_two_level_mesh_quantizes_over_the_outer_axis():
  axis_names = ("node", "local")
  # Auto axes here, Explicit ones (jax.make_mesh's default) elsewhere: both work.
  mesh = jax.make_mesh((2, NUM_DEVICES // 2), axis_names,
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  tx = optax.chain(qsgd_jax.onebit_sgd(axis_names, error_feedback="worker"),
                   optax.sgd(0.05, momentum=0.9))
  # By default the batch is split over every axis of the mesh, outer first.
  init, train_step, abstract_state = qsgd_jax.data_parallel(loss_fn, tx, mesh)
  params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
  residual = abstract_state(params)[0].local_error[0]
  # "w" is reduce-scattered over the 4 "local" devices first: each quantizes a quarter.
  assert residual.sharding.spec == P(axis_names)
  assert residual.shape == (NUM_DEVICES * 64 * 128 // 4,)
  opt_state, losses = init(params), []
  for step in range(NUM_STEPS):
    batch = jax.device_put((INPUTS[step], TARGETS[step]), NamedSharding(mesh, P(axis_names)))
    params, opt_state, loss = train_step(params, opt_state, batch)
    assert_replicas_identical(_device_copies(params))
    losses.append(float(loss))
  assert losses[-1] < losses[0]
  assert np.asarray(opt_state[0].local_error[0]).any()


def test_an_optimizer_that_does_not_average_is_a_value_error():
  mesh = _mesh()
  init, train_step, _ = qsgd_jax.data_parallel(loss_fn, optax.sgd(0.1), mesh)
  params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
  with pytest.raises(ValueError, match=r"\['b'\] differs per device.*qsgd_jax.qsgd\('batch'\)"):
    train_step(params, init(params), _batch(mesh, 0))


def test_an_axis_not_in_the_mesh_is_a_value_error():
  with pytest.raises(ValueError, match="'data' is not an axis of the mesh"):
    qsgd_jax.data_parallel(loss_fn, make_optimizer(), _mesh(), "data")


_RESTORE_IN_A_FRESH_PROCESS = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import conftest  # Eight CPU devices, before JAX starts.
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import data_parallel_test as test

    mesh, init, train_step, abstract_state = test._converted()
    params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())),
        test.PARAMS)
    target = {"params": params, "opt_state": abstract_state(params)}
    restored = ocp.StandardCheckpointer().restore(sys.argv[2], target)
    for array, expected in zip(jax.tree.leaves(restored), jax.tree.leaves(target), strict=True):
      assert array.sharding.is_equivalent_to(expected.sharding, array.ndim), array.sharding
    np.savez(sys.argv[3], *jax.tree.leaves(test.host_arrays(restored)))
""")


@pytest.mark.slow
def test_orbax_restores_in_a_fresh_process_with_the_abstract_state(tmp_path):
  params, opt_state, _ = _train_converted(2)
  saved = {"params": params, "opt_state": opt_state}
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "checkpoint", saved)
  checkpointer.wait_until_finished()
  result = subprocess.run(
      [sys.executable, "-c", _RESTORE_IN_A_FRESH_PROCESS, str(pathlib.Path(__file__).parent),
       str(tmp_path / "checkpoint"), str(tmp_path / "restored.npz")],
      capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  restored = np.load(tmp_path / "restored.npz")
  expected = jax.tree.leaves(host_arrays(saved))
  assert len(restored.files) == len(expected)
  for index, array in enumerate(expected):
    np.testing.assert_array_equal(restored[f"arr_{index}"], array)


# Slow, as the other docstring examples (docs_test.py runs every public name's): each example
# compiles programs of its own for what the tests above check.
@pytest.mark.slow
def test_docstring_examples():
  result = doctest.testmod(data_parallel_module, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0
