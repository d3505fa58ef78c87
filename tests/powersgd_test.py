"""Tests of qsgd_jax.powersgd: PyTorch's powerSGD_hook, its maths, its state and its bytes.

Compiling for simulated devices is the slow part: the trajectories are cached
(``_trajectory``) and several tests read the same one. Four devices take part.
"""

import doctest
import functools
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import powersgd_reference as reference
import pytest
from helpers import assert_replicas_identical, host_arrays, placed_like
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qsgd_jax
from qsgd_jax._src.powersgd import low_rank, shard_step
from qsgd_jax._src.powersgd import transform as powersgd_module

AXIS = "batch"
NUM_WORKERS = 4
_DEVICES = jax.devices()[:NUM_WORKERS]

# Flax layouts: a Conv kernel (kh, kw, in, out), two Dense kernels (in, out) of one shape
# (batched into one matmul), a bias and a 2-d leaf too small to compress.
_SHAPES = {"bias": (12,), "conv": (3, 3, 4, 8), "dense": (16, 12), "dense2": (16, 12),
           "small": (2, 3)}
_COMPRESSED = ("conv", "dense", "dense2")

_CONFIGS = {
    # PyTorch's defaults but a short warm-up: Gram-Schmidt, warm start, error feedback.
    "defaults": dict(rank=1, start_iter=2),
    # QR (rank > 2), a new draw every step, no error memory, no warm-up.
    "qr_redrawn": dict(rank=3, start_iter=0, use_error_feedback=False, warm_start=False),
}
_STEPS = 5


def _pmap(f, **kwargs):
  return jax.pmap(f, axis_name=AXIS, devices=_DEVICES, **kwargs)


def _gradients(seed):
  """Gaussian gradients of ``_SHAPES`` plus a common rank-2 part, ``[workers, *shape]``."""
  rng = np.random.default_rng(seed)
  grads = {}
  for name, shape in _SHAPES.items():
    common = rng.normal(size=(shape[0], 2)) @ rng.normal(size=(2, math.prod(shape[1:])))
    noise = rng.normal(size=(NUM_WORKERS, *shape))
    grads[name] = (3 * common.reshape(shape) + noise).astype(np.float32)
  return grads


@functools.cache
def _functions(config_name):
  tx = qsgd_jax.powersgd(AXIS, **_CONFIGS[config_name])
  return tx, _pmap(tx.init), _pmap(tx.update)


@functools.cache
def _trajectory(config_name):
  """``_STEPS`` pmapped steps: the states (initial first), the gradients and the outputs."""
  tx, init, update = _functions(config_name)
  state = init({name: np.zeros((NUM_WORKERS, *s), np.float32) for name, s in _SHAPES.items()})
  states, grads, outputs = [state], [], []
  for step in range(_STEPS):
    grads.append(_gradients(step))
    out, state = jax.block_until_ready(update(grads[-1], state))
    outputs.append(host_arrays(out))
    states.append(state)
  return states, grads, outputs


@pytest.mark.slow
def test_steps_are_pytorchs_hook_on_each_leafs_matrix():
  """Every step against the numpy reference of powerSGD_hook, fed each leaf's matrix.

  The reference takes the (prod(shape[:-1]), shape[-1]) matrix of each leaf
  (the hook views a 2-d tensor as it is) and the library's own draws of Q.
  """
  for config_name, options in _CONFIGS.items():
    states, grads, outputs = _trajectory(config_name)
    config = reference.HookConfig(**options)
    plan = low_rank.make_plan(jax.tree.map(lambda x: x[0], grads[0]), config.rank,
                              config.min_compression_rate)
    ref_state = reference.HookState()
    names = sorted(_SHAPES)  # The tree's order, and the bucket's.
    for step in range(_STEPS):
      state = states[step]

      def draw_q(shapes, state=state, config=config, plan=plan):
        if config.warm_start:  # Drawn at init, as PyTorch draws on its first compressed step.
          drawn = host_arrays(state.q_memory)
          return [q[0] for q in drawn]
        step_key = jax.random.split(state.key[0])[1]
        return host_arrays(shard_step.draw_q(step_key, plan))

      tensors = [grads[step][name].reshape(NUM_WORKERS, *low_rank.matrix_shape(_SHAPES[name]))
                 if name in _COMPRESSED else grads[step][name] for name in names]
      expected, ref_state = reference.hook_step(config, ref_state, tensors, draw_q)
      for name, want in zip(names, expected, strict=True):
        got = outputs[step][name].reshape(want.shape)
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5,
                                   err_msg=f"{config_name}, step {step}, {name}")
      if config.use_error_feedback and step >= config.start_iter:
        # The errors of the compressed leaves are PyTorch's (its others cancel in the mean).
        offsets = np.cumsum([0, *(math.prod(_SHAPES[n]) for n in names)])
        errors = host_arrays(states[step + 1].error)
        for group, error in zip(plan.groups, errors, strict=True):
          for k, leaf in enumerate(group.leaves):
            want = ref_state.error[:, offsets[leaf]:offsets[leaf + 1]]
            np.testing.assert_allclose(error[:, k].reshape(want.shape), want, rtol=2e-4,
                                       atol=2e-5, err_msg=f"error of {names[leaf]}, step {step}")


def test_warm_up_steps_are_exact_means_and_leave_the_state():
  states, grads, outputs = _trajectory("defaults")
  pmean = _pmap(lambda g: jax.lax.pmean(g, AXIS))
  for step in range(2):
    chex.assert_trees_all_equal(outputs[step], host_arrays(pmean(grads[step])))
    for field in ("error", "q_memory", "p_memory"):
      chex.assert_trees_all_equal(host_arrays(getattr(states[step + 1], field)),
                                  host_arrays(getattr(states[0], field)))
    stats = qsgd_jax.compression_stats(states[step + 1])
    assert float(stats.compression_ratio[0]) == 1
  assert not np.asarray(states[2].error[0]).any()
  assert np.asarray(states[3].error[0]).any()


def test_output_is_the_projection_of_the_mean_onto_p_of_rank_r():
  for config_name, options in _CONFIGS.items():
    states, grads, outputs = _trajectory(config_name)
    plan = low_rank.make_plan(jax.tree.map(lambda x: x[0], grads[0]), options["rank"], 2.0)
    start = options["start_iter"]
    for step in range(start, _STEPS):
      before, after = states[step], states[step + 1]
      for g, group in enumerate(plan.groups):
        p = np.asarray(after.p_memory[g])[0]  # [count, n, r]
        q = np.asarray(after.q_memory[g])[0]
        np.testing.assert_allclose(np.swapaxes(p, 1, 2) @ p,
                                   np.broadcast_to(np.eye(group.rank), (len(p), group.rank,
                                                                        group.rank)), atol=1e-5)
        for k, leaf in enumerate(group.leaves):
          name = sorted(_SHAPES)[leaf]
          matrix = grads[step][name].reshape(NUM_WORKERS, group.rows, group.columns)
          if options.get("use_error_feedback", True):
            matrix = matrix + np.asarray(before.error[g])[:, k]
          mean = matrix.mean(axis=0)
          out = outputs[step][name][0].reshape(group.rows, group.columns)
          np.testing.assert_allclose(out, p[k] @ p[k].T @ mean, rtol=1e-4, atol=1e-4)
          np.testing.assert_allclose(out, p[k] @ q[k].T, rtol=1e-5, atol=1e-5)
          assert np.linalg.matrix_rank(out, tol=1e-4 * np.abs(out).max()) <= group.rank


def test_replicas_and_q_memories_are_bit_identical():
  for config_name in _CONFIGS:
    states, _, outputs = _trajectory(config_name)
    for out in outputs:
      assert_replicas_identical(out)
    for state in states:
      assert_replicas_identical((state.q_memory, state.p_memory, state.key, state.count))


def test_resume_from_a_host_copy_continues_exactly():
  _, _, update = _functions("defaults")
  states, grads, outputs = _trajectory("defaults")
  saved = host_arrays(states[3])  # After the first compressed step: errors and Q in use.
  restored = jax.tree.map(placed_like, states[3], saved)
  state = restored
  for step in (3, 4):
    out, state = jax.block_until_ready(update(grads[step], state))
    chex.assert_trees_all_equal(host_arrays(out), outputs[step])
  chex.assert_trees_all_equal(host_arrays(state), host_arrays(states[5]))


def _subspace_run(num_steps, use_error_feedback, gradients):
  """``num_steps`` steps of rank 2 on the same per-device ``gradients``, in one program."""
  tx = qsgd_jax.powersgd(AXIS, rank=2, start_iter=2, use_error_feedback=use_error_feedback)

  def run(grads):
    def body(state, _):
      out, state = tx.update(grads, state)
      return state, out

    state, outs = jax.lax.scan(body, tx.init(grads), None, length=num_steps)
    return outs, state

  return jax.block_until_ready(_pmap(run)(gradients))


def test_subspace_iteration_converges_to_the_best_rank_r_approximation():
  # A fixed mean with singular values 8, 4, 2, 1, ...: warm-started power iteration
  # gains a factor 2 / 4 a step on the third direction.
  rng = np.random.default_rng(0)
  left, _ = np.linalg.qr(rng.normal(size=(48, 16)))
  right, _ = np.linalg.qr(rng.normal(size=(16, 16)))
  mean = (left * 2.0 ** (3 - np.arange(16))) @ right.T
  noise = rng.normal(size=(NUM_WORKERS, 48, 16))
  grads = (mean + noise - noise.mean(axis=0)).astype(np.float32)
  outs, _ = _subspace_run(40, False, grads)
  u, s, vt = np.linalg.svd(mean)
  best = (u[:, :2] * s[:2]) @ vt[:2]
  np.testing.assert_allclose(np.asarray(outs)[0, -1], best, atol=1e-4)
  assert np.abs(np.asarray(outs)[0, 2] - best).max() > 1e-3  # It did have to converge.


def test_error_feedback_keeps_the_accumulated_error_bounded():
  """Sum over steps of (mean gradient - output): the mean error with feedback, growing without.

  With feedback the sum telescopes to the devices' mean error; without, PowerSGD's
  bias toward the top of the spectrum adds up step after step.
  """
  rng = np.random.default_rng(1)
  grads = rng.normal(size=(NUM_WORKERS, 40, 24)).astype(np.float32)
  results = {}
  for use_error_feedback in (True, False):
    outs, state = _subspace_run(60, use_error_feedback, grads)
    missed = np.cumsum(grads.mean(axis=0) - np.asarray(outs)[0], axis=0)
    results[use_error_feedback] = np.linalg.norm(missed.reshape(60, -1), axis=1)
    if use_error_feedback:
      np.testing.assert_allclose(missed[-1], np.asarray(state.error[0]).mean(axis=0)[0],
                                 atol=1e-3)
  with_feedback, without = results[True], results[False]
  assert with_feedback[-1] < 2 * with_feedback[20]
  assert without[-1] > 2.5 * without[20]
  assert without[-1] > 5 * with_feedback[-1]


@pytest.mark.parametrize("epsilon", [0.0, 1e-8])
def test_an_all_zero_leaf_gives_zeros_not_nan(epsilon):
  tx = qsgd_jax.powersgd(AXIS, rank=2, start_iter=2, orthogonalization_epsilon=epsilon)
  grads = {"zero": np.zeros((NUM_WORKERS, 32, 16), np.float32),
           "w": np.ones((NUM_WORKERS, 32, 16), np.float32)}
  state = _pmap(tx.init)(grads)
  update = _pmap(tx.update)
  for _ in range(3):  # Two exact steps, then a compressed one.
    out, state = jax.block_until_ready(update(grads, state))
  np.testing.assert_array_equal(np.asarray(out["zero"]), 0)
  assert np.isfinite(np.asarray(out["w"])).all()
  # PyTorch's Gram-Schmidt divides the zero column by its zero norm when epsilon is 0.
  zero = np.zeros((1, 32, 2), np.float32)
  assert np.isnan(reference.gram_schmidt(zero, epsilon)).all() == (epsilon == 0)


@pytest.mark.slow
def test_a_nonfinite_gradient_skips_the_step_on_every_device():
  average = qsgd_jax.powersgd(AXIS, start_iter=2)
  tx = optax.chain(average, optax.apply_if_finite(optax.sgd(0.1), 3))
  params = {name: np.zeros((NUM_WORKERS, *shape), np.float32) for name, shape in _SHAPES.items()}
  state = _pmap(tx.init)(params)

  def step(params, state, grads):
    updates, new_state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), new_state, average.update(grads, state[0])[0]

  step = _pmap(step)
  for seed in range(3):
    params, state, _ = jax.block_until_ready(step(params, state, _gradients(seed)))
  poisoned = _gradients(3)
  poisoned["dense"][2, 5, 7] = np.nan  # One element on device 2.
  skipped, skipped_state, averaged = jax.block_until_ready(step(params, state, poisoned))
  for leaf in jax.tree.leaves(host_arrays(averaged)):
    assert np.isnan(leaf).all()
  chex.assert_trees_all_equal(host_arrays(skipped), host_arrays(params))
  for field in ("error", "q_memory", "p_memory"):
    chex.assert_trees_all_equal(host_arrays(getattr(skipped_state[0], field)),
                                host_arrays(getattr(state[0], field)))
  params, state, _ = jax.block_until_ready(step(skipped, skipped_state, _gradients(4)))
  for leaf in jax.tree.leaves(host_arrays((params, state[0].error))):
    assert np.isfinite(leaf).all()


def test_integer_leaves_are_averaged_as_pmean_does_and_float0_pass():
  tx = qsgd_jax.powersgd(AXIS, start_iter=2)
  updates = {"w": _gradients(0)["dense"],
             "step": np.arange(NUM_WORKERS * 3, dtype=np.int32).reshape(NUM_WORKERS, 3),
             "int_param": np.zeros((NUM_WORKERS, 4), jax.dtypes.float0)}
  state = _pmap(tx.init)(updates)
  update = _pmap(tx.update)
  for _ in range(3):  # Two exact steps, then a compressed one.
    mean, state = jax.block_until_ready(update(updates, state))
    np.testing.assert_allclose(mean["step"][0], updates["step"].mean(axis=0))
    assert mean["int_param"].dtype == jax.dtypes.float0
  assert [e.shape for e in state.error] == [(NUM_WORKERS, 1, 16, 12)]


def test_shard_map_matches_pmap_with_the_state_laid_out():
  tx, _, _ = _functions("defaults")
  states, grads, outputs = _trajectory("defaults")
  mesh = jax.make_mesh((NUM_WORKERS,), (AXIS,), devices=_DEVICES)
  like = {name: jnp.zeros(shape) for name, shape in _SHAPES.items()}
  specs = qsgd_jax.state_partition_specs(jax.eval_shape(tx.init, like), AXIS)
  assert specs.error == (P(AXIS),) * 2 and specs.q_memory == (P(),) * 2
  assert specs.p_memory == (P(),) * 2 and specs.key == specs.count == P()
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
  step = jax.jit(jax.shard_map(
      lambda g, s: tx.update(jax.tree.map(lambda x: x[0], g), s), mesh=mesh,
      in_specs=(P(AXIS), specs), out_specs=(P(), specs)))
  state = init(like)
  for k in range(_STEPS):
    data = jax.device_put(grads[k], NamedSharding(mesh, P(AXIS)))
    out, state = jax.block_until_ready(step(data, state))
    chex.assert_trees_all_close(host_arrays(out), jax.tree.map(lambda x: x[0], outputs[k]),
                                rtol=1e-5, atol=1e-6)
  # The errors lie along the axis: device i's block is its own.
  pmap_errors = host_arrays(states[-1].error)
  chex.assert_trees_all_close(host_arrays(state.error),
                              tuple(e.reshape(-1, *e.shape[2:]) for e in pmap_errors),
                              rtol=1e-4, atol=1e-5)


def test_data_parallel_trains_with_powersgd():
  mesh = jax.make_mesh((NUM_WORKERS,), (AXIS,), devices=_DEVICES)

  def loss_fn(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

  tx = optax.chain(qsgd_jax.powersgd(AXIS, start_iter=2), optax.sgd(0.05))
  init, step, _ = qsgd_jax.data_parallel(loss_fn, tx, mesh)
  params = jax.device_put({"w": jnp.zeros((64, 32)), "b": jnp.zeros(32)},
                          NamedSharding(mesh, P()))
  rng = np.random.default_rng(0)
  x = rng.normal(size=(8 * NUM_WORKERS, 64)).astype(np.float32)
  y = (x @ rng.normal(size=(64, 1)) @ rng.normal(size=(1, 32))).astype(np.float32)
  batch = jax.device_put((x, y), NamedSharding(mesh, P(AXIS)))
  opt_state = init(params)
  losses = []
  for _ in range(6):
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(float(loss))
  assert losses[-1] < losses[0]
  stats = qsgd_jax.compression_stats(opt_state)
  assert float(stats.compression_ratio) > 10  # (64 x 32) sent as 64 + 32, the bias exactly.


def test_two_levels_compress_the_mean_of_every_device_as_node_means_would():
  """``(node, local)``: the hook with each node's mean as one worker, to float rounding."""
  mesh = jax.make_mesh((2, 4), ("node", "local"))
  names = ("node", "local")
  tx = qsgd_jax.powersgd(names, rank=2, start_iter=2)
  like = {"w": jnp.zeros((40, 24))}
  specs = qsgd_jax.state_partition_specs(jax.eval_shape(tx.init, like), names)
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
  step = jax.jit(jax.shard_map(
      lambda g, s: tx.update({"w": g[0]}, s), mesh=mesh, in_specs=(P(names), specs),
      out_specs=(P(), specs)))
  state = init(like)
  config = reference.HookConfig(rank=2, start_iter=2)
  ref_state = reference.HookState()
  rng = np.random.default_rng(2)
  for _ in range(4):
    grads = rng.normal(size=(8, 40, 24)).astype(np.float32)
    q_drawn = host_arrays(state.q_memory)
    out, state = jax.block_until_ready(
        step(jax.device_put(grads, NamedSharding(mesh, P(names))), state))
    node_means = grads.reshape(2, 4, 40, 24).mean(axis=1)
    (expected,), ref_state = reference.hook_step(config, ref_state, [node_means],
                                                 lambda shapes, q=q_drawn: list(q))
    np.testing.assert_allclose(np.asarray(out["w"]), expected[0], rtol=1e-4, atol=1e-5)
  node_errors = np.asarray(state.error[0]).reshape(2, 4, 40, 24).mean(axis=1)
  np.testing.assert_allclose(node_errors.reshape(2, -1), ref_state.error, rtol=1e-4, atol=1e-5)
  stats = qsgd_jax.compression_stats(state)
  np.testing.assert_allclose(float(stats.outer_wire_bits), float(stats.wire_bits) / 4)


def test_wire_bytes_of_the_compiled_step_are_the_factors():
  tx = qsgd_jax.powersgd(AXIS, rank=2, start_iter=0, use_error_feedback=False, warm_start=False)
  grads = _gradients(0)
  state = _pmap(tx.init)(grads)
  compiled = _pmap(tx.update).lower(grads, state).compile()
  _, state = jax.block_until_ready(compiled(grads, state))
  sent = qsgd_jax.wire_bytes(compiled.as_text())
  stats = qsgd_jax.compression_stats(state)
  assert float(stats.wire_bits[0]) == 8 * sent
  # (n + m) r a compressed leaf, the rest as it is: three all-reduces.
  factors = sum((sum(low_rank.matrix_shape(_SHAPES[n])) * 2) for n in _COMPRESSED)
  exact = sum(math.prod(_SHAPES[n]) for n in _SHAPES if n not in _COMPRESSED)
  assert sent == 2 * (NUM_WORKERS - 1) / NUM_WORKERS * 4 * (factors + exact)
  kinds = [c.kind for c in qsgd_jax.collectives_in_hlo(compiled.as_text())]
  # Three all-reduces (exact leaves, P, Q); XLA may combine the first two, independent.
  assert set(kinds) == {"all-reduce"} and len(kinds) <= 3
  total = sum(math.prod(s) for s in _SHAPES.values())
  np.testing.assert_allclose(float(stats.compression_ratio[0]), total / (factors + exact),
                             rtol=1e-6)


def _batched_lapack_qr_calls(hlo_text):
  """Operand shapes of the ``geqrf`` custom calls in ``hlo_text`` that factor several matrices."""
  shapes = re.findall(r"= \(f32\[([\d,]+)\][^\n]*custom_call_target=\"lapack_sgeqrf_ffi\"",
                      hlo_text)
  return [s for s in shapes if math.prod(int(d) for d in s.split(",")[:-2]) > 1]


@pytest.mark.slow
def test_qr_of_a_group_on_every_device_at_once_does_not_deadlock():
  """Rank 16 with two (128, 512) leaves, one group: P and Q are QR'd as batches of two.

  jaxlib's CPU QR split such a batch over XLA:CPU's intra-op pool and blocked its pool
  thread until the pieces were done; with every device's QR blocked at once (the pool has
  about one thread a device here), none was left to run them, and the first compressed step
  hung in the rendezvous of the Q all-reduce. On CPU the matrices now go one at a time, to
  the same Q bit for bit. All eight devices take part, under pmap and shard_map.
  """
  devices = jax.devices()
  tx = qsgd_jax.powersgd(AXIS, rank=16, start_iter=2)
  rng = np.random.default_rng(5)
  grads = {name: rng.normal(size=(len(devices), 128, 512)).astype(np.float32) for name in "ab"}
  init = jax.pmap(tx.init, axis_name=AXIS, devices=devices)
  update = jax.pmap(tx.update, axis_name=AXIS, devices=devices).lower(grads, init(grads))
  compiled = update.compile()
  assert not _batched_lapack_qr_calls(compiled.as_text())
  state = init(grads)
  for _ in range(3):  # The third is the first compressed step.
    out, state = jax.block_until_ready(compiled(grads, state))
  assert_replicas_identical(out)
  mean = grads["a"].mean(axis=0)
  p = np.asarray(state.p_memory[0])[0, 0]
  np.testing.assert_allclose(out["a"][0], p @ p.T @ mean, rtol=1e-4, atol=1e-4)

  mesh = jax.make_mesh((len(devices),), (AXIS,))
  like = {name: jnp.zeros((128, 512)) for name in "ab"}
  specs = qsgd_jax.state_partition_specs(jax.eval_shape(tx.init, like), AXIS)
  sharded_init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
  sharded_step = jax.jit(jax.shard_map(
      lambda g, s: tx.update(jax.tree.map(lambda x: x[0], g), s), mesh=mesh,
      in_specs=(P(AXIS), specs), out_specs=(P(), specs)))
  sharded_state = sharded_init(like)
  data = jax.device_put(grads, NamedSharding(mesh, P(AXIS)))
  for _ in range(3):
    sharded_out, sharded_state = jax.block_until_ready(sharded_step(data, sharded_state))
  chex.assert_trees_all_close(host_arrays(sharded_out), jax.tree.map(lambda x: x[0], out),
                              rtol=1e-5, atol=1e-6)

  matrices = jnp.asarray(rng.normal(size=(3, 128, 16)), jnp.float32)
  chex.assert_trees_all_equal(jax.jit(low_rank.orthogonalize, static_argnums=1)(matrices, 0.0),
                              jnp.linalg.qr(matrices, mode="reduced")[0])


@pytest.mark.slow
def test_off_the_cpu_rank_above_two_orthogonalizes_by_gram_schmidt_twice(monkeypatch):
  # Nearly rank one, as a gradient's P often is: one pass leaves the columns 1e-4 from
  # orthogonal in float32, the second brings them to QR's precision, and they span the
  # columns float64's QR finds (float32's QR itself is 2e-5 off here).
  rng = np.random.default_rng(8)
  matrices = jnp.asarray(rng.normal(size=(3, 2048, 1)) + 1e-3 * rng.normal(size=(3, 2048, 4)),
                         jnp.float32)

  def distance_from_orthonormal(q):
    q = np.asarray(q, np.float64)
    return np.abs(np.einsum("bnr,bns->brs", q, q) - np.eye(q.shape[-1])).max()

  once = low_rank._gram_schmidt(matrices, 0.0)
  twice = jax.jit(low_rank.gram_schmidt_twice)(matrices)
  exact = np.linalg.qr(np.asarray(matrices, np.float64), mode="reduced")[0]
  assert distance_from_orthonormal(once) > 1e-5
  assert distance_from_orthonormal(twice) <= 1e-6
  np.testing.assert_allclose(np.einsum("bnr,bmr->bnm", np.asarray(twice, np.float64), twice),
                             np.einsum("bnr,bmr->bnm", exact, exact), atol=1e-6)

  # PowerSGD's steps with it equal those with QR (P Q^T is the projection onto the span).
  grads = {"w": jnp.asarray(rng.normal(size=(96, 64)), jnp.float32)}
  tx = qsgd_jax.powersgd(None, rank=4, start_iter=2)

  def run():
    state, outs = tx.init(grads), []
    for i in range(5):
      out, state = jax.jit(tx.update)(jax.tree.map(lambda g, i=i: g * (i + 1), grads), state)
      outs.append(out)
    return outs

  with_qr = run()
  with monkeypatch.context() as patch:
    patch.setattr(low_rank, "orthogonalize", lambda m, epsilon: (
        low_rank.gram_schmidt_twice(m) if m.shape[-1] > 2 else low_rank._gram_schmidt(m, epsilon)))
    with_gram_schmidt = run()
  chex.assert_trees_all_close(with_gram_schmidt, with_qr, rtol=1e-4, atol=1e-5)


def test_bfloat16_leaves_are_computed_in_float32_and_cast_back():
  tx = qsgd_jax.powersgd(None, start_iter=2)
  rng = np.random.default_rng(3)
  grads = rng.normal(size=(64, 32)).astype(np.float32)
  half = jnp.asarray(grads, jnp.bfloat16)
  state = tx.init(half)
  update = jax.jit(tx.update)
  for _ in range(3):
    out, new_state = update(half, state)
    if int(state.count) >= 2:
      break
    state = new_state
  assert out.dtype == jnp.bfloat16
  p, q = np.asarray(new_state.p_memory[0][0]), np.asarray(new_state.q_memory[0][0])
  exact = p @ q.T
  np.testing.assert_array_equal(np.asarray(out), np.asarray(jnp.asarray(exact, jnp.bfloat16)))
  # The error holds what the rank-1 approximation and the cast to bfloat16 dropped.
  np.testing.assert_allclose(np.asarray(new_state.error[0][0]),
                             np.asarray(half, np.float32) - np.asarray(out, np.float32),
                             atol=1e-6)


def test_the_view_is_the_transpose_of_pytorchs_for_dense_and_conv_kernels():
  rng = np.random.default_rng(4)
  dense = rng.normal(size=(16, 12))  # Flax (in, out); PyTorch's weight is (out, in).
  torch_dense = dense.T
  n, m = low_rank.matrix_shape(dense.shape)
  np.testing.assert_array_equal(dense.reshape(n, m),
                                torch_dense.reshape(reference.matrix_view(torch_dense.shape)).T)
  conv = rng.normal(size=(3, 3, 4, 8))  # Flax HWIO; PyTorch's weight is OIHW.
  torch_conv = conv.transpose(3, 2, 0, 1)
  ours = conv.reshape(low_rank.matrix_shape(conv.shape))
  theirs = torch_conv.reshape(reference.matrix_view(torch_conv.shape))  # (out, in*kh*kw).
  # The same matrix transposed, its rows ordered (kh, kw, in) here, (in, kh, kw) there.
  rows = np.arange(3 * 3 * 4).reshape(4, 3, 3).transpose(1, 2, 0).reshape(-1)
  np.testing.assert_array_equal(ours, theirs.T[rows])
  for shape in (dense.shape, conv.shape, (3, 3, 512, 512), (7, 7, 3, 64), (2048, 1000)):
    for rank in (1, 2, 4):
      ours = low_rank.should_compress(*low_rank.matrix_shape(shape), rank, 2.0)
      torch_shape = (shape[-1], *shape[:-1])
      rows_, cols_ = reference.matrix_view(torch_shape)
      assert ours == reference.should_compress(rows_, cols_, min(rows_, cols_, rank), 2.0)


def _linen_attention_params():
  import flax.linen as nn
  attention = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=64)
  return attention.init(jax.random.key(0), jnp.ones((1, 3, 64)))["params"]


def _group_leaves(tx, params):
  """``{matrix (n, m): sorted paths}`` of the leaves ``tx`` compresses."""
  plan = low_rank.make_plan(params, 2, 2.0)
  state = tx.init(params)
  assert [q.shape for q in state.q_memory] == [g.q_shape for g in plan.groups]
  return {(g.rows, g.columns): sorted(plan.paths[i] for i in g.leaves) for g in plan.groups}


@pytest.mark.slow
def test_flax_attention_kernels_are_their_layers_input_to_output_maps():
  params = _linen_attention_params()
  assert params["query"]["kernel"].shape == (64, 4, 16)  # (in, heads, head_dim).
  assert params["out"]["kernel"].shape == (4, 16, 64)  # (heads, head_dim, out).
  tx = qsgd_jax.powersgd(None, rank=2, start_iter=2)
  # Query, key, value: (in, heads * head_dim), not (in * heads, head_dim) = (256, 16).
  # Out: (heads * head_dim, out). All four 64 x 64, batched into one matmul.
  assert _group_leaves(tx, params) == {(64, 64): [
      f"['{name}']['kernel']" for name in ("key", "out", "query", "value")]}
  # The step's output of each kernel is of rank 2 as its layer's 64 x 64 map.
  tx = qsgd_jax.powersgd(None, rank=2, start_iter=0, use_error_feedback=False,
                         warm_start=False)
  grads = jax.tree.map(lambda x: jax.random.normal(jax.random.key(1), x.shape), params)
  out, _ = jax.jit(tx.update)(grads, tx.init(params))
  for name in ("query", "key", "value"):
    assert np.linalg.matrix_rank(np.asarray(out[name]["kernel"]).reshape(64, 64)) == 2
  assert np.linalg.matrix_rank(np.asarray(out["out"]["kernel"]).reshape(64, 64)) == 2


def test_flax_nnx_attention_kernels_get_the_same_view():
  from flax import nnx
  attention = nnx.MultiHeadAttention(num_heads=4, in_features=64, qkv_features=64,
                                     decode=False, rngs=nnx.Rngs(0))
  params = nnx.state(attention, nnx.Param)
  groups = _group_leaves(qsgd_jax.powersgd(None, rank=2, start_iter=2), params)
  assert list(groups) == [(64, 64)] and len(groups[(64, 64)]) == 4


def test_other_leaves_keep_the_last_axis_as_columns():
  view = qsgd_jax.attention_matrix_view
  assert view(("params", "Dense_0", "kernel"), (64, 32)) == (64, 32)
  assert view(("params", "Conv_0", "kernel"), (3, 3, 8, 16)) == (72, 16)
  assert view(("params", "out", "kernel"), (4, 16, 64)) == (64, 64)
  # A 3-d kernel of another name: the names do not say, the last axis is the output.
  assert view(("params", "qkv", "kernel"), (64, 4, 16)) == (256, 16)
  # A 4-d "query" leaf is no attention projection of Flax's.
  assert view(("params", "query", "kernel"), (2, 64, 4, 16)) == (512, 16)
  # A leaf named "query" that is no kernel.
  assert view(("params", "query", "embedding"), (64, 4, 16)) == (256, 16)


def test_a_custom_view_says_which_axes_are_inputs():
  # A fused projection (in, 3, heads, head_dim), as examples/lm's "qkv" kernel.
  params = {"qkv": {"kernel": jnp.zeros((128, 3, 4, 32))}, "mlp": {"kernel": jnp.zeros((128, 512))}}

  def view(path, shape):
    if path[-2:] == ("qkv", "kernel"):
      return shape[0], math.prod(shape[1:])
    return qsgd_jax.attention_matrix_view(path, shape)

  tx = qsgd_jax.powersgd(None, rank=4, start_iter=2, matrix_view=view)
  state = tx.init(params)
  assert sorted(e.shape for e in state.error) == [(1, 128, 384), (1, 128, 512)]
  updates, _ = jax.jit(tx.update)(params, state)
  chex.assert_trees_all_equal_shapes(updates, params)


@pytest.mark.parametrize("view, match", [
    (lambda path, shape: (16, 4096), r"gave \(16, 4096\) for the leaf \['w'\] of shape "
     r"\(128, 3, 4, 32\).*one of \[128, 384, 1536\]"),
    (lambda path, shape: (128, 1), "gave"),
    (lambda path, shape: [128, 384], "gave"),
])
def test_a_view_that_is_not_a_matrix_of_the_leaf_is_named(view, match):
  tx = qsgd_jax.powersgd(None, start_iter=2, matrix_view=view)
  with pytest.raises(ValueError, match=match):
    tx.init({"w": jnp.zeros((128, 3, 4, 32))})


def test_a_state_of_the_last_axis_view_resumes_with_that_view_and_says_so_without():
  params = _linen_attention_params()

  def last_axis(path, shape):
    return math.prod(shape[:-1]), shape[-1]

  old = qsgd_jax.powersgd(None, rank=2, start_iter=2, matrix_view=last_axis)
  state = old.init(params)  # As saved before matrix_view: q/k/v kernels (256, 16).
  with pytest.raises(ValueError, match=r"another matrix_view.*math.prod\(shape\[:-1\]\)"):
    qsgd_jax.powersgd(None, rank=2, start_iter=2).update(params, state)
  old.update(params, state)


def test_a_start_iter_past_the_declared_run_is_refused():
  with pytest.raises(ValueError, match=r"start_iter=1000 is not less than total_steps=300"):
    qsgd_jax.powersgd(AXIS, total_steps=300)
  qsgd_jax.powersgd(AXIS, start_iter=30, total_steps=300)
  with pytest.raises(ValueError, match="total_steps must be a positive int"):
    qsgd_jax.powersgd(AXIS, total_steps=0)
  with pytest.raises(ValueError, match="matrix_view must be a function"):
    qsgd_jax.powersgd(AXIS, matrix_view=(64, 64))


# Wrong use gets a clear error.


@pytest.mark.parametrize("options, match", [
    (dict(rank=0), "rank must be a positive int"),
    (dict(rank=1.5), "rank must be a positive int"),
    (dict(rank=True), "rank must be a positive int"),
    (dict(start_iter=1), "start_iter must be at least 2 with use_error_feedback or warm_start"),
    (dict(start_iter=0, warm_start=False), "start_iter must be at least 2"),
    (dict(start_iter=-1, warm_start=False, use_error_feedback=False), "non-negative int"),
    (dict(min_compression_rate=0), "min_compression_rate must be a positive number"),
    (dict(min_compression_rate=-2.0), "min_compression_rate must be a positive number"),
    (dict(orthogonalization_epsilon=-1e-8), "orthogonalization_epsilon must be a non-negative"),
    (dict(warm_start=1), "warm_start must be a bool"),
])
def test_bad_options_are_value_errors_naming_them(options, match):
  with pytest.raises(ValueError, match=match):
    qsgd_jax.powersgd(AXIS, **options)


def test_start_iter_one_is_allowed_without_memories():
  qsgd_jax.powersgd(AXIS, start_iter=1, use_error_feedback=False, warm_start=False)


def test_an_unbound_axis_is_a_name_error():
  tx = qsgd_jax.powersgd(AXIS)
  like = {"w": jnp.zeros((32, 16))}
  with pytest.raises(NameError, match=f"'{AXIS}' is not bound"):
    tx.update(like, tx.init(like))


def test_a_leaf_whose_shape_changed_since_init_is_named():
  tx = qsgd_jax.powersgd(None, start_iter=2)
  state = tx.init({"a": jnp.zeros((32, 16)), "b": jnp.zeros((64, 16))})
  with pytest.raises(ValueError, match=r"\['b'\] \(64, 24\).*changed since init"):
    tx.update({"a": jnp.zeros((32, 16)), "b": jnp.zeros((64, 24))}, state)


# Slow, as the other docstring examples (docs_test.py runs every public name's): each example
# compiles programs of its own for what the tests above check.
@pytest.mark.slow
def test_docstring_example_runs():
  result = doctest.testmod(powersgd_module, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted and not result.failed
