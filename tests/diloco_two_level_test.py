"""Tests of DiLoCo on a two-level mesh: two workers ("outer") of four devices ("inner"), the
inner optimizer averaging over a worker's devices; by hand under jax.shard_map and through
qsgd_jax.data_parallel, the exchange whole or split over a worker's devices."""

import functools

import chex
import diloco_reference as reference
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from diloco_helpers import (
    TWO_FRAGMENTS,
    example_params,
    example_targets,
    reference_grad,
    stack,
    step_with_params_per_device,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qsgd_jax
from qsgd_jax import diloco

BOTH = ("outer", "inner")


def _two_level_inner():
  """SGD on the gradients averaged over a worker's four devices (the "inner" axis)."""
  return optax.chain(
      qsgd_jax.compressed_allreduce(qsgd_jax.Identity(), "inner", min_compressed_size=1),
      optax.sgd(0.1))


def _loss(params, target):
  """Half the squared distance to this device's target (a ``[1, ...]`` slice a leaf): its
  gradient is ``params - target``."""
  return sum(jnp.sum((x - c[0]) ** 2) / 2 for x, c in zip(
      jax.tree.leaves(params), jax.tree.leaves(target), strict=True))


def _run_two_level(tx, targets, steps, state_axes=BOTH, split_axis=None, initial=None):
  """Params and state after each of ``steps`` on two workers of four devices, by hand under
  ``jax.shard_map``: the params along "outer" (``initial``, by default the example's), the
  state laid out by ``state_partition_specs(state, state_axes, split_axis=split_axis)``."""
  initial = example_params() if initial is None else initial
  mesh = jax.make_mesh((2, 4), BOTH)
  with jax.set_mesh(mesh):  # Binds split_axis's size for init under jax.eval_shape.
    specs = qsgd_jax.state_partition_specs(jax.eval_shape(tx.init, initial), state_axes,
                                           split_axis=split_axis)
  own = lambda tree: jax.tree.map(lambda x: x[0], tree)  # noqa: E731

  def step(params, state, target):
    params = own(params)
    grads = jax.grad(_loss)(qsgd_jax.as_varying(params, "inner"), target)
    updates, state = tx.update(grads, state, params)
    return jax.tree.map(lambda x: x[None], optax.apply_updates(params, updates)), state

  init = jax.jit(jax.shard_map(lambda p: tx.init(own(p)), mesh=mesh, in_specs=P("outer"),
                               out_specs=specs))
  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("outer"), specs, P(BOTH)),
                              out_specs=(P("outer"), specs)))
  treedef = jax.tree.structure(initial)
  params = jax.device_put(stack(initial, 2), NamedSharding(mesh, P("outer")))
  state = init(params)
  history = []
  for t in range(steps):
    target = jax.device_put(jax.tree.unflatten(treedef, targets[t]), NamedSharding(mesh, P(BOTH)))
    params, state = jax.block_until_ready(run(params, state, target))
    history.append((params, state))
  return history


def _run_data_parallel(tx, targets, steps):
  """The same steps through ``qsgd_jax.data_parallel`` over both axes, from a copy of the
  params a worker (as its step returns them: one program compiled)."""
  mesh = jax.make_mesh((2, 4), BOTH)
  init, step, _ = qsgd_jax.data_parallel(_loss, tx, mesh, BOTH)
  treedef = jax.tree.structure(example_params())
  params, state = stack(example_params(), 2), init(example_params())
  history = []
  for t in range(steps):
    params, state, loss = step(params, state, jax.tree.unflatten(treedef, targets[t]))
    jax.block_until_ready(loss)
    history.append((params, state))
  return history


def _worker_targets(targets):
  """Worker m's target: the mean over its four devices' (devices 4m..4m+3)."""
  return [[c.reshape(2, 4, *c.shape[1:]).mean(axis=1) for c in step_targets]
          for step_targets in targets]


@pytest.mark.parametrize("delay, fragment_of, layout", [
    (0, (0, 0, 0, 0), dict(state_axes=BOTH)),
    # Streaming's outer gradient waits in the state between its take and its exchange: a
    # worker's, along "outer".
    (1, TWO_FRAGMENTS, dict(state_axes="outer", split_axis="inner")),
])
def test_two_level_mesh_matches_reference(delay, fragment_of, layout):
  """Two workers of four devices: the inner chain averages over "inner", DiLoCo over
  "outer"."""
  sync_every, steps = (2, 5) if not delay else (4, 10)
  tx = diloco(_two_level_inner(), "outer", sync_every=sync_every, delay=delay,
              fragments=max(fragment_of) + 1, outer_optimizer=optax.sgd(0.7, momentum=0.9))
  targets = example_targets(steps)
  params, state = _run_two_level(tx, targets, steps, **layout)[-1]
  local, global_ = reference.streaming_diloco(
      jax.tree.leaves(example_params()), reference_grad(_worker_targets(targets)), workers=2,
      steps=steps, sync_every=sync_every, fragment_of=fragment_of, inner=reference.SGD(0.1),
      outer=reference.SGD(0.7, momentum=0.9), delay=delay)
  for leaf, want in zip(jax.tree.leaves(state.global_params), global_[-1], strict=True):
    np.testing.assert_allclose(np.asarray(leaf), want, rtol=2e-5, atol=2e-5)
  for leaf, want in zip(jax.tree.leaves(params), zip(*local[-1], strict=True), strict=True):
    np.testing.assert_allclose(np.asarray(leaf), np.stack(want), rtol=2e-5, atol=2e-5)


def _bfloat16(axis_name):
  """A bfloat16 average over ``axis_name``, each device keeping its rounding's residual."""
  return qsgd_jax.compressed_allreduce(qsgd_jax.Cast(jnp.bfloat16), axis_name,
                                       error_feedback=True, min_compressed_size=1)


def _runs(tx, steps):
  """``(by hand, through data_parallel)``: the histories of ``tx``'s steps."""
  targets = example_targets(steps)
  return (_run_two_level(tx, targets, steps, "outer", split_axis="inner"),
          _run_data_parallel(tx, targets, steps))


_STREAMING_STEPS = 7  # Two rounds and the second's merge.


@functools.cache
def _split_tx():
  """Adam on a worker's float32 average, the outer gradients exchanged a step after the sync,
  split over the worker's devices."""
  inner = optax.chain(
      qsgd_jax.compressed_allreduce(qsgd_jax.Identity(), "inner", min_compressed_size=1),
      optax.adam(0.05))
  return diloco(inner, "outer", sync_every=3, delay=1, split_axis="inner",
                outer_optimizer=optax.sgd(0.7, momentum=0.9))


@pytest.fixture(scope="module")
def split_by_hand():
  """The history of ``_split_tx``'s steps by hand (the first of ``_runs``), alone: the tests
  that read no other run compile no ``data_parallel`` program."""
  return _run_two_level(_split_tx(), example_targets(_STREAMING_STEPS), _STREAMING_STEPS,
                        "outer", split_axis="inner")


@pytest.fixture(scope="module")
def split_runs(split_by_hand):
  """``_runs`` of ``_split_tx``."""
  return split_by_hand, _run_data_parallel(_split_tx(), example_targets(_STREAMING_STEPS),
                                           _STREAMING_STEPS)


@pytest.fixture(scope="module")
def residual_runs():
  """Adam on a worker's bfloat16 average, each device keeping its own residual."""
  inner = optax.chain(_bfloat16("inner"), optax.adam(0.05))
  return _runs(diloco(inner, "outer", sync_every=2), 4)


@pytest.mark.slow
@pytest.mark.parametrize("runs", ["split_runs", "residual_runs"])
def test_two_level_data_parallel_is_the_hand_written_step_bit_for_bit(runs, request):
  by_hand, through_data_parallel = request.getfixturevalue(runs)
  mesh = jax.make_mesh((2, 4), BOTH)
  for (want_params, want_state), (params, state) in zip(by_hand, through_data_parallel,
                                                         strict=True):
    chex.assert_trees_all_equal(params, want_params)  # A copy a worker: [2, ...] a leaf.
    chex.assert_trees_all_equal(state, want_state)
  assert all(leaf.sharding.is_equivalent_to(NamedSharding(mesh, P("outer")), leaf.ndim)
             for leaf in jax.tree.leaves(params))


@pytest.mark.slow
def test_split_streaming_matches_reference(split_by_hand):
  params, state = split_by_hand[-1]
  local, global_ = reference.streaming_diloco(
      jax.tree.leaves(example_params()),
      reference_grad(_worker_targets(example_targets(_STREAMING_STEPS))), workers=2,
      steps=_STREAMING_STEPS, sync_every=3, fragment_of=(0, 0, 0, 0),
      inner=reference.Adam(0.05), outer=reference.SGD(0.7, momentum=0.9), delay=1)
  for leaf, want in zip(jax.tree.leaves(state.global_params), global_[-1], strict=True):
    np.testing.assert_allclose(np.asarray(leaf), want, rtol=2e-5, atol=2e-5)
  for leaf, want in zip(jax.tree.leaves(params), zip(*local[-1], strict=True), strict=True):
    np.testing.assert_allclose(np.asarray(leaf), np.stack(want), rtol=2e-5, atol=2e-5)


@pytest.mark.slow
def test_inner_residuals_are_each_devices_own(residual_runs):
  """The inner average's residuals lie along both axes, a row a device, and differ between a
  worker's devices; the worker's Adam moments lie along "outer", one a worker."""
  _, state = residual_runs[0][-1]
  rows = np.asarray(state.inner_state[0].local_error[0]).reshape(8, -1)
  assert np.all(np.isfinite(rows)) and len({row.tobytes() for row in rows[:4]}) == 4
  mu = jax.tree.leaves(state.inner_state[1][0].mu)[0]
  assert mu.shape[0] == 2
  assert np.all(np.isfinite(np.asarray(jax.tree.leaves(state.global_params)[0])))


def test_run_stats_count_data_parallel_on_every_device(split_by_hand):
  """A DiLoCo run's bytes against synchronous data parallel over all 8 devices: a float32
  all-reduce of the gradients every step (and across the outer axis, run hierarchically,
  that over the 4 devices of a worker), with no NaN from the steps that sent nothing."""
  by_hand = split_by_hand
  run = None
  for _, state in by_hand:
    run = qsgd_jax.accumulate_stats(run, state)
  elements = sum(np.size(x) for x in jax.tree.leaves(example_params()))
  steps = _STREAMING_STEPS
  assert float(run.float32_bits) == steps * 2 * 7 / 8 * 32 * elements
  assert float(run.outer_float32_bits) == steps * 2 * 1 / 2 * 32 * elements / 4
  sent = sum(float(state.stats.wire_bits) for _, state in by_hand)
  assert float(run.wire_bits) == sent > 0
  assert float(run.compression_ratio) == float(run.float32_bits) / sent
  outer = sum(float(state.stats.outer_wire_bits) for _, state in by_hand)
  assert float(run.outer_compression_ratio) == float(run.outer_float32_bits) / outer


@pytest.mark.slow
def test_split_exchange_draws_its_own_randomness_on_each_device():
  """Every quarter of the outer gradient is the same: the four devices of a worker quantize
  equal parts, and with draws of their own round them differently."""
  tx = diloco(optax.chain(
      qsgd_jax.compressed_allreduce(qsgd_jax.Identity(), "inner", min_compressed_size=1),
      optax.sgd(1.0)), "outer", sync_every=1, outer_optimizer=optax.sgd(1.0),
      average=qsgd_jax.qsgd("outer", bits=2, min_compressed_size=1), split_axis="inner")
  quarter = np.random.default_rng(0).normal(size=(2, 16)).astype(np.float32)  # A worker's.
  targets = [[np.tile(quarter[:, None], (1, 4, 4)).reshape(8, 64)]]  # The same on its devices.
  (_, state), = _run_two_level(tx, targets, 1, "outer", split_axis="inner",
                               initial={"w": np.zeros(64, np.float32)})
  # Outer SGD at 1 from zero after one inner SGD step at 1: the workers' mean target, each
  # quarter of it within 2-bit QSGD's rounding (at most a part's norm a coordinate).
  parts = np.asarray(state.global_params["w"]).reshape(4, 16)
  bound = np.linalg.norm(quarter, axis=1).max()
  assert np.all(np.abs(parts - quarter.mean(axis=0)) <= bound)
  assert len({part.tobytes() for part in parts}) == 4


def test_state_along_a_workers_devices_raises_saying_how_to_lay_it_out():
  """Streaming's outer gradient waits in the state from its take to its exchange: laid out
  along both axes it reads back as each device's own, which the exchange over "outer" would
  not make the same on a worker's devices."""
  tx = diloco(_two_level_inner(), "outer", sync_every=4, fragments=2, delay=1)
  with pytest.raises(ValueError, match=r"state_partition_specs\(state, 'outer', "
                                       r"split_axis='inner'\)"):
    _run_two_level(tx, example_targets(3), 3)


@pytest.mark.slow
def test_split_exchange_is_the_whole_exchange_with_a_quarter_of_the_bytes():
  """Each of a worker's four devices averages a quarter of the outer gradient across the
  workers: the float32 average is bit for bit the whole one's, for a quarter of the bytes."""
  # Fragment 1 (Block_1, 15 elements; offset 4) is the only one exchanged at the last step.
  steps = 8
  targets = example_targets(steps)
  options = dict(sync_every=4, outer_optimizer=optax.sgd(0.7, momentum=0.9), fragments=2)
  whole = _run_two_level(diloco(_two_level_inner(), "outer", **options), targets, steps)[-1]
  split = _run_two_level(diloco(_two_level_inner(), "outer", split_axis="inner", **options),
                         targets, steps)[-1]
  chex.assert_trees_all_equal(split[0], whole[0])
  chex.assert_trees_all_equal(split[1].global_params, whole[1].global_params)
  # Its 15 elements: 4 of them a device (ceil(15 / 4)), not 15; and the count of the finite
  # workers, one element.
  assert float(whole[1].stats.outer_wire_bits) == wire_bits(15) + wire_bits(1)
  assert float(split[1].stats.outer_wire_bits) == wire_bits(4) + wire_bits(1)
  # All the bits add the gather of the four parts inside the worker: 3 of them, 4 elements each.
  assert float(split[1].stats.wire_bits) == wire_bits(4) + wire_bits(1) + 3 * 4 * 32


def wire_bits(elements):
  """Bits a device sends in a float32 all-reduce of ``elements`` between two workers."""
  return 2 * (2 - 1) / 2 * 4 * elements * 8


@pytest.mark.slow
def test_split_exchange_keeps_each_devices_part_of_the_error_feedback():
  steps = 6
  targets = example_targets(steps)
  average = qsgd_jax.qsgd("outer", bits=8, error_feedback=True, min_compressed_size=1)
  options = dict(sync_every=3, outer_optimizer=optax.sgd(1.0), average=average)
  _, split = _run_two_level(diloco(_two_level_inner(), "outer", split_axis="inner", **options),
                            targets, steps)[-1]
  # Whole, every device of a worker holds the same state: laid along the workers alone.
  _, whole = _run_two_level(diloco(_two_level_inner(), "outer", **options), targets, steps,
                            state_axes="outer")[-1]
  _, exact = _run_two_level(diloco(_two_level_inner(), "outer", sync_every=3,
                                   outer_optimizer=optax.sgd(1.0)), targets, steps)[-1]
  # 8 bits a coordinate with error feedback, split or whole: near the float32 average's.
  for run in (split, whole):
    for leaf, want in zip(jax.tree.leaves(run.global_params),
                          jax.tree.leaves(exact.global_params), strict=True):
      np.testing.assert_allclose(np.asarray(leaf), np.asarray(want), atol=0.01)
  # The 42 elements go as 11 a device (ceil(42 / 4)) in one vector, not as four leaves.
  assert split.stats.outer_wire_bits < whole.stats.outer_wire_bits
  # The gather inside the worker: 3 parts of 11 float32 elements, on the fast links alone.
  assert split.stats.wire_bits - split.stats.outer_wire_bits == 3 * 11 * 32
  # Each device's error feedback is for its own part (11 elements, in a bucket's padding),
  # a row a device along both axes. Worker 1 owns the one chunk of QSGD's two-phase exchange,
  # so its four devices hold the residuals: of four different parts.
  residuals = [np.asarray(leaf) for leaf in jax.tree.leaves(split.fragments)
               if leaf.dtype == jnp.float32 and leaf.ndim > 1]
  assert residuals and all(r.shape[0] == 8 and not r[:, 11:].any() for r in residuals)
  rows = {row.tobytes() for r in residuals for row in r[:, :11] if row.any()}
  assert len(rows) == 4


def test_split_exchange_refuses_a_worker_whose_devices_differ():
  # No average over "inner": each device of a worker moves on its own.
  tx = diloco(optax.sgd(0.1), "outer", sync_every=1, split_axis="inner")
  with pytest.raises(ValueError, match="differs across axis 'inner': every device of a worker"):
    step_with_params_per_device(tx, jax.make_mesh((2, 4), ("outer", "inner")))


def test_split_axis_must_be_a_workers_devices():
  with pytest.raises(ValueError, match="split_axis='outer' must name the axes of a worker"):
    diloco(optax.sgd(0.1), "outer", sync_every=2, split_axis="outer")
  with pytest.raises(ValueError, match="must name the axes of a worker"):
    diloco(optax.sgd(0.1), None, sync_every=2, split_axis="inner")
  # A compressed average's state is of this device's part, whose length needs the axis's size.
  tx = diloco(optax.sgd(0.1), "outer", sync_every=2, split_axis="inner",
              average=qsgd_jax.qsgd("outer", error_feedback=True))
  with pytest.raises(NameError, match="jax.set_mesh"):
    jax.eval_shape(tx.init, example_params())


@pytest.mark.slow
def test_resize_state_refuses_a_split_exchanges_parts():
  """Each device's SplitAverageState is its part of the outer gradient, cut for the worker's
  device count: resize_state says so rather than giving every device the first one's."""
  average = qsgd_jax.qsgd("outer", bits=4, error_feedback=True, min_compressed_size=1)
  tx = diloco(optax.sgd(0.1), "outer", sync_every=2, average=average, split_axis="inner")

  def init_on(workers):  # Every device's state stacked along one first axis.
    state = jax.vmap(jax.vmap(tx.init, axis_name="inner"), axis_name="outer")(
        stack(stack(example_params(), 4), workers))
    return jax.tree.map(lambda x: x.reshape(workers * 4, *x.shape[2:]), state)

  with pytest.raises(ValueError, match="SplitAverageState"):
    qsgd_jax.resize_state(init_on(2), jax.eval_shape(lambda: init_on(3)), from_devices=8,
                          to_devices=12, stacked=True)
