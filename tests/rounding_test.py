"""Statistical tests of the counter-hash uniforms and of stochastic rounding.

Every key is fixed, so each test is deterministic; the thresholds are five
standard deviations of the statistic under the hypothesis being tested.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qsgd_jax._src.compressors import rounding

GRID = 2**24
NUM_DRAWS = 2**20
NUM_KEYS = 4096


_uniform_grid = jax.jit(rounding.uniform_grid, static_argnums=1)


@functools.cache
def _draws(seed: int, shape=(NUM_DRAWS,)) -> np.ndarray:
  return np.asarray(_uniform_grid(jax.random.key(seed), shape), np.int64)


def _chi_square(counts: np.ndarray) -> float:
  expected = counts.sum() / counts.size
  return float(((counts - expected) ** 2 / expected).sum())


def _correlation(a: np.ndarray, b: np.ndarray) -> float:
  return float(np.corrcoef(a.astype(np.float64), b.astype(np.float64))[0, 1])


def test_draws_lie_on_the_grid():
  draws = _uniform_grid(jax.random.key(0), (3, 5, 7))
  assert draws.dtype == jnp.uint32 and draws.shape == (3, 5, 7)
  values = _draws(0)
  assert values.min() >= 0 and values.max() < GRID


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "name, bins", [("high bits", lambda u: u >> 14), ("low bits", lambda u: u & 1023)]
)
def test_chi_square_over_bins(seed, name, bins):
  # 1024 bins of the top ten bits, and of the bottom ten; chi-square with 1023
  # degrees of freedom has mean 1023 and standard deviation sqrt(2 * 1023).
  counts = np.bincount(bins(_draws(seed)), minlength=1024)
  assert counts.size == 1024, name
  dof = counts.size - 1
  assert abs(_chi_square(counts) - dof) < 5 * np.sqrt(2 * dof), name


@pytest.mark.parametrize("seed", [0, 1])
def test_every_bit_is_balanced(seed):
  values = _draws(seed)
  ones = np.array([np.mean((values >> bit) & 1) for bit in range(24)])
  np.testing.assert_array_less(np.abs(ones - 0.5), 5 * 0.5 / np.sqrt(NUM_DRAWS))


@pytest.mark.parametrize("lag", [1, 2, 32, 512])
def test_neighbouring_indices_are_uncorrelated(lag):
  values = _draws(0)
  limit = 5 / np.sqrt(NUM_DRAWS)
  assert abs(_correlation(values[:-lag], values[lag:])) < limit
  # Also the low bits, which a weak counter hash would leave correlated.
  assert abs(_correlation(values[:-lag] & 255, values[lag:] & 255)) < limit


def test_rows_of_a_matrix_are_uncorrelated():
  values = _draws(3, (1024, 1024))
  assert abs(_correlation(values[:-1].ravel(), values[1:].ravel())) < 5 / np.sqrt(values.size)


@pytest.mark.parametrize(
    "other",
    [
        lambda key: jax.random.split(key)[1],
        lambda key: jax.random.fold_in(key, 1),
        lambda key: jax.random.key(1),
    ],
    ids=["split", "fold_in", "next_seed"],
)
def test_different_keys_give_different_uncorrelated_streams(other):
  key = jax.random.key(0)
  first = np.asarray(_uniform_grid(key, (NUM_DRAWS,)), np.int64)
  second = np.asarray(_uniform_grid(other(key), (NUM_DRAWS,)), np.int64)
  # Equal by chance with probability 2**-24 an element.
  assert np.mean(first == second) < 1e-4
  assert abs(_correlation(first, second)) < 5 / np.sqrt(NUM_DRAWS)
  # Not one stream shifted along the other.
  for shift in (1, 2, 3):
    assert np.mean(first[shift:] == second[:-shift]) < 1e-4


def test_same_key_same_stream_and_raw_keys_accepted():
  key = jax.random.key(7)
  first = _uniform_grid(key, (1000,))
  np.testing.assert_array_equal(first, _uniform_grid(key, (1000,)))
  raw = jax.random.key_data(key)
  np.testing.assert_array_equal(first, _uniform_grid(raw, (1000,)))
  # A shape's elements are counted in row-major order.
  np.testing.assert_array_equal(first.reshape(10, 100), _uniform_grid(key, (10, 100)))


# Values with fractional parts across [0, 1), on and off the 2**-24 grid.
FRACTIONAL = np.array(
    [0.0, 1e-3, 0.1, 0.25, 1 / 3, 0.5, 0.75, 0.9, 0.999, 1.0, 3.7, 12.5, 100.01, 32766.6],
    np.float32,
)


@functools.cache
def _rounded_over_keys() -> tuple[np.ndarray, np.ndarray]:
  """``round_stochastic`` of 64 copies of FRACTIONAL under NUM_KEYS keys."""
  y = jnp.tile(jnp.asarray(FRACTIONAL), (64, 1))
  keys = jax.random.split(jax.random.key(11), NUM_KEYS)
  rounded = jax.jit(jax.vmap(rounding.round_stochastic, in_axes=(0, None)))(keys, y)
  return np.asarray(y), np.asarray(rounded)


def test_round_stochastic_is_unbiased():
  _, rounded = _rounded_over_keys()
  samples = rounded.reshape(-1, FRACTIONAL.size).astype(np.float64)  # Keys and copies.
  value = FRACTIONAL.astype(np.float64)
  up = value - np.floor(value)  # The chance of rounding up.
  standard_error = np.sqrt(up * (1 - up) / len(samples))
  # The slack is the 2**-24 resolution of the draws.
  np.testing.assert_array_less(np.abs(samples.mean(axis=0) - value), 5 * standard_error + 1e-6)
  # A value on the grid (no fractional part) rounds to itself every time.
  on_grid = up == 0
  assert np.all(samples[:, on_grid] == value[on_grid])


def test_round_stochastic_gives_floor_or_floor_plus_one():
  y, rounded = _rounded_over_keys()
  floor = np.floor(y)
  assert np.all((rounded == floor) | (rounded == floor + 1))


def test_round_stochastic_rounds_up_exactly_when_the_draw_is_below_the_fraction():
  # On the 2**-24 grid the rule is exact: up iff draw < frac * 2**24.
  key = jax.random.key(5)
  steps = np.arange(0, GRID, GRID // 256, dtype=np.int64)[None, :] + np.arange(16)[:, None]
  y = 5.0 + steps.astype(np.float64) / GRID
  rounded = np.asarray(jax.jit(rounding.round_stochastic)(key, jnp.asarray(y, jnp.float32)))
  draws = np.asarray(_uniform_grid(key, y.shape), np.int64)
  np.testing.assert_array_equal(rounded, 5.0 + (draws < steps))


def test_round_stochastic_to_level_clamps_and_converts():
  top = 2**15 - 1

  @jax.jit
  def levels(key, edges, y):
    return (
        rounding.round_stochastic_to_level(key, edges, top),
        rounding.round_stochastic_to_level(key, y, top),
        rounding.round_stochastic(key, y).astype(jnp.int32),
    )

  edges = jnp.array([0.0, 2.0, 6.0, top, top + 0.75, 1e9, jnp.inf, jnp.nan], jnp.float32)
  y = np.random.default_rng(0).uniform(0, top, 4096).astype(np.float32)
  at_edges, level, reference = levels(jax.random.key(2), edges, y)
  assert at_edges.dtype == jnp.int32
  np.testing.assert_array_equal(at_edges, [0, 2, 6, top, top, top, top, top])
  # Away from the clamp it is round_stochastic, converted exactly.
  np.testing.assert_array_equal(level, reference)
