"""Tests of the sparse family: TopK, the sparse exchange, top-k with error feedback, DeMo,
SparseLoCo's outer average and DGC, against the NumPy references of ``sparse_reference.py``.

Four simulated devices take part; the shapes are tiny, so that each program compiles in a few
seconds.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import sparse_reference as reference
from helpers import assert_replicas_identical
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qsgd_jax
from qsgd_jax._src import serialize
from qsgd_jax._src.sparse import blocks, exchange

AXIS = "batch"
WORKERS = 4
_DEVICES = jax.devices()[:WORKERS]


def _pmap(f, **kwargs):
  return jax.pmap(f, axis_name=AXIS, devices=_DEVICES, **kwargs)


def _normal(seed, *shape):
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


# TopK ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("value_dtype", [jnp.float32, jnp.bfloat16])
def test_topk_keeps_the_largest_magnitudes_of_each_chunk(value_dtype):
  x = _normal(0, 37, 29)  # 1073 elements: the last chunk of 100 is padded.
  topk = qsgd_jax.TopK(density=0.05, chunk=100, value_dtype=value_dtype)
  payload = jax.jit(topk.encode)(jax.random.key(0), x)
  expected = reference.topk_chunks(x, 5, 100)
  expected = np.asarray(jnp.asarray(expected, value_dtype).astype(jnp.float32))
  np.testing.assert_array_equal(np.asarray(jax.jit(topk.decode)(payload)), expected)
  np.testing.assert_array_equal(np.asarray(jax.jit(topk.support)(payload)), expected != 0)


@pytest.mark.parametrize("options", [
    dict(k=3, chunk=64), dict(k=3, chunk=64, value_dtype=jnp.bfloat16),
    dict(k=5, chunk=100, value_bits=4), dict(k=5, chunk=100, value_bits=2, quantizer="bin_means")])
def test_topk_payload_round_trips_through_the_wire_bit_for_bit(options):
  topk = qsgd_jax.TopK(**options)
  x = _normal(1, 300)
  payload = jax.jit(topk.encode)(jax.random.key(1), x)
  received = jax.jit(lambda words: serialize.from_words(words, payload))(
      jax.jit(serialize.to_words)(payload))
  decode = jax.jit(topk.decode)
  np.testing.assert_array_equal(np.asarray(decode(received)), np.asarray(decode(payload)))
  assert 8 * serialize.num_words(payload) * 4 == topk.wire_bits(x.shape)


# 4 bits: codes that divide 32, as 2 and 8 bits'.
@pytest.mark.parametrize("bits", [2, pytest.param(4, marks=pytest.mark.slow), 8])
def test_scaled_values_are_unbiased_given_the_kept_positions(bits):
  topk = qsgd_jax.TopK(k=4, chunk=16, value_bits=bits)
  x = jnp.asarray(_normal(2, 64))
  samples = np.asarray(jax.jit(jax.vmap(lambda key: topk.decode(topk.encode(key, x))))(
      jax.random.split(jax.random.key(2), 4000)), np.float64)
  target = reference.topk_chunks(np.asarray(x), 4, 16)
  mean, spread = np.mean(samples, axis=0), np.std(samples, axis=0)
  varies = spread > 0
  np.testing.assert_array_equal(mean[~varies], target[~varies])
  z = (mean[varies] - target[varies]) / (spread[varies] / math.sqrt(samples.shape[0]))
  assert np.max(np.abs(z)) < 5, z
  # Nothing decodes above its chunk's largest kept magnitude.
  largest = np.max(np.abs(target.reshape(4, 16)), axis=1)
  assert np.all(np.abs(samples).reshape(-1, 4, 16).max(axis=(0, 2)) <= largest)


def test_bin_means_are_sparselocos_quantizer():
  topk = qsgd_jax.TopK(k=8, chunk=64, value_bits=2, quantizer="bin_means")
  x = _normal(3, 640)
  payload = jax.jit(topk.encode)(jax.random.key(0), x)
  kept = reference.topk_chunks(x, 8, 64)
  mask = kept != 0
  expected = np.zeros_like(kept)
  expected[mask] = reference.bin_means(kept[mask], 2)
  np.testing.assert_allclose(np.asarray(jax.jit(topk.decode)(payload)), expected, rtol=1e-6,
                             atol=1e-7)


@pytest.mark.parametrize("options, shape, bits", [
    # chunks * k positions of ceil(log2 chunk) bits, packed; then the values.
    (dict(k=3, chunk=64), (1000,), 32 * math.ceil(16 * 3 * 6 / 32) + 16 * 3 * 32),
    (dict(k=3, chunk=64, value_dtype=jnp.bfloat16), (1000,),
     32 * math.ceil(16 * 3 * 6 / 32) + 32 * math.ceil(16 * 3 / 2)),
    (dict(k=32, chunk=4096, value_bits=2, quantizer="bin_means"), (64, 128),
     2 * 32 * 12 + 32 * math.ceil(2 * 32 * 2 / 32) + 32 * 5),
    (dict(k=10, chunk=1024, value_bits=4), (3000,),
     32 * math.ceil(3 * 10 * 10 / 32) + 32 * math.ceil(3 * 10 * 4 / 32) + 3 * 32),
])
def test_wire_bits_are_the_analytic_count(options, shape, bits):
  assert qsgd_jax.TopK(**options).wire_bits(shape) == bits


@pytest.mark.parametrize("options, error, match", [
    (dict(k=0), ValueError, r"k must be an int in \(0, chunk\]"),
    (dict(k=65), ValueError, r"k must be an int in \(0, chunk\] = \[1, 64\]"),
    (dict(density=0.0), ValueError, r"density must be a fraction in \(0, 1\]"),
    (dict(density=1.5), ValueError, r"density must be a fraction in \(0, 1\]"),
    (dict(k=2, density=0.1), ValueError, "exactly one of k and density"),
    (dict(), ValueError, "exactly one of k and density"),
    (dict(k=2, value_dtype=jnp.float16), ValueError, "float16 overflows above 65504"),
    (dict(k=2, value_bits=3), ValueError, "value_bits must be None or one of"),
    (dict(k=2, chunk=0), ValueError, "chunk must be an int"),
    (dict(k=2, value_bits=4, value_dtype=jnp.bfloat16), ValueError,
     "value_dtype=bfloat16 is for values sent as floats, but value_bits=4"),
    (dict(k=2, quantizer="bin_means"), ValueError,
     "quantizer='bin_means' quantizes values, but value_bits=None"),
])
def test_topk_refuses_bad_arguments(options, error, match):
  with pytest.raises(error, match=match):
    qsgd_jax.TopK(**options)


def test_bfloat16_values_of_a_float16_leaf_stay_finite():
  """float16's largest, 65504, is 65536 in bfloat16: it decodes to 65504, not inf."""
  topk = qsgd_jax.TopK(k=2, chunk=4, value_dtype=jnp.bfloat16)
  x = jnp.array([65504.0, -65504.0, 1.0, 0.0], jnp.float16)
  # Compiled, as the tests above run them (not operation by operation): the payload's
  # bfloat16 values come out of one program and go into the other.
  decoded = jax.jit(topk.decode)(jax.jit(topk.encode)(jax.random.key(0), x))
  assert decoded.dtype == jnp.float16
  np.testing.assert_array_equal(np.asarray(decoded), [65504.0, -65504.0, 0.0, 0.0])


def test_topk_refuses_integer_values():
  with pytest.raises(TypeError, match="TopK.encode expects a floating-point array"):
    qsgd_jax.TopK(k=2).encode(jax.random.key(0), jnp.arange(100))


def test_reductions_that_sum_payloads_refuse_sparse_ones():
  topk = qsgd_jax.TopK(k=2)
  for method in ("two_phase", "psum"):
    with pytest.raises(ValueError, match="sends sparse payloads.*method='all_gather'"):
      qsgd_jax.compressed_allreduce(topk, AXIS, method=method)

  def psum_scatter(x):
    return qsgd_jax.quantized_psum_scatter(x, AXIS, topk, jax.random.key(0))

  with pytest.raises(ValueError, match="'reduce_scatter' reduction would add up"):
    _pmap(psum_scatter)(jnp.ones((WORKERS, 8192)))


def test_chunks_that_do_not_divide_a_leaf_are_said_once():
  tx = qsgd_jax.compressed_allreduce(qsgd_jax.TopK(k=3, chunk=64), AXIS, min_compressed_size=0)
  tree = {"a": np.ones((WORKERS, 100), np.float32), "b": np.ones((WORKERS, 128), np.float32)}
  state = _pmap(tx.init)(tree)
  with pytest.warns(UserWarning, match=r"chunks of 64 do not divide 1 of the 2 leaves it "
                    r"encodes \(of 100 elements on a device\): each is zero-padded to whole "
                    r"chunks \(28 elements of padding against the 228 encoded\), and its last "
                    r"chunk still sends k=3"):
    jax.block_until_ready(_pmap(tx.update)(tree, state))


def test_the_two_averages():
  """Worker 0 keeps elements 0 and 1, worker 1 elements 1 and 2: over the workers, element 1
  is their sum over 2; over its contributors, their mean, and elements 0 and 2 their own."""
  topk = qsgd_jax.TopK(k=2, chunk=4)
  rows = jnp.array([[3.0, 1.0, 0.0, 0.0], [0.0, 5.0, 2.0, 0.0]])
  aggregations = ("mean_over_workers", "mean_over_contributors")

  @jax.jit  # One program: compiling dominates.
  def averages(rows, taking_part):
    payloads = jax.vmap(topk.encode)(jax.random.split(jax.random.key(0), 2), rows)
    return [{aggregation: exchange.average(topk, payloads, aggregation, mask)
             for aggregation in aggregations} for mask in taking_part]

  both, without_0 = averages(rows, (jnp.array([True, True]), jnp.array([False, True])))
  np.testing.assert_array_equal(both["mean_over_workers"], [1.5, 3.0, 1.0, 0.0])
  np.testing.assert_array_equal(both["mean_over_contributors"], [3.0, 3.0, 2.0, 0.0])
  # Worker 0 left out: worker 1's alone, whichever average.
  for aggregation in aggregations:
    np.testing.assert_array_equal(without_0[aggregation], rows[1])


# Top-k with error feedback through compressed_allreduce ------------------------------------

_TOPK = qsgd_jax.TopK(density=0.05, chunk=128, value_bits=8)
_EF_SHAPES = {"kernel": (40, 50), "bias": (50,)}


def _ef_tx():
  return qsgd_jax.compressed_allreduce(_TOPK, AXIS, error_feedback=True, min_compressed_size=0)


def _ef_grads(step):
  return {name: _normal(10 + step, WORKERS, *shape) for name, shape in _EF_SHAPES.items()}


@functools.cache
def _ef_pmap_run():
  tx = _ef_tx()
  state = _pmap(tx.init)({name: np.zeros((WORKERS, *s), np.float32)
                          for name, s in _EF_SHAPES.items()})
  update = _pmap(tx.update)
  outs, states = [], []
  for step in range(3):
    out, state = jax.block_until_ready(update(_ef_grads(step), state))
    outs.append(out)
    states.append(state)
  hlo = update.lower(_ef_grads(0), state).compile().as_text()
  return outs, states, hlo


def test_topk_error_feedback_is_grace_mean_of_residual_corrected_top_k():
  """GRACE's ResidualMemory and all-gather communicator: each worker sends top-k of gradient
  plus residual and keeps the rest; the update is the workers' sum over their number. The
  8-bit values round stochastically, so the check is on float32 values."""
  tx = qsgd_jax.compressed_allreduce(qsgd_jax.TopK(density=0.05, chunk=128), AXIS,
                                     error_feedback=True, min_compressed_size=0)
  state = _pmap(tx.init)(np.zeros((WORKERS, 40, 50), np.float32))
  residual = [np.zeros((40, 50)) for _ in range(WORKERS)]
  for step in range(3):
    grads = _ef_grads(step)["kernel"]
    out, state = jax.block_until_ready(_pmap(tx.update)(grads, state))
    corrected = [grads[w] + residual[w] for w in range(WORKERS)]
    sent = [reference.topk_chunks(c, 6, 128) for c in corrected]
    residual = [c - s for c, s in zip(corrected, sent, strict=True)]
    np.testing.assert_allclose(np.asarray(out[0]), sum(sent) / WORKERS, rtol=1e-6, atol=1e-6)
    assert_replicas_identical(out)


def test_topk_error_feedback_is_the_same_on_every_device_and_counts_its_bytes():
  outs, states, hlo = _ef_pmap_run()
  for out in outs:
    assert_replicas_identical(out)
  stats = qsgd_jax.compression_stats(states[-1])
  # The analytic count: one all-gather of every device's payloads (the leaves end to end,
  # each padded to whole chunks), (n - 1) / n of the gathered words, and one float32 flag
  # all-reduced (whether any device's gradient was not finite).
  chunks = sum(-(-math.prod(s) // 128) for s in _EF_SHAPES.values())
  payload_bits = _TOPK.wire_bits((chunks * 128,))
  analytic = (WORKERS - 1) * payload_bits + 2 * (WORKERS - 1) / WORKERS * 32
  assert float(stats.wire_bits[0]) == pytest.approx(analytic)
  assert qsgd_jax.wire_bytes(hlo) * 8 == pytest.approx(analytic, rel=0.02)


def test_topk_error_feedback_under_shard_map_matches_pmap():
  outs, _, _ = _ef_pmap_run()
  tx = _ef_tx()
  mesh = jax.make_mesh((WORKERS,), (AXIS,), devices=_DEVICES,
                       axis_types=(jax.sharding.AxisType.Explicit,))
  zeros = {name: jnp.zeros(s) for name, s in _EF_SHAPES.items()}
  specs = qsgd_jax.state_partition_specs(jax.eval_shape(tx.init, zeros), AXIS)
  init = jax.jit(jax.shard_map(lambda p: tx.init(jax.tree.map(lambda x: x[0], p)), mesh=mesh,
                               in_specs=P(AXIS), out_specs=specs))
  update = jax.jit(jax.shard_map(
      lambda g, s: tx.update(jax.tree.map(lambda x: x[0], g), s), mesh=mesh,
      in_specs=(P(AXIS), specs), out_specs=(P(), specs)))
  put = functools.partial(jax.device_put, device=NamedSharding(mesh, P(AXIS)))
  state = init(put({name: np.zeros((WORKERS, *s), np.float32) for name, s in _EF_SHAPES.items()}))
  for step in range(3):
    out, state = jax.block_until_ready(update(put(_ef_grads(step)), state))
    for name in _EF_SHAPES:
      np.testing.assert_array_equal(np.asarray(out[name]), np.asarray(outs[step][name][0]))


def test_a_nonfinite_gradient_makes_every_mean_nan_and_keeps_the_residuals():
  _, states, _ = _ef_pmap_run()
  grads = _ef_grads(5)
  grads["kernel"][2, 3, 4] = np.nan
  out, state = _pmap(_ef_tx().update)(grads, states[-1])
  assert np.all(np.isnan(np.asarray(out["kernel"])))
  for new, old in zip(state.local_error, states[-1].local_error, strict=True):
    np.testing.assert_array_equal(np.asarray(new), np.asarray(old))


# DeMo -----------------------------------------------------------------------------------------

_DEMO_SHAPES = ((24, 40), (100,), (6, 10))
_DEMO_OPTIONS = dict(chunk=8, k=5, decay=0.9, weight_decay=0.1)


def _demo_grads(step):
  return [_normal(30 + step, WORKERS, *shape) for shape in _DEMO_SHAPES]


@pytest.mark.slow
def test_demo_is_demo_py():
  lr = 0.01
  tx = qsgd_jax.demo(lr, AXIS, **_DEMO_OPTIONS)
  params = [_normal(20, *shape) for shape in _DEMO_SHAPES]
  stacked = [np.broadcast_to(p, (WORKERS, *p.shape)) for p in params]
  state = _pmap(tx.init)(stacked)
  update = _pmap(tx.update)
  expected = [p.astype(np.float64) for p in params]
  momenta = [[np.zeros(s) for s in _DEMO_SHAPES] for _ in range(WORKERS)]
  for step in range(3):
    grads = _demo_grads(step)
    updates, state = jax.block_until_ready(update(grads, state, stacked))
    assert_replicas_identical(updates)
    stacked = [np.asarray(p + u) for p, u in zip(stacked, updates, strict=True)]
    expected, momenta = reference.demo_step(
        expected, momenta, [[g[w] for g in grads] for w in range(WORKERS)], lr,
        chunk=8, k=5, decay=0.9, weight_decay=0.1)
    for got, want in zip(stacked, expected, strict=True):
      np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-6)
    for w in range(WORKERS):
      for got, want in zip(state[0].momentum, momenta[w], strict=True):
        np.testing.assert_allclose(np.asarray(got[w]), want, rtol=1e-4, atol=1e-6)


def test_demo_skips_a_nonfinite_step_on_every_device():
  tx = qsgd_jax.demo(0.01, AXIS, **_DEMO_OPTIONS)
  params = [np.zeros((WORKERS, *s), np.float32) for s in _DEMO_SHAPES]
  state = _pmap(tx.init)(params)
  update = _pmap(tx.update)
  _, state = update(_demo_grads(0), state, params)
  grads = _demo_grads(1)
  grads[1][3, 7] = np.inf
  updates, new_state = update(grads, state, params)
  for u in updates:
    np.testing.assert_array_equal(np.asarray(u), 0.0)
  assert int(new_state[0].count[0]) == 1
  for new, old in zip(new_state[0].momentum, state[0].momentum, strict=True):
    np.testing.assert_array_equal(np.asarray(new), np.asarray(old))


def test_demo_counts_its_bytes_as_the_compiled_program_sends_them():
  tx = qsgd_jax.scale_by_demo(0.01, AXIS, chunk=8, k=5)
  params = [np.zeros((WORKERS, *s), np.float32) for s in _DEMO_SHAPES]
  state = _pmap(tx.init)(params)
  update = _pmap(tx.update)
  _, state = update(_demo_grads(0), state)
  layouts = [blocks.block_layout(s, (1, s[0]) if len(s) == 1 else s, 8) for s in _DEMO_SHAPES]
  # Per leaf, k (or the whole block) positions and float32 values a block; one flag word.
  words = 1 + sum(
      math.ceil(b.num_blocks * min(5, b.block_size) * max(1, (b.block_size - 1).bit_length()) / 32)
      + b.num_blocks * min(5, b.block_size) for b in layouts)
  analytic = 8 * (WORKERS - 1) * words * 4
  assert float(state.stats.wire_bits[0]) == analytic
  hlo = update.lower(_demo_grads(0), state).compile().as_text()
  assert qsgd_jax.wire_bytes(hlo) * 8 == pytest.approx(analytic, rel=0.02)


def test_demo_refuses_bad_arguments():
  with pytest.raises(ValueError, match=r"k must be an int in \[1, 64\]"):
    qsgd_jax.demo(0.1, AXIS, chunk=8, k=65)
  with pytest.raises(ValueError, match=r"decay must be in \[0, 1\)"):
    qsgd_jax.demo(0.1, AXIS, decay=1.0)
  with pytest.raises(ValueError, match="value_dtype must be float32 or bfloat16"):
    qsgd_jax.demo(0.1, AXIS, value_dtype=jnp.float16)
  with pytest.raises(ValueError, match=r"matrix_view gave \(3, 3\) for the leaf \['w'\]"):
    qsgd_jax.demo(0.1, AXIS, matrix_view=lambda path, shape: (3, 3)).init(
        {"w": jnp.zeros((4, 4))})


# SparseLoCo -------------------------------------------------------------------------------

_LOCO_SHAPES = ((16, 24), (40,), (2, 3, 8))
_LOCO_OPTIONS = dict(density=0.1, chunk=8, value_bits=2, error_decay=0.9)


def test_sparseloco_average_is_sparseloco_py():
  tx = qsgd_jax.sparseloco_average(AXIS, **_LOCO_OPTIONS)
  state = _pmap(tx.init)(tuple(np.zeros((WORKERS, *s), np.float32) for s in _LOCO_SHAPES))
  update = _pmap(tx.update)
  errors = [[np.zeros(s) for s in _LOCO_SHAPES] for _ in range(WORKERS)]
  for step in range(3):
    deltas = tuple(_normal(40 + step, WORKERS, *s) for s in _LOCO_SHAPES)
    averaged, state = jax.block_until_ready(update(deltas, state))
    assert_replicas_identical(averaged)
    expected, errors = reference.sparseloco_round(
        errors, [[d[w] for d in deltas] for w in range(WORKERS)], density=0.1, chunk=8,
        bits=2, decay=0.9)
    for got, want in zip(averaged, expected, strict=True):
      np.testing.assert_allclose(np.asarray(got[0]), want, rtol=1e-5, atol=1e-6)
    for w in range(WORKERS):
      for got, want in zip(state.error, errors[w], strict=True):
        np.testing.assert_allclose(np.asarray(got[w]), want, rtol=1e-5, atol=1e-5)


# SparseLoCo hands its aggregation to exchange.average, whose mean over the workers (a worker
# left out too) test_the_two_averages checks: that one runs in the slow tier.
@pytest.mark.parametrize("aggregation", [
    "mean_over_contributors", pytest.param("mean_over_workers", marks=pytest.mark.slow)])
def test_sparseloco_average_leaves_out_the_workers_not_taking_part(aggregation):
  """Worker 1 does not take part in the second round, with a NaN outer gradient: the average is
  sparseloco.py's over the other three (whose buffers go on as theirs), and worker 1's buffer
  stays as the first round left it."""
  tx = qsgd_jax.sparseloco_average(AXIS, aggregation=aggregation, **_LOCO_OPTIONS)
  assert isinstance(tx, qsgd_jax.AverageOverParticipants)
  state = _pmap(tx.init)(tuple(np.zeros((WORKERS, *s), np.float32) for s in _LOCO_SHAPES))
  update = _pmap(tx.update)
  errors = [[np.zeros(s) for s in _LOCO_SHAPES] for _ in range(WORKERS)]
  first = tuple(_normal(60, WORKERS, *s) for s in _LOCO_SHAPES)
  _, state = jax.block_until_ready(update(first, state, participating=np.ones(WORKERS, bool)))
  _, errors = reference.sparseloco_round(
      errors, [[d[w] for d in first] for w in range(WORKERS)], density=0.1, chunk=8, bits=2,
      decay=0.9)
  second = tuple(_normal(61, WORKERS, *s) for s in _LOCO_SHAPES)
  second[0][1, 0, 0] = np.nan
  taking_part = np.array([True, False, True, True])
  averaged, state = jax.block_until_ready(update(second, state, participating=taking_part))
  assert_replicas_identical(averaged)
  in_ = [0, 2, 3]
  expected, errors_in = reference.sparseloco_round(
      [errors[w] for w in in_], [[d[w] for d in second] for w in in_], density=0.1, chunk=8,
      bits=2, decay=0.9)
  if aggregation == "mean_over_workers":
    expected = _mean_over_workers_round([errors[w] for w in in_],
                                        [[d[w] for d in second] for w in in_])
  for got, want in zip(averaged, expected, strict=True):
    np.testing.assert_allclose(np.asarray(got[0]), want, rtol=1e-5, atol=1e-6)
  for w, want_errors in zip(in_ + [1], errors_in + [errors[1]], strict=True):
    for got, want in zip(state.error, want_errors, strict=True):
      np.testing.assert_allclose(np.asarray(got[w]), want, rtol=1e-5, atol=1e-5)


def _mean_over_workers_round(errors, deltas):
  r"""The paper's mean of a round, :math:`\frac1R \sum_r \hat\Delta_r`, over the workers given."""
  sent = []
  for w in range(len(deltas)):
    _, (new,) = reference.sparseloco_round([errors[w]], [deltas[w]], density=0.1, chunk=8,
                                           bits=2, decay=0.9)
    sent.append([0.9 * e + d - n for e, d, n in zip(errors[w], deltas[w], new, strict=True)])
  return [np.mean([s[i] for s in sent], axis=0) for i in range(len(deltas[0]))]


def test_diloco_leaves_a_non_finite_worker_out_of_sparselocos_mean_over_contributors():
  """Worker 0's outer gradient overflows at a sync: the global parameters move by the
  contributor mean of the other three workers' sparse outer gradients (not rescaled by 4 / 3,
  as a mean over all workers would be), and worker 0's buffer stays empty."""
  tx = qsgd_jax.diloco(optax.sgd(1.0), AXIS, sync_every=1, outer_optimizer=optax.sgd(1.0),
                       average=qsgd_jax.sparseloco_average(AXIS, **_LOCO_OPTIONS))
  start = np.zeros((WORKERS, 16, 24), np.float32)
  start[:, 0, 0] = 2e38
  state = _pmap(tx.init)({"w": start})
  local = start.copy()
  local[0, 0, 0] = -2e38  # Worker 0's outer gradient there: 2e38 + 2e38, inf.
  grads = _normal(70, WORKERS, 16, 24)
  grads[:, 0, 0] = 0.0  # Every other worker's outer gradient is its gradient, exactly.

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  _, state = jax.block_until_ready(_pmap(step)({"w": local}, state, {"w": grads}))
  assert int(state.skipped_workers[0]) == 1
  (expected,), _ = reference.sparseloco_round(
      [[np.zeros((16, 24))] for _ in range(3)], [[grads[w]] for w in (1, 2, 3)], density=0.1,
      chunk=8, bits=2, decay=0.9)
  moved = np.asarray(state.global_params["w"]) - start
  assert_replicas_identical(moved)
  moved[:, 0, 0] = 0.0
  np.testing.assert_allclose(moved[0], -expected, rtol=1e-5, atol=1e-6)
  (buffer,) = state.fragments[0].average_state.error
  np.testing.assert_array_equal(np.asarray(buffer[0]), 0.0)
  assert np.count_nonzero(np.asarray(buffer[1:])) > 0


def test_sparseloco_is_diloco_average_under_shard_map():
  """Two workers of two devices each (a worker's devices alike), syncing every 2 steps: the
  global parameters the same on every device, and moved by the sparse average."""
  tx = qsgd_jax.diloco(optax.sgd(0.1), "workers", sync_every=2, outer_optimizer=optax.sgd(1.0),
                       average=qsgd_jax.sparseloco_average("workers", **_LOCO_OPTIONS))
  mesh = jax.make_mesh((2, 2), ("workers", AXIS), devices=_DEVICES,
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  params = {"w": jnp.zeros((16, 24)), "b": jnp.zeros(40)}
  shapes = jax.eval_shape(tx.init, params)
  specs = qsgd_jax.state_partition_specs(shapes, "workers")

  def step(p, s, target):
    p = jax.tree.map(lambda x: x[0], p)
    grads = jax.tree.map(lambda x, t: x - t[0], p, target)
    updates, s = tx.update(grads, s, p)
    return jax.tree.map(lambda x: x[None], optax.apply_updates(p, updates)), s

  init = jax.jit(jax.shard_map(lambda p: tx.init(jax.tree.map(lambda x: x[0], p)), mesh=mesh,
                               in_specs=P("workers"), out_specs=specs))
  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("workers"), specs, P("workers")),
                              out_specs=(P("workers"), specs)))
  stacked = jax.device_put(jax.tree.map(lambda x: jnp.stack([x, x]), params),
                           NamedSharding(mesh, P("workers")))
  state = init(stacked)
  targets = jax.device_put({"w": _normal(50, 2, 16, 24), "b": _normal(51, 2, 40)},
                           NamedSharding(mesh, P("workers")))
  sent = []
  for _ in range(3):  # The second step syncs.
    stacked, state = jax.block_until_ready(run(stacked, state, targets))
    sent.append(float(qsgd_jax.compression_stats(state).wire_bits))
  assert sent[0] == sent[2] == 0 < sent[1]
  assert np.count_nonzero(np.asarray(state.global_params["w"])) > 0


def test_sparseloco_refuses_bad_arguments():
  with pytest.raises(ValueError, match=r"density must be a fraction in \(0, 1\]"):
    qsgd_jax.sparseloco_average(AXIS, density=0.0)
  with pytest.raises(ValueError, match=r"error_decay must be in \[0, 1\]"):
    qsgd_jax.sparseloco_average(AXIS, error_decay=1.5)
  with pytest.raises(ValueError, match="value_bits must be None or one of"):
    qsgd_jax.sparseloco_average(AXIS, value_bits=3)
  with pytest.raises(ValueError, match="aggregation must be one of"):
    qsgd_jax.sparseloco_average(AXIS, aggregation="sum")


# DGC ------------------------------------------------------------------------------------------

_DGC_SHAPES = ((20, 30), (3, 4, 25))


def test_dgc_is_momentum_corrected_masked_top_k():
  tx = qsgd_jax.scale_by_dgc(AXIS, density=0.05, chunk=100, momentum=0.9, clip_norm=2.0)
  state = _pmap(tx.init)([np.zeros((WORKERS, *s), np.float32) for s in _DGC_SHAPES])
  update = _pmap(tx.update)
  momenta = [[np.zeros(s) for s in _DGC_SHAPES] for _ in range(WORKERS)]
  velocities = [[np.zeros(s) for s in _DGC_SHAPES] for _ in range(WORKERS)]
  for step in range(3):
    grads = [_normal(60 + step, WORKERS, *s) for s in _DGC_SHAPES]
    out, state = jax.block_until_ready(update(grads, state))
    assert_replicas_identical(out)
    expected, momenta, velocities = reference.dgc_step(
        momenta, velocities, [[g[w] for g in grads] for w in range(WORKERS)], k=5, chunk=100,
        momentum=0.9, masking=True, clip=2.0 * math.sqrt(WORKERS))
    for got, want in zip(out, expected, strict=True):
      np.testing.assert_allclose(np.asarray(got[0]), want, rtol=1e-5, atol=1e-6)
    for w in range(WORKERS):
      for got, want in zip(state.momentum + state.velocity, momenta[w] + velocities[w],
                           strict=True):
        np.testing.assert_allclose(np.asarray(got[w]), want, rtol=1e-5, atol=1e-6)


def test_dgc_warm_up_sends_the_densities_of_its_stages():
  tx = qsgd_jax.scale_by_dgc(None, density=0.01, chunk=400, warmup_densities=(0.25, 0.05),
                             warmup_steps=2)
  grads = {"w": jnp.asarray(_normal(70, 20, 20)), "b": jnp.ones(20)}
  state = tx.init(grads)
  update = jax.jit(tx.update)
  kept = []
  for _ in range(5):
    out, state = update(grads, state)
    kept.append(int(jnp.count_nonzero(out["w"])))
  assert kept == [100, 100, 20, 20, 4]


def test_dgc_refuses_bad_arguments():
  with pytest.raises(ValueError, match="warmup_densities need warmup_steps"):
    qsgd_jax.scale_by_dgc(AXIS, warmup_densities=(0.25,))
  with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\)"):
    qsgd_jax.scale_by_dgc(AXIS, momentum=1.0)
  with pytest.raises(ValueError, match=r"warmup_densities\[1\] must be a fraction in \(0, 1\]"):
    qsgd_jax.scale_by_dgc(AXIS, warmup_densities=(0.25, 2.0), warmup_steps=1)
  with pytest.raises(ValueError, match="warmup_steps=100 without warmup_densities"):
    qsgd_jax.scale_by_dgc(AXIS, warmup_steps=100)
