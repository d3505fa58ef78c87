"""Tests for qsgd_jax.elias: the paper's table, bit-exact codes, round trips, size bounds."""

import functools
import math
import struct

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qsgd_jax
from qsgd_jax import elias
from qsgd_jax._src.compressors import elias as elias_module

# The Elias omega table of the QSGD paper notes.
_TABLE = {
    1: "0",
    2: "10 0",
    3: "11 0",
    4: "10 100 0",
    5: "10 101 0",
    6: "10 110 0",
    7: "10 111 0",
    8: "11 1000 0",
    9: "11 1001 0",
    10: "11 1010 0",
    11: "11 1011 0",
    12: "11 1100 0",
    13: "11 1101 0",
    14: "11 1110 0",
    15: "11 1111 0",
    16: "10 100 10000 0",
}
_VARIANTS = ("sparse", "dense")
# One capacity for every codec check, so that jit compiles once a size.
_MAX_LEVEL = 127


def _reference_omega(k: int) -> str:
  """Elias omega code of ``k >= 1``, built group by group from the right."""
  code = "0"
  while k > 1:
    code = format(k, "b") + code
    k = k.bit_length() - 1
  return code


def _reference_bits(levels, norm: float, variant: str) -> str:
  """The paper's bit string for ``levels``, one character a bit."""
  bits = format(struct.unpack(">I", struct.pack(">f", norm))[0], "032b")
  previous = -1
  for index, level in enumerate(int(level) for level in levels):
    sign = "1" if level < 0 else "0"
    if variant == "dense":
      bits += sign + _reference_omega(abs(level) + 1)
    elif level != 0:
      bits += _reference_omega(index - previous) + sign + _reference_omega(abs(level))
      previous = index
  return bits


def _as_bits(words) -> str:
  return "".join(format(int(word), "032b") for word in np.asarray(words))


def _check_codec(levels, norm: float, variant: str) -> None:
  """``encode`` matches the reference bit for bit and ``decode`` inverts it."""
  levels = np.asarray(levels, np.int32)
  expected = _reference_bits(levels, norm, variant)
  words, num_bits = elias.encode(levels, norm, variant=variant, max_level=_MAX_LEVEL)
  assert words.dtype == jnp.uint32
  assert words.shape == (elias.capacity_words(levels.size, variant=variant,
                                              max_level=_MAX_LEVEL),)
  assert int(num_bits) == len(expected)
  assert int(elias.encoded_bits(levels, variant=variant)) == len(expected)
  written = _as_bits(words)
  assert written[:len(expected)] == expected
  assert set(written[len(expected):]) <= {"0"}
  decoded, decoded_norm = elias.decode(words, num_bits, levels.size, variant=variant,
                                       max_level=_MAX_LEVEL)
  np.testing.assert_array_equal(decoded, levels)
  assert decoded.dtype == jnp.int32
  assert np.float32(decoded_norm).tobytes() == np.float32(norm).tobytes()


def _qsgd_levels(key, n: int, s, scaling: str = "l2") -> jax.Array:
  """The paper's Q_s levels sgn(v_i) s xi_i of a standard Gaussian vector."""
  vector_key, rounding_key = jax.random.split(key)
  v = jax.random.normal(vector_key, (n,))
  scale = jnp.linalg.norm(v) if scaling == "l2" else jnp.max(jnp.abs(v))
  scaled = s * jnp.abs(v) / scale
  low = jnp.floor(scaled)
  up = jax.random.uniform(rounding_key, (n,)) < scaled - low
  return (jnp.sign(v) * (low + up)).astype(jnp.int32)


def test_reference_matches_the_table():
  for k, code in _TABLE.items():
    assert _reference_omega(k) == code.replace(" ", "")


def test_omega_length_reproduces_the_table():
  lengths = elias.omega_length(jnp.arange(1, 17))
  np.testing.assert_array_equal(lengths, [len(_TABLE[k].replace(" ", "")) for k in range(1, 17)])
  np.testing.assert_array_equal(
      elias.omega_length(jnp.array([1, 2, 3, 4, 8, 15, 16])), [1, 3, 3, 6, 7, 7, 11])


def test_omega_length_at_every_bit_length():
  values = [2**b - 1 for b in range(1, 32)] + [2**b for b in range(1, 32)] + [2**32 - 1]
  lengths = elias.omega_length(jnp.array(values, jnp.uint32))
  np.testing.assert_array_equal(lengths, [len(_reference_omega(k)) for k in values])
  assert int(elias.omega_length(jnp.int32(2**31 - 1))) == 42
  np.testing.assert_array_equal(elias.omega_length(jnp.array([0, -1, -(2**31)])), [0, 0, 0])


@pytest.mark.parametrize("k", [1, 2, 3, 4, 7, 8, 15, 16])
def test_encode_writes_the_table_codes(k):
  code = _TABLE[k].replace(" ", "")
  # max_level as _check_codec passes it (the default): the round trips' programs of size 1.
  words, num_bits = elias.encode(jnp.array([k - 1]), 1.0, variant="dense", max_level=_MAX_LEVEL)
  assert _as_bits(words)[32:int(num_bits)] == "0" + code
  words, num_bits = elias.encode(jnp.array([-k]), 1.0, variant="sparse", max_level=_MAX_LEVEL)
  assert _as_bits(words)[32:int(num_bits)] == "0" + "1" + code  # omega(position 1), sign, code


def test_encode_stores_the_norm_bits():
  # 64 zeros and _MAX_LEVEL: the program of the other checks of that size (compiling dominates).
  words, num_bits = elias.encode(jnp.zeros(64, jnp.int32), -3.25, variant="sparse",
                                 max_level=_MAX_LEVEL)
  assert int(num_bits) == 32
  assert int(words[0]) == struct.unpack(">I", struct.pack(">f", -3.25))[0]


@pytest.mark.slow
@pytest.mark.parametrize("variant", _VARIANTS)
@pytest.mark.parametrize("size", [64, 5000])
def test_round_trip_random(variant, size):
  rng = np.random.default_rng(size)
  for s, density in [(1, 0.05), (4, 0.6), (16, 0.3), (127, 0.9)]:
    levels = rng.integers(-s, s + 1, size) * (rng.random(size) < density)
    _check_codec(levels, float(rng.normal()), variant)


@pytest.mark.slow
@pytest.mark.parametrize("variant", _VARIANTS)
def test_round_trip_qsgd_levels_over_many_chunks(variant):
  # About 4 bits a coordinate: the strings span several decoding chunks.
  levels = _qsgd_levels(jax.random.key(0), 5000, 4, scaling="max")
  _check_codec(levels, 1.5, variant)


@pytest.mark.parametrize("variant", _VARIANTS)
def test_round_trip_edge_cases(variant):
  size, max_level = 5000, _MAX_LEVEL
  last = np.zeros(size, np.int32)
  last[-1] = -3
  cases = [
      np.zeros(size, np.int32),
      last,
      np.full(size, max_level, np.int32),
      np.full(size, -max_level, np.int32),
      np.resize(np.array([max_level, -max_level, 0], np.int32), size),
  ]
  for levels in cases:
    _check_codec(levels, 0.0, variant)


@pytest.mark.parametrize("variant", _VARIANTS)
def test_round_trip_size_one(variant):
  for level in (0, 1, -1, 127, -127):
    _check_codec([level], 2.0, variant)


@pytest.mark.parametrize("variant", _VARIANTS)
def test_largest_levels_fill_the_capacity(variant):
  # All levels at max_level is the longest string of each variant.
  size = 5000
  words, num_bits = elias.encode(jnp.full(size, -_MAX_LEVEL, jnp.int32), 1.0,
                                 variant=variant, max_level=_MAX_LEVEL)
  if variant == "dense":
    per_coordinate = 1 + len(_reference_omega(_MAX_LEVEL + 1))
  else:
    per_coordinate = 2 + len(_reference_omega(_MAX_LEVEL))
  assert int(num_bits) == 32 + size * per_coordinate
  assert words.size == math.ceil(int(num_bits) / 32)


_SIZE = 64
_level_vectors = st.lists(
    st.one_of(st.just(0), st.just(0), st.integers(-3, 3),
              st.integers(-_MAX_LEVEL, _MAX_LEVEL)),
    min_size=_SIZE, max_size=_SIZE)


@pytest.mark.slow
@hypothesis.settings(deadline=None, max_examples=150, derandomize=True)
@hypothesis.given(levels=_level_vectors, norm=st.floats(width=32, allow_nan=False))
def test_matches_reference_sparse(levels, norm):
  _check_codec(levels, norm, "sparse")


@hypothesis.settings(deadline=None, max_examples=150, derandomize=True)
@hypothesis.given(levels=_level_vectors, norm=st.floats(width=32, allow_nan=False))
def test_matches_reference_dense(levels, norm):
  _check_codec(levels, norm, "dense")


def test_bit_counts_past_the_int32_range_do_not_wrap():
  # 2**19 coordinates of 2**13 bits: 2**32 bits, which an int32 sum wraps to 0 (a billion
  # levels at 4 bits take about 1.2e10).
  counts = jnp.full((2**19,), 2**13, jnp.int32)
  assert int(jnp.sum(counts, dtype=jnp.int32)) == 0
  total = elias_module.sum_counts(counts)
  assert total.dtype == jnp.float32 and float(total) == 2.0**32


@pytest.mark.slow
def test_total_bits_is_encoded_bits_and_qsgd_sizes_count_in_float32():
  levels = jnp.array([0, 0, 3, -1, 0, 7, 0, 0, 0, -2], jnp.int32)
  for variant in _VARIANTS:
    total = elias.total_bits(levels, variant=variant)
    assert total.dtype == jnp.float32
    assert float(total) == int(elias.encoded_bits(levels, variant=variant))
  q = qsgd_jax.QSGD(bits=4, bucket_size=512)
  payload = q.encode(jax.random.key(1), jax.random.normal(jax.random.key(0), (1500,)))
  size = q.elias_bits(payload)
  assert all(field.dtype == jnp.float32 for field in size)
  buckets = jnp.pad(q.signed_levels(payload), (0, 36)).reshape(3, 512)
  for variant, found in (("sparse", size.sparse), ("dense", size.dense)):
    expected = sum(int(elias.encoded_bits(b, variant=variant)) for b in buckets)
    if variant == "dense":
      expected -= 36 * 2  # The last bucket's zero padding: 2 bits each.
    assert float(found) == expected


@hypothesis.settings(deadline=None, max_examples=100, derandomize=True)
@hypothesis.given(levels=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=8, max_size=8),
                  zeros=st.lists(st.booleans(), min_size=8, max_size=8))
def test_encoded_bits_over_the_int32_range(levels, zeros):
  levels = [0 if zero else level for level, zero in zip(levels, zeros, strict=True)]
  for variant in _VARIANTS:
    expected = len(_reference_bits(levels, 0.0, variant))
    assert int(elias.encoded_bits(jnp.array(levels, jnp.int32), variant=variant)) == expected


@pytest.mark.parametrize("variant", _VARIANTS)
def test_overflow_is_flagged(variant):
  for bad in (_MAX_LEVEL + 1, -_MAX_LEVEL - 1, -(2**31), 2**31 - 1):
    levels = jnp.zeros(_SIZE, jnp.int32).at[3].set(bad)
    words, num_bits = elias.encode(levels, 1.0, variant=variant, max_level=_MAX_LEVEL)
    assert int(num_bits) == -1
    assert not np.any(words)
    decoded, _ = elias.decode(words, num_bits, _SIZE, variant=variant, max_level=_MAX_LEVEL)
    assert not np.any(decoded)


def test_overflow_is_checkable_inside_jit():
  @jax.jit
  def levels_or_minus_one(levels):
    words, num_bits = elias.encode(levels, 1.0, variant="sparse", max_level=7)
    decoded, _ = elias.decode(words, num_bits, levels.size, variant="sparse", max_level=7)
    return jnp.where(num_bits < 0, -1, decoded)

  np.testing.assert_array_equal(levels_or_minus_one(jnp.array([0, 7, -7])), [0, 7, -7])
  np.testing.assert_array_equal(levels_or_minus_one(jnp.array([0, 8, -7])), [-1, -1, -1])


def test_jit_does_not_retrace():
  encode = chex.assert_max_traces(
      lambda levels: elias.encode(levels, 1.0, variant="dense", max_level=7), n=1)
  encode = jax.jit(encode)
  for seed in range(3):
    levels = jax.random.randint(jax.random.key(seed), (100,), -7, 8)
    encode(levels)


def test_bad_arguments_raise():
  with pytest.raises(ValueError, match="variant"):
    elias.encoded_bits(jnp.zeros(3, jnp.int32), variant="huffman")
  with pytest.raises(ValueError, match="max_level"):
    elias.capacity_words(3, variant="dense", max_level=0)
  with pytest.raises(ValueError, match="vector of integers"):
    elias.encode(jnp.zeros((2, 2), jnp.int32), 1.0, variant="dense")
  with pytest.raises(ValueError, match="vector of integers"):
    elias.encoded_bits(jnp.zeros(3), variant="dense")


def _theorem_3_2_bound(n: int, s: int) -> float:
  """Theorem 3.2's expected sparse size with the o(1) term taken as 0."""
  support = s * (s + math.sqrt(n))
  return (3 + 1.5 * math.log2(2 * (s * s + n) / support)) * support + 32


@functools.partial(jax.jit, static_argnames="n")
def _mean_bits(s: jax.Array, n: int) -> dict[str, jax.Array]:
  """Mean sparse and dense sizes of Q_s of 8 Gaussian vectors."""
  keys = jax.random.split(jax.random.key(0), 8)
  levels = jax.vmap(lambda key: _qsgd_levels(key, n, s))(keys)
  return {variant: jnp.mean(jax.vmap(functools.partial(elias.encoded_bits, variant=variant))(
      levels)) for variant in _VARIANTS}


@pytest.mark.parametrize("s", [2, 4, 8])
def test_sparse_size_within_theorem_3_2(s):
  n = 10_000
  mean = float(_mean_bits(s, n)["sparse"])
  assert mean <= _theorem_3_2_bound(n, s)
  # The bound is not loose by orders of magnitude either (measured 72-82%).
  assert mean >= 0.5 * _theorem_3_2_bound(n, s)


def test_corollary_3_3_at_sqrt_n_levels():
  n = 10_000
  bits = _mean_bits(math.isqrt(n), n)
  sparse, dense = float(bits["sparse"]) / n, float(bits["dense"]) / n
  assert sparse <= 2.8 + 32 / n  # measured 2.758
  assert 2.6 <= sparse
  assert 3.1 <= dense <= 3.5  # measured 3.315: a sign bit on every coordinate
