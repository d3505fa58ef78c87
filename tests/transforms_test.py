"""Tests of the optax transforms: qsgd, onebit_sgd, compressed_allreduce.

Compiling for eight simulated devices is the slow part, so tests share
compiled programs: ``_pmap_functions`` and ``_shard_map_functions`` build one
per named optimizer and cache it.
"""

import functools
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import (
  apply_step,
  assert_replicas_identical,
  backend_compiles,
  host_arrays,
  placed_like,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import qsgd_jax
from qsgd_jax._src import base

AXIS = "batch"
NUM_DEVICES = 8

# A least-squares problem: "w" (8192 elements) is sent compressed, "b" (128,
# under the default min_compressed_size) in float32.
_PARAMS = {"w": jnp.zeros((64, 128)), "b": jnp.zeros((128,))}
_INPUTS = jax.random.normal(jax.random.key(0), (NUM_DEVICES, 16, 64))
_TARGETS = jax.random.normal(jax.random.key(1), (NUM_DEVICES, 16, 128))

_OPTIMIZERS = {
    # The chain users write, defaults included (Elias sizes not measured).
    "qsgd_adamw": lambda: optax.chain(qsgd_jax.qsgd(AXIS), optax.adamw(1e-3)),
    # Every residual and the warm-up branch.
    "onebit_both": lambda: optax.chain(
        qsgd_jax.onebit_sgd(AXIS, error_feedback="both", warmup_steps=1,
                            axis_size=NUM_DEVICES),
        optax.sgd(0.05, momentum=0.9)),
}
_TRACES = {name: 0 for name in _OPTIMIZERS}


def _loss(params, x, y):
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


# Where pmap puts its outputs. Inputs placed the same way make the second
# step (outputs fed back) run the first step's executable.
_PMAP_SHARDING = NamedSharding(
    jax.sharding.Mesh(np.array(jax.devices()[:NUM_DEVICES]), (AXIS,)), P(AXIS))


def _on_devices(tree):
  """``tree``, with leading axis ``NUM_DEVICES``, laid out as pmap lays out outputs."""
  return jax.device_put(tree, _PMAP_SHARDING)


_PMAP_DATA = _on_devices((_INPUTS, _TARGETS))


def _stacked(tree):
  """The same pytree on every device, along pmap's leading axis."""
  return _on_devices(
      jax.tree.map(lambda x: jnp.broadcast_to(x, (NUM_DEVICES, *jnp.shape(x))), tree))


def _first(tree):
  """Device 0's slice of every leaf."""
  return jax.tree.map(lambda x: x[0], tree)


def _gaussian(seed):
  """Different Gaussian gradients like ``_PARAMS`` on every device."""
  w_key, b_key = jax.random.split(jax.random.key(seed))
  return _on_devices({"w": jax.random.normal(w_key, (NUM_DEVICES, 64, 128)),
                      "b": jax.random.normal(b_key, (NUM_DEVICES, 128))})


@functools.cache
def _pmap_functions(name):
  """``(init, step)`` pmapped for ``_OPTIMIZERS[name]``; ``step`` counts its traces."""
  tx = _OPTIMIZERS[name]()

  def step(params, state, x, y):
    _TRACES[name] += 1
    grads = jax.grad(_loss)(params, x, y)
    return (*apply_step(tx, params, state, grads), jax.lax.pmean(_loss(params, x, y), AXIS))

  return jax.pmap(tx.init, axis_name=AXIS), jax.pmap(step, axis_name=AXIS)


def _pmap_train(name, num_steps, params=None, state=None, check_replicas=False):
  """``num_steps`` pmapped steps; returns params, state and the losses."""
  init, step = _pmap_functions(name)
  params = _stacked(_PARAMS) if params is None else params
  state = init(params) if state is None else state
  losses = []
  for _ in range(num_steps):
    # Each step waits for the last: eight simulated devices share few cores.
    params, state, loss = jax.block_until_ready(step(params, state, *_PMAP_DATA))
    losses.append(float(loss[0]))
    if check_replicas:
      assert_replicas_identical(params)
  return params, state, losses


def _device_step(tx, params, state, x, y):
  """One shard_map training step on this device's ``x[0]``, ``y[0]``."""
  # The gradient of replicated parameters is already summed over the axis by
  # autodiff; the device's own gradient is that of its parameters made varying.
  local = jax.tree.map(lambda p: jax.lax.pcast(p, AXIS, to="varying"), params)
  grads = jax.grad(_loss)(local, x[0], y[0])
  return apply_step(tx, params, state, grads)


@functools.cache
def _shard_map_functions(name):
  """``(init, step, params, inputs, targets)`` for ``_OPTIMIZERS[name]`` under jit(shard_map).

  ``step`` also returns every device's own copy of the parameters,
  ``[devices, ...]``, to check that they agree. ``params`` are ``_PARAMS``
  placed as ``step`` returns them (``P()``), so that the second step reuses
  the first one's trace.
  """
  tx = _OPTIMIZERS[name]()
  mesh = jax.make_mesh((NUM_DEVICES,), (AXIS,))
  specs = qsgd_jax.state_partition_specs(jax.eval_shape(tx.init, _PARAMS), AXIS)
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

  def step(params, state, x, y):
    _TRACES[name] += 1
    params, state = _device_step(tx, params, state, x, y)
    copies = jax.tree.map(lambda p: jax.lax.pcast(p, AXIS, to="varying")[None], params)
    return params, state, copies

  step = jax.jit(jax.shard_map(
      step, mesh=mesh, in_specs=(P(), specs, P(AXIS), P(AXIS)),
      out_specs=(P(), specs, P(AXIS))))
  params = jax.device_put(_PARAMS, NamedSharding(mesh, P()))
  data = [jax.device_put(a, NamedSharding(mesh, P(AXIS))) for a in (_INPUTS, _TARGETS)]
  return init, step, params, *data


# Training under pmap and shard_map.


@pytest.mark.parametrize("name", ["qsgd_adamw", "onebit_both"])
def test_pmap_training_keeps_replicas_identical(name):
  _, state, losses = _pmap_train(name, 4, check_replicas=True)
  assert losses[-1] < losses[0]
  stats = _first(qsgd_jax.compression_stats(state))
  assert float(stats.compression_ratio) > 5


def test_shard_map_training_keeps_replicas_identical_and_matches_pmap():
  init, step, params, inputs, targets = _shard_map_functions("onebit_both")
  state = init(params)
  for _ in range(3):
    params, state, copies = jax.block_until_ready(step(params, state, inputs, targets))
    assert_replicas_identical(copies)
  assert float(qsgd_jax.compression_stats(state).compression_ratio) > 5

  pmap_params, pmap_state, _ = _pmap_train("onebit_both", 3)
  chex.assert_trees_all_equal(host_arrays(params), host_arrays(_first(pmap_params)))
  # The residuals too: shard_map lays them out along the axis, pmap stacks them.
  chex.assert_trees_all_equal(
      host_arrays(state[0].local_error),
      host_arrays(tuple(e.reshape(-1) for e in pmap_state[0].local_error)))


def test_shard_map_scan_carries_the_state():
  # Residuals of leaves sent in float32 are constant zeros; they must still be
  # typed per device, or the carry of the scan changes type.
  tx = _OPTIMIZERS["onebit_both"]()
  init, _, params, inputs, targets = _shard_map_functions("onebit_both")
  mesh = jax.make_mesh((NUM_DEVICES,), (AXIS,))
  specs = qsgd_jax.state_partition_specs(jax.eval_shape(tx.init, _PARAMS), AXIS)

  def train(params, state, x, y):
    def body(carry, _):
      return _device_step(tx, *carry, x, y), None

    return jax.lax.scan(body, (params, state), None, length=3)[0]

  train = jax.jit(jax.shard_map(
      train, mesh=mesh, in_specs=(P(), specs, P(AXIS), P(AXIS)), out_specs=(P(), specs)))
  params, _ = jax.block_until_ready(train(params, init(params), inputs, targets))
  pmap_params, _, _ = _pmap_train("onebit_both", 3)
  chex.assert_trees_all_equal(host_arrays(params), host_arrays(_first(pmap_params)))


@pytest.mark.parametrize("name, mapping", [
    ("qsgd_adamw", "pmap"), ("onebit_both", "pmap"), ("onebit_both", "shard_map")])
def test_steps_after_the_first_do_not_recompile(name, mapping):
  if mapping == "pmap":
    init, step = _pmap_functions(name)
    params = _stacked(_PARAMS)
    state, data = init(params), _PMAP_DATA
  else:
    init, step, params, *data = _shard_map_functions(name)
    state = init(params)
  params, state, _ = jax.block_until_ready(step(params, state, *data))
  traces = _TRACES[name]
  with backend_compiles() as compiles:
    for _ in range(3):
      params, state, _ = jax.block_until_ready(step(params, state, *data))
  assert not compiles
  assert _TRACES[name] == traces


# The state is a plain pytree: checkpoints.


def _save_and_restore_with_orbax(tree, directory):
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(directory / "checkpoint", tree)
  checkpointer.wait_until_finished()
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
  return checkpointer.restore(directory / "checkpoint", target)


def _save_and_restore_with_numpy(tree, directory):
  del directory
  saved = host_arrays(tree)  # What np.savez would write.
  return jax.tree.map(placed_like, tree, saved)  # Placed as orbax's restore places them.


@pytest.mark.parametrize("save_and_restore", [
    _save_and_restore_with_orbax, _save_and_restore_with_numpy], ids=["orbax", "numpy"])
def test_checkpoint_mid_training_continues_exactly(save_and_restore, tmp_path):
  straight = _pmap_train("onebit_both", 4)[:2]
  params, state, _ = _pmap_train("onebit_both", 2)
  restored = save_and_restore({"params": params, "opt_state": state}, tmp_path)
  assert jax.tree.structure(restored["opt_state"]) == jax.tree.structure(state)
  resumed = _pmap_train("onebit_both", 2, restored["params"], restored["opt_state"])[:2]
  chex.assert_trees_all_equal(host_arrays(resumed), host_arrays(straight))


# Composition with optax's wrappers.


@pytest.mark.parametrize("transform, bad", [
    (functools.partial(qsgd_jax.qsgd, error_feedback="both", track_elias=False), np.nan),
    (functools.partial(qsgd_jax.onebit_sgd, error_feedback="worker"), np.inf),
], ids=["qsgd_both_nan", "onebit_worker_inf"])
def test_apply_if_finite_skips_a_step_with_one_bad_device(transform, bad):
  # apply_if_finite goes after the all-reduce, where every device tests the same mean.
  tx = optax.chain(transform(AXIS, axis_size=NUM_DEVICES),
                   optax.apply_if_finite(optax.adam(1e-2), 3))
  params = _stacked(_PARAMS)
  state = jax.pmap(tx.init, axis_name=AXIS)(params)
  step = jax.pmap(functools.partial(apply_step, tx), axis_name=AXIS)
  params, state = jax.block_until_ready(step(params, state, _gaussian(0)))

  poisoned = _gaussian(1)
  poisoned["w"] = poisoned["w"].at[3, 5, 7].set(bad)  # One element on device 3.
  poisoned = _on_devices(poisoned)
  skipped_params, skipped_state = jax.block_until_ready(step(params, state, poisoned))
  chex.assert_trees_all_equal(host_arrays(skipped_params), host_arrays(params))
  assert not np.asarray(skipped_state[1].last_finite).any()
  for field in ("local_error", "chunk_error"):
    chex.assert_trees_all_equal(host_arrays(getattr(skipped_state[0], field)),
                                host_arrays(getattr(state[0], field)))
  chex.assert_trees_all_equal(host_arrays(skipped_state[1].inner_state),
                              host_arrays(state[1].inner_state))

  params, state = jax.block_until_ready(step(skipped_params, skipped_state, _gaussian(2)))
  assert np.asarray(state[1].last_finite).all()
  for leaf in jax.tree.leaves(host_arrays((params, state[0].local_error, state[0].chunk_error))):
    assert np.isfinite(leaf).all()
  assert not np.array_equal(np.asarray(params["w"]), np.asarray(skipped_params["w"]))
  assert_replicas_identical(params)


def _trace_data_parallel(tx, mesh):
  """Traces a qsgd_jax.data_parallel step of ``tx`` on ``_PARAMS`` (shapes only)."""
  train = qsgd_jax.data_parallel(lambda p, batch: jnp.mean((p["w"] * batch) ** 2), tx, mesh)
  abstract_params = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())),
      _PARAMS)
  batch = jax.ShapeDtypeStruct((NUM_DEVICES, 64, 128), jnp.float32,
                               sharding=NamedSharding(mesh, P(AXIS)))
  return jax.eval_shape(train.step, abstract_params, train.abstract_state(_PARAMS), batch)


def test_wrapping_in_apply_if_finite_is_refused_at_trace_time_under_pmap_and_shard_map():
  # Each device would test its own gradient: device 3 skips, the others wait for it forever.
  tx = optax.apply_if_finite(optax.chain(qsgd_jax.qsgd(AXIS), optax.sgd(0.1)), 3)
  params = _stacked(_PARAMS)
  state = jax.pmap(tx.init, axis_name=AXIS)(params)
  with pytest.raises(ValueError, match=r"compressed_allreduce runs in a branch .*"
                     r"optax.apply_if_finite.*Put it after this transform"):
    jax.pmap(tx.update, axis_name=AXIS).lower(_gaussian(0), state)
  mesh = jax.make_mesh((NUM_DEVICES,), (AXIS,))
  with pytest.raises(ValueError, match="each device computes for itself"):
    _trace_data_parallel(tx, mesh)
  # The decentralized exchange likewise; its inner optimizer may be wrapped.
  ring = optax.apply_if_finite(qsgd_jax.low_precision_decentralized(optax.sgd(0.1), AXIS), 3)
  with pytest.raises(ValueError, match="Wrap the inner optimizer instead"):
    jax.pmap(ring.update, axis_name=AXIS).lower(
        _gaussian(0), jax.pmap(ring.init, axis_name=AXIS)(params), params)


def test_per_device_predicates_are_refused_and_step_counts_allowed():
  """By what a wrapper's predicate is, not by the wrapper's name: optax.MultiSteps skipping on
  each device's own updates is refused; optax.conditionally_transform on a step count runs
  (under pmap: under shard_map its branches, one passing each device's updates through and
  one averaging them, differ in type, which JAX refuses before anything here)."""
  mesh = jax.make_mesh((NUM_DEVICES,), (AXIS,))
  params = _stacked(_PARAMS)
  skipping = optax.MultiSteps(qsgd_jax.qsgd(AXIS), 2,
                              should_skip_update_fn=optax.skip_not_finite)
  counted = optax.conditionally_transform(
      qsgd_jax.qsgd(AXIS), lambda step: step >= 1, forward_extra_args=False)
  state = jax.pmap(skipping.init, axis_name=AXIS)(params)
  with pytest.raises(ValueError, match="optax.MultiSteps with a should_skip_update_fn"):
    jax.pmap(skipping.update, axis_name=AXIS).lower(_gaussian(0), state)
  state = jax.pmap(counted.init, axis_name=AXIS)(params)
  step = jax.pmap(counted.update, axis_name=AXIS)
  grads = _gaussian(0)
  updates, state = jax.block_until_ready(step(grads, state))
  chex.assert_trees_all_equal(updates, grads)  # Step 0: passed through.
  updates, state = jax.block_until_ready(step(grads, state))
  assert_replicas_identical(updates)  # Step 1: averaged.
  # Under shard_map the predicate's type says it: each device's own.
  with pytest.raises(ValueError, match="each device computes for itself"):
    _trace_data_parallel(skipping, mesh)


def test_a_residual_overflowing_finite_updates_is_not_a_nonfinite_step():
  # QSGD's scales tell a step that its updates are finite. Device 3's scales
  # are inf here while its updates are not: the step reads them and goes on.
  largest = float(jnp.finfo(jnp.float32).max)
  tx = qsgd_jax.qsgd(AXIS, error_feedback="worker", axis_size=NUM_DEVICES)
  state = jax.pmap(tx.init, axis_name=AXIS)(_stacked(_PARAMS))
  state = state._replace(local_error=tuple(jnp.full_like(e, largest) for e in state.local_error))
  grads = _gaussian(0)
  grads["w"] = grads["w"].at[3].set(largest)
  mean, new_state = jax.block_until_ready(
      jax.pmap(tx.update, axis_name=AXIS)(_on_devices(grads), state))
  expected_b = np.mean(np.asarray(grads["b"]), axis=0)
  np.testing.assert_allclose(np.asarray(mean["b"]), np.broadcast_to(expected_b, (8, 128)),
                             rtol=1e-5, atol=1e-6)
  (old,), (new,) = host_arrays(state.local_error), host_arrays(new_state.local_error)
  assert not np.array_equal(old[0], new[0])  # The residual moved on: the step was taken.


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, None])
def test_all_finite_finds_one_bad_element_in_any_float_leaf(dtype, bad):
  largest = float(jnp.finfo(dtype).max)  # Finite, and its square is not.
  tree = {"w": jnp.full((64, 33), largest, dtype), "b": -jnp.full((7,), largest, dtype),
          "steps": jnp.arange(3)}
  if bad is not None:
    tree["w"] = tree["w"].at[40, 17].set(bad)
  assert bool(jax.jit(base.all_finite)(tree)) == (bad is None)


def _multiples_of_an_eighth():
  # The running mean that MultiSteps keeps gives these back exactly.
  w_key, b_key = jax.random.split(jax.random.key(4))
  return _on_devices({"w": jax.random.randint(w_key, (NUM_DEVICES, 64, 128), -8, 8) / 8.0,
                      "b": jax.random.randint(b_key, (NUM_DEVICES, 128), -8, 8) / 8.0})


@pytest.mark.slow
def test_multi_steps_advances_the_state_only_when_applying():
  """optax.MultiSteps gives the compressed mean; key and count advance once per k mini-steps.

  It still runs the all-reduce on every mini-step and keeps the result only on
  the k-th, so it sends k times the bytes; qsgd_jax.accumulate_gradients sends
  them once (tests/accumulation_test.py counts both).
  """
  k = 3
  tx = optax.MultiSteps(
      optax.chain(qsgd_jax.qsgd(AXIS, error_feedback="worker", track_elias=False),
                  optax.sgd(1.0)),
      every_k_schedule=k)
  grads = _multiples_of_an_eighth()
  state = jax.pmap(tx.init, axis_name=AXIS)(_stacked(_PARAMS))
  update = jax.pmap(tx.update, axis_name=AXIS)
  counts, keys, applied = [], [], []
  for _ in range(2 * k):
    updates, state = jax.block_until_ready(update(grads, state))
    ours = _first(state.inner_opt_state[0])
    counts.append(int(ours.count))
    keys.append(tuple(np.asarray(jax.random.key_data(ours.key))))
    applied.append(bool(np.asarray(updates["w"]).any()))
    if applied[-1]:
      # The compressed mean of the accumulated gradients (here, of the gradients).
      mean = np.asarray(grads["w"]).mean(axis=0)
      np.testing.assert_allclose(-np.asarray(updates["w"])[0], mean, atol=0.5)
  assert counts == [0, 0, 1, 1, 1, 2]
  assert keys[0] == keys[1] != keys[2] == keys[3] == keys[4] != keys[5]
  assert applied == [False, False, True, False, False, True]


def _with_learning_rate(state, learning_rate):
  """``state`` of ``chain(transform, inject_hyperparams(...))`` with another learning rate."""
  hyperparams = {**state[1].hyperparams, "learning_rate": learning_rate}
  return (state[0], state[1]._replace(hyperparams=hyperparams))


def test_inject_hyperparams_learning_rate_changes_mid_run():
  tx = optax.chain(qsgd_jax.qsgd(AXIS, track_elias=False),
                   optax.inject_hyperparams(optax.adam)(learning_rate=1e-3))
  params = _stacked(_PARAMS)
  state = jax.pmap(tx.init, axis_name=AXIS)(params)
  step = jax.pmap(functools.partial(apply_step, tx), axis_name=AXIS)
  learning_rate = state[1].hyperparams["learning_rate"]
  zero, larger = jnp.zeros_like(learning_rate), jnp.full_like(learning_rate, 1e-2)

  def largest_change(new, old):
    return float(np.abs(np.asarray(new["w"]) - np.asarray(old["w"])).max())

  new_params, state = jax.block_until_ready(step(params, state, _gaussian(0)))
  first_change = largest_change(new_params, params)
  params = new_params
  grads = _gaussian(1), _gaussian(2)
  with backend_compiles() as compiles:
    frozen_params, state = jax.block_until_ready(
        step(params, _with_learning_rate(state, zero), grads[0]))
    counts = np.asarray(state[0].count)
    new_params, state = jax.block_until_ready(
        step(params, _with_learning_rate(state, larger), grads[1]))
  assert not compiles
  chex.assert_trees_all_equal(host_arrays(frozen_params), host_arrays(params))
  assert (counts == 2).all()  # The all-reduce ran all the same.
  # Adam's early steps move each coordinate by about the learning rate.
  assert 5 < largest_change(new_params, params) / first_change < 20
  assert_replicas_identical(new_params)


def test_compression_stats_are_found_in_wrapped_states():
  qsgd = functools.partial(qsgd_jax.qsgd, AXIS)
  wrapped = {
      "chain": optax.chain(optax.clip_by_global_norm(1.0), qsgd(), optax.adam(1e-3)),
      "multi_steps": optax.MultiSteps(optax.chain(qsgd(), optax.adam(1e-3)), 4),
      "apply_if_finite": optax.chain(qsgd(), optax.apply_if_finite(optax.adam(1e-3), 2)),
      "inject_hyperparams": optax.inject_hyperparams(
          lambda learning_rate: optax.chain(qsgd(), optax.sgd(learning_rate)))(
              learning_rate=0.1),
      "named_chain": optax.named_chain(("average", qsgd()), ("adam", optax.adam(1e-3))),
  }
  for name, tx in wrapped.items():
    state = jax.eval_shape(tx.init, _PARAMS)
    stats = qsgd_jax.compression_stats(state)
    assert isinstance(stats, qsgd_jax.CompressionStats), name
    assert stats.wire_bits.shape == () and stats.wire_bits.dtype == jnp.float32, name
  assert qsgd_jax.compression_stats(optax.adam(1e-3).init(_PARAMS)) is None


def test_state_partition_specs_lay_residuals_along_the_axis():
  tx = optax.chain(
      qsgd_jax.onebit_sgd(AXIS, error_feedback="both", axis_size=NUM_DEVICES),
      optax.adam(1e-3))
  shapes = jax.eval_shape(tx.init, _PARAMS)
  specs = qsgd_jax.state_partition_specs(shapes, AXIS)
  ours = specs[0]
  # Only "w" is sent compressed: it alone has residuals, shaped like what they hold.
  assert ours.local_error == (P(AXIS),)
  assert [e.shape for e in shapes[0].local_error] == [(64 * 128,)]
  assert ours.chunk_error == (P(AXIS),)  # One block: the leaves end to end.
  # A device owns 1/8 of "w": 2 buckets of 512.
  assert [e.shape for e in shapes[0].chunk_error] == [(1, 2, 512)]
  assert ours.key == ours.count == P()
  assert all(spec == P() for spec in ours.stats)
  assert all(spec == P() for spec in jax.tree.leaves(
      specs[1], is_leaf=lambda node: isinstance(node, P)))


# Wrong use gets a clear error.


def test_unbound_axis_name_is_a_name_error():
  tx = qsgd_jax.qsgd(AXIS)
  state = tx.init(_PARAMS)
  with pytest.raises(NameError, match=f"'{AXIS}' is not bound"):
    tx.update(_first(_gaussian(0)), state)
  with pytest.raises(NameError, match=f"'{AXIS}' is not bound"):
    jax.pmap(tx.update, axis_name="devices")(_gaussian(0), _stacked(state))
  mesh = jax.make_mesh((NUM_DEVICES,), ("data",))
  with pytest.raises(NameError, match=f"'{AXIS}' is not bound"):
    jax.shard_map(lambda g: tx.update(g, state)[0], mesh=mesh, in_specs=P(),
                  out_specs=P())(_first(_gaussian(0)))


def test_integer_leaves_are_pmean_cast_back_and_bool_and_float0_keep_their_dtype():
  """``jax.grad(..., allow_int=True)`` gives float0 leaves; they, and integer leaves, pass."""
  tx = qsgd_jax.qsgd(AXIS, error_feedback="worker")
  updates = {"w": _gaussian(3)["w"],
             "step": jnp.arange(NUM_DEVICES * 3, dtype=jnp.int32).reshape(NUM_DEVICES, 3),
             "mask": jnp.zeros((NUM_DEVICES, 2), bool).at[0, 1].set(True),
             "int_param": np.zeros((NUM_DEVICES, 4), jax.dtypes.float0)}
  state = jax.pmap(tx.init, axis_name=AXIS)(updates)
  mean, state = jax.pmap(tx.update, axis_name=AXIS)(updates, state)
  exact = jax.pmap(lambda u: jax.lax.pmean(u, AXIS).astype(u.dtype),
                   axis_name=AXIS)(updates["step"])
  np.testing.assert_array_equal(mean["step"], exact)
  np.testing.assert_array_equal(mean["mask"], np.tile([False, True], (NUM_DEVICES, 1)))
  assert {name: mean[name].dtype for name in ("step", "mask", "int_param")} == {
      "step": jnp.int32, "mask": jnp.bool_, "int_param": jax.dtypes.float0}
  assert_replicas_identical(mean["w"])
  assert [e.shape for e in state.local_error] == [(NUM_DEVICES, 64 * 128)]


@pytest.mark.parametrize("compressor", [
    "qsgd", qsgd_jax.QSGD, optax.sgd(0.1), None], ids=["str", "class", "optax", "none"])
def test_not_a_compressor_is_a_type_error(compressor):
  with pytest.raises(TypeError, match="qsgd_jax.Compressor"):
    qsgd_jax.compressed_allreduce(compressor, AXIS)


@pytest.mark.parametrize("error_feedback", ["workers", "yes", None, 1, 0.0, "Worker"])
def test_bad_error_feedback_is_a_value_error(error_feedback):
  with pytest.raises(ValueError, match="error_feedback"):
    qsgd_jax.onebit_sgd(AXIS, error_feedback=error_feedback)


@pytest.mark.parametrize("warmup_steps", [-1, 1.5, "10", True, None])
def test_bad_warmup_steps_is_a_value_error(warmup_steps):
  with pytest.raises(ValueError, match="warmup_steps"):
    qsgd_jax.qsgd(AXIS, warmup_steps=warmup_steps)


@pytest.mark.parametrize("min_compressed_size", [-1, 2.5, None, "4096", True])
def test_bad_min_compressed_size_is_a_value_error(min_compressed_size):
  with pytest.raises(ValueError, match="min_compressed_size must be a non-negative int"):
    qsgd_jax.qsgd(AXIS, min_compressed_size=min_compressed_size)


def test_the_internal_reduce_scatter_method_is_refused():
  with pytest.raises(ValueError, match=r"method must be one of \('two_phase', 'psum', "
                     r"'all_gather'\), got 'reduce_scatter'"):
    qsgd_jax.qsgd(AXIS, method="reduce_scatter")


@pytest.mark.parametrize("axis_size", [0, -2, 2.0, True, {"other": 8}, {AXIS: 0}])
def test_bad_axis_size_is_a_value_error(axis_size):
  with pytest.raises(ValueError, match="axis_size"):
    qsgd_jax.onebit_sgd(AXIS, error_feedback="both", axis_size=axis_size)


def test_one_axis_size_for_two_axes_is_a_value_error():
  with pytest.raises(ValueError, match=r"axis_size must be a dict naming each of \('node', "
                     r"'local'\), got 8"):
    qsgd_jax.onebit_sgd(("node", "local"), axis_size=8)


def test_residuals_of_another_axis_size_are_an_error_naming_axis_size():
  # 8 devices run it; the owners' residuals hold a piece of 1/n of the segment each.
  tx = qsgd_jax.onebit_sgd(AXIS, error_feedback="owner", min_compressed_size=0, axis_size=2)
  grads = {"w": jnp.ones((NUM_DEVICES, 4096))}
  state = tx.init(jax.tree.map(lambda g: g[0], grads))
  step = jax.pmap(lambda g, s: tx.update(g, s)[0], axis_name=AXIS, in_axes=(0, None))
  with pytest.raises(ValueError, match=r"chunk_error has shapes .*axis_size=2"):
    step(grads, state)


def test_owner_residuals_without_an_axis_are_a_value_error():
  with pytest.raises(ValueError, match="axis_name=None has none"):
    qsgd_jax.onebit_sgd(None, error_feedback="both")


def test_warm_up_averages_integer_leaves_as_the_compressed_steps_do():
  tx = qsgd_jax.qsgd(AXIS, warmup_steps=1, min_compressed_size=0)
  grads = {"w": jnp.ones((NUM_DEVICES, 4096)),
           "step": jnp.arange(NUM_DEVICES * 3, dtype=jnp.int32).reshape(NUM_DEVICES, 3)}
  state = tx.init(jax.tree.map(lambda g: g[0], grads))

  def two_steps(grads):
    first, state1 = tx.update(grads, state)
    return first, tx.update(grads, state1)[0]

  warm, compressed = jax.pmap(two_steps, axis_name=AXIS)(grads)
  expected = np.mean(np.asarray(grads["step"]), axis=0).astype(np.int32)
  for mean in (warm, compressed):
    assert mean["step"].dtype == jnp.int32
    np.testing.assert_array_equal(mean["step"][0], expected)


# Warm-up and statistics.


@pytest.mark.slow
def test_warmup_steps_are_exact_float32_means():
  warmup_steps = 2
  tx = qsgd_jax.compressed_allreduce(
      qsgd_jax.QSGD(bits=4), AXIS, warmup_steps=warmup_steps, error_feedback="worker",
      track_elias=False)
  update = jax.pmap(tx.update, axis_name=AXIS)
  pmean = jax.pmap(lambda g: jax.lax.pmean(g, AXIS), axis_name=AXIS)
  state = jax.pmap(tx.init, axis_name=AXIS)(_stacked(_PARAMS))
  for step in range(warmup_steps + 2):
    grads = _gaussian(10 + step)
    mean, state = jax.block_until_ready(update(grads, state))
    exact = pmean(grads)
    assert_replicas_identical(mean)
    stats = _first(qsgd_jax.compression_stats(state))
    (residual,) = np.asarray(state.local_error)  # "w", the one leaf sent compressed.
    if step < warmup_steps:
      chex.assert_trees_all_equal(host_arrays(mean), host_arrays(exact))
      assert float(stats.compression_ratio) == 1
      assert float(stats.wire_bits) == float(stats.float32_bits)
      assert not residual.any()
    else:
      assert not np.array_equal(np.asarray(mean["w"]), np.asarray(exact["w"]))
      # "b" is below min_compressed_size: still exact.
      np.testing.assert_array_equal(np.asarray(mean["b"]), np.asarray(exact["b"]))
      # Two 4-bit roundings of buckets of 512 Gaussians: errors well under one.
      np.testing.assert_allclose(np.asarray(mean["w"]), np.asarray(exact["w"]), atol=1.0)
      assert float(stats.compression_ratio) > 6
      assert residual.any()


@pytest.mark.parametrize("transform, elias_is_smaller", [
    (qsgd_jax.qsgd(AXIS, norm="l2", track_elias=True), True),
    (qsgd_jax.qsgd(AXIS, method="psum", error_feedback="worker", track_elias=False), False),
    (qsgd_jax.onebit_sgd(AXIS, error_feedback="both", axis_size=NUM_DEVICES), False),
], ids=["qsgd_l2", "qsgd_psum_worker", "onebit_both"])
def test_wire_bits_are_what_the_compiled_update_sends(transform, elias_is_smaller):
  params = {"w": jnp.zeros((64, 128)), "v": jnp.zeros((5000,)), "b": jnp.zeros((128,))}
  w_key, v_key, b_key = jax.random.split(jax.random.key(7), 3)
  grads = _on_devices({"w": jax.random.normal(w_key, (NUM_DEVICES, 64, 128)),
                       "v": jax.random.normal(v_key, (NUM_DEVICES, 5000)),
                       "b": jax.random.normal(b_key, (NUM_DEVICES, 128))})
  state = jax.pmap(transform.init, axis_name=AXIS)(_stacked(params))
  update = jax.pmap(transform.update, axis_name=AXIS)
  compiled = update.lower(grads, state).compile()
  _, state = jax.block_until_ready(compiled(grads, state))
  stats = _first(qsgd_jax.compression_stats(state))

  # Exactly: the payloads, the float32 all-reduce of "b", and the scalar
  # all-reduces (the non-finite flag; the Elias estimate's mean).
  assert float(stats.wire_bits) == qsgd_jax.wire_bytes(compiled.as_text()) * 8
  size = 64 * 128 + 5000 + 128
  assert float(stats.float32_bits) == 2 * (NUM_DEVICES - 1) / NUM_DEVICES * 32 * size
  np.testing.assert_allclose(float(stats.compression_ratio),
                             float(stats.float32_bits) / float(stats.wire_bits), rtol=1e-6)
  if elias_is_smaller:
    # With the paper's L2 scaling most 4-bit levels of Gaussians are 0 or 1:
    # cheap in Elias code.
    assert 0 < float(stats.elias_bits) < float(stats.wire_bits)
  else:
    assert np.isnan(float(stats.elias_bits))


@pytest.mark.slow
def test_elias_bits_are_off_by_default_and_measured_every_k_steps():
  _, state, _ = _pmap_train("qsgd_adamw", 1)
  assert np.isnan(float(_first(qsgd_jax.compression_stats(state)).elias_bits))

  tx = qsgd_jax.qsgd(AXIS, track_elias=3)
  state = jax.pmap(tx.init, axis_name=AXIS)(_stacked(_PARAMS))
  update = jax.pmap(tx.update, axis_name=AXIS)
  found = []
  for step in range(4):
    _, state = jax.block_until_ready(update(_gaussian(20 + step), state))
    found.append(_first(qsgd_jax.compression_stats(state)))
  scalar_all_reduce_bits = 2 * (NUM_DEVICES - 1) / NUM_DEVICES * 32
  # Unlike with the L2 norm, at 4 bits the max norm's levels are large enough
  # that Elias coding is about as long as the fixed-width wire (a few % more
  # on Gaussians), so only finiteness is asserted.
  assert np.isfinite(float(found[0].elias_bits)) and float(found[0].elias_bits) > 0
  # Held between measurements, which alone send the estimate's scalar pmean.
  assert float(found[1].elias_bits) == float(found[2].elias_bits) == float(found[0].elias_bits)
  assert float(found[0].wire_bits) - float(found[1].wire_bits) == scalar_all_reduce_bits
  assert float(found[3].elias_bits) != float(found[0].elias_bits)
  assert float(found[3].wire_bits) == float(found[0].wire_bits)


# Error feedback on a small real problem: scikit-learn's digits, an MLP.

_DIGITS_STEPS = 300
_DIGITS_SEEDS = (0, 1, 2)
_DIGITS_MODES = ("float32", "qsgd_4bit", "onebit_none", "onebit_worker")


def _digits_data():
  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  x_train, x_test, y_train, y_test = train_test_split(
      x, y, test_size=360, stratify=y, random_state=0)
  per_device = len(x_train) // NUM_DEVICES
  used = per_device * NUM_DEVICES
  return (x_train[:used].reshape(NUM_DEVICES, per_device, 64),
          y_train[:used].reshape(NUM_DEVICES, per_device), x_test, y_test)


def _mlp_init(key):
  first, second = jax.random.split(key)
  return {"hidden": {"w": jax.random.normal(first, (64, 128)) * np.sqrt(2 / 64),
                     "b": jnp.zeros((128,))},
          "out": {"w": jax.random.normal(second, (128, 10)) * np.sqrt(1 / 128),
                  "b": jnp.zeros((10,))}}


def _mlp_logits(params, x):
  hidden = jax.nn.relu(x @ params["hidden"]["w"] + params["hidden"]["b"])
  return hidden @ params["out"]["w"] + params["out"]["b"]


def _mlp_loss(params, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(_mlp_logits(params, x), y).mean()


def _digits_optimizers():
  # Both weight matrices (8192 and 1280 elements) are compressed, the biases not.
  options = dict(min_compressed_size=1024, track_elias=False)
  averages = {
      "float32": optax.GradientTransformation(
          lambda params: optax.EmptyState(),
          lambda updates, state, params=None: (jax.lax.pmean(updates, AXIS), state)),
      "qsgd_4bit": qsgd_jax.qsgd(AXIS, **options),
      "onebit_none": qsgd_jax.onebit_sgd(AXIS, error_feedback=False, **options),
      "onebit_worker": qsgd_jax.onebit_sgd(AXIS, error_feedback="worker", **options),
  }
  return {mode: optax.chain(averages[mode], optax.sgd(0.05, momentum=0.9))
          for mode in _DIGITS_MODES}


@functools.cache
def _digits_train():
  """Every mode side by side and every seed at once, one ``lax.scan`` over the steps.

  Maps ``(params [devices, seeds, ...], x, y, keys [devices, seeds])`` to each
  mode's final parameters ``[devices, seeds, ...]``.
  """
  optimizers = _digits_optimizers()

  def train(params, x, y, key):
    key = jax.random.fold_in(key, jax.lax.axis_index(AXIS))

    def step(carry, step_key):
      # Every mode draws the same batch at a step.
      index = jax.random.randint(step_key, (32,), 0, x.shape[0])
      new_carry = {}
      for mode, tx in optimizers.items():
        mode_params, state = carry[mode]
        grads = jax.grad(_mlp_loss)(mode_params, x[index], y[index])
        updates, state = tx.update(grads, state, mode_params)
        new_carry[mode] = (optax.apply_updates(mode_params, updates), state)
      return new_carry, None

    carry = {mode: (params, tx.init(params)) for mode, tx in optimizers.items()}
    carry, _ = jax.lax.scan(step, carry, jax.random.split(key, _DIGITS_STEPS))
    return {mode: mode_params for mode, (mode_params, _) in carry.items()}

  return jax.pmap(jax.vmap(train, in_axes=(0, None, None, 0)), axis_name=AXIS)


@pytest.mark.slow
def test_error_feedback_matters_on_digits():
  x_train, y_train, x_test, y_test = _digits_data()
  params = jax.vmap(_mlp_init)(jax.random.split(jax.random.key(0), len(_DIGITS_SEEDS)))
  keys = jax.random.key_data(jax.random.split(jax.random.key(1), len(_DIGITS_SEEDS)))
  final = jax.block_until_ready(_digits_train()(
      _stacked(params), x_train, y_train, jax.random.wrap_key_data(_stacked(keys))))
  assert_replicas_identical(final)
  accuracy, loss = {}, {}
  for mode, mode_params in final.items():
    mode_params = jax.tree.map(lambda x: x[0], mode_params)  # [seeds, ...]
    predicted = jnp.argmax(jax.vmap(_mlp_logits, in_axes=(0, None))(mode_params, x_test), -1)
    accuracy[mode] = 100 * float(jnp.mean(predicted == y_test))
    loss[mode] = float(jnp.mean(jax.vmap(_mlp_loss, in_axes=(0, None, None))(
        mode_params, x_train.reshape(-1, 64), y_train.reshape(-1))))
  print(f"digits, {len(_DIGITS_SEEDS)} seeds x {_DIGITS_STEPS} steps: "
        f"test accuracy % {accuracy}, training loss {loss}")

  assert accuracy["qsgd_4bit"] >= accuracy["float32"] - 1
  assert accuracy["onebit_worker"] >= accuracy["float32"] - 2
  # Without error feedback 1-bit SGD trains measurably worse.
  assert accuracy["onebit_none"] < accuracy["onebit_worker"]
  assert loss["onebit_none"] > 1.2 * loss["onebit_worker"]


# One device, two levels, and trees that are hardly compressed.


@pytest.mark.slow
def test_no_axis_quantizes_locally_with_error_feedback():
  """axis_name=None: the step as one device alone would send it, residuals kept."""
  compressor = qsgd_jax.OneBit(bucket_size=512)
  tx = qsgd_jax.compressed_allreduce(compressor, None, error_feedback="worker")
  grads = _first(_gaussian(4))
  state = tx.init(_PARAMS)
  update = jax.jit(tx.update)
  sent, state = update(grads, state)
  np.testing.assert_array_equal(sent["b"], grads["b"])  # Small: as it is.
  alone = compressor.decode(compressor.encode(jax.random.key(0), grads["w"].reshape(-1)))
  np.testing.assert_allclose(sent["w"].reshape(-1), alone, rtol=1e-6)
  (residual,) = state.local_error
  np.testing.assert_allclose(residual, grads["w"].reshape(-1) - alone, rtol=1e-5, atol=1e-6)
  stats = qsgd_jax.compression_stats(state)
  assert float(stats.wire_bits) == 0.0
  assert not qsgd_jax.collectives_in_hlo(update.lower(grads, state).compile().as_text())


def test_two_levels_report_the_outer_links_own_ratio():
  mesh = jax.make_mesh((2, 4), ("node", "local"))
  axes = ("node", "local")
  tx = qsgd_jax.qsgd(axes, bits=4)
  params = {"w": jnp.zeros((512, 1024))}
  grads = jax.device_put(jax.random.normal(jax.random.key(0), (8, 512, 1024)),
                         NamedSharding(mesh, P(axes)))

  def step(grads):
    state = tx.init(params)
    _, state = tx.update({"w": grads[0]}, state)
    return qsgd_jax.compression_stats(state)

  stats = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P(axes), out_specs=P()))(grads)
  # Over all links, the float32 reduce-scatter and all-gather inside each node dominate.
  assert float(stats.compression_ratio) < 1.5
  # Across nodes only packed 4-bit codes travel: about 8x less than float32.
  assert 7.5 < float(stats.outer_compression_ratio) < 8.0
  assert float(stats.outer_wire_bits) < float(stats.wire_bits) / 4


def test_a_tree_hardly_compressed_is_warned_about_once():
  tx = qsgd_jax.qsgd(AXIS)  # min_compressed_size=4096: nothing is quantized.
  small = {"b": jnp.zeros((NUM_DEVICES, 3000)), "c": jnp.zeros((NUM_DEVICES, 3000))}
  state = jax.pmap(tx.init, axis_name=AXIS)(small)
  with pytest.warns(UserWarning, match=r"only 0 of the 6000 elements.*min_compressed_size"):
    jax.pmap(tx.update, axis_name=AXIS)(small, state)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jax.pmap(tx.update, axis_name=AXIS)(small, state)  # The same tree: cached, silent.


def test_gradients_of_replicated_params_under_shard_map_are_an_error():
  mesh = jax.make_mesh((NUM_DEVICES,), (AXIS,))
  tx = qsgd_jax.qsgd(AXIS)
  specs = qsgd_jax.state_partition_specs(jax.eval_shape(tx.init, _PARAMS), AXIS)

  def step(params, state, x, y):
    grads = jax.grad(_loss)(params, x[0], y[0])  # No as_varying: summed by autodiff.
    return tx.update(grads, state)[0]

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P(AXIS), P(AXIS)),
                            out_specs=P()))
  data = [jax.device_put(a, NamedSharding(mesh, P(AXIS))) for a in (_INPUTS, _TARGETS)]
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(_PARAMS)
  with pytest.raises(ValueError, match=r"compressed_allreduce: leaf \['b'\] is replicated"):
    f(_PARAMS, state, *data)
