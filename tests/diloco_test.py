"""Tests of DiLoCo and Streaming DiLoCo (qsgd_jax.diloco) against NumPy references."""

import functools

import chex
import diloco_reference as reference
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from diloco_helpers import (
  AXIS,
  TWO_FRAGMENTS,
  WORKERS,
  example_params,
  example_targets,
  reference_grad,
  stack,
  step_with_params_per_device,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qsgd_jax
from qsgd_jax import DiLoCoState, diloco
from qsgd_jax._src.diloco import exchange as diloco_exchange
from qsgd_jax._src.diloco import inner_step, partition


def _step(tx, events=None):
  def step(params, state, target):
    grads = jax.tree.map(lambda x, c: x - c, params, target)
    updates, state = tx.update(grads, state, params, events=events)
    return optax.apply_updates(params, updates), state
  return step


def _programs(make_step, events_of):
  """A function of the step count ``t`` to ``make_step(events)``'s program: one for every step
  with ``events_of=None``, else one for each distinct ``events_of(t)``, made once."""
  programs = {}

  def program(t):
    events = None if events_of is None else events_of(t)
    if events not in programs:
      programs[events] = make_step(events)
    return programs[events]
  return program


def _run_pmap(tx, targets, steps):
  """Local params and state after every step, under jax.pmap."""
  treedef = jax.tree.structure(example_params())
  params = stack(example_params())
  state = jax.pmap(tx.init, axis_name=AXIS)(params)
  step = jax.pmap(_step(tx), axis_name=AXIS)
  history = []
  for t in range(steps):
    params, state = jax.block_until_ready(
        step(params, state, jax.tree.unflatten(treedef, targets[t])))
    history.append((params, state))
  return history


def _run_shard_map(tx, targets, steps, events_of=None):
  """The same under jax.shard_map, params laid out along the axis (a leading axis each); with
  ``events_of`` (a function of the step count), each step's events decided on the host."""
  mesh = jax.make_mesh((WORKERS,), (AXIS,))
  treedef = jax.tree.structure(example_params())
  specs = qsgd_jax.state_partition_specs(jax.eval_shape(tx.init, example_params()), AXIS)
  own = lambda tree: jax.tree.map(lambda x: x[0], tree)  # noqa: E731
  stacked = lambda tree: jax.tree.map(lambda x: x[None], tree)  # noqa: E731
  init = jax.jit(jax.shard_map(lambda p: tx.init(own(p)), mesh=mesh, in_specs=P(AXIS),
                               out_specs=specs))
  program = _programs(lambda events: jax.jit(jax.shard_map(
      lambda p, s, c: (lambda out: (stacked(out[0]), out[1]))(
          _step(tx, events)(own(p), s, own(c))),
      mesh=mesh, in_specs=(P(AXIS), specs, P(AXIS)), out_specs=(P(AXIS), specs))), events_of)
  put = lambda tree: jax.device_put(tree, NamedSharding(mesh, P(AXIS)))  # noqa: E731
  params = put(stack(example_params()))
  state = init(params)
  history = []
  for t in range(steps):
    params, state = jax.block_until_ready(
        program(t)(params, state, put(jax.tree.unflatten(treedef, targets[t]))))
    history.append((params, state))
  return history


_RUNS = {"pmap": _run_pmap, "shard_map": _run_shard_map}


def _check_against(history, local_history, global_history, shard_map=False):
  for t, ((params, state), local, global_) in enumerate(
      zip(history, local_history, global_history, strict=True)):
    got = [np.asarray(x) for x in jax.tree.leaves(params)]
    for m in range(WORKERS):
      for leaf, want in zip(got, local[m], strict=True):
        np.testing.assert_allclose(leaf[m], want, rtol=2e-5, atol=2e-5,
                                   err_msg=f"step {t}, worker {m}")
    held = [np.asarray(x) for x in jax.tree.leaves(state.global_params)]
    for leaf, want in zip(held, global_, strict=True):
      copies = [leaf] if shard_map else list(leaf)
      for copy in copies:  # The global copy: the same bits on every device.
        np.testing.assert_array_equal(copy, copies[0])
        np.testing.assert_allclose(copy, want, rtol=2e-5, atol=2e-5, err_msg=f"step {t}")


@pytest.mark.parametrize("mapping", ["pmap", "shard_map"])
def test_algorithm1_matches_reference(mapping):
  sync_every, rounds = 3, 3
  targets = example_targets(sync_every * rounds)
  tx = diloco(optax.sgd(0.1), AXIS, sync_every=sync_every)
  history = _RUNS[mapping](tx, targets, sync_every * rounds)
  local, global_ = reference.diloco(
      jax.tree.leaves(example_params()), reference_grad(targets), workers=WORKERS, rounds=rounds,
      sync_every=sync_every, inner=reference.SGD(0.1),
      outer=reference.SGD(0.7, momentum=0.9, nesterov=True))
  _check_against(history, local, global_, shard_map=mapping == "shard_map")


@pytest.mark.parametrize("mapping, sync_every, delay, alpha, steps", [
    ("pmap", 4, 1, 0.5, 11),
    ("shard_map", 4, 1, 0.5, 11),
    ("pmap", 6, 2, 0.0, 13),  # The exchange at s + 1, the merge at s + 2.
])
@pytest.mark.slow
def test_streaming_matches_reference(mapping, sync_every, delay, alpha, steps):
  targets = example_targets(steps)
  tx = diloco(optax.adam(0.05), AXIS, sync_every=sync_every, fragments=2, delay=delay,
              alpha=alpha)
  history = _RUNS[mapping](tx, targets, steps)
  local, global_ = reference.streaming_diloco(
      jax.tree.leaves(example_params()), reference_grad(targets), workers=WORKERS, steps=steps,
      sync_every=sync_every, fragment_of=TWO_FRAGMENTS, inner=reference.Adam(0.05),
      outer=reference.SGD(0.7, momentum=0.9, nesterov=True), delay=delay, alpha=alpha)
  _check_against(history, local, global_, shard_map=mapping == "shard_map")

def _quadratic_grads(params, t):
  """A gradient that moves with the step: params - target_t."""
  return jax.tree.map(lambda x: x - jnp.sin(t + jnp.arange(x.size).reshape(x.shape)), params)


def _run_one_device(tx, steps, params=None):
  params = example_params() if params is None else params
  state = tx.init(params)
  update = jax.jit(tx.update)
  for t in range(steps):
    updates, state = update(_quadratic_grads(params, t), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def test_one_device_equals_lookahead():
  tx = diloco(optax.adam(0.05), None, sync_every=3, outer_optimizer=optax.sgd(0.5))
  params, state = _run_one_device(tx, 8)
  lookahead = optax.lookahead(optax.adam(0.05), sync_period=3, slow_step_size=0.5)
  both = optax.LookaheadParams.init_synced(example_params())
  look_state = lookahead.init(both)
  update = jax.jit(lookahead.update)
  for t in range(8):
    updates, look_state = update(_quadratic_grads(both.fast, t), look_state, both)
    both = optax.apply_updates(both, updates)
  # diloco's params are lookahead's fast ones, its global copy the slow ones.
  chex.assert_trees_all_close(params, both.fast, rtol=1e-6, atol=1e-6)
  chex.assert_trees_all_close(state.global_params, both.slow, rtol=1e-6, atol=1e-6)


# The path of test_one_device_equals_lookahead (DiLoCo on one device, an outer SGD), at another
# outer learning rate.
@pytest.mark.slow
def test_outer_sgd_at_one_is_the_inner_optimizer():
  tx = diloco(optax.adam(0.05), None, sync_every=3, outer_optimizer=optax.sgd(1.0))
  params, _ = _run_one_device(tx, 7)
  alone, _ = _run_one_device(optax.adam(0.05), 7)
  chex.assert_trees_all_close(params, alone, rtol=1e-6, atol=1e-6)


def _compressed_tx():
  average = qsgd_jax.qsgd(AXIS, bits=4, error_feedback=True, min_compressed_size=8, key=5)
  return diloco(optax.sgd(0.1), AXIS, sync_every=4, fragments=2, average=average)


@pytest.fixture(scope="module")
def compressed_run():
  """Eight steps of DiLoCo with a 4-bit outer average, two fragments, under jax.pmap."""
  tx = _compressed_tx()
  targets = example_targets(8)
  treedef = jax.tree.structure(example_params())
  traced = chex.assert_max_traces(_step(tx), n=1)
  step = jax.pmap(traced, axis_name=AXIS)
  params = jax.pmap(lambda x: x, axis_name=AXIS)(stack(example_params()))
  state = jax.pmap(tx.init, axis_name=AXIS)(params)
  history = [(params, state)]
  for t in range(8):  # Traced once: the second call reuses the first's program.
    params, state = jax.block_until_ready(
        step(params, state, jax.tree.unflatten(treedef, targets[t])))
    history.append((params, state))
  return step, targets, history


@pytest.mark.slow
def test_compressed_average_keeps_its_error_feedback(compressed_run):
  _, _, history = compressed_run
  # Fragment 0 syncs at steps 1 and 5 (offset 2), fragment 1 at steps 3 and 7 (offset 4).
  exchanges = {0: (1, 5), 1: (3, 7)}
  for p, steps in exchanges.items():
    for t in range(8):
      before = history[t][1].fragments[p].average_state.local_error
      after = history[t + 1][1].fragments[p].average_state.local_error
      if t in steps:
        assert all(np.any(np.asarray(a) != np.asarray(b))
                   for a, b in zip(after, before, strict=True))
      else:  # Between its exchanges a fragment's residuals stay as they were.
        chex.assert_trees_all_equal(after, before)
  errors = history[-1][1].fragments[0].average_state.local_error
  assert all(np.any(np.asarray(e) != 0) for e in errors)
  for _, state in history:  # The global copy: the same bits on every device.
    for leaf in jax.tree.leaves(state.global_params):
      np.testing.assert_array_equal(np.asarray(leaf), np.broadcast_to(leaf[0], leaf.shape))
  assert np.all(np.isfinite(np.asarray(jax.tree.leaves(history[-1][0])[0])))


@pytest.mark.slow
def test_stats_count_only_exchange_steps(compressed_run):
  _, _, history = compressed_run
  bits = [float(qsgd_jax.compression_stats(state).wire_bits[0]) for _, state in history[1:]]
  assert [t for t, b in enumerate(bits) if b != 0] == [1, 3, 5, 7]
  assert all(b > 0 for b in bits[1::2])
  quiet = qsgd_jax.compression_stats(history[3][1])  # After step 2: nothing sent.
  assert float(quiet.float32_bits[0]) > 0 and float(quiet.compression_ratio[0]) == np.inf
  # An exchange step sends what the fragment's average sent, and the count of the workers
  # whose outer gradient is finite: one float32 all-reduce.
  sent = qsgd_jax.compression_stats(history[2][1].fragments[0].average_state)
  assert bits[1] == float(sent.wire_bits[0]) + 2 * (WORKERS - 1) / WORKERS * 32


def test_run_stats_sum_the_float32_baseline_of_every_step(compressed_run):
  """A run's bytes against a float32 all-reduce of the gradients every step, steps that sent
  nothing included (no 0 x inf there): on one axis, across it too."""
  _, _, history = compressed_run
  run = None
  for _, state in history[1:]:
    run = qsgd_jax.accumulate_stats(run, state)
  elements = sum(np.size(x) for x in jax.tree.leaves(example_params()))
  baseline = 8 * 2 * (WORKERS - 1) / WORKERS * 32 * elements  # 8 steps.
  np.testing.assert_array_equal(run.float32_bits, baseline)
  np.testing.assert_array_equal(run.outer_float32_bits, baseline)
  sent = sum(np.asarray(state.stats.wire_bits, np.float64) for _, state in history[1:])
  np.testing.assert_array_equal(run.compression_ratio, baseline / sent)
  np.testing.assert_array_equal(run.outer_compression_ratio, baseline / sent)


def test_host_round_trip_mid_round_continues_bit_identically(compressed_run):
  step, targets, history = compressed_run
  treedef = jax.tree.structure(example_params())
  host = jax.device_get(history[2])  # Mid-round: fragment 0 synced, fragment 1 not.
  params, state = jax.device_put(host, jax.tree.map(lambda x: x.sharding, history[2]))
  for t in range(2, 8):
    params, state = jax.block_until_ready(
        step(params, state, jax.tree.unflatten(treedef, targets[t])))
  chex.assert_trees_all_equal(jax.device_get((params, state)), jax.device_get(history[-1]))


def _pmap_grads_run(tx, grads_per_step, params):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  step = jax.pmap(step, axis_name=AXIS)
  state = jax.pmap(tx.init, axis_name=AXIS)(params)
  history = [(params, state)]
  for grads in grads_per_step:
    params, state = jax.block_until_ready(step(params, state, grads))
    history.append((params, state))
  return history


@pytest.mark.parametrize("param_dtype, inner", [
    (jnp.bfloat16, optax.adamw(0.1, mu_dtype=jnp.float32)),  # float32 updates.
    (jnp.float32, optax.sgd(0.1)),  # Of bfloat16 gradients: bfloat16 updates.
])
def test_inner_updates_in_another_dtype_than_the_params(param_dtype, inner):
  """optax adds updates of another dtype than the params in their sum's dtype: diloco's
  updates are the inner optimizer's between syncs, and at a merge take every worker to the
  global params, which move to the workers' mean under an outer SGD at 1."""
  tx = diloco(inner, AXIS, sync_every=2, outer_optimizer=optax.sgd(1.0))
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(stack(rng.normal(size=16)), param_dtype)}
  grads = [{"w": jnp.asarray(rng.normal(size=(WORKERS, 16)), jnp.bfloat16)} for _ in range(2)]
  history = _pmap_grads_run(tx, grads, params)
  # Each worker alone with optax: its own two steps.
  local = []
  for m in range(WORKERS):
    theta, state = params["w"][m], inner.init(params["w"][m])
    for g in grads:
      updates, state = inner.update(g["w"][m], state, theta)
      theta = optax.apply_updates(theta, updates)
      local.append(theta)
  # Within a bfloat16 ulp of the params' scale (XLA rounds a fused step's bfloat16
  # intermediates once, optax's operations one by one).
  ulp = 2.0**-7 * np.abs(np.asarray(params["w"], np.float32)).max()
  if param_dtype == jnp.float32:
    ulp = 0.0
  after_one = np.stack([np.asarray(x, np.float32) for x in local[0::2]])
  np.testing.assert_allclose(np.asarray(history[1][0]["w"], np.float32), after_one, atol=ulp)
  merged, state = history[2]
  assert merged["w"].dtype == param_dtype
  mean = np.mean([np.asarray(x, np.float32) for x in local[1::2]], axis=0)
  np.testing.assert_allclose(np.asarray(state.global_params["w"][0], np.float32), mean,
                             atol=2 * ulp + 1e-6)
  np.testing.assert_allclose(np.asarray(merged["w"], np.float32),
                             np.asarray(state.global_params["w"], np.float32), rtol=1e-6)


def test_non_finite_inner_step_skips_on_that_device():
  tx = diloco(optax.adam(0.1), AXIS, sync_every=3)
  params = {"w": np.zeros((WORKERS, 16), np.float32)}
  grads = [{"w": np.ones((WORKERS, 16), np.float32) * (t + 1)} for t in range(3)]
  grads[1]["w"][2, 5] = np.nan
  history = _pmap_grads_run(tx, grads, params)
  (before, state_before), (after, state_after) = history[1], history[2]
  np.testing.assert_array_equal(after["w"][2], before["w"][2])  # Its update was zero.
  chex.assert_trees_all_equal(jax.tree.map(lambda x: x[2], state_after.inner_state),
                              jax.tree.map(lambda x: x[2], state_before.inner_state))
  assert np.all(after["w"][3] != before["w"][3])  # The others stepped.
  final_params, final_state = history[3]
  assert np.all(np.isfinite(final_state.global_params["w"]))
  assert np.all(np.isfinite(final_params["w"]))


@pytest.mark.slow
@pytest.mark.parametrize("mapping", ["pmap", "shard_map"])
def test_non_finite_guard_is_the_same_as_a_select_or_a_conditional(mapping, monkeypatch):
  """The CPU takes the conditional, other backends the select: the same bits either way."""
  targets = example_targets(4)
  targets[1][0][2, 0] = np.nan  # Device 2's inner step 1 is not finite.
  tx = diloco(optax.adam(0.1), AXIS, sync_every=2)
  histories = []
  for guard in (inner_step.kept_by_conditional, diloco_exchange.select):
    monkeypatch.setattr(inner_step, "finite_or_kept", guard)
    histories.append(jax.device_get(_RUNS[mapping](tx, targets, 4)))
  chex.assert_trees_all_equal(*histories)
  params, state = histories[0][-1]
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves((params, state.global_params)))


@pytest.mark.parametrize("delay", [0, 1])
def test_a_device_whose_params_would_overflow_skips_that_step(delay):
  """Device 0's inner update is finite but takes a parameter past float32's range on the
  step before a sync (delay 0) or on the sync step (delay 1): it skips that step, and the
  global parameters go on moving at every later sync."""
  tx = diloco(optax.sgd(1.0), AXIS, sync_every=4, outer_optimizer=optax.sgd(1.0), delay=delay)
  params = {"w": np.zeros((WORKERS, 16), np.float32)}
  rng = np.random.default_rng(0)
  grads = [{"w": rng.normal(size=(WORKERS, 16)).astype(np.float32)} for _ in range(12)]
  overflows = 2 if delay == 0 else 3  # The step before the sync at step 3, or the sync.
  grads[1]["w"][0, 0] = -3e38  # sgd(1.0): an update of +3e38, to 3e38 ...
  grads[overflows]["w"][0, 0] = -3e38  # ... and another, finite, to past float32's range.
  history = _pmap_grads_run(tx, grads, params)
  before, after = history[overflows][0], history[overflows + 1][0]
  np.testing.assert_array_equal(after["w"][0], before["w"][0])
  global_params = [np.asarray(state.global_params["w"][0]) for _, state in history]
  for t in (4 + delay, 8 + delay):  # Every round moves the global parameters.
    assert np.all(np.isfinite(global_params[t]))
    assert np.all(global_params[t][1:] != global_params[t - 1][1:]), t
  assert all(np.all(np.isfinite(p)) for p in jax.tree.leaves(history[-1][0]))


def test_a_worker_whose_state_went_non_finite_starts_afresh_at_the_merge():
  """A NaN gradient on device 3 at a mini-step of accumulate_gradients puts a NaN in its
  running mean: from the next merge on it trains again, from a fresh inner state."""
  inner = qsgd_jax.accumulate_gradients(optax.sgd(0.1), every_k_steps=2)
  tx = diloco(inner, AXIS, sync_every=4, outer_optimizer=optax.sgd(1.0))
  params = {"w": np.zeros((WORKERS, 16), np.float32)}
  rng = np.random.default_rng(0)
  grads = [{"w": rng.normal(size=(WORKERS, 16)).astype(np.float32)} for _ in range(8)]
  grads[0]["w"][3, 0] = np.nan
  history = _pmap_grads_run(tx, grads, params)
  merged_params, merged = history[4]  # After the sync at step 3: a finite, fresh state.
  assert all(np.all(np.isfinite(np.asarray(x)[3])) for x in jax.tree.leaves(merged.inner_state))
  np.testing.assert_array_equal(merged_params["w"][3], merged.global_params["w"][3])
  later_params, later = history[8]
  assert np.all(later_params["w"][3] != merged_params["w"][3])  # It steps again.
  assert np.all(np.isfinite(later.global_params["w"]))
  # Its outer gradient at the second sync is its own, not zero: the global step differs from
  # the mean of the other seven workers' alone.
  before_sync = np.asarray(history[7][0]["w"]) + np.asarray(
      -0.1 * np.mean(np.stack([g["w"] for g in grads[6:8]]), axis=0))
  others = np.delete(np.arange(WORKERS), 3)
  assert not np.allclose(later.global_params["w"][0], before_sync[others].mean(axis=0))


def test_a_non_finite_worker_is_left_out_of_the_average():
  """Device 0's outer gradient overflows (global - local past float32's range): the round
  averages the other seven workers, the stats count one skipped worker, and device 0 takes
  the global parameters back at the merge and trains on with the others."""
  tx = diloco(optax.sgd(1.0), AXIS, sync_every=2, outer_optimizer=optax.sgd(1.0))
  params = {"w": np.zeros((WORKERS, 16), np.float32)}
  rng = np.random.default_rng(0)
  grads = [{"w": rng.normal(size=(WORKERS, 16)).astype(np.float32)} for _ in range(8)]
  grads[0]["w"][:, 0] = 4e37  # The global coordinate goes to -4e37 at the first sync ...
  grads[2]["w"][0, 0] = -1.6e38  # ... device 0's to 1.2e38, then 3.2e38: its outer
  grads[3]["w"][0, 0] = -2e38  # gradient, -4e37 - 3.2e38, is -inf.
  history = _pmap_grads_run(tx, grads, params)
  skipped = [int(state.skipped_workers[0]) for _, state in history[1:]]
  assert skipped == [0, 0, 0, 1, 0, 0, 0, 0]
  local, state = history[4]
  global_params = np.asarray(state.global_params["w"][0])
  assert np.all(np.isfinite(global_params))
  others = np.delete(np.arange(WORKERS), 0)
  synced = np.asarray(history[2][1].global_params["w"][0])
  moved = np.mean(-np.stack([g["w"][others] for g in grads[2:4]]).sum(axis=0), axis=0)
  np.testing.assert_allclose(global_params[1:], (synced + moved)[1:], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(local["w"], np.broadcast_to(global_params, (WORKERS, 16)),
                             rtol=1e-6, atol=1e-6)
  final, _ = history[-1]
  assert np.all(np.isfinite(final["w"]))
  assert np.all(final["w"][0, 1:] != local["w"][0, 1:])  # Device 0 trains on.


@pytest.mark.slow
def test_the_round_is_skipped_everywhere_when_the_average_is_not_finite():
  """Each worker's outer gradient is finite, 3e38, but their sum overflows: every device
  keeps the global parameters, the outer state and the error feedback, and goes back to the
  global parameters, as torchft restores them when a sync does not commit."""
  average = qsgd_jax.qsgd(AXIS, bits=4, error_feedback=True, min_compressed_size=8)
  tx = diloco(optax.sgd(1.0), AXIS, sync_every=2, average=average)
  params = {"w": np.zeros((WORKERS, 16), np.float32)}
  grads = [{"w": np.full((WORKERS, 16), 3e38, np.float32)},
           {"w": np.zeros((WORKERS, 16), np.float32)}]
  history = _pmap_grads_run(tx, grads, params)
  (_, initial), (final, skipped) = history[0], history[2]
  assert np.all(np.asarray(skipped.skipped_workers) == 0)
  chex.assert_trees_all_equal(skipped.global_params, initial.global_params)
  chex.assert_trees_all_equal(skipped.fragments, initial.fragments)
  np.testing.assert_array_equal(final["w"], np.asarray(skipped.global_params["w"]))


def test_default_partition_strides_top_level_modules():
  blocks = {f"Block_{i}": {"kernel": np.zeros((2, 2), np.float32)} for i in range(12)}
  params = {"params": {**blocks, "Embed_0": {"embedding": np.zeros(3, np.float32)}}}
  tx = diloco(optax.sgd(0.1), None, sync_every=4, fragments=2,
              outer_optimizer=optax.sgd(0.7, momentum=0.9))
  state = tx.init(params)
  # Natural order Block_0, ..., Block_11, Embed_0: even ones to fragment 0, odd to 1.
  sizes = [[x.size for x in jax.tree.leaves(f.outer_state)] for f in state.fragments]
  assert sizes == [[4] * 6 + [3], [4] * 6]
  assert [x.shape for x in jax.tree.leaves(state.fragments[0].outer_state)][-1] == (3,)
  by_function = diloco(optax.sgd(0.1), None, sync_every=4, fragments=lambda p: {
      "params": {**{name: 0 for name in blocks}, "Embed_0": 1}})
  state = by_function.init(params)
  assert [len(jax.tree.leaves(f.outer_state)) for f in state.fragments] == [12, 1]


def test_default_partition_puts_other_modules_where_fewest_coordinates_are():
  zeros = lambda *shape: {"w": np.zeros(shape, np.float32)}  # noqa: E731
  params = {"params": {"block_0": zeros(10), "block_1": zeros(10), "block_2": zeros(10),
                       "embedding": zeros(25), "head": zeros(12), "norm": zeros(2),
                       "Dense_0": zeros(1)}}
  # Layers block_0 and block_2 to fragment 0, block_1 to 1 (20 and 10 coordinates); then
  # embedding (25) to 1, head (12) to 0, norm (2) to 0, Dense_0 (alone of its stem: not a
  # layer; 1) to 0: 35 and 35 coordinates, where striding every module gave 38 and 32.
  ids = dict(zip(sorted(params["params"]), jax.tree.leaves(
      jax.tree.unflatten(jax.tree.structure(params),
                         partition.strided(params, 2))), strict=True))
  assert ids == {"Dense_0": 0, "block_0": 0, "block_1": 1, "block_2": 0, "embedding": 1,
                 "head": 0, "norm": 0}
  # Modules of no coordinates still leave no fragment empty.
  empty = {"a": np.zeros(5, np.float32), "b": np.zeros(0, np.float32),
           "c": np.zeros(0, np.float32)}
  assert partition.strided(empty, 3) == (0, 1, 2)


@pytest.mark.parametrize("kwargs, message", [
    (dict(sync_every=0), "sync_every must be a positive int"),
    (dict(sync_every=4, fragments=2, delay=2), "delay=2 must be below the fragment interval"),
    (dict(sync_every=4, alpha=1.5), "alpha must be in"),
    (dict(sync_every=4, alpha=-0.1), "alpha must be in"),
    (dict(sync_every=4, fragments=0), "fragments must be a positive int"),
    (dict(sync_every=2, fragments=3), "cannot each sync once"),
])
def test_bad_arguments(kwargs, message):
  with pytest.raises(ValueError, match=message):
    diloco(optax.sgd(0.1), AXIS, **kwargs)


def test_bad_fragments_for_the_params():
  with pytest.raises(ValueError, match="fragments=5 but the params have 4 leaves"):
    diloco(optax.sgd(0.1), None, sync_every=8, fragments=5).init(example_params())
  with pytest.raises(ValueError, match=r"no leaf to fragment\(s\) \[1\]"):
    diloco(optax.sgd(0.1), None, sync_every=8, fragments=lambda p: jax.tree.map(
        lambda _: 2 * 0, p) | {"params": {"Block_0": 2, "Block_1": 0, "Embed_0": 0}}
           ).init(example_params())


def test_state_from_another_configuration_or_worker_count():
  params = example_params()
  two = diloco(optax.sgd(0.1), None, sync_every=4, fragments=2)
  one = diloco(optax.sgd(0.1), None, sync_every=4)
  # Each init compiled as one program, not operation by operation.
  with pytest.raises(ValueError, match="another configuration"):
    one.update(params, jax.jit(two.init)(params), params)
  state = jax.jit(one.init)(params)
  assert isinstance(state, DiLoCoState)
  grown = state._replace(inner_state=(optax.EmptyState(),))
  with pytest.raises(ValueError, match="another configuration"):
    one.update(params, grown, params)
  average = qsgd_jax.qsgd(AXIS, error_feedback=True, min_compressed_size=8)
  tx = diloco(optax.adam(0.1), AXIS, sync_every=4, average=average)
  state = jax.jit(jax.vmap(tx.init, axis_name=AXIS))(stack(params, 2))
  doubled = state._replace(inner_state=jax.tree.map(
      lambda x: jnp.concatenate([x, x], axis=1), state.inner_state))
  with pytest.raises(ValueError, match=r"state leaf .*inner_state.* number of workers"):
    jax.vmap(tx.update, axis_name=AXIS)(stack(params, 2), doubled, stack(params, 2))


def test_replicated_params_under_shard_map_raise():
  mesh = jax.make_mesh((WORKERS,), (AXIS,))
  tx = diloco(optax.sgd(0.1), AXIS, sync_every=4)
  specs = qsgd_jax.state_partition_specs(jax.eval_shape(tx.init, example_params()), AXIS)
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
  state = init(example_params())

  def step(params, state):
    updates, state = tx.update(params, state, params)
    return optax.apply_updates(params, updates), state

  run = jax.shard_map(step, mesh=mesh, in_specs=(P(), specs), out_specs=(P(), specs))
  with pytest.raises(ValueError, match=r"replicated over axis 'workers'.*in_specs=P\('workers'\)"):
    jax.jit(run)(example_params(), state)


@pytest.mark.slow
def test_data_parallel_keeps_a_model_a_device_and_matches_shard_map():
  # data_parallel lays the params out by itself: one copy in, a copy a device out (stacked
  # along the workers' axis), the same steps as the hand-laid shard_map run, bit for bit.
  mesh = jax.make_mesh((WORKERS,), (AXIS,))
  tx = diloco(optax.adam(0.1), AXIS, sync_every=2)
  treedef = jax.tree.structure(example_params())

  def loss_fn(params, target):  # Its gradient is params - target, as _step's.
    return sum(0.5 * jnp.sum((x - c[0]) ** 2)
               for x, c in zip(jax.tree.leaves(params), jax.tree.leaves(target), strict=True))

  init, step, abstract_state = qsgd_jax.data_parallel(loss_fn, tx, mesh)
  targets = example_targets(5)
  expected = _run_shard_map(tx, targets, 5)
  params, state = example_params(), init(example_params())
  for t, (want_params, want_state) in enumerate(expected):
    params, state, _ = step(params, state, jax.tree.unflatten(treedef, targets[t]))
    chex.assert_trees_all_equal(params, want_params)
    chex.assert_trees_all_equal(state, want_state)
  # Each step's program chosen on the host: step passes its static events to diloco, whose
  # step between syncs then holds none of the schedule's conditionals.
  def conditionals(**events):
    traced = step.trace(params, state, jax.tree.unflatten(treedef, targets[0]), **events)
    return sum(1 for jaxpr in _jaxprs(traced.jaxpr.jaxpr) for eqn in jaxpr.eqns
               if eqn.primitive.name == "cond")

  assert conditionals(events=qsgd_jax.diloco_events(0, sync_every=2)) < conditionals()
  assert all(leaf.sharding.is_equivalent_to(NamedSharding(mesh, P(AXIS)), leaf.ndim)
             for leaf in jax.tree.leaves(params))
  assert all(jax.tree.leaves(jax.tree.map(
      lambda want, got: want.sharding.is_equivalent_to(got.sharding, got.ndim),
      abstract_state(example_params()), state)))
  # Between syncs the copies differ; at a sync every device takes the global parameters (to
  # float32 rounding: the update is global - local, added to local).
  kernel = np.asarray(params["params"]["Block_0"]["kernel"])
  assert not np.allclose(kernel[0], kernel[1])
  params, state, _ = step(params, state, jax.tree.unflatten(treedef, targets[0]))
  np.testing.assert_allclose(np.asarray(params["params"]["Block_0"]["kernel"]),
                             stack(np.asarray(state.global_params["params"]["Block_0"]
                                               ["kernel"])), rtol=1e-6, atol=1e-7)

  with pytest.raises(ValueError, match=r"params leaf \['params'\]\['Block_0'\]\['kernel'\] has "
                                       r"shape \(2, 4, 3\).*one copy.*\(8, 4, 3\)"):
    step(jax.tree.map(lambda x: np.asarray(x)[:2], params), state,
         jax.tree.unflatten(treedef, targets[0]))
  with pytest.raises(ValueError, match="is not the one qsgd_jax.diloco keeps global parameters of"):
    step({"other": params}, state, jax.tree.unflatten(treedef, targets[0]))


def test_average_over_another_axis_raises():
  average = qsgd_jax.compressed_allreduce(qsgd_jax.Identity(), "other", min_compressed_size=1)
  tx = diloco(optax.sgd(0.1), AXIS, sync_every=1, average=average)
  with pytest.raises(ValueError, match="average returned an outer gradient that still differs"):
    step_with_params_per_device(tx, jax.make_mesh((4, 2), (AXIS, "other")))


def test_partition_specs_and_resize():
  average = qsgd_jax.qsgd(AXIS, error_feedback=True, min_compressed_size=8)
  tx = diloco(optax.adam(0.1), AXIS, sync_every=4, fragments=2, delay=1, average=average)
  shapes = jax.eval_shape(tx.init, example_params())
  specs = qsgd_jax.state_partition_specs(shapes, AXIS)
  assert specs.count == P() and set(jax.tree.leaves(specs.global_params)) == {P()}
  assert set(jax.tree.leaves([f.outer_state for f in specs.fragments])) == {P()}
  assert set(jax.tree.leaves(specs.inner_state)) == {P(AXIS)}
  assert set(jax.tree.leaves([f.outer_gradient for f in specs.fragments])) == {P(AXIS)}
  assert set(jax.tree.leaves([f.averaged_gradient for f in specs.fragments])) == {P()}
  average_state = specs.fragments[0].average_state
  assert average_state.local_error == (P(AXIS),) and average_state.key == P()

  def init_on(n):
    return jax.vmap(tx.init, axis_name=AXIS)(stack(example_params(), n))

  saved = jax.jit(init_on, static_argnums=0)(8)  # One program, not operation by operation.
  saved = saved._replace(inner_state=jax.tree.map(
      lambda x: x + jnp.arange(8).reshape(8, *[1] * (x.ndim - 1)).astype(x.dtype),
      saved.inner_state))
  resized = qsgd_jax.resize_state(saved, jax.eval_shape(lambda: init_on(4)), from_devices=8,
                                  to_devices=4, stacked=True)
  mu = jax.tree.leaves(resized.inner_state)[1]
  np.testing.assert_array_equal(mu, np.zeros_like(mu))  # Worker 0's (it added 0).
  chex.assert_trees_all_equal(jax.tree.map(lambda x: x[:4], saved.global_params),
                              resized.global_params)


def _inner_jaxprs(params):
  """The jaxprs an equation's ``params`` hold (a ``jit``'s, a ``shard_map``'s, a ``cond``'s
  branches)."""
  for value in params.values():
    for x in value if isinstance(value, tuple | list) else (value,):
      if isinstance(x, jax.extend.core.ClosedJaxpr):
        yield x.jaxpr
      elif isinstance(x, jax.extend.core.Jaxpr):
        yield x


def _conds_holding_a_collective(jaxpr):
  """For each ``cond`` of ``jaxpr`` with a ``psum`` in a branch: the indices of the invars it
  depends on, through every equation before it."""

  def holds(jaxpr):
    return any(e.primitive.name == "psum" or any(holds(j) for j in _inner_jaxprs(e.params))
               for e in jaxpr.eqns)

  depends = {v: {i} for i, v in enumerate(jaxpr.invars)}
  found = []
  for eqn in jaxpr.eqns:
    on = set().union(*(depends.get(v, set()) for v in eqn.invars
                       if isinstance(v, jax.extend.core.Var)))
    depends.update({v: on for v in eqn.outvars})
    if eqn.primitive.name == "cond" and holds(eqn.params["branches"][1].jaxpr):
      found.append(on)
  return found


def test_a_delayed_exchange_waits_for_nothing_the_step_computes():
  # With delay >= 1 the exchange sends the outer gradient held in the state: under jit it
  # depends on neither the gradients nor the params, so XLA may run it during the forward and
  # backward passes (benchmarks/network_diloco.py measures whether it does).
  params = example_params()
  tx = diloco(optax.adam(0.1), AXIS, sync_every=4, fragments=2, delay=1)
  state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(tx.init, params))
  grads = jax.tree.map(jnp.ones_like, params)
  jaxpr = jax.make_jaxpr(tx.update, axis_env=[(AXIS, WORKERS)])(grads, state, params).jaxpr
  num_grads, num_state = len(jax.tree.leaves(grads)), len(jax.tree.leaves(state))
  exchanges = _conds_holding_a_collective(jaxpr)
  assert len(exchanges) == 2  # One a fragment.
  for inputs in exchanges:
    assert min(inputs) >= num_grads and max(inputs) < num_grads + num_state


@pytest.mark.slow
@pytest.mark.usefixtures("full_optimizations")
def test_events_decided_on_the_host_give_the_same_bits():
  # AdamW inside and Nesterov outside, the exchange and the merge one step after the sync:
  # each step's own program gives what the one program of conditionals does, as XLA optimizes
  # both for users. Each fragment's second merge is where the outer momentum first adds to
  # the averaged gradient, a sum XLA could fuse with the average's last product (rounding the
  # two once) in one program and not in the other.
  sync_every, steps, delay = 4, 7, 1
  tx = diloco(optax.adamw(0.05), AXIS, sync_every=sync_every, delay=delay,
              fragments=lambda params: jax.tree.unflatten(jax.tree.structure(params),
                                                          TWO_FRAGMENTS))
  targets = example_targets(steps)
  in_program = _run_shard_map(tx, targets, steps)
  on_host = _run_shard_map(tx, targets, steps, lambda count: qsgd_jax.diloco_events(
      count, sync_every=sync_every, fragments=2, delay=delay))
  chex.assert_trees_all_equal(on_host, in_program)


def _jaxprs(jaxpr):
  """``jaxpr`` and every jaxpr inside it."""
  yield jaxpr
  for eqn in jaxpr.eqns:
    for inner in _inner_jaxprs(eqn.params):
      yield from _jaxprs(inner)


def _collectives(jaxpr, inside_cond=False):
  """The (primitive, whether under a ``cond``) of each collective of ``jaxpr``."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("psum", "all_gather", "all_to_all", "ppermute"):
      yield eqn.primitive.name, inside_cond
    for inner in _inner_jaxprs(eqn.params):
      yield from _collectives(inner, inside_cond or eqn.primitive.name == "cond")


def test_events_put_an_exchange_at_the_top_level_and_nothing_between_syncs():
  params = example_params()
  tx = diloco(optax.adam(0.1), AXIS, sync_every=4, fragments=2, delay=1,
              average=qsgd_jax.qsgd(AXIS, bits=4, error_feedback=True, min_compressed_size=1))
  state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(tx.init, params))
  grads = jax.tree.map(jnp.ones_like, params)

  def collectives(count):
    events = qsgd_jax.diloco_events(count, sync_every=4, fragments=2, delay=1)
    update = functools.partial(tx.update, events=events)
    return list(_collectives(
        jax.make_jaxpr(update, axis_env=[(AXIS, WORKERS)])(grads, state, params).jaxpr))

  assert collectives(0) == collectives(1) == []  # Before the first exchange; a sync step.
  sent = collectives(2)  # Fragment 0's exchange.
  assert sent and not any(under_cond for _, under_cond in sent)
  in_program = jax.make_jaxpr(tx.update, axis_env=[(AXIS, WORKERS)])(grads, state, params)
  assert all(under_cond for _, under_cond in _collectives(in_program.jaxpr))


def test_events_of_another_schedule_raise():
  params = example_params()
  tx = diloco(optax.sgd(0.1), AXIS, sync_every=4, fragments=2, delay=1)
  state = jax.eval_shape(tx.init, params)
  update = lambda events: jax.eval_shape(  # noqa: E731
      functools.partial(tx.update, events=events), params, state, params)
  with pytest.raises(ValueError, match=r"delay=0, but this transformation has sync_every=4, "
                     r"2 fragments, delay=1"):
    update(qsgd_jax.diloco_events(0, sync_every=4, fragments=2))
  with pytest.raises(TypeError, match="DiLoCoEvents"):
    update((0,))
  with pytest.raises(TypeError, match="pass them to jax.jit as a static argument"):
    jax.jit(lambda events: update(events))(qsgd_jax.diloco_events(0, sync_every=4, fragments=2,
                                                                  delay=1))
  with pytest.raises(ValueError, match="count must be at least 0"):
    qsgd_jax.diloco_events(-1, sync_every=4)
  with pytest.raises(TypeError, match="count must be an int"):
    qsgd_jax.diloco_events(1.0, sync_every=4)
  with pytest.raises(ValueError, match="delay=2 must be below the fragment interval"):
    qsgd_jax.diloco_events(0, sync_every=4, fragments=2, delay=2)


@pytest.mark.parametrize("delay", [0, 1])
def test_a_step_that_does_not_sync_leaves_the_whole_model_alone(delay):
  # The outer gradient (global - local) is computed inside the branch of a fragment that
  # syncs, and a non-finite inner step is skipped by a conditional: outside every conditional,
  # nothing of a parameter's shape is added, subtracted or selected (the inner SGD only
  # multiplies), but for the check that params + update stay finite, whose sum goes only
  # into a scalar reduction (XLA fuses it there: nothing of the model's size is written).
  params = example_params()
  tx = diloco(optax.sgd(0.1), AXIS, sync_every=4, fragments=2, delay=delay)
  state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(tx.init, params))
  grads = jax.tree.map(jnp.ones_like, params)
  jaxpr = jax.make_jaxpr(tx.update, axis_env=[(AXIS, WORKERS)])(grads, state, params).jaxpr
  shapes = {np.shape(leaf) for leaf in jax.tree.leaves(params)}

  def outside_conds(jaxpr):  # Into jit's jaxprs (jnp.where is one), not into a cond's.
    for eqn in jaxpr.eqns:
      if eqn.primitive.name != "cond":
        yield jaxpr, eqn
        for inner in _inner_jaxprs(eqn.params):
          yield from outside_conds(inner)

  def consumers(jaxpr, var):
    return [e for e in jaxpr.eqns if any(v is var for v in e.invars)]

  def only_checked(jaxpr, eqn):  # add -> mul by zero -> a scalar reduce_sum, nothing else.
    uses = consumers(jaxpr, eqn.outvars[0])
    return eqn.primitive.name == "add" and uses and all(
        use.primitive.name == "mul" and all(
            last.primitive.name == "reduce_sum" and last.outvars[0].aval.shape == ()
            for last in consumers(jaxpr, use.outvars[0])) for use in uses)

  whole_model = [eqn.primitive.name for jaxpr, eqn in outside_conds(jaxpr)
                 if eqn.primitive.name in ("add", "sub", "select_n")
                 and any(tuple(v.aval.shape) in shapes for v in eqn.outvars)
                 and not only_checked(jaxpr, eqn)]
  assert not whole_model
