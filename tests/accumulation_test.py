"""Tests of accumulate_gradients: the mean of k mini-steps' gradients, sent once.

Compiling for eight simulated devices is the slow part: each run of the
optimizers below is made once (``functools.cache``) and shared by the tests.
"""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import apply_step, assert_replicas_identical, host_arrays
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qsgd_jax
from qsgd_jax import AccumulationState, accumulate_gradients

AXIS = "batch"
NUM_DEVICES = 8
EVERY_K_STEPS = 4
MINI_STEPS = 2 * EVERY_K_STEPS

# "w" (8192 elements) is sent compressed, "b" (128) in float32.
_PARAMS = {"w": jnp.zeros((64, 128)), "b": jnp.zeros((128,))}
_PMAP_SHARDING = NamedSharding(
    jax.sharding.Mesh(np.array(jax.devices()[:NUM_DEVICES]), (AXIS,)), P(AXIS))


def _batch(step):
  """Mini-step ``step``'s inputs and targets, ``[devices, 16, ...]``: different on every device."""
  inputs_key, targets_key = jax.random.split(jax.random.key(step))
  return (jax.random.normal(inputs_key, (NUM_DEVICES, 16, 64)),
          jax.random.normal(targets_key, (NUM_DEVICES, 16, 128)))


def _loss(params, x, y):
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def _counted(transform, runs):
  """``transform``, appending to ``runs`` each time (and on each device) its update runs."""

  def update_fn(updates, state, params=None, **extra_args):
    jax.debug.callback(lambda: runs.append(1))
    return transform.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(transform.init, update_fn)


def _optimizer(wrapper, runs):
  """``wrapper`` around QSGD's all-reduce, counted, then SGD."""
  inner = optax.chain(
      _counted(qsgd_jax.qsgd(AXIS, error_feedback="worker", track_elias=False), runs),
      optax.sgd(0.1))
  if wrapper == "accumulate_gradients":
    return accumulate_gradients(inner, EVERY_K_STEPS)
  return optax.MultiSteps(inner, every_k_schedule=EVERY_K_STEPS)


def _allreduce_state(wrapper, state):
  return state.inner_state[0] if wrapper == "accumulate_gradients" else state.inner_opt_state[0]


@functools.cache
def _pmap_run(wrapper):
  """``MINI_STEPS`` pmapped steps of ``_optimizer(wrapper)``.

  Returns the params, the state, the updates of each mini-step (device 0),
  the all-reduce's count after each mini-step (device 0), how many times the
  all-reduce ran over all devices, and the compiled step's HLO.
  """
  runs = []
  tx = _optimizer(wrapper, runs)

  def step(params, state, x, y):
    updates, state = tx.update(jax.grad(_loss)(params, x, y), state, params)
    return optax.apply_updates(params, updates), state, updates

  stack = lambda x: jnp.broadcast_to(x, (NUM_DEVICES, *x.shape))  # noqa: E731
  params = jax.device_put(jax.tree.map(stack, _PARAMS), _PMAP_SHARDING)
  state = jax.pmap(tx.init, axis_name=AXIS)(params)
  batches = [jax.device_put(_batch(mini_step), _PMAP_SHARDING) for mini_step in range(MINI_STEPS)]
  # Compiled once, run and read from the same executable.
  step = jax.pmap(step, axis_name=AXIS).lower(params, state, *batches[0]).compile()
  all_updates, counts = [], []
  for batch in batches:
    # Each step waits for the last: eight simulated devices share few cores.
    params, state, updates = jax.block_until_ready(step(params, state, *batch))
    all_updates.append(host_arrays(jax.tree.map(lambda x: x[0], updates)))
    counts.append(int(_allreduce_state(wrapper, state).count[0]))
  jax.effects_barrier()
  return params, state, all_updates, counts, len(runs), step.as_text()


@pytest.mark.slow
def test_pmap_matches_multi_steps():
  params, state, updates, _, _, _ = _pmap_run("accumulate_gradients")
  multi_params, multi_state, multi_updates, _, _, _ = _pmap_run("multi_steps")
  # The same running mean, and the same key when the all-reduce runs: the same bits.
  chex.assert_trees_all_equal(updates, multi_updates)
  chex.assert_trees_all_equal(
      host_arrays(state.inner_state), host_arrays(multi_state.inner_opt_state))
  for mini_step, mini_step_updates in enumerate(updates):
    applied = (mini_step + 1) % EVERY_K_STEPS == 0
    assert all(leaf.any() == applied for leaf in jax.tree.leaves(mini_step_updates))
  # The params are the float32 sums of those updates. MultiSteps' agree only to
  # rounding (a few ulps of values near 1e-4): XLA fuses its last multiply of
  # the update with the add to the params into one fused multiply-add, while
  # here the update comes out of the conditional already rounded.
  summed = functools.reduce(lambda a, b: jax.tree.map(np.add, a, b), updates)
  chex.assert_trees_all_equal(host_arrays(jax.tree.map(lambda x: x[0], params)), summed)
  chex.assert_trees_all_close(host_arrays(params), host_arrays(multi_params), rtol=0, atol=1e-10)
  assert_replicas_identical(params)
  assert (np.asarray(state.mini_step) == 0).all()
  for mean in state.accumulated:
    assert not np.asarray(mean).any()


@pytest.mark.slow
def test_communicates_only_on_every_kth_mini_step():
  _, _, _, counts, runs, _ = _pmap_run("accumulate_gradients")
  _, _, _, multi_counts, multi_runs, _ = _pmap_run("multi_steps")
  assert counts == multi_counts == [0, 0, 0, 1, 1, 1, 1, 2]
  # The all-reduce ran on mini-steps 4 and 8, on every device; MultiSteps ran it on all 8.
  assert runs == 2 * NUM_DEVICES
  assert multi_runs == MINI_STEPS * NUM_DEVICES


_COMPUTATION = re.compile(r"^(?:ENTRY )?%(?P<name>[\w.\-]+) .*\{$")
_CALLS = re.compile(
    r"\b(?:to_apply|calls|body|condition|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")


def _computations(hlo_text):
  """``{name: (is_entry, instruction lines)}`` of an HLO module's computations."""
  computations, lines = {}, None
  for line in hlo_text.splitlines():
    if match := _COMPUTATION.match(line):
      lines = []
      computations[match.group("name")] = (line.startswith("ENTRY"), lines)
    elif line == "}":
      lines = None
    elif lines is not None:
      lines.append(line)
  return computations


def _branch_computations(computations):
  """Names of the computations that run only inside a ``conditional``'s branch."""
  pending = [name.strip().lstrip("%")
             for _, lines in computations.values() for line in lines if " conditional(" in line
             for name in _BRANCHES.search(line).group(1).split(",")]
  found = set()
  while pending:
    name = pending.pop()
    if name not in found:
      found.add(name)
      pending.extend(_CALLS.findall("\n".join(computations[name][1])))
  return found


def test_compiled_collectives_run_only_inside_the_conditional():
  hlo_text = _pmap_run("accumulate_gradients")[-1]
  computations = _computations(hlo_text)
  with_collectives = {
      name: {c.kind for c in qsgd_jax.collectives_in_hlo("\n".join(lines))}
      for name, (_, lines) in computations.items()}
  with_collectives = {name: kinds for name, kinds in with_collectives.items() if kinds}
  assert {"all-to-all", "all-gather", "all-reduce"} <= set().union(*with_collectives.values())
  assert set(with_collectives) <= _branch_computations(computations)
  (entry,) = [lines for is_entry, lines in computations.values() if is_entry]
  assert not qsgd_jax.collectives_in_hlo("\n".join(entry))
  # The check tells the two apart: MultiSteps runs the collectives unconditionally.
  multi_steps = _computations(_pmap_run("multi_steps")[-1])
  (multi_entry,) = [lines for is_entry, lines in multi_steps.values() if is_entry]
  assert qsgd_jax.collectives_in_hlo("\n".join(multi_entry))


@pytest.mark.slow
def test_shard_map_matches_pmap():
  tx = _optimizer("accumulate_gradients", [])
  mesh = jax.make_mesh((NUM_DEVICES,), (AXIS,))
  specs = qsgd_jax.state_partition_specs(jax.eval_shape(tx.init, _PARAMS), AXIS)
  assert specs.mini_step == P() and specs.accumulated == (P(AXIS), P(AXIS))
  # The all-reduce's state inside is found and laid out as on its own.
  assert specs.inner_state[0].local_error == (P(AXIS),)  # "w"; "b" goes in float32.
  assert specs.inner_state[0].key == specs.inner_state[0].count == P()
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

  def step(params, state, x, y):
    # The gradient of replicated params is already summed over the axis by autodiff.
    local = jax.tree.map(lambda p: jax.lax.pcast(p, AXIS, to="varying"), params)
    params, state = apply_step(tx, params, state, jax.grad(_loss)(local, x[0], y[0]))
    copies = jax.tree.map(lambda p: jax.lax.pcast(p, AXIS, to="varying")[None], params)
    return params, state, copies

  step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P(AXIS), P(AXIS)),
                               out_specs=(P(), specs, P(AXIS))))
  params = jax.device_put(_PARAMS, NamedSharding(mesh, P()))
  state = init(params)
  for mini_step in range(MINI_STEPS):
    batch = jax.device_put(_batch(mini_step), NamedSharding(mesh, P(AXIS)))
    params, state, copies = jax.block_until_ready(step(params, state, *batch))
    assert_replicas_identical(copies)
    if mini_step == EVERY_K_STEPS - 2:
      # Each device's own running mean, laid out along the axis.
      means = np.asarray(state.accumulated[0]).reshape(NUM_DEVICES, -1)
      assert not np.array_equal(means[0], means[1])

  pmap_params, pmap_state, *_ = _pmap_run("accumulate_gradients")
  chex.assert_trees_all_equal(
      host_arrays(params), host_arrays(jax.tree.map(lambda x: x[0], pmap_params)))
  chex.assert_trees_all_equal(
      host_arrays(state.inner_state[0].local_error),
      host_arrays(tuple(e.reshape(-1) for e in pmap_state.inner_state[0].local_error)))


def test_compression_stats_are_found_inside():
  tx = _optimizer("accumulate_gradients", [])
  state = jax.eval_shape(tx.init, _PARAMS)
  assert isinstance(state, AccumulationState)
  assert isinstance(qsgd_jax.compression_stats(state), qsgd_jax.CompressionStats)


def test_params_and_extra_args_reach_inner():
  def update_fn(updates, state, params=None, *, scale):
    return jax.tree.map(lambda u, p: scale * u + p, updates, params), state

  tx = accumulate_gradients(
      optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn), 2)
  update = jax.jit(tx.update)
  params, state = jnp.full(3, 10.0), tx.init(jnp.zeros(3))
  updates, state = update(jnp.full(3, 1.0), state, params, scale=2.0)
  np.testing.assert_array_equal(updates, np.zeros(3))
  updates, state = update(jnp.full(3, 3.0), state, params, scale=2.0)
  np.testing.assert_array_equal(updates, np.full(3, 2.0 * 2.0 + 10.0))


def test_float0_gradients_pass_through():
  # jax.grad(allow_int=True) gives float0 for an integer input, as optax.apply_updates skips.
  params = {"w": jnp.ones(3), "n": jnp.int32(2)}
  grads = jax.grad(lambda p: jnp.sum(p["w"] * p["n"]), allow_int=True)(params)
  tx = accumulate_gradients(optax.identity(), 2)
  update = jax.jit(tx.update)
  state = tx.init(params)
  for expected in (0.0, 2.0):
    updates, state = update(grads, state, params)
    assert updates["n"].dtype == jax.dtypes.float0 and updates["n"].shape == ()
    np.testing.assert_array_equal(updates["w"], np.full(3, expected))
  np.testing.assert_array_equal(state.accumulated[0], np.zeros(1))  # "n"'s slot: untouched.


@pytest.mark.parametrize("every_k_steps", [0, -1, 2.0, True, "4", None])
def test_bad_every_k_steps_is_a_value_error(every_k_steps):
  with pytest.raises(ValueError, match="every_k_steps"):
    accumulate_gradients(optax.sgd(0.1), every_k_steps)
