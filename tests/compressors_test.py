"""Tests of the compressors: statistics, exact reconstructions, wire size, API.

Statistics use many fixed keys under one compiled ``vmap`` a configuration:
unbiasedness by z-scores against the exact variance of stochastic rounding,
QSGD's Lemma 3.1 (Alistarh et al. 2017) for the L2 norm, MinMax's one-step
error bound. Compiling dominates the run time, so the edge cases (shapes,
dtypes, zeros, non-finite values) of each compressor share one program.
"""

import dataclasses
import doctest
import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import references

import qsgd_jax
from qsgd_jax._src.compressors import baselines, minmax, onebit, packing, qsgd, zero_aligned_minmax

NUM_KEYS = 4096
KEYS = jax.random.split(jax.random.key(0), NUM_KEYS)
Z_LIMIT = 5.0


def _marked_slow(names, slow):
  """``names`` as test parameters, those in ``slow`` marked slow: each takes the code paths of
  a parameter that stays (the reason is given where they are chosen)."""
  assert set(slow) <= set(names), set(slow) - set(names)
  return [pytest.param(name, marks=pytest.mark.slow) if name in slow else name for name in names]


def _gaussian(shape, seed=0) -> np.ndarray:
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@functools.cache
def _round_trips_over_keys(compressor, shape):
  """``decode(encode(k, x))`` of a Gaussian ``x`` for every key, and its scales."""
  x = _gaussian(shape)

  @jax.jit  # One program for both: compiling dominates.
  def run(keys):
    samples = jax.vmap(lambda key: compressor.decode(compressor.encode(key, x)))(keys)
    return samples, compressor.encode(keys[0], x).scales

  samples, scales = run(KEYS)
  return x.astype(np.float64), np.asarray(samples), np.asarray(scales, np.float64)


def _buckets(flat: np.ndarray, bucket_size, size: int) -> np.ndarray:
  """Bucket index of each element of a flattened array."""
  bucket_len = size if bucket_size is None else min(bucket_size, size)
  return np.arange(flat.size) // max(bucket_len, 1)


def _rounding_grid(compressor, x: np.ndarray, scales: np.ndarray):
  """Per element: the quantizer's step, and where x sits between two levels.

  Returns ``(step, fraction)``: stochastic rounding lands on one of two levels
  a step apart, the upper one with probability ``fraction``.
  """
  flat = x.reshape(-1)
  bucket = _buckets(flat, compressor.bucket_size, flat.size)
  if isinstance(compressor, qsgd_jax.QSGD):
    step = scales[bucket, 0] / compressor.levels
    position = np.abs(flat) / np.where(step > 0, step, 1.0)
  else:
    low, high = scales[bucket, 0], scales[bucket, 1]
    step = (high - low) / compressor.num_steps
    position = (flat - low) / np.where(step > 0, step, 1.0)
  return step, position - np.floor(position)


UNBIASED = {
    "qsgd4_max_bucket256": qsgd_jax.QSGD(bits=4, bucket_size=256),
    "qsgd8_max_whole": qsgd_jax.QSGD(bits=8, bucket_size=None),
    "qsgd4_l2_whole": qsgd_jax.QSGD(bits=4, bucket_size=None, norm="l2"),
    "qsgd3levels_l2_bucket100": qsgd_jax.QSGD(levels=3, bucket_size=100, norm="l2"),
    "minmax8_whole": qsgd_jax.MinMax(bits=8, bucket_size=None),
    "minmax1_bucket64": qsgd_jax.MinMax(bits=1, bucket_size=64),
    "minmax3_bucket7": qsgd_jax.MinMax(bits=3, bucket_size=7),
}
SHAPE = (20, 50)  # 1000 elements: no bucket size above divides it.


# Each norm, bucketing and bit width stays: the max norm and bits that divide 32 in
# qsgd4_max_bucket256, the L2 norm in qsgd3levels_l2_bucket100, one bucket a leaf in
# minmax8_whole (FixedBuckets' length, QSGD's and MinMax's alike). QSGD's whole leaves, at
# 8 bits under the max norm and at 4 under the L2 norm, run in the slow tier.
@pytest.mark.parametrize("name", _marked_slow(UNBIASED, {"qsgd8_max_whole", "qsgd4_l2_whole"}))
def test_unbiased(name):
  compressor = UNBIASED[name]
  assert compressor.unbiased
  x, samples, scales = _round_trips_over_keys(compressor, SHAPE)
  chex.assert_shape(samples, (NUM_KEYS, *SHAPE))
  step, fraction = _rounding_grid(compressor, x, scales)
  variance = (step**2 * fraction * (1 - fraction)).reshape(SHAPE)
  sample_variance = samples.var(axis=0, dtype=np.float64)
  error = np.abs(samples.mean(axis=0, dtype=np.float64) - x)
  # A value on a level (a bucket's maximum, say) can land a float rounding
  # below it and then, very rarely, round down a whole step: the observed
  # variance covers that. The slack covers float rounding of the scales and
  # the 2**-24 resolution of the draws.
  standard_error = np.sqrt(np.maximum(variance, sample_variance) / NUM_KEYS)
  slack = 1e-6 * (np.abs(x) + step.reshape(SHAPE))
  np.testing.assert_array_less(error, Z_LIMIT * standard_error + slack)
  # The spread is stochastic rounding's, no more: sum of variances within 5%.
  np.testing.assert_allclose(sample_variance.sum(), variance.sum(), rtol=0.05)


def _heavy_tailed(size: int) -> np.ndarray:
  return np.random.default_rng(1).standard_cauchy(size).astype(np.float32)


LEMMA_SIZE = 1024
LEMMA_VECTORS = {
    "gaussian": _gaussian((LEMMA_SIZE,), seed=2),
    "cauchy": _heavy_tailed(LEMMA_SIZE),
}


@functools.cache
def _lemma_round_trip(levels: int):
  """``Q_s`` of one vector under 2048 keys, compiled once for every vector."""
  compressor = qsgd_jax.QSGD(levels=levels, bucket_size=None, norm="l2")
  return jax.jit(
      jax.vmap(lambda key, x: compressor.decode(compressor.encode(key, x)), in_axes=(0, None))
  )


def _lemma_samples(levels: int, vector: str) -> np.ndarray:
  return np.asarray(_lemma_round_trip(levels)(KEYS[:2048], LEMMA_VECTORS[vector]), np.float64)


@pytest.mark.parametrize("vector", list(LEMMA_VECTORS))
# s = 7 (4 bits): bits dividing 32 as s = 1 and 64, below sqrt(n) as s = 1 and 2.
@pytest.mark.parametrize("levels", [1, 2, pytest.param(7, marks=pytest.mark.slow), 64])
def test_lemma_3_1_variance_and_sparsity(levels, vector):
  v = LEMMA_VECTORS[vector].astype(np.float64)
  n, s = v.size, levels
  samples = _lemma_samples(levels, vector)
  norm_squared = np.sum(v**2)
  # Exact expectations: each |v_i| s / ||v|| rounds up with its fraction.
  position = np.abs(v) * s / np.sqrt(norm_squared)
  fraction = position - np.floor(position)
  exact_error = np.sum((np.sqrt(norm_squared) / s) ** 2 * fraction * (1 - fraction))
  exact_nonzeros = np.sum(np.where(position >= 1, 1.0, fraction))
  variance_bound = min(n / s**2, np.sqrt(n) / s) * norm_squared
  sparsity_bound = s * (s + np.sqrt(n))
  assert exact_error <= variance_bound and exact_nonzeros <= sparsity_bound

  squared_error = np.sum((samples - v) ** 2, axis=1)
  nonzeros = np.count_nonzero(samples, axis=1)
  for estimate, exact, bound in (
      (squared_error, exact_error, variance_bound),
      (nonzeros, exact_nonzeros, sparsity_bound),
  ):
    standard_error = estimate.std() / np.sqrt(estimate.size)
    assert abs(estimate.mean() - exact) <= Z_LIMIT * standard_error + 1e-6 * exact
    assert estimate.mean() <= bound + Z_LIMIT * standard_error


@pytest.mark.parametrize("name", [name for name in UNBIASED if name.startswith("minmax")])
def test_minmax_error_within_one_step(name):
  compressor = UNBIASED[name]
  x, samples, scales = _round_trips_over_keys(compressor, SHAPE)
  step, _ = _rounding_grid(compressor, x, scales)
  error = np.abs(samples - x).reshape(NUM_KEYS, -1)
  np.testing.assert_array_less(error, np.broadcast_to(step * (1 + 1e-5), error.shape))


def test_minmax_constant_buckets_decode_exactly():
  # 450 elements in buckets of 100: the last one is short; every one constant.
  x = np.repeat(np.array([3.0, -1.5, 0.0, 1e-3, 7.25], np.float32), [100, 100, 100, 100, 50])
  constant = np.full_like(x, -2.75)
  bucketed, whole = qsgd_jax.MinMax(2, bucket_size=100), qsgd_jax.MinMax(8, bucket_size=None)

  @jax.jit
  def round_trips(key):
    return (
        bucketed.decode(bucketed.encode(key, x)),
        whole.decode(whole.encode(key, constant)),
    )

  decoded_bucketed, decoded_whole = round_trips(KEYS[1])
  np.testing.assert_array_equal(decoded_bucketed, x)
  np.testing.assert_array_equal(decoded_whole, constant)


def _onebit_reference(x: np.ndarray, bucket_size) -> tuple[np.ndarray, np.ndarray]:
  """Each element's bucket mean of its side (negative or not), and bucket ids."""
  if bucket_size is None:
    rows = x.reshape(-1, x.shape[-1] if x.ndim else 1)
    bucket = np.repeat(np.arange(rows.shape[0]), rows.shape[1])
  else:
    bucket = np.arange(x.size) // min(bucket_size, x.size)
  flat = x.reshape(-1).astype(np.float64)
  expected = np.empty_like(flat)
  for b in np.unique(bucket):
    for side in (flat < 0, flat >= 0):
      members = (bucket == b) & side
      if members.any():
        expected[members] = flat[members].mean()
  return expected.reshape(x.shape), bucket


SIDES = np.array([1, -1, 1], np.float32)
ONEBIT_CASES = {
    "rows_of_matrix": (None, _gaussian((4, 50), seed=3)),
    "rows_of_3d": (None, _gaussian((2, 3, 10), seed=4)),
    "vector_one_bucket": (None, _gaussian((77,), seed=5)),
    "bucket_not_dividing": (16, _gaussian((77,), seed=6)),
    # Buckets of 16: all non-negative, all negative, and a short non-negative one.
    "one_sided_buckets": (16, np.abs(_gaussian((40,), seed=7)) * np.repeat(SIDES, [16, 16, 8])),
}


@functools.cache
def _onebit_decoded() -> dict[str, np.ndarray]:
  """Every OneBit case, compiled as one program."""

  @jax.jit
  def run(key, cases):
    decoded = {}
    for name, x in cases.items():
      compressor = qsgd_jax.OneBit(bucket_size=ONEBIT_CASES[name][0])
      decoded[name] = compressor.decode(compressor.encode(key, x))
    return decoded

  cases = {name: x for name, (_, x) in ONEBIT_CASES.items()}
  return jax.tree.map(lambda d: np.asarray(d, np.float64), run(KEYS[0], cases))


@pytest.mark.parametrize("name", list(ONEBIT_CASES))
def test_onebit_reconstructs_bucket_means_and_keeps_sums(name):
  bucket_size, x = ONEBIT_CASES[name]
  assert qsgd_jax.OneBit(bucket_size).deterministic and not qsgd_jax.OneBit(bucket_size).unbiased
  decoded = _onebit_decoded()[name]
  expected, bucket = _onebit_reference(x, bucket_size)
  chex.assert_trees_all_close(decoded, expected, rtol=1e-5, atol=1e-6)
  flat = x.reshape(-1).astype(np.float64)
  sums = np.bincount(bucket, weights=flat)
  decoded_sums = np.bincount(bucket, weights=decoded.reshape(-1))
  scale = np.bincount(bucket, weights=np.abs(flat))
  np.testing.assert_array_less(np.abs(decoded_sums - sums), 1e-5 * scale + 1e-6)
  if name == "one_sided_buckets":  # One value a bucket: its mean.
    np.testing.assert_allclose(decoded[:16], flat[:16].mean(), rtol=1e-6)
    np.testing.assert_allclose(decoded[16:32], flat[16:32].mean(), rtol=1e-6)


def _bagua_cases() -> dict[str, tuple[int | None, np.ndarray]]:
  """Vectors for Bagua's quantizer: ``(bucket_size, x)``."""
  rng = np.random.default_rng(12)
  spread = (rng.standard_normal(1030) * rng.uniform(0.01, 10.0, 1030)).astype(np.float32)
  spread[200:300] = 0.0  # A zero bucket.
  spread[300:400] = np.abs(spread[300:400]) + 5.0  # Positive, away from zero.
  spread[400:500] = -np.abs(spread[400:500])  # Negative.
  return {
      "buckets_of_100": (100, spread),  # The last bucket is 30 long.
      "whole": (None, _gaussian((777,), seed=13) * np.float32(1e-3)),
  }


@pytest.mark.parametrize("name", ["buckets_of_100", "whole"])
def test_nearest_zero_aligned_is_baguas_kernel_bit_for_bit(name):
  bucket_size, x = _bagua_cases()[name]
  compressor = qsgd_jax.NearestZeroAlignedMinMax(bucket_size=bucket_size)
  assert compressor.deterministic and not compressor.unbiased

  @jax.jit  # One program: compiling dominates.
  def run(x):
    payload = compressor.encode(KEYS[0], x)
    return packing.unpack(payload.packed, x.size, 8), compressor.decode(payload), payload.scales

  codes, decoded, scales = (np.asarray(a) for a in run(x))
  bucket_len = bucket_size or x.size
  for index, start in enumerate(range(0, x.size, bucket_len)):
    bucket = slice(start, start + bucket_len)
    expected_codes, minimum, maximum = references.bagua_compress(x[bucket])
    np.testing.assert_array_equal(codes[bucket], expected_codes)
    np.testing.assert_array_equal(scales[index], [minimum, maximum])
    expected = references.bagua_decompress(expected_codes, minimum, maximum)
    np.testing.assert_array_equal(decoded[bucket].view(np.uint32), expected.view(np.uint32))


def test_nearest_zero_aligned_keeps_zeros_and_errs_half_a_step():
  bucket_size, x = _bagua_cases()["buckets_of_100"]
  x = x.copy()
  x[::7] = 0.0  # Zeros inside buckets whose range is not zero.
  compressor = qsgd_jax.NearestZeroAlignedMinMax(bucket_size=bucket_size)
  decoded = np.asarray(jax.jit(lambda v: compressor.decode(compressor.encode(KEYS[0], v)))(x))
  np.testing.assert_array_equal(decoded[::7], 0.0)
  low = np.minimum.reduceat(x, np.arange(0, x.size, bucket_size)).astype(np.float64)
  high = np.maximum.reduceat(x, np.arange(0, x.size, bucket_size)).astype(np.float64)
  step = np.repeat((high - low + 1e-7) / 255, bucket_size)[: x.size]
  error = np.abs(decoded.astype(np.float64) - x)
  np.testing.assert_array_less(error, step * (0.5 + 1e-4))


# Both quantizers' paths are the fast tests': rounding to nearest bit for bit Bagua's
# (test_nearest_zero_aligned_is_baguas_kernel_bit_for_bit), stochastic rounding's variance
# exactly p(1 - p) a step squared (test_unbiased). Their ratio runs in the slow tier.
@pytest.mark.slow
def test_nearest_rounding_has_half_the_mean_squared_error_of_stochastic():
  # The same data and buckets of 512: rounding to nearest errs by a uniform
  # fraction of a step (mean square 1/12), stochastic rounding by p(1 - p) on
  # average (1/6). So half the mean squared error, 1/sqrt(2) of the RMS error.
  x = _gaussian((64, 4096), seed=14)
  nearest = qsgd_jax.NearestZeroAlignedMinMax(bucket_size=512)
  stochastic = qsgd_jax.MinMax(bits=8, bucket_size=512)

  @jax.jit
  def squared_errors(keys, x):
    def one(compressor, key, row):
      return jnp.mean(jnp.square(compressor.decode(compressor.encode(key, row)) - row))

    return (jax.vmap(functools.partial(one, nearest))(keys, x),
            jax.vmap(functools.partial(one, stochastic))(keys, x))

  nearest_mse, stochastic_mse = (float(np.mean(e)) for e in squared_errors(KEYS[:64], x))
  assert 0.47 < nearest_mse / stochastic_mse < 0.53, nearest_mse / stochastic_mse


# Every compressor, in settings that take different code paths (bit widths
# that divide 32 or not, buckets that divide the size or not, L2 norm, rows).
COMPRESSORS = {
    "qsgd4_bucket512": qsgd_jax.QSGD(bits=4, bucket_size=512),
    "qsgd3levels_l2_bucket100": qsgd_jax.QSGD(levels=3, bucket_size=100, norm="l2"),
    "minmax8_bucket512": qsgd_jax.MinMax(bits=8),
    "minmax5_bucket100": qsgd_jax.MinMax(bits=5, bucket_size=100),
    "nearest_abs_max8_bucket512": qsgd_jax.NearestAbsMax(bits=8, bucket_size=512),
    "nearest8_whole": qsgd_jax.NearestZeroAlignedMinMax(),
    "nearest3_bucket100": qsgd_jax.NearestZeroAlignedMinMax(bits=3, bucket_size=100),
    "onebit_bucket512": qsgd_jax.OneBit(bucket_size=512),
    "onebit_rows": qsgd_jax.OneBit(bucket_size=None),
    "cast_bfloat16": qsgd_jax.Cast(jnp.bfloat16),
    "cast_float16": qsgd_jax.Cast(jnp.float16),
    "identity": qsgd_jax.Identity(),
}


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
# NearestAbsMax encodes parts as QSGD does (its levels draw nothing); the default
# encode_concatenated (the concatenation encoded) of NearestZeroAlignedMinMax and Cast is
# nearest8_whole's and cast_bfloat16's.
@pytest.mark.parametrize("name", _marked_slow(
    COMPRESSORS, {"nearest_abs_max8_bucket512", "nearest3_bucket100", "cast_float16"}))
def test_encode_concatenated_is_the_encode_of_the_concatenation(name, dtype):
  """Bit for bit, for rows of whole runs (the pieces of a two-phase sum) and for vectors."""
  compressor = COMPRESSORS[name]
  run = compressor.bucket_length((9, 100)) or 100
  rng = np.random.default_rng(3)
  cases = [[jnp.asarray(rng.normal(size=shape), dtype) for shape in shapes]
           for shapes in ([(3, run), (1, run), (5, run)], [(9, run)], [(700,), (300,)])]

  @jax.jit  # One program for every case: compiling dominates.
  def encodings(key, cases):
    return [(compressor.encode_concatenated(key, parts),
             compressor.encode(key, jnp.concatenate(parts))) for parts in cases]

  for from_parts, whole in encodings(KEYS[0], cases):
    assert (from_parts.shape, from_parts.dtype) == (whole.shape, whole.dtype)
    for a, b in zip(jax.tree.leaves(from_parts), jax.tree.leaves(whole), strict=True):
      np.testing.assert_array_equal(a, b)


# bfloat16 takes a path of its own only where a scale depends on the input's dtype (the L2
# norm's clip to its largest value, qsgd3levels_l2_bucket100); the others cast it to float32
# and go on as with float32 input. NearestAbsMax's scales are QSGD's max norm (qsgd4_bucket512).
_ALL_FINITE_SLOW = {("nearest_abs_max8_bucket512", "float32"),
                    ("nearest_abs_max8_bucket512", "bfloat16"), ("qsgd4_bucket512", "bfloat16"),
                    ("minmax8_bucket512", "bfloat16"), ("minmax5_bucket100", "bfloat16")}


@pytest.mark.parametrize("name, dtype", [
    pytest.param(name, dtype, id=f"{name}-{np.dtype(dtype).name}",
                 marks=[pytest.mark.slow] if (name, np.dtype(dtype).name) in _ALL_FINITE_SLOW
                 else [])
    for dtype in (jnp.float32, jnp.bfloat16) for name in COMPRESSORS])
def test_encoded_all_finite_says_whether_the_input_was(name, dtype):
  """Exactly, for the compressors whose scales tell, at the dtype's largest values too."""
  compressor = COMPRESSORS[name]
  largest = float(jnp.finfo(dtype).max)  # Finite; its square and sums of it are not.
  x = jnp.asarray(np.random.default_rng(5).normal(size=(7, 150)), dtype).at[0, :3].set(largest)
  cases = {"finite": x, "nan": x.at[6, 149].set(np.nan), "inf": x.at[2, 0].set(np.inf),
           "-inf": x.at[4, 77].set(-np.inf), "all -largest": jnp.full_like(x, -largest)}
  tells = jax.eval_shape(
      lambda: compressor.encoded_all_finite(compressor.encode(KEYS[0], x))) is not None
  assert tells == isinstance(compressor, (qsgd_jax.QSGD, qsgd_jax.MinMax))
  if not tells:
    return

  @jax.jit
  def found(value):
    payloads = (compressor.encode(KEYS[0], value),
                compressor.encode_concatenated(KEYS[0], [value[:4], value[4:]]),
                jax.vmap(compressor.encode)(KEYS[:2], jnp.stack([x, value])))
    return [compressor.encoded_all_finite(p) for p in payloads]

  for case, value in cases.items():
    expected = case in ("finite", "all -largest")
    assert [bool(f) for f in found(value)] == [expected] * 3, case


def _expected_payload_bytes(compressor, shape, dtype=np.float32) -> int:
  """``ceil(n * bits / 32)`` words and 4 bytes a scale a bucket; the baselines' values."""
  n = math.prod(shape)
  if isinstance(compressor, qsgd_jax.Identity):
    return n * np.dtype(dtype).itemsize
  if isinstance(compressor, qsgd_jax.Cast):
    return n * np.dtype(compressor.dtype).itemsize
  if isinstance(compressor, qsgd_jax.OneBit):
    bits, num_scales = 1, 2
    if compressor.bucket_size is None:
      num_buckets = n // shape[-1] if shape and shape[-1] else n
    else:
      num_buckets = -(-n // min(compressor.bucket_size, n)) if n else 0
  else:
    bits, num_scales = compressor.bits, 1 if isinstance(compressor, qsgd_jax.QSGD) else 2
    bucket_len = n if compressor.bucket_size is None else min(compressor.bucket_size, n)
    num_buckets = -(-n // bucket_len) if n else 0
  return math.ceil(n * bits / 32) * 4 + 4 * num_scales * num_buckets


# Edge cases that every compressor runs through one compiled program.
CASES = {
    "scalar": np.float32(0.7),
    "empty": np.zeros((0,), np.float32),
    "bfloat16_matrix": _gaussian((6, 50), seed=9).astype(jnp.bfloat16),
    "float16": _gaussian((1030,), seed=10).astype(np.float16),
}
# Rows of one float32 batch, run under vmap: zeros, then a NaN, an inf and a -inf.
SPECIAL_ROWS = np.concatenate([np.zeros((1, 700), np.float32), _gaussian((3, 700), seed=11)])
SPECIAL_ROWS[1, 3], SPECIAL_ROWS[2, 10], SPECIAL_ROWS[3, 600] = np.nan, np.inf, -np.inf
NON_FINITE_AT = {1: 3, 2: 10, 3: 600}


@functools.cache
def _edge_cases(name: str):
  """Payloads and round trips of every case in CASES, and of SPECIAL_ROWS."""
  compressor = COMPRESSORS[name]

  def round_trip(key, x):
    return compressor.decode(compressor.encode(key, x))

  @jax.jit
  def run(key, cases, rows):
    payloads = {case: compressor.encode(key, x) for case, x in cases.items()}
    decoded = {case: compressor.decode(p) for case, p in payloads.items()}
    keys = jax.random.split(key, len(rows))
    return payloads, decoded, jax.vmap(round_trip)(keys, rows)

  return run(KEYS[2], CASES, SPECIAL_ROWS)


# Cast to float16 goes the way of Cast to bfloat16 through every test of _edge_cases.
_EDGE_CASES_PARAMS = _marked_slow(COMPRESSORS, {"cast_float16"})


@pytest.mark.parametrize("name", _EDGE_CASES_PARAMS)
def test_shapes_and_dtypes_kept(name):
  payloads, decoded, _ = _edge_cases(name)
  for case, x in CASES.items():
    chex.assert_shape(decoded[case], np.shape(x))
    assert decoded[case].dtype == np.asarray(x).dtype, case
    assert payloads[case].shape == np.shape(x) and payloads[case].dtype == np.asarray(x).dtype
  for case in ("scalar", "bfloat16_matrix", "float16"):
    # The values, not just their shape, come back: most of x's direction.
    x = np.asarray(CASES[case], np.float64).reshape(-1)
    y = np.asarray(decoded[case], np.float64).reshape(-1)
    assert np.dot(x, y) > 0.5 * np.dot(x, x), case


# NearestAbsMax traces QSGD's buckets, parts and packing (only its levels differ); Cast to
# float16, Cast to bfloat16's.
@pytest.mark.parametrize("name", _marked_slow(
    COMPRESSORS, {"nearest_abs_max8_bucket512", "cast_float16"}))
def test_more_shapes_and_dtypes_by_tracing(name):
  compressor = COMPRESSORS[name]
  for shape in [(), (0,), (5,), (4, 0), (2, 3, 4), (1, 1, 513)]:
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
      x = jax.ShapeDtypeStruct(shape, dtype)
      out = jax.eval_shape(lambda k, x: compressor.decode(compressor.encode(k, x)), KEYS[0], x)
      assert out.shape == shape and out.dtype == dtype, (shape, dtype)


@pytest.mark.parametrize("name", _EDGE_CASES_PARAMS)
def test_zeros_decode_to_zeros(name):
  *_, rows = _edge_cases(name)
  np.testing.assert_array_equal(rows[0], np.zeros(700, np.float32))


@pytest.mark.parametrize("name", _EDGE_CASES_PARAMS)
def test_non_finite_input_stays_non_finite(name):
  *_, rows = _edge_cases(name)
  for row, index in NON_FINITE_AT.items():
    assert not np.isfinite(rows[row, index]), SPECIAL_ROWS[row, index]


# Inputs at the edges of each floating dtype: five rows of 500 (one segment a
# row, so OneBit's per-row buckets are homogeneous and the other bucket sizes
# straddle segments).
EDGE_DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16, "float16": np.float16}


def _edge_values(dtype) -> np.ndarray:
  """Values near the dtype's maximum, large, tiny (subnormal), and mixed, mixed signs."""
  info = jnp.finfo(dtype)
  big, tiny = float(info.max), float(info.smallest_subnormal)
  rng = np.random.default_rng(17)
  signs = rng.choice([-1.0, 1.0], 500)
  near_max = rng.uniform(0.5, 1.0, 500) * big * signs
  near_max[:2] = big, -big
  same_sign = rng.uniform(0.9, 1.0, 500) * big  # Their float32 sums overflow.
  # Squares overflow float32 above about 1e19, though the norms do not.
  large = np.minimum(10.0 ** rng.uniform(19, 30, 500), big / 2) * signs
  subnormal = rng.integers(1, 64, 500) * tiny * signs
  mixed = np.where(np.arange(500) % 2, near_max, subnormal)
  rows = np.stack([near_max, same_sign, large, subnormal, mixed])
  return np.asarray(jnp.asarray(rows, jnp.float32).astype(dtype))


@functools.cache
def _edge_round_trips(name: str):
  """Payloads and round trips of the edge values of every dtype, one program."""
  compressor = COMPRESSORS[name]

  @jax.jit
  def run(key, cases):
    payloads = {case: compressor.encode(key, x) for case, x in cases.items()}
    return payloads, {case: compressor.decode(p) for case, p in payloads.items()}

  cases = {case: _edge_values(dtype) for case, dtype in EDGE_DTYPES.items()}
  return cases, *run(KEYS[6], cases)


# Cast overflows (to inf, as documented) where its dtype's range differs: bf16
# rounds float16's maximum up past it, and the float32 maximum past its own.
EDGE_CASES = [
    (name, case) for name in COMPRESSORS for case in EDGE_DTYPES
    if not name.startswith("cast") or name == f"cast_{case}"
]


@pytest.mark.parametrize("name, case", EDGE_CASES)
def test_edges_of_the_dtype_decode_finite_and_within_the_error_bound(name, case):
  compressor = COMPRESSORS[name]
  cases, payloads, decoded = _edge_round_trips(name)
  x = np.asarray(cases[case], np.float64)
  y = np.asarray(decoded[case], np.float64)
  assert decoded[case].dtype == cases[case].dtype
  assert np.all(np.isfinite(y)), case
  # Slack: the output dtype's rounding, and float32 subnormals, which XLA on
  # CPU flushes to zero.
  info = jnp.finfo(cases[case].dtype)
  flushed = float(jnp.finfo(jnp.float32).tiny) + float(info.smallest_subnormal)
  scales = np.asarray(payloads[case].scales, np.float64)
  if isinstance(compressor, qsgd_jax.QSGD | qsgd_jax.MinMax):
    step, _ = _rounding_grid(compressor, x, scales)
    step = step.reshape(x.shape)
    slack = float(info.eps) * (np.abs(x) + step) + flushed
    np.testing.assert_array_less(np.abs(y - x), step * (1 + 1e-5) + slack)
    bucket = _buckets(x.reshape(-1), compressor.bucket_size, x.size).reshape(x.shape)
    if isinstance(compressor, qsgd_jax.QSGD):  # Never above the bucket's scale.
      np.testing.assert_array_less(np.abs(y), scales[bucket, 0] * (1 + float(info.eps)) + flushed)
    else:  # Within the bucket's range.
      assert np.all(y >= scales[bucket, 0] - slack) and np.all(y <= scales[bucket, 1] + slack)
  elif isinstance(compressor, qsgd_jax.OneBit):
    # The sides are the payload's bits: x < 0, but for float32 subnormals,
    # zeros (either side) where XLA flushes them.
    negative = np.asarray(packing.unpack(payloads[case].packed, x.size, 1), bool)
    normal = np.abs(x.reshape(-1)) >= float(jnp.finfo(jnp.float32).tiny)
    np.testing.assert_array_equal(negative[normal], x.reshape(-1)[normal] < 0)
    expected = _side_means_reference(x, negative, compressor.bucket_size)
    rtol = 1e-5 + float(info.eps)
    np.testing.assert_array_less(np.abs(y - expected), rtol * np.abs(expected) + flushed)
  elif isinstance(compressor, qsgd_jax.NearestZeroAlignedMinMax):
    # Rounded to nearest: within half a step of the bucket's range over 2**bits - 1.
    bucket = _buckets(x.reshape(-1), compressor.bucket_size, x.size).reshape(x.shape)
    step = (scales[bucket, 1] - scales[bucket, 0] + 1e-7) / compressor.num_steps
    slack = float(info.eps) * (np.abs(x) + step) + flushed
    np.testing.assert_array_less(np.abs(y - x), 0.5 * step * (1 + 1e-5) + slack)
  else:
    np.testing.assert_array_less(np.abs(y - x), float(info.eps) * np.abs(x) + flushed)


def _side_means_reference(x: np.ndarray, negative: np.ndarray, bucket_size) -> np.ndarray:
  """Each element's bucket mean of its side, the sides given."""
  _, bucket = _onebit_reference(x, bucket_size)
  flat = x.reshape(-1)
  expected = np.empty_like(flat)
  for b in np.unique(bucket):
    for side in (negative, ~negative):
      members = (bucket == b) & side
      expected[members] = flat[members].mean() if members.any() else 0.0
  return expected.reshape(x.shape)


@pytest.mark.parametrize("case", list(EDGE_DTYPES))
def test_l2_norm_of_large_values_is_exact_and_clipped_to_the_dtype(case):
  compressor = COMPRESSORS["qsgd3levels_l2_bucket100"]
  cases, payloads, _ = _edge_round_trips("qsgd3levels_l2_bucket100")
  x = np.asarray(cases[case], np.float64).reshape(-1, 100)
  norms = np.sqrt(np.sum(x**2, axis=1))
  scales = np.asarray(payloads[case].scales[:, 0], np.float64)
  largest = float(jnp.finfo(cases[case].dtype).max)
  clipped = norms > largest
  assert compressor.norm == "l2" and clipped.any() and not clipped.all()
  np.testing.assert_array_equal(scales[clipped], largest)
  # Rows of values whose float32 squares overflow (row 2) and underflow (row
  # 3); float32 subnormals count as zeros where XLA flushes them.
  flushed = np.sqrt(100) * float(jnp.finfo(jnp.float32).tiny)
  np.testing.assert_allclose(scales[~clipped], norms[~clipped], rtol=1e-6, atol=flushed)


@pytest.mark.slow
@pytest.mark.parametrize(
    "compressor", [qsgd_jax.QSGD(bits=16, bucket_size=None), qsgd_jax.MinMax(bits=8)], ids=str
)
def test_small_normal_values_quantize_on_their_own_scale(compressor):
  # A scale of 1e-36 has no float32 reciprocal over 2**15 levels or 255 steps.
  x = (np.random.default_rng(18).uniform(-1, 1, 1000) * 1e-36).astype(np.float32)
  payload = compressor.encode(KEYS[7], x)
  y = np.asarray(compressor.decode(payload), np.float64)
  x = x.astype(np.float64)
  step, _ = _rounding_grid(compressor, x, np.asarray(payload.scales, np.float64))
  # Decoded values below the smallest normal float32 may be flushed to zero.
  flushed = float(jnp.finfo(jnp.float32).tiny)
  np.testing.assert_array_less(np.abs(y - x), step * (1 + 1e-5) + flushed)


@pytest.mark.parametrize(
    "compressor",
    [qsgd_jax.QSGD(levels=levels, bucket_size=1) for levels in (1, 3, 7, 127, 2**15 - 1)]
    + [qsgd_jax.MinMax(bits=bits, bucket_size=1) for bits in (1, 2, 8, 16)],
    ids=str,
)
def test_top_code_decodes_within_the_scale(compressor):
  # 20000 one-element buckets with scales across every exponent, and at the
  # float32 maximum: the top code never decodes past the largest value.
  rng = np.random.default_rng(19)
  largest = float(jnp.finfo(jnp.float32).max)
  high = (rng.uniform(1, 2, 20000) * 2.0 ** rng.integers(-126, 128, 20000)).astype(np.float32)
  high[:100] = largest
  high = np.where(np.isfinite(high), high, largest).astype(np.float32)
  low = (-high * rng.uniform(0, 1, 20000)).astype(np.float32)
  top = compressor.code_range[1]
  if isinstance(compressor, qsgd_jax.QSGD):
    scales, limit = high[:, None], high
  else:
    scales, limit = np.stack([low, high], axis=1), high
  total = jnp.full((20000,), top, jnp.int32)
  decoded = jax.jit(compressor.decode_code_sum, static_argnums=(2, 3))(total, scales, 1, (20000,))
  decoded = np.asarray(decoded, np.float64)
  assert np.all(decoded <= limit)
  np.testing.assert_allclose(decoded, limit, rtol=1e-6)


@pytest.mark.parametrize(
    "compressor, mode",
    [
        (qsgd_jax.QSGD(bits=4, bucket_size=256), "constant"),
        (qsgd_jax.QSGD(bits=5, bucket_size=64, norm="l2"), "constant"),
        (qsgd_jax.MinMax(bits=8, bucket_size=128), "edge"),
        (qsgd_jax.OneBit(bucket_size=96), "constant"),
    ],
    ids=str,
)
def test_short_last_bucket_encodes_as_in_the_padded_array(compressor, mode):
  # 1000 elements: whole buckets read in place and the short last one
  # padded alone give the codes (and draws) of the array padded by hand.
  x = _gaussian((1000,), seed=20)
  padded = np.pad(x, (0, 1024 - 1000), mode=mode)
  # One program for both: compiling dominates.
  encode = jax.jit(lambda key, *xs: [compressor.encode(key, x) for x in xs])
  payload, reference = encode(KEYS[8], x, padded)
  np.testing.assert_array_equal(payload.packed, reference.packed[: payload.packed.size])
  if not isinstance(compressor, qsgd_jax.OneBit):  # Padded zeros change its means.
    np.testing.assert_array_equal(payload.scales, reference.scales[: payload.scales.shape[0]])


@pytest.mark.parametrize(
    "compressor",
    [qsgd_jax.QSGD(bits=4, bucket_size=512), qsgd_jax.QSGD(bits=8, bucket_size=512, norm="l2"),
     qsgd_jax.MinMax(bits=8, bucket_size=512), qsgd_jax.OneBit(bucket_size=512)],
    ids=str,
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_encode_writes_no_copy_of_its_input(compressor, dtype):
  # A size that is not a multiple of the bucket, and an input computed in
  # the same program: XLA's temporaries stay a small fraction of the input.
  size = 100_000 - 37
  x = jax.ShapeDtypeStruct((size,), dtype)
  for encode in (compressor.encode, lambda key, x: compressor.encode(key, jnp.sin(x))):
    compiled = jax.jit(encode).lower(KEYS[0], x).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 0.05 * size * np.dtype(dtype).itemsize


@pytest.mark.parametrize("name", _EDGE_CASES_PARAMS)
def test_payload_holds_the_stated_bits(name):
  compressor = COMPRESSORS[name]
  payloads, *_ = _edge_cases(name)
  for case in CASES:
    x = np.asarray(CASES[case])
    nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(payloads[case]))
    assert nbytes == _expected_payload_bytes(compressor, x.shape, x.dtype), case
    assert nbytes * 8 == compressor.wire_bits(x.shape, x.dtype), case
  for shape in [(1,), (31,), (4096,), (1000, 3), (3, 1000), (7, 11, 13)]:
    payload = jax.eval_shape(compressor.encode, KEYS[0], jax.ShapeDtypeStruct(shape, jnp.float32))
    nbytes = sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(payload))
    assert nbytes == _expected_payload_bytes(compressor, shape) == compressor.wire_bits(shape) // 8


def test_bits_a_coordinate():
  shape = (1 << 20,)
  assert qsgd_jax.Identity().wire_bits(shape) == 32 * shape[0]
  assert qsgd_jax.Cast(jnp.bfloat16).wire_bits(shape) == 16 * shape[0]
  assert qsgd_jax.QSGD(bits=4, bucket_size=512).wire_bits(shape) == shape[0] * (4 + 32 / 512)
  assert qsgd_jax.MinMax(bits=8, bucket_size=None).wire_bits(shape) == 8 * shape[0] + 64
  assert qsgd_jax.MinMax(bits=8).wire_bits(shape) == shape[0] * (8 + 64 / 512)
  assert qsgd_jax.NearestZeroAlignedMinMax().wire_bits(shape) == 8 * shape[0] + 64
  assert qsgd_jax.OneBit(bucket_size=512).wire_bits(shape) == shape[0] * (1 + 64 / 512)


@pytest.mark.parametrize(
    "make, argument",
    [
        (lambda: qsgd_jax.QSGD(bits=1), "bits"),
        (lambda: qsgd_jax.QSGD(bits=17), "bits"),
        (lambda: qsgd_jax.QSGD(bits=4.0), "bits"),
        (lambda: qsgd_jax.QSGD(levels=0), "levels"),
        (lambda: qsgd_jax.QSGD(levels=2**15), "levels"),
        (lambda: qsgd_jax.QSGD(levels=2.5), "levels"),
        (lambda: qsgd_jax.QSGD(bits=4, levels=3), "bits"),
        (lambda: qsgd_jax.QSGD(bits=8, levels=7), "bits"),
        (lambda: qsgd_jax.QSGD(bucket_size=0), "bucket_size"),
        (lambda: qsgd_jax.QSGD(bucket_size=-4), "bucket_size"),
        (lambda: qsgd_jax.QSGD(bucket_size=8.0), "bucket_size"),
        (lambda: qsgd_jax.QSGD(bucket_size=True), "bucket_size"),
        (lambda: qsgd_jax.QSGD(norm="l1"), "norm"),
        (lambda: qsgd_jax.QSGD(norm="l2", largest_scale=0.0), "largest_scale"),
        (lambda: qsgd_jax.QSGD(norm="l2", largest_scale=True), "largest_scale"),
        (lambda: qsgd_jax.QSGD(norm="l2", largest_scale="65504"), "largest_scale"),
        (lambda: qsgd_jax.MinMax(bits=0), "bits"),
        (lambda: qsgd_jax.MinMax(bits=17), "bits"),
        (lambda: qsgd_jax.MinMax(bucket_size=0), "bucket_size"),
        (lambda: qsgd_jax.NearestZeroAlignedMinMax(bits=0), "bits"),
        (lambda: qsgd_jax.NearestZeroAlignedMinMax(bits=8.0), "bits"),
        (lambda: qsgd_jax.NearestZeroAlignedMinMax(bucket_size=-1), "bucket_size"),
        (lambda: qsgd_jax.OneBit(bucket_size=0), "bucket_size"),
        (lambda: qsgd_jax.OneBit(bucket_size=2.5), "bucket_size"),
        (lambda: qsgd_jax.Cast(jnp.int32), "dtype"),
        (lambda: qsgd_jax.Cast(jnp.uint8), "dtype"),
        (lambda: qsgd_jax.Cast("not a dtype"), "dtype"),
    ],
)
def test_bad_settings_raise_value_error_naming_the_argument(make, argument):
  with pytest.raises(ValueError, match=argument):
    make()


def test_levels_and_bits_agree():
  assert qsgd_jax.QSGD(bits=4) == qsgd_jax.QSGD(levels=7)
  assert qsgd_jax.QSGD().bits == 4 and qsgd_jax.QSGD().levels == 7
  assert qsgd_jax.QSGD(levels=1).bits == 2
  assert qsgd_jax.QSGD(levels=8).bits == 5
  assert qsgd_jax.QSGD(levels=2**15 - 1).bits == 16


@pytest.mark.parametrize("name", list(COMPRESSORS))
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_])
def test_non_float_input_raises_type_error_naming_the_dtype(name, dtype):
  with pytest.raises(TypeError, match=np.dtype(dtype).name):
    COMPRESSORS[name].encode(KEYS[0], jnp.zeros((8,), dtype))


# One compressor of each class: a second of the same class (another bucket size or bit width)
# hashes, traces once and maps over keys as the first does (their packing under vmap is
# test_unbiased's and _edge_cases').
@pytest.mark.parametrize("name", _marked_slow(COMPRESSORS, {
    "qsgd3levels_l2_bucket100", "minmax5_bucket100", "nearest3_bucket100", "onebit_bucket512",
    "cast_float16"}))
def test_jit_with_static_compressor_vmap_and_no_recompiling(name):
  compressor = COMPRESSORS[name]
  twin = dataclasses.replace(compressor)  # Equal, but a new object.
  assert twin is not compressor and twin == compressor and hash(twin) == hash(compressor)

  def plain(compressor, key, x):
    return compressor.decode(compressor.encode(key, x))

  chex.clear_trace_counter()
  round_trip = jax.jit(chex.assert_max_traces(plain, n=1), static_argnums=0)
  xs = _gaussian((2, 64), seed=15)
  first = round_trip(compressor, KEYS[3], xs[0])
  second = round_trip(twin, KEYS[4], xs[1])  # An equal compressor, new values: no retrace.
  batched = jax.jit(jax.vmap(functools.partial(plain, compressor)))(KEYS[3:5], xs)
  chex.assert_trees_all_close(batched, jnp.stack([first, second]), rtol=1e-6)
  if compressor.deterministic:
    chex.assert_trees_all_close(round_trip(compressor, KEYS[5], xs[0]), first)


@pytest.mark.slow
@pytest.mark.parametrize("module", [qsgd, minmax, zero_aligned_minmax, onebit, baselines])
def test_docstring_examples(module):
  result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0
