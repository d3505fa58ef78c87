"""The numpy references of ``references.py`` against small cases worked out by hand."""

import numpy as np
import pytest
import references


def _f32(*values):
  return np.array(values, np.float32)


# Bagua.


def test_bagua_compress_rounds_to_nearest_on_a_grid_through_zero():
  # Range 4 (1e-7 is lost in float32 at 4): scale 255 / 4 = 63.75, top level
  # rint(3 * 63.75) = 191, bottom level 191 - 255 = -64.
  codes, minimum, maximum = references.bagua_compress(_f32(-1.0, 0.0, 0.25, 3.0))
  np.testing.assert_array_equal(codes, [0, 64, 80, 255])  # rint(-63.75), 0, rint(15.94), 191.
  assert (minimum, maximum) == (-1.0, 3.0)
  np.testing.assert_allclose(references.bagua_decompress(codes, minimum, maximum),
                             np.array([-64, 0, 16, 191]) / 63.75, rtol=1e-7)


def test_bagua_compress_keeps_a_zero_chunk_zero():
  codes, minimum, maximum = references.bagua_compress(np.zeros(5, np.float32))
  np.testing.assert_array_equal(codes, 255)  # Level 0, bottom level -255.
  np.testing.assert_array_equal(references.bagua_decompress(codes, minimum, maximum), 0.0)


def test_bagua_compress_refuses_a_code_bagua_leaves_undefined():
  # A constant chunk at 1: scale 2.55e9, and float32 cannot hold top - 255.
  with pytest.raises(ValueError, match="undefined"):
    references.bagua_compress(np.ones(3, np.float32))


@pytest.mark.parametrize("leaf_bytes, bucket_bytes, expected", [
    ([4, 8, 4, 12, 4], 10, [[0, 1], [2, 3], [4]]),  # A bucket closes at 10 bytes or more.
    ([40, 4], 10, [[0], [1]]),  # A large tensor fills a bucket alone.
    ([4, 4, 4], 100, [[0, 1, 2]]),  # The last bucket may be short.
])
def test_bagua_buckets_are_whole_tensors_until_full(leaf_bytes, bucket_bytes, expected):
  assert references.bagua_buckets(leaf_bytes, bucket_bytes) == expected


def _ring(models):
  models = _f32(*models).reshape(len(models), -1)
  return models, np.roll(models, 1, axis=0), np.roll(models, -1, axis=0)


def test_bagua_step_on_a_ring_of_four():
  # Worker i holds i * (3, 6): z_i = ((x_{i-1} - x_i) + (x_{i+1} - x_i)) / 3, which
  # is (4, 8), 0, 0 and (-4, -8), each on its own grid (or zero) and so exact.
  models, left, right = _ring([[0, 0], [3, 6], [6, 12], [9, 18]])
  step = references.bagua_decentralized_step(models, left, right, np.zeros_like(models))
  np.testing.assert_array_equal(step.differences, [[4, 8], [0, 0], [0, 0], [-4, -8]])
  np.testing.assert_array_equal(step.models, [[4, 8], [3, 6], [6, 12], [5, 10]])
  np.testing.assert_array_equal(step.left_replicas, np.roll(step.models, 1, axis=0))
  np.testing.assert_array_equal(step.right_replicas, np.roll(step.models, -1, axis=0))


def test_bagua_step_with_two_workers_weighs_the_peer_two_thirds():
  # The single peer is both neighbours: x_0 + 2/3 (x_1 - x_0) = (2, 4).
  models, left, right = _ring([[0, 0], [3, 6]])
  step = references.bagua_decentralized_step(models, left, right, np.zeros_like(models))
  np.testing.assert_array_equal(step.models, [[2, 4], [1, 2]])
  np.testing.assert_array_equal(step.left_replicas, [[1, 2], [2, 4]])


def test_bagua_hierarchical_step_averages_each_node_first():
  # Node 0's workers step by (1, 2) and (3, 2): their average (2, 2) is its step.
  models, left, right = _ring([[0, 0], [3, 6]])
  local_steps = _f32([[1, 2], [3, 2]], [[0, 0], [0, 0]])
  step = references.bagua_decentralized_step(models, left, right, local_steps)
  np.testing.assert_array_equal(step.differences, [[4, 6], [-2, -4]])
  np.testing.assert_array_equal(step.models, [[4, 6], [1, 2]])
  np.testing.assert_array_equal(step.right_replicas, [[1, 2], [4, 6]])


def test_bagua_step_gives_each_bucket_its_own_range():
  # One bucket of (4, 8) and one of (400, 800): each is exact on its own grid.
  models, left, right = _ring([[0, 0, 0, 0], [3, 6, 300, 600]])
  one_bucket_each = references.bagua_decentralized_step(
      models, left, right, np.zeros_like(models), bucket_sizes=[2, 2])
  np.testing.assert_array_equal(one_bucket_each.models[0], [2, 4, 200, 400])
  shared = references.bagua_decentralized_step(models, left, right, np.zeros_like(models))
  assert shared.models[0, 0] != 2.0  # One range for all: (2, 4) falls between levels.


# CNTK.


@pytest.mark.parametrize("row, zero_threshold, expected", [
    ([1, 3, -2, -4], True, [2, 2, -3, -3]),  # The means of each side.
    ([1, 3], True, [2, 2]),  # No negative element: its side is 0 / 1.
    ([0, 0], True, [0, 0]),  # An empty range decodes to its lower end.
    ([0, 1, 2, 5], False, [0.5, 0.5, 3.5, 3.5]),  # Mean 2, mean absolute deviation 1.5.
    ([0, 1, 2, 5], True, [2, 2, 2, 2]),
])
def test_cntk_one_bit_reconstructs_two_values_a_row(row, zero_threshold, expected):
  bits, lower, upper = references.cntk_quantize_1bit(_f32(row), zero_threshold)
  np.testing.assert_array_equal(references.cntk_unquantize_1bit(bits, lower, upper), [expected])


def test_cntk_one_bit_sends_the_range_not_the_values():
  # Values -3 and 2 travel as the range [-5.5, 4.5]: twice their distance, same middle.
  _, lower, upper = references.cntk_quantize_1bit(_f32(1, 3, -2, -4)[None])
  np.testing.assert_array_equal([lower[0], upper[0]], [-5.5, 4.5])


@pytest.mark.parametrize("rows, num_workers, expected", [
    (5, 2, [(0, 3), (3, 5)]),
    (1, 4, [(0, 1), (1, 1), (1, 1), (1, 1)]),  # Only worker 0 owns a stripe.
    (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
])
def test_cntk_stripes_are_whole_rows(rows, num_workers, expected):
  stripes = references.cntk_stripes(rows, num_workers)
  assert [(s.start, s.stop) for s in stripes] == expected


def _two_worker_gradients():
  return _f32([[1, -1], [2, 2]], [[3, -3], [0, 4]])


def test_cntk_aggregate_of_two_workers():
  # Row 1 of worker 1, (0, 4), is all non-negative: it decodes to (2, 2),
  # leaving the residual (-2, 2). Owner 1 re-quantizes (2, 2) + (2, 2).
  gradients = _two_worker_gradients()
  zeros = np.zeros_like(gradients)
  result = references.cntk_onebit_aggregate(gradients, zeros, zeros)
  np.testing.assert_array_equal(result.total, [[4, -4], [4, 4]])
  np.testing.assert_array_equal(result.worker_residuals, [[[0, 0], [0, 0]], [[0, 0], [-2, 2]]])
  np.testing.assert_array_equal(result.owner_residuals, 0.0)


def test_cntk_aggregate_with_the_own_stripe_in_full_precision():
  # Owner 1 starts from its raw row (0, 4): (0, 4) + (2, 2) = (2, 6) -> (4, 4).
  gradients = _two_worker_gradients()
  zeros = np.zeros_like(gradients)
  result = references.cntk_onebit_aggregate(gradients, zeros, zeros, quantize_own_stripe=False)
  np.testing.assert_array_equal(result.total, [[4, -4], [4, 4]])
  np.testing.assert_array_equal(result.owner_residuals, [[[0, 0], [0, 0]], [[0, 0], [-2, 2]]])


def test_cntk_aggregate_loses_nothing_to_its_residuals():
  # What is not delivered stays in a residual: total plus the new residuals
  # equals the gradients plus the old residuals.
  rng = np.random.default_rng(0)
  gradients, worker, owner = (rng.standard_normal((3, 4, 7, 5)).astype(np.float32))
  result = references.cntk_onebit_aggregate(gradients, worker, owner)
  stripes = references.cntk_stripes(7, 4)
  owned = sum(owner[k, s].sum(axis=0) for k, s in enumerate(stripes))
  new_owned = sum(result.owner_residuals[k, s].sum(axis=0) for k, s in enumerate(stripes))
  np.testing.assert_allclose(
      result.total.sum(axis=0) + result.worker_residuals.sum(axis=(0, 1)) + new_owned,
      gradients.sum(axis=(0, 1)) + worker.sum(axis=(0, 1)) + owned, rtol=1e-5, atol=1e-5)


# QSGD-TF.


def test_qsgd_tf_two_rounds_by_hand():
  # Chunks (0:3) and (3:6); every bucket spans 0..255, so the unit is 1.
  gradients = _f32([0, -0.25, 0, 0, 50.5, 255], [0, 100.25, 255, 0, 0.1, 0])
  first = _f32([0.0, 0.0, 0.0, 0.2, 0.4, 0.0], [0.3, 0.8, 0.9, 0.0, 0.0, 0.0])
  second = _f32(0.5, 0.2, 0.5, 0.5, 0.95, 0.5)
  # Round 1: 100.25 + 0.8 -> 101 (to owner 0), 50.5 + 0.4 -> 50 (to owner 1).
  # The owners add their own chunks unquantized: 101 - 0.25 and 50 + 0.1.
  # Round 2: 100.75 + 0.2 -> 100 and 50.1 + 0.95 -> 51.
  total = references.qsgd_tf_allreduce(gradients, first, second)
  np.testing.assert_array_equal(total, [0, 100, 255, 0, 51, 255])


def test_qsgd_tf_buckets_are_512_elements():
  # One worker, so only round 2: 600 integers, the first 512 in 0..255 and the
  # last 88 in 1000..1255. Each bucket's unit is 1, so every value is exact;
  # one range for all would have a unit near 5.
  x = np.concatenate([np.arange(512) % 256, 1000 + np.minimum(np.arange(88) * 3, 255)])
  x[-1] = 1255
  x = x.astype(np.float32)[None]
  total = references.qsgd_tf_allreduce(x, np.zeros_like(x), np.full(600, 0.5))
  np.testing.assert_array_equal(total, x[0])


def test_qsgd_tf_chunks_match_the_stripes():
  assert [(s.start, s.stop) for s in references.qsgd_tf_chunks(10, 4)] == [
      (0, 3), (3, 6), (6, 8), (8, 10)]


# The QSGD paper.


@pytest.mark.parametrize("uniforms, norm, expected", [
    ([0.7, 0.5], "l2", [2.5, -5.0]),  # |v| s / 5 = (1.2, 1.6): levels 1 and 2 of 2.
    ([0.9, 0.3], "l2", [5.0, -2.5]),
    ([0.4, 0.9], "max", [2.0, -4.0]),  # |v| s / 4 = (1.5, 2): levels 1 and 2.
])
def test_qsgd_quantize_by_hand(uniforms, norm, expected):
  decoded = references.qsgd_quantize([3.0, -4.0], np.array(uniforms), levels=2, norm=norm)
  np.testing.assert_allclose(decoded, expected)


def test_qsgd_quantize_keeps_a_zero_bucket_and_scales_each_bucket():
  decoded = references.qsgd_quantize([0.0, 0.0, 3.0, -4.0], np.full(4, 0.5), levels=2,
                                     bucket_size=2)
  np.testing.assert_allclose(decoded, [0.0, 0.0, 2.5, -5.0])


def test_qsgd_all_gather_mean_is_unbiased_with_the_variance_of_one_quantization():
  # E||mean - g_bar||^2 = (1 / n^2) sum_i sum_j ||g_i|| ^ 2 / s^2 * p_ij (1 - p_ij)
  # for the fractions p_ij: each gradient is quantized once.
  rng = np.random.default_rng(1)
  num_workers, size, levels, draws = 4, 64, 3, 4000
  gradients = rng.standard_normal((num_workers, size))
  uniforms = rng.uniform(size=(draws, num_workers, size))
  means = np.array([references.qsgd_all_gather_mean(gradients, u, levels) for u in uniforms])
  norms = np.linalg.norm(gradients, axis=1, keepdims=True)
  fraction = np.modf(levels * np.abs(gradients) / norms)[0]
  exact = np.sum((norms / levels) ** 2 * fraction * (1 - fraction)) / num_workers**2
  errors = np.sum((means - gradients.mean(axis=0)) ** 2, axis=1)
  assert abs(errors.mean() - exact) < 5 * errors.std() / np.sqrt(draws)
  bias = means.mean(axis=0) - gradients.mean(axis=0)
  assert np.all(np.abs(bias) < 5 * means.std(axis=0) / np.sqrt(draws) + 1e-12)
