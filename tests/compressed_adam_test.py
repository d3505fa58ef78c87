"""1-bit Adam and 0/1 Adam: DeepSpeed's numbers, optax's warm-up, state, bytes and bad input."""

import functools

import chex
import deepspeed_reference as ds
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qsgd_jax
from qsgd_jax._src.adam import common as compressed_adam
from qsgd_jax._src.adam import sign_exchange

N = 8
AXIS = "batch"
SHAPES = ((24, 20), (6,), (150,))  # A compressed matrix, a float32-path bias, a compressed vector.
STEPS = 7


def _problem(seed=0, steps=STEPS, shapes=SHAPES):
  """Parameters and each step's per-worker gradients, well away from sign ties."""
  rng = np.random.default_rng(seed)
  params = [rng.normal(size=s).astype(np.float32) for s in shapes]
  grads = [[[(rng.normal(size=s) + 0.3 * np.sign(rng.normal(size=s))).astype(np.float32)
             for s in shapes] for _ in range(N)] for _ in range(steps)]
  return params, grads


def _stacked(grads_of_step):
  """``[worker][leaf]`` to one ``[N, ...]`` array a leaf."""
  return [jnp.stack([worker[i] for worker in grads_of_step]) for i in range(len(grads_of_step[0]))]


def _pmap_program(tx):
  """``tx``'s init and one training step (the new parameters and state), under pmap."""

  def step(g, state, p):
    updates, state = tx.update(g, state, p)
    return optax.apply_updates(p, updates), state

  return jax.pmap(tx.init, AXIS), jax.pmap(step, AXIS)


def _pmap_steps(program, params, grads):
  """Runs a :func:`_pmap_program` on ``grads`` from ``params``; yields the parameters
  (``[N, ...]`` a leaf) and the state after each step."""
  init, step = program
  p = [jnp.broadcast_to(x, (N, *x.shape)) for x in params]
  state = init(p)
  for g in grads:
    p, state = step(_stacked(g), state, p)
    jax.block_until_ready(p)
    yield p, state


SCHEDULE = optax.linear_schedule(1e-2, 5e-3, STEPS)
ONEBIT_OPTIONS = dict(freeze_step=3, weight_decay=0.01, bias_correction=False,
                      min_compressed_size=100)
ZERO_ONE_OPTIONS = dict(var_freeze_step=7, weight_decay=0.01, var_update_scaler=2,
                        local_step_scaler=3)


@functools.cache
def _onebit():
  """The 1-bit Adam that several tests run, and its compiled program (compiled once)."""
  tx = qsgd_jax.onebit_adam(SCHEDULE, AXIS, **ONEBIT_OPTIONS)
  return tx, _pmap_program(tx)


@functools.cache
def _zero_one(local_step_clipper: int):
  tx = qsgd_jax.zero_one_adam(1e-2, AXIS, bias_correction=False, min_compressed_size=0,
                              local_step_clipper=local_step_clipper, **ZERO_ONE_OPTIONS)
  return tx, _pmap_program(tx)


def _assert_close_to(p, reference, start, tolerance):
  """Every device's leaf within ``tolerance`` of the distance the reference travelled."""
  for leaf, ref, first in zip(p, reference, start, strict=True):
    distance = np.max(np.abs(ref - first))
    np.testing.assert_allclose(np.asarray(leaf), np.broadcast_to(ref, leaf.shape),
                               atol=tolerance * distance, rtol=0)


# Its tolerance is float32 rounding of XLA's fused sums, which its other optimization levels
# round differently.
@pytest.mark.slow
@pytest.mark.usefixtures("full_optimizations")
def test_sign_exchange_is_deepspeeds_compressed_allreduce_with_its_errors():
  rng = np.random.default_rng(1)
  sizes = (1000, 37, 64)
  layout = sign_exchange.sign_layout(sizes, N)
  worker_errors = [[np.zeros(ds.padded_size(s, N), np.float32) for _ in range(N)] for s in sizes]
  server_errors = [[np.zeros(ds.padded_size(s, N) // N, np.float32) for _ in range(N)]
                   for s in sizes]
  exchange = jax.pmap(
      lambda v, w, s: sign_exchange.exchange(v, w, s, layout, AXIS), AXIS)
  worker = jnp.zeros((N, *layout.worker_error_shape().shape))
  server = jnp.zeros((N, *layout.server_error_shape().shape))
  for _ in range(3):  # The errors carry over from round to round.
    vectors = [rng.normal(size=(N, s)).astype(np.float32) + 0.2 for s in sizes]
    out = exchange(vectors, worker, server)
    worker, server = out.worker_error, out.server_error
    for i, size in enumerate(sizes):
      expected = ds.compressed_allreduce(list(vectors[i]), worker_errors[i], server_errors[i])
      np.testing.assert_allclose(np.asarray(out.vectors[i]),
                                 np.broadcast_to(expected, (N, size)), rtol=1e-6, atol=1e-6)
      columns = slice(layout.offsets[i], layout.offsets[i] + layout.chunks[i])
      for k in range(N):
        np.testing.assert_allclose(np.asarray(worker[k][:, columns]).reshape(-1),
                                   worker_errors[i][k], atol=1e-6)
        np.testing.assert_allclose(np.asarray(server[k][columns]), server_errors[i][k],
                                   atol=1e-6)
    helpers.assert_replicas_identical(out.vectors)
  assert bool(jnp.all(out.all_finite))


@pytest.mark.slow
def test_onebit_adam_is_deepspeeds_step_by_step_under_pmap():
  params, grads = _problem()
  reference = ds.OnebitAdam(params, N, freeze_step=3, weight_decay=0.01,
                            non_freeze=[False, True, False], discard_first_call=False)
  for t, (p, _) in enumerate(_pmap_steps(_onebit()[1], params, grads)):
    reference.step(grads[t], float(SCHEDULE(t)))
    _assert_close_to(p, reference.params, params, 1e-5 if t < 3 else 1e-4)
    helpers.assert_replicas_identical(p)


@pytest.mark.slow
def test_onebit_adam_is_deepspeeds_step_by_step_under_shard_map():
  params, grads = _problem(seed=2)
  tx = qsgd_jax.onebit_adam(1e-2, AXIS, freeze_step=2, bias_correction=False,
                            min_compressed_size=0)
  reference = ds.OnebitAdam(params, N, freeze_step=2, discard_first_call=False)
  mesh = jax.make_mesh((N,), (AXIS,))
  specs = qsgd_jax.state_partition_specs(
      jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P(),
                                   check_vma=False), params), AXIS)

  def step(p, state, g):
    updates, state = tx.update([x[0] for x in g], state, p)
    return optax.apply_updates(p, updates), state

  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
  step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P(AXIS)),
                               out_specs=(P(), specs)))
  p = jax.device_put([jnp.asarray(x) for x in params], NamedSharding(mesh, P()))
  state = init(p)
  for t in range(STEPS):
    g = jax.device_put(_stacked(grads[t]), NamedSharding(mesh, P(AXIS)))
    p, state = jax.block_until_ready(step(p, state, g))
    reference.step(grads[t], 1e-2)
    _assert_close_to([x[None] for x in p], reference.params, params, 1e-5 if t < 2 else 1e-4)


def test_deepspeeds_first_call_only_counts_a_step():
  """DeepSpeed's freeze_step=k on g0, g1, ... is the library's k - 1 on g1, g2, ..."""
  params, grads = _problem(seed=3)
  deepspeed = ds.OnebitAdam(params, N, freeze_step=3)
  library = ds.OnebitAdam(params, N, freeze_step=2, discard_first_call=False)
  deepspeed.step(grads[0], 1e-2)
  chex.assert_trees_all_equal(deepspeed.params, params)
  for g in grads[1:]:
    deepspeed.step(g, 1e-2)
    library.step(g, 1e-2)
    chex.assert_trees_all_close(deepspeed.params, library.params, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("local_step_clipper", [1, 4])
def test_zero_one_adam_is_deepspeeds_step_by_step(local_step_clipper):
  """Variance intervals doubling, the freeze, then (with a clipper above 1) local steps."""
  steps = 18
  params, grads = _problem(seed=4, steps=steps, shapes=((24, 20), (150,)))
  reference = ds.ZeroOneAdam(params, N, discard_first_call=False,
                             local_step_clipper=local_step_clipper, **ZERO_ONE_OPTIONS)
  for t, (p, state) in enumerate(_pmap_steps(_zero_one(local_step_clipper)[1], params, grads)):
    reference.step(grads[t], 1e-2)
    for k in range(N):
      _assert_close_to([x[k] for x in p], reference.params[k], params, 1e-5 if t < 7 else 1e-4)
    assert int(state.variance_interval[0]) == reference.var_interval
    assert int(state.local_interval[0]) == reference.local_step_interval
    if local_step_clipper == 1 or reference.step_count % reference.local_step_interval == 0:
      # Synchronized (every step without local steps): the devices agree to float rounding.
      np.testing.assert_allclose(np.asarray(p[0]), np.broadcast_to(p[0][:1], p[0].shape),
                                 atol=1e-5)
  assert reference.local_step_interval == min(4, local_step_clipper)


@pytest.mark.slow
def test_warm_up_is_optax_adamw_on_the_mean_gradient():
  """To the last bit but one: XLA fuses the two programs' arithmetic differently."""
  params, grads = _problem(seed=5, steps=3)
  options = dict(b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1)
  tx = qsgd_jax.onebit_adam(1e-2, AXIS, freeze_step=10, min_compressed_size=100, **options)
  adamw = optax.adamw(1e-2, **options)

  def adamw_of_the_mean(g, state, p):
    updates, state = adamw.update(jax.lax.pmean(g, AXIS), state, p)
    return optax.apply_updates(p, updates), state

  adamw_step = jax.pmap(adamw_of_the_mean, AXIS)
  expected = [jnp.broadcast_to(x, (N, *x.shape)) for x in params]
  adamw_state = jax.pmap(adamw.init, AXIS)(expected)
  for t, (p, _) in enumerate(_pmap_steps(_pmap_program(tx), params, grads)):
    expected, adamw_state = adamw_step(_stacked(grads[t]), adamw_state, expected)
    chex.assert_trees_all_close(p, expected, rtol=3e-7, atol=1e-9)


def test_bytes_after_the_freeze_are_a_thirtieth_of_float32():
  n = N
  params = [jnp.zeros((n, 256, 128)), jnp.zeros((n, 128))]
  tx = qsgd_jax.onebit_adam(1e-3, AXIS, freeze_step=1)
  state = jax.pmap(tx.init, AXIS)(params)
  step = jax.pmap(tx.update, AXIS)
  warm = frozen = None
  for _ in range(2):
    _, state = step(params, state, params)
    stats = qsgd_jax.compression_stats(state)
    frozen, warm = float(stats.wire_bits[0]) / 8, warm or float(stats.wire_bits[0]) / 8
  float32 = 2 * (n - 1) / n * 4 * (256 * 128 + 128)
  assert warm == pytest.approx(float32)
  assert float32 / frozen > 25
  # The compiled step holds both stages: its collectives send what the two steps counted.
  hlo = step.lower(params, state, params).compile().as_text()
  assert qsgd_jax.wire_bytes(hlo) == pytest.approx(warm + frozen, rel=1e-6)


@pytest.mark.slow
def test_a_host_copy_of_the_state_resumes_bit_for_bit():
  params, grads = _problem(seed=7)
  straight = list(_pmap_steps(_onebit()[1], params, grads))
  host = jax.device_get(straight[3])  # Parameters and state after four steps, on the host.
  # A new transformation, as in a new process.
  _, step = _pmap_program(qsgd_jax.onebit_adam(SCHEDULE, AXIS, **ONEBIT_OPTIONS))
  p, state = jax.tree.map(jnp.asarray, host)
  for t in range(4, STEPS):
    p, state = step(_stacked(grads[t]), state, p)
  chex.assert_trees_all_equal(p, straight[-1][0])
  chex.assert_trees_all_equal(helpers.host_arrays(state), helpers.host_arrays(straight[-1][1]))


@pytest.mark.slow
def test_data_parallel_takes_them_as_they_are():
  mesh = jax.make_mesh((N,), (AXIS,))
  rng = np.random.default_rng(8)
  params = {"w": jnp.asarray(rng.normal(size=(64, 80)) * 0.1, jnp.float32),
            "b": jnp.zeros(80)}
  x = rng.normal(size=(64, 64)).astype(np.float32)
  y = np.tanh(x @ rng.normal(size=(64, 80))).astype(np.float32)

  def loss_fn(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

  batch = jax.device_put((x, y), NamedSharding(mesh, P(AXIS)))
  for tx in (qsgd_jax.onebit_adam(3e-2, AXIS, freeze_step=3, min_compressed_size=1000),
             qsgd_jax.zero_one_adam(3e-2, AXIS, var_freeze_step=3, min_compressed_size=1000,
                                    local_step_clipper=1)):
    init, step, _ = qsgd_jax.data_parallel(loss_fn, tx, mesh)
    p = jax.device_put(params, NamedSharding(mesh, P()))
    state = init(p)
    losses = []
    for _ in range(8):
      p, state, loss = jax.block_until_ready(step(p, state, batch))
      losses.append(float(loss))
    assert losses[-1] < 0.7 * losses[0]
    assert float(qsgd_jax.compression_stats(state).compression_ratio) > 10


@pytest.mark.slow
def test_auto_freeze_chooses_a_step_once_the_variance_settles():
  params, grads = _problem(seed=9, steps=12)
  tx = qsgd_jax.onebit_adam(1e-3, AXIS, freeze_step="auto", auto_freeze_window=3,
                            auto_freeze_tolerance=0.25, min_compressed_size=100)
  counts = [int(state[0].freeze_count[0])
            for _, state in _pmap_steps(_pmap_program(tx), params, grads)]
  chosen = counts[-1]
  assert 3 <= chosen < 12
  # Not chosen before; kept once chosen; then the steps send 1-bit momenta.
  assert counts[:chosen - 1] == [2**31 - 1] * (chosen - 1) and set(counts[chosen - 1:]) == {
      chosen}


def _decisions(rule, statistics):
  history, decisions = rule.initial(len(statistics[0])), []
  record = jax.jit(rule.record)  # One program, not operation by operation.
  for updates_seen, statistic in enumerate(statistics, 1):
    history, settled = record(history, jnp.int32(updates_seen),
                              jnp.asarray(statistic, jnp.float32))
    decisions.append(bool(settled))
  return decisions


def test_auto_freeze_reads_the_leaves_shares_not_the_norm():
  rule = compressed_adam.AutoFreeze(window=4, tolerance=0.05)
  # Clipped gradients: the norm stands still while the variance moves between the leaves.
  moving = [[1.0 - 0.15 * t, 0.15 * t] for t in range(6)]
  assert not any(_decisions(rule, moving))
  # The shares settled while the norm still falls (as the learning rate decays): freeze as
  # soon as the window is full.
  settled = [[0.7 * 0.9**t, 0.3 * 0.9**t] for t in range(6)]
  assert _decisions(rule, settled) == [False, False, False, True, True, True]
  # One leaf: its share is always 1, so the rule reads the drift of its norm.
  assert not any(_decisions(rule, [[0.9**t] for t in range(6)]))
  assert _decisions(rule, [[1.0], [1.01], [0.99], [1.0]])[-1]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["onebit_adam", "zero_one_adam"])
def test_a_nonfinite_gradient_on_one_device_skips_the_step_everywhere(optimizer):
  """After the freeze; for 0/1 Adam at a local step, where nothing else is exchanged."""
  if optimizer == "onebit_adam":
    (_, program), shapes, steps = _onebit(), SHAPES, 5
  else:
    (_, program), shapes, steps = _zero_one(4), ((24, 20), (150,)), 19
  params, grads = _problem(seed=10, steps=steps, shapes=shapes)
  p, state = list(_pmap_steps(program, params, grads[:-1]))[-1]
  if optimizer == "zero_one_adam":
    assert steps % int(state.local_interval[0]) != 0  # The next step is a local one.
  poisoned = [list(worker) for worker in grads[-1]]
  poisoned[3][0] = poisoned[3][0].copy()
  poisoned[3][0][1, 2] = np.nan
  new_p, new_state = program[1](_stacked(poisoned), state, p)
  chex.assert_trees_all_equal(new_p, p)

  def core(state):  # The optimizer's own state, without the stats (updated even when skipped).
    state = state if isinstance(state, qsgd_jax.ZeroOneAdamState) else state[0]
    return helpers.host_arrays(state._replace(stats=None))

  chex.assert_trees_all_equal(core(new_state), core(state))


def test_dtypes_masks_and_small_leaves():
  rng = np.random.default_rng(11)
  params = {"kernel": jnp.asarray(rng.normal(size=(N, 32, 64)), jnp.bfloat16),
            "masked": jnp.asarray(rng.normal(size=(N, 32, 64)), jnp.float32),
            "bias": jnp.zeros((N, 64)), "steps": jnp.zeros((N, 3), jnp.int32)}
  tx = qsgd_jax.onebit_adam(
      1e-2, AXIS, freeze_step=1, mu_dtype=jnp.float32, min_compressed_size=1000,
      compression_mask=lambda p: {"kernel": True, "masked": False, "bias": True,
                                  "steps": True})
  state = jax.pmap(tx.init, AXIS)(params)
  grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype)
                       if jnp.issubdtype(x.dtype, jnp.floating) else jnp.ones_like(x), params)
  step = jax.pmap(tx.update, AXIS)
  for _ in range(2):
    updates, state = step(grads, state, params)
  core = state[0]
  assert updates["kernel"].dtype == jnp.bfloat16 and core.mu["kernel"].dtype == jnp.float32
  # A leaf that is not float is not optimized.
  assert updates["steps"].dtype == jnp.int32 and not np.any(np.asarray(updates["steps"]))
  # Only the kernel travels 1-bit: its variance stays frozen, the others' keeps moving.
  layout = sign_exchange.sign_layout([32 * 64], N)
  assert [e.shape[1:] for e in core.worker_error] == [layout.worker_error_shape().shape]
  first = jax.tree.map(np.asarray, core.nu)
  _, state = step(grads, state, params)
  assert np.array_equal(first["kernel"], np.asarray(state[0].nu["kernel"]))
  assert not np.array_equal(first["masked"], np.asarray(state[0].nu["masked"]))
  assert not np.array_equal(first["bias"], np.asarray(state[0].nu["bias"]))


def test_two_levels_compress_only_across_the_outer_axis():
  devices = np.array(jax.devices()).reshape(2, 4)
  mesh = jax.sharding.Mesh(devices, ("node", "local"))
  tx = qsgd_jax.onebit_adam(1e-2, ("node", "local"), freeze_step=1, min_compressed_size=0)
  params = [jnp.zeros((64, 48))]
  specs = qsgd_jax.state_partition_specs(
      jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P(),
                                   check_vma=False), params), ("node", "local"))

  def step(p, state, g):
    updates, state = tx.update([g[0][0]], state, p)
    return optax.apply_updates(p, updates), state

  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
  step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P(("node", "local"))),
                               out_specs=(P(), specs)))
  state = init(params)
  grads = jnp.asarray(np.random.default_rng(12).normal(size=(N, 64, 48)), jnp.float32)
  hlo = step.lower(params, state, [grads]).compile().as_text()
  # The packed signs (uint32) cross the outer axis (groups of 2); float32 stays within a node.
  collectives = qsgd_jax.collectives_in_hlo(hlo)
  signs = [c for c in collectives if "u32" in c.result_type]
  assert signs and all(c.group_size == 2 for c in signs)
  for _ in range(3):
    params, state = jax.block_until_ready(step(params, state, [grads]))
  stats = qsgd_jax.compression_stats(state)
  assert float(stats.outer_compression_ratio) > 20


def test_wrapping_in_apply_if_finite_is_refused_and_resizing_needs_drop():
  tx = qsgd_jax.scale_by_onebit_adam(AXIS, freeze_step=2)
  params = [jnp.zeros((N, 64, 64))]
  wrapped = optax.apply_if_finite(tx, 3)
  state = jax.pmap(wrapped.init, AXIS)(params)
  with pytest.raises(ValueError, match="apply_if_finite"):
    jax.pmap(wrapped.update, AXIS)(params, state, params)

  def init_on(n):  # The state as jax.pmap over n devices holds it.
    state = qsgd_jax.onebit_adam(1e-3, AXIS, freeze_step=3, axis_size=n).init([jnp.zeros(4096)])
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), state)

  target = jax.eval_shape(lambda: init_on(4))
  with pytest.raises(ValueError, match="drop=True"):
    qsgd_jax.resize_state(init_on(8), target, from_devices=8, to_devices=4, stacked=True)
  with pytest.warns(UserWarning, match="worker_error"):
    resized = qsgd_jax.resize_state(init_on(8), target, from_devices=8, to_devices=4,
                                    stacked=True, drop=True)
  assert [e.shape for e in resized[0].worker_error] == [e.shape for e in target[0].worker_error]


@pytest.mark.parametrize("make, message", [
    (lambda: qsgd_jax.onebit_adam(1e-3, AXIS, freeze_step=0), "freeze_step must be a positive"),
    (lambda: qsgd_jax.onebit_adam(1e-3, AXIS, freeze_step=-5), "freeze_step"),
    (lambda: qsgd_jax.onebit_adam(1e-3, AXIS, freeze_step=10, b1=1.0), "b1 must be"),
    (lambda: qsgd_jax.onebit_adam(1e-3, AXIS, freeze_step=10, b2=-0.1), "b2 must be"),
    (lambda: qsgd_jax.onebit_adam(1e-3, AXIS, freeze_step="later"), "freeze_step"),
    (lambda: qsgd_jax.zero_one_adam(1e-3, AXIS, var_freeze_step=0), "var_freeze_step"),
    (lambda: qsgd_jax.zero_one_adam(1e-3, AXIS, var_freeze_step=5, local_step_clipper=0),
     "local_step_clipper"),
])
def test_bad_options_fail_at_construction(make, message):
  with pytest.raises(ValueError, match=message):
    make()


def test_bad_calls_say_what_is_wrong():
  params = [jnp.zeros((N, 64, 64))]
  tx = qsgd_jax.onebit_adam(1e-3, AXIS, freeze_step=2)
  with pytest.raises(NameError, match="axis_size"):
    tx.init([jnp.zeros((64, 64))])  # Outside the mapping, with no axis_size.
  state = jax.pmap(tx.init, AXIS)(params)
  with pytest.raises(NameError, match="not bound"):
    tx.update([p[0] for p in params], jax.tree.map(lambda x: x[0], state), None)
  with pytest.raises(ValueError, match="tree structure"):
    jax.pmap(tx.update, AXIS)([params[0], params[0]], state, params)
  with pytest.raises(TypeError, match="ScaleByOneBitAdamState"):
    other = jax.pmap(optax.adam(1e-3).init, AXIS)(params)
    jax.pmap(tx.update, AXIS)(params, (other,) + state[1:], params)
  # A state made for 4 devices, used on 8.
  four = qsgd_jax.onebit_adam(1e-3, AXIS, freeze_step=2, axis_size=4).init([jnp.zeros((64, 64))])
  four = jax.tree.map(lambda x: jnp.broadcast_to(x, (N, *jnp.shape(x))), four)
  with pytest.raises(ValueError, match="made for 4 devices .* runs on 8"):
    jax.pmap(tx.update, AXIS)(params, four, params)
