"""The seed systems reproduced: CNTK's 1-bit aggregator, QSGD-TF's two rounds, QSGD's Algorithm 1.

Each is compared with the numpy reference of ``references.py``, written from
the systems' published code: exactly where the rounding is deterministic
(CNTK), statistically where it is random (QSGD-TF and the QSGD paper draw
their uniforms their own way). Bagua's step is tested in
``decentralized_test.py``. Four of the eight simulated devices take part.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import references

import qsgd_jax

AXIS = "batch"
NUM_WORKERS = 4
_DEVICES = jax.devices()[:NUM_WORKERS]


def _pmap(f, **kwargs):
  return jax.pmap(f, axis_name=AXIS, devices=_DEVICES, **kwargs)


def test_onebit_rows_with_both_residuals_is_cntks_aggregator():
  """``OneBit(bucket_size=None)``, both residuals, own piece quantized: CNTK's defaults.

  Six steps of new gradients, the residuals carried: every step's mean is
  CNTK's sum over ``n``, and the residuals follow CNTK's (the owner's scaled
  by ``1 / n``, as the mean is quantized rather than the sum), to float
  rounding. Two leaves of different row lengths share no segment.
  """
  shapes = {"a": (64, 128), "b": (40, 96)}
  tx = qsgd_jax.compressed_allreduce(
      qsgd_jax.OneBit(bucket_size=None), AXIS, error_feedback="both", exact_own_piece=False,
      min_compressed_size=1000)
  zeros = {name: jnp.zeros((NUM_WORKERS, *shape)) for name, shape in shapes.items()}
  state = _pmap(tx.init)(zeros)
  update = _pmap(tx.update)
  rng = np.random.default_rng(0)
  worker = {name: np.zeros((NUM_WORKERS, *shape), np.float32) for name, shape in shapes.items()}
  owner = {name: np.zeros((NUM_WORKERS, *shape), np.float32) for name, shape in shapes.items()}
  for step in range(6):
    grads = {name: rng.normal(size=(NUM_WORKERS, *shape)).astype(np.float32)
             for name, shape in shapes.items()}
    mean, state = jax.block_until_ready(update(grads, state))
    for name in shapes:
      cntk = references.cntk_onebit_aggregate(grads[name], worker[name], owner[name])
      worker[name], owner[name] = cntk.worker_residuals, cntk.owner_residuals
      for device in range(NUM_WORKERS):
        np.testing.assert_allclose(mean[name][device], cntk.total / NUM_WORKERS,
                                   rtol=2e-5, atol=2e-6, err_msg=f"{name}, step {step}")
  # The worker residuals, each device's, as CNTK keeps them.
  for k, name in enumerate(sorted(shapes)):
    np.testing.assert_allclose(np.asarray(state.local_error[k]).reshape(worker[name].shape),
                               worker[name], rtol=1e-4, atol=1e-5)


def _assert_unbiased(samples, exact):
  """The mean error's z-scores over draws: none extreme for thousands of coordinates, mean ~0.

  With 256 draws each z is Student's t with 255 degrees of freedom:
  ``P(|t| > 5.5)`` is about 1e-7, so a bound of 5.5 over ~6000 coordinates fails
  by chance once in a thousand runs.
  """
  z, _ = _error_statistics(samples, exact)
  assert np.max(np.abs(z)) < 5.5 and abs(np.mean(z)) < 5.0 / np.sqrt(z.size)


def _error_statistics(samples, exact):
  """Per coordinate over draws: the z-scores of the mean error, and the mean squared error."""
  errors = np.asarray(samples, np.float64) - exact
  z = errors.mean(axis=0) / (errors.std(axis=0, ddof=1) / np.sqrt(len(errors)) + 1e-30)
  return z, float(np.mean(errors**2))


@functools.cache
def _gradients(size: int):
  rng = np.random.default_rng(1)
  return (rng.normal(size=(NUM_WORKERS, size)) * np.linspace(0.5, 2.0, size)).astype(
      np.float32)


def _ours(compressor, method, size, draws=256):
  """The pmean over ``draws`` keys, ``[draws, size]``, from device 0."""
  keys = jax.random.split(jax.random.key(3), draws)

  def means(x, keys):
    return jax.vmap(lambda key: qsgd_jax.quantized_pmean(
        x, AXIS, compressor, key, method=method, min_compressed_size=0))(keys)

  return np.asarray(_pmap(means, in_axes=(0, None))(_gradients(size), keys)[0])


@pytest.mark.slow
def test_minmax_two_phase_is_qsgd_tfs_two_rounds_in_law():
  """``MinMax()`` two-phase, own piece exact: QSGD-TF's error, unbiased, the same size.

  One leaf of 4 x 3 x 512 elements, so that QSGD-TF's chunks of its fused
  vector and its 512-element buckets fall where the plan's pieces and buckets
  do; the draws differ, so the errors are compared in law over 256 draws.
  """
  size = NUM_WORKERS * 3 * 512
  x = _gradients(size)
  exact = x.astype(np.float64).mean(axis=0)
  ours = _ours(qsgd_jax.MinMax(), "two_phase", size)
  rng = np.random.default_rng(5)
  theirs = np.stack([references.qsgd_tf_allreduce(
      x, rng.random((NUM_WORKERS, size)), rng.random(size)) / NUM_WORKERS
      for _ in range(len(ours))])
  for samples in (ours, theirs):
    _assert_unbiased(samples, exact)
  ratio = _error_statistics(ours, exact)[1] / _error_statistics(theirs, exact)[1]
  assert 0.9 < ratio < 1.1, ratio


# Buckets of 512 under the max norm, all-gathered: unbiased and the devices' errors independent
# (collectives_test's qsgd4_all_gather), each device's the exact variance of stochastic rounding
# (compressors_test's test_unbiased[qsgd4_max_bucket256]): in the slow tier.
@pytest.mark.parametrize(
    "bucket_size, norm", [(None, "l2"), pytest.param(512, "max", marks=pytest.mark.slow)],
    ids=["paper_l2", "bucketed_max"])
def test_all_gather_is_qsgds_algorithm_1_in_law(bucket_size, norm):
  """``method="all_gather"``: one quantization a worker, averaged: the paper's error, unbiased."""
  size = 4096
  x = _gradients(size)
  exact = x.astype(np.float64).mean(axis=0)
  compressor = qsgd_jax.QSGD(bits=4, bucket_size=bucket_size, norm=norm)
  ours = _ours(compressor, "all_gather", size)
  rng = np.random.default_rng(6)
  theirs = np.stack([references.qsgd_all_gather_mean(
      x, rng.random((NUM_WORKERS, size)), compressor.levels, bucket_size, norm)
      for _ in range(len(ours))])
  for samples in (ours, theirs):
    _assert_unbiased(samples, exact)
  ratio = _error_statistics(ours, exact)[1] / _error_statistics(theirs, exact)[1]
  assert 0.9 < ratio < 1.1, ratio
  if bucket_size is None:  # Lemma 3.1: E|Q(v) - v|^2 <= min(d / s^2, sqrt(d) / s) |v|^2.
    s = compressor.levels
    bound = min(size / s**2, np.sqrt(size) / s) * np.sum(x.astype(np.float64) ** 2)
    assert _error_statistics(ours, exact)[1] * size < bound / NUM_WORKERS**2
