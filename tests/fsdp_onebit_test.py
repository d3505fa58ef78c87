"""Tests of 1-bit Adam under FSDP: fsdp_onebit_gather's 1-bit gradient and fsdp_onebit_adam.

Eight simulated CPU devices (``conftest.py``). The reference is DeepSpeed's worker
compression in numpy (``deepspeed_reference.worker_compressed_reduce_scatter``); the
loss is linear in the parameters, so each device's cotangent is known exactly. One
compiled program serves the warm-up and the 1-bit steps.
"""

import doctest
import functools
import math

import deepspeed_reference as ds
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qsgd_jax
from qsgd_jax._src.fsdp import onebit as fsdp_onebit

AXIS = "batch"
N = 8
MESH = jax.make_mesh((N,), (AXIS,))
# A matrix sharded by rows, one flattened and padded (4500 = 8 * 563 - 4), a small
# sharded leaf (float32 path) and a bias left whole on every device.
SHAPES = {"w": (64, 96), "odd": (9, 500), "small": (16, 8), "b": (5,)}


def _params():
  rng = np.random.default_rng(0)
  params = {name: rng.normal(size=shape).astype(np.float32) for name, shape in SHAPES.items()}
  return qsgd_jax.fsdp_shard(params, MESH, AXIS, min_sharded_size=64)


def _data(step):
  """Each device's coefficients of the linear loss: ``[N, *shape]`` a leaf."""
  rng = np.random.default_rng(step + 1)
  return {name: (rng.normal(size=(N, *shape)) + 0.5).astype(np.float32)
          for name, shape in SHAPES.items()}


@functools.cache
def _program():
  """``(shards, worker_error, data, compress) -> (gradient shards, new worker error)``."""
  shards = _params()
  specs = jax.tree.map(lambda x: x.sharding.spec, shards)

  def step(shards, worker_error, data, compress):
    def loss(shards, worker_error):
      whole = qsgd_jax.fsdp_onebit_gather(shards, worker_error, AXIS, compress=compress)
      local = sum(jnp.sum(whole[name] * data[name][0]) for name in SHAPES)
      return jax.lax.pmean(local, AXIS)
    grads, new_error = jax.grad(loss, argnums=(0, 1))(shards, worker_error)
    return grads, new_error

  def initial_error(shards):
    return qsgd_jax.fsdp_onebit_error(shards, AXIS)

  mapped = jax.jit(jax.shard_map(step, mesh=MESH, in_specs=(specs, P(AXIS), P(AXIS), P()),
                                 out_specs=(specs, P(AXIS))))
  error = jax.jit(jax.shard_map(initial_error, mesh=MESH, in_specs=(specs,),
                                out_specs=P(AXIS)))(shards)
  return shards, error, mapped


def _run(error, step, compress):
  shards, _, mapped = _program()
  data = jax.device_put(_data(step), NamedSharding(MESH, P(AXIS)))
  grads, new_error = mapped(shards, error, data, jnp.bool_(compress))
  return jax.block_until_ready((grads, new_error))


def _whole_cotangents(step):
  """Each device's cotangent of each whole parameter, flattened: ``data / N``."""
  return {name: [d.reshape(-1) / np.float32(N) for d in coefficients]
          for name, coefficients in _data(step).items()}


def _padded(vector, total):
  return np.concatenate([vector, np.zeros(total - vector.size, np.float32)])


def test_warm_up_is_the_float32_reduce_scatter_and_keeps_the_error():
  _, error, _ = _program()
  grads, new_error = _run(error, 0, compress=False)
  np.testing.assert_array_equal(new_error, error)
  cotangents = _whole_cotangents(0)
  np.testing.assert_allclose(grads["w"], np.sum(cotangents["w"], axis=0).reshape(64, 96),
                             rtol=1e-5, atol=1e-6)
  odd = np.asarray(grads["odd"].shard)
  np.testing.assert_allclose(odd[:4500], np.sum(cotangents["odd"], axis=0), rtol=1e-5,
                             atol=1e-6)
  assert not odd[4500:].any()  # The padding's gradient.


def test_onebit_steps_are_deepspeeds_worker_compression_with_error_feedback():
  """Two 1-bit steps from a zero error, against the numpy reference, and the maths: what a
  device gets is the sum of the cotangents plus the errors' change, exactly."""
  _, error, _ = _program()
  n_rows = {"w": 64 * 96 // N, "odd": 563}
  reference_errors = {name: [np.zeros(N * rows, np.float32) for _ in range(N)]
                      for name, rows in n_rows.items()}
  for step in (1, 2):
    grads, new_error = _run(error, step, compress=True)
    cotangents = _whole_cotangents(step)
    previous = {name: [e.copy() for e in errors] for name, errors in reference_errors.items()}
    for name, rows in n_rows.items():
      size = math.prod(SHAPES[name])
      buffers = [_padded(c, N * rows) for c in cotangents[name]]
      expected = np.concatenate(ds.worker_compressed_reduce_scatter(
          buffers, reference_errors[name], size))
      got = np.asarray(grads[name].shard if name == "odd" else grads[name]).reshape(-1)
      np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
      identity = sum(b + e - f for b, e, f in zip(buffers, previous[name],
                                                 reference_errors[name], strict=True))
      np.testing.assert_allclose(got, identity, rtol=1e-4, atol=1e-5)
    # Device k's error: row j is its error of shard j of every 1-bit leaf, end to end, in
    # the tree's order.
    rows = np.asarray(new_error).reshape(N, N, -1)
    for k in range(N):
      np.testing.assert_allclose(
          rows[k], np.concatenate([reference_errors[name][k].reshape(N, -1)
                                   for name in sorted(n_rows)], axis=1), rtol=1e-5, atol=1e-6)
    # The small leaf (128 elements): float32; the bias: summed exactly by autodiff.
    np.testing.assert_allclose(np.asarray(grads["small"]).reshape(-1),
                               np.sum(cotangents["small"], axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads["b"], np.sum(cotangents["b"], axis=0), rtol=1e-5)
    error = new_error


def test_the_onebit_branch_sends_a_bit_an_element():
  shards, error, mapped = _program()
  data = jax.device_put(_data(0), NamedSharding(MESH, P(AXIS)))
  collectives = qsgd_jax.collectives_in_hlo(
      mapped.lower(shards, error, data, jnp.bool_(True)).as_text(dialect="hlo"))
  width = 64 * 96 // N + 563
  words = -(-width // 32) + 2  # The signs, and one scale a 1-bit leaf.
  onebit = [c for c in collectives if c.kind == "all-to-all" and c.result_type.startswith(
      f"u32[{N},{words}]")]
  assert len(onebit) == 1
  float32_bytes = 4 * (N - 1) / N * N * width
  assert float32_bytes / onebit[0].bytes_sent > 29


def _reference_adam(grads, freeze_step, b1=0.9, b2=0.999, eps=1e-8):
  """Adam in numpy whose variance stops at update ``freeze_step``, and whose momentum stays
  zero where the frozen variance is."""
  m = v = np.zeros_like(grads[0])
  out = []
  for t, g in enumerate(grads, start=1):
    m = b1 * m + (1 - b1) * g
    if t <= freeze_step:
      v = b2 * v + (1 - b2) * g * g
    else:
      m = np.where(v == 0, 0, m)
    out.append(m / (1 - b1 ** t) / (np.sqrt(v / (1 - b2 ** min(t, freeze_step))) + eps))
  return out


def test_fsdp_onebit_adam_is_adamw_then_freezes_the_masked_variance():
  rng = np.random.default_rng(3)
  grads = [{"frozen": rng.normal(size=6).astype(np.float32),
            "free": rng.normal(size=3).astype(np.float32)} for _ in range(5)]
  for t in range(2):  # No gradient for element 5 while warming up: it never moves.
    grads[t]["frozen"][5] = 0
  params = {"frozen": np.ones(6, np.float32), "free": np.ones(3, np.float32)}
  tx = qsgd_jax.fsdp_onebit_adam(0.1, freeze_step=2, weight_decay=0.01,
                                 frozen_mask={"frozen": True, "free": False})
  adamw = optax.adamw(0.1, weight_decay=0.01)
  state, adamw_state = tx.init(params), adamw.init(params)
  update, adamw_update = jax.jit(tx.update), jax.jit(adamw.update)
  frozen = _reference_adam([g["frozen"] for g in grads], freeze_step=2)
  for t, g in enumerate(grads):
    updates, state = update(g, state, params)
    expected, adamw_state = adamw_update(g, adamw_state, params)
    np.testing.assert_allclose(updates["free"], expected["free"], rtol=1e-5)
    np.testing.assert_allclose(updates["frozen"], -0.1 * (frozen[t] + 0.01 * params["frozen"]),
                               rtol=1e-4)
    if t < 2:
      np.testing.assert_allclose(updates["frozen"], expected["frozen"], rtol=1e-5)
    else:
      assert updates["frozen"][5] == -0.1 * 0.01 * params["frozen"][5]  # Weight decay only.
  assert int(state[0].count) == 5


def test_bad_input_is_an_error_that_says_what_to_do():
  shards, error, _ = _program()
  with pytest.raises(ValueError, match=r"worker_error has shape \(8, 3\).*fsdp_onebit_error"):
    jax.shard_map(lambda s: qsgd_jax.fsdp_onebit_gather(s, jnp.zeros((8, 3)), AXIS,
                                                        compress=True)["w"],
                  mesh=MESH, in_specs=(jax.tree.map(lambda x: x.sharding.spec, shards),),
                  out_specs=P())(shards)
  nodes = jax.make_mesh((2, 4), ("node", "local"))
  with pytest.raises(ValueError, match="one mapped axis"):
    jax.shard_map(lambda w: qsgd_jax.fsdp_onebit_error(w, ("node", "local")), mesh=nodes,
                  in_specs=P(("node", "local")), out_specs=P(("node", "local")))(
                      jax.device_put(jnp.zeros((8, 4)), NamedSharding(nodes, P(("node",
                                                                                 "local")))))
  with pytest.raises(ValueError, match="freeze_step must be a positive int"):
    qsgd_jax.fsdp_onebit_adam(1e-3, freeze_step=0)


# Slow, as the other docstring examples (docs_test.py runs every public name's): each example
# compiles programs of its own for what the tests above check.
@pytest.mark.slow
def test_docstring_examples():
  result = doctest.testmod(fsdp_onebit, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0


def test_a_nonfinite_cotangent_keeps_every_error_and_is_seen_everywhere():
  _, error, _ = _program()
  _, error = _run(error, 1, compress=True)
  shards, _, mapped = _program()
  data = _data(2)
  data["w"][5, 3, 7] = np.nan  # One device's cotangent of one element.
  data = jax.device_put(data, NamedSharding(MESH, P(AXIS)))
  grads, new_error = jax.block_until_ready(mapped(shards, error, data, jnp.bool_(True)))
  np.testing.assert_array_equal(np.asarray(new_error), np.asarray(error))
  for name in ("w", "small"):  # A 1-bit leaf, and a float32 one on every device.
    assert np.all(np.isnan(np.asarray(grads[name])))
  # The next finite step goes on from the kept error.
  grads, later = _run(new_error, 3, compress=True)
  assert np.all(np.isfinite(np.asarray(later))) and np.all(np.isfinite(np.asarray(grads["w"])))


def _optimizer(worker_errors=None):
  # Clipping first: it must leave the errors, an extra argument, alone.
  return optax.chain(optax.clip(1e-4), qsgd_jax.fsdp_onebit_adam(
      1e-2, freeze_step=2, frozen_mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p),
      worker_errors=worker_errors))


def test_the_errors_in_the_optimizer_state_are_the_caller_carried_ones():
  shards, _, _ = _program()
  specs = jax.tree.map(lambda x: x.sharding.spec, shards)
  carried = _optimizer(functools.partial(qsgd_jax.fsdp_onebit_error, axis_name=AXIS))
  by_hand = _optimizer()

  def init(shards):
    return carried.init(shards), by_hand.init(shards), qsgd_jax.fsdp_onebit_error(shards, AXIS)

  def step(shards, state, data):
    (carried_state, hand_state, hand_error), hand_shards = state, shards[1]
    error, compress = qsgd_jax.fsdp_onebit_step_inputs(carried_state)

    def grads(shards, error, compress):
      def loss(shards, error):
        whole = qsgd_jax.fsdp_onebit_gather(shards, error, AXIS, compress=compress)
        return jax.lax.pmean(sum(jnp.sum(whole[k] * data[k][0]) for k in SHAPES), AXIS)
      return jax.grad(loss, argnums=(0, 1))(shards, error)

    g, new_error = grads(shards[0], error, compress)
    updates, carried_state = carried.update(g, carried_state, shards[0], worker_error=new_error)
    hand_count = hand_state[1][0].count  # chain(clip, chain(adam, ...))
    g, hand_error = grads(hand_shards, hand_error, hand_count >= 2)  # The switch by hand.
    hand_updates, hand_state = by_hand.update(g, hand_state, hand_shards)
    return ((optax.apply_updates(shards[0], updates), optax.apply_updates(hand_shards,
                                                                         hand_updates)),
            (carried_state, hand_state, hand_error))

  # The state's layout as state_partition_specs gives it (the errors along the axis), with
  # FSDP's moments laid out as the parameters' shards.
  shapes = jax.eval_shape(jax.shard_map(init, mesh=MESH, in_specs=(specs,), out_specs=P(),
                                        check_vma=False), shards)

  def moments_as_shards(node):
    if isinstance(node, qsgd_jax.FSDPOneBitAdamState):
      return node._replace(mu=specs, nu=specs)
    return node

  carried_specs, hand_specs, _ = jax.tree.map(
      moments_as_shards, qsgd_jax.state_partition_specs(shapes, AXIS),
      is_leaf=lambda node: isinstance(node, qsgd_jax.FSDPOneBitAdamState))
  state_specs = (carried_specs, hand_specs, P(AXIS))  # The errors carried by hand.
  assert state_specs[0][1][0] == qsgd_jax.FSDPOneBitErrorState(worker_error=P(AXIS),
                                                               warm_up_left=P())
  init_fn = jax.jit(jax.shard_map(init, mesh=MESH, in_specs=(specs,), out_specs=state_specs))
  step_fn = jax.jit(jax.shard_map(step, mesh=MESH, in_specs=((specs, specs), state_specs,
                                                             P(AXIS)),
                                  out_specs=((specs, specs), state_specs)))
  params, state = (shards, shards), init_fn(shards)
  for t in range(4):  # Two float32 steps, then two 1-bit ones.
    data = jax.device_put(_data(t), NamedSharding(MESH, P(AXIS)))
    params, state = jax.block_until_ready(step_fn(params, state, data))
    for a, b in zip(jax.tree.leaves(params[0]), jax.tree.leaves(params[1]), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    kept = np.asarray(state[0][1][0].worker_error)
    np.testing.assert_array_equal(kept, np.asarray(state[2]))
    assert kept.any() == (t >= 2)  # Errors appear with the 1-bit steps.
  with pytest.raises(ValueError, match="drop=True"):
    qsgd_jax.resize_state(state[0], state[0], from_devices=8, to_devices=4)


def test_the_carried_errors_bad_input_says_what_to_do():
  tx = qsgd_jax.keep_fsdp_onebit_error(lambda p: {"layer": jnp.zeros((2, 3))}, freeze_step=1)
  state = tx.init(jnp.zeros(3))
  with pytest.raises(ValueError, match="update needs worker_error="):
    tx.update(jnp.zeros(3), state)
  with pytest.raises(ValueError, match=r"worker_error\['layer'\] is float32\[2, 4\]"):
    tx.update(jnp.zeros(3), state, worker_error={"layer": jnp.zeros((2, 4))})
  with pytest.raises(ValueError, match="structure"):
    tx.update(jnp.zeros(3), state, worker_error=jnp.zeros((2, 3)))
  with pytest.raises(ValueError, match="holds 0 FSDPOneBitErrorState"):
    qsgd_jax.fsdp_onebit_step_inputs(optax.adam(1e-3).init(jnp.zeros(3)))
  with pytest.raises(ValueError, match="freeze_step must be a positive int"):
    qsgd_jax.keep_fsdp_onebit_error(lambda p: (), freeze_step=0)
  with pytest.raises(TypeError, match="worker_errors must be a function"):
    qsgd_jax.keep_fsdp_onebit_error(jnp.zeros(3), freeze_step=1)


def test_by_default_only_the_leaves_that_go_one_bit_freeze_their_variance():
  # Under shard_map: a sharded kernel whose whole size reaches the gather's threshold
  # freezes (its shard alone would not); a shard of a small leaf and a small replicated bias
  # keep Adam's variance, as the gather sends their gradients in float32.
  tx = qsgd_jax.scale_by_fsdp_onebit_adam(freeze_step=1, min_compressed_size=1024)
  grads = {"kernel": jnp.ones((N * 16, 8)), "small": jnp.ones((N * 4, 8)),
           "bias": jnp.ones(512)}
  specs = {"kernel": P(AXIS), "small": P(AXIS), "bias": P()}

  def two_updates(grads):
    state = tx.init(grads)
    _, state = tx.update(grads, state)
    _, later = tx.update(jax.tree.map(lambda g: 3 * g, grads), state)
    return jax.tree.map(lambda a, b: jnp.all(a == b)[None], later.nu, state.nu)

  grads = jax.device_put(grads, jax.tree.map(lambda spec: NamedSharding(MESH, spec), specs))
  frozen = jax.jit(jax.shard_map(two_updates, mesh=MESH, in_specs=(specs,),
                                 out_specs=P(AXIS)))(grads)
  assert {name: bool(np.all(np.asarray(kept))) for name, kept in frozen.items()} == {
      "kernel": True, "small": False, "bias": False}
