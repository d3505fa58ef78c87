"""``qsgd`` and ``onebit_sgd``: :func:`~qsgd_jax.compressed_allreduce` with QSGD's and CNTK's
quantizers, as ``optax.adamw`` is a chain of optax's own transforms."""

from typing import Literal

import jax
import optax

from qsgd_jax._src import axes, base
from qsgd_jax._src.averaging.allreduce import ErrorFeedback, compressed_allreduce
from qsgd_jax._src.collectives import plan
from qsgd_jax._src.compressors.onebit import OneBit
from qsgd_jax._src.compressors.qsgd import QSGD


def qsgd(
    axis_name: axes.AxisName,
    bits: int = 4,
    bucket_size: int | None = 512,
    norm: Literal["max", "l2"] = "max",
    key: jax.Array | int = 0,
    *,
    error_feedback: ErrorFeedback = False,
    warmup_steps: int = 0,
    method: plan.Method = "two_phase",
    min_compressed_size: int = plan.DEFAULT_MIN_COMPRESSED_SIZE,
    axis_size: int | dict[str, int] | None = None,
    track_elias: bool | int = False,
    exact_own_piece: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """QSGD (Alistarh et al. 2017): gradients averaged with the QSGD quantizer.

  ``compressed_allreduce(QSGD(bits, bucket_size, norm), axis_name, key=key)``:
  each coordinate travels as a ``bits``-bit stochastic level of its bucket's
  norm, unbiased, with the variance bound of Lemma 3.1.

  Args:
    axis_name: the mapped axis to average over.
    bits: bits a coordinate; ``2**(bits - 1) - 1`` levels.
    bucket_size: coordinates sharing one scale; ``None`` for one per piece.
    norm: ``"max"`` or ``"l2"``.
    key: PRNG key or integer seed.
    error_feedback, warmup_steps, method: as in :func:`compressed_allreduce`.
    axis_size, track_elias, exact_own_piece: as in :func:`compressed_allreduce`.
    min_compressed_size: leaves with fewer elements (4096 by default: biases
      and norm scales) go in float32.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Under ``optax.inject_hyperparams`` only ``key`` may be traced: name the
  other numeric options in ``static_args``,
  ``static_args=("bits", "bucket_size", "warmup_steps", "min_compressed_size")``
  (and ``"axis_size"``, ``"track_elias"`` if given); the error says so too.

  Examples:
    >>> import optax, qsgd_jax
    >>> tx = optax.chain(qsgd_jax.qsgd("batch"), optax.adamw(1e-3))

  References:
    Alistarh et al., `QSGD: Communication-Efficient SGD via Gradient
    Quantization and Encoding <https://arxiv.org/abs/1610.02132>`_, 2017.
  """
  base.check_static_options(
      "qsgd_jax.qsgd", bits=bits, bucket_size=bucket_size, warmup_steps=warmup_steps,
      min_compressed_size=min_compressed_size, axis_size=axis_size, track_elias=track_elias)
  compressor = QSGD(bits=bits, bucket_size=bucket_size, norm=norm)
  return compressed_allreduce(
      compressor, axis_name, key=key, error_feedback=error_feedback,
      warmup_steps=warmup_steps, method=method, min_compressed_size=min_compressed_size,
      axis_size=axis_size, track_elias=track_elias, exact_own_piece=exact_own_piece)


def onebit_sgd(
    axis_name: axes.AxisName,
    key: jax.Array | int = 0,
    *,
    bucket_size: int | None = 512,
    error_feedback: ErrorFeedback = "worker",
    warmup_steps: int = 0,
    method: plan.Method = "two_phase",
    min_compressed_size: int = plan.DEFAULT_MIN_COMPRESSED_SIZE,
    axis_size: int | dict[str, int] | None = None,
    track_elias: bool | int = False,
    exact_own_piece: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """1-bit SGD (Seide et al. 2014): sign bits, bucket means, error feedback.

  ``compressed_allreduce(OneBit(bucket_size), axis_name, error_feedback=...)``.

  CNTK's ``AllReduceDistGradAggregator`` quantizes each column of a gradient
  matrix on its own (a row here: ``bucket_size=None``), keeps a residual on
  every worker *and* on every stripe owner's re-quantized sum, and quantizes
  the owner's own stripe too: ``onebit_sgd(axis_name, bucket_size=None,
  error_feedback="both", exact_own_piece=False)`` reproduces it to float
  rounding (``tests/fidelity_test.py``).

  The defaults come from ``benchmarks/error_feedback.py`` (digits, an MLP on
  8 devices, 5 seeds x 300 SGD steps; test accuracy): float32 97.00 +- 0.41;
  worker residuals 96.44 +- 0.60 with buckets of 512, 96.78 +- 0.50 with
  rows; both residuals 95.56 +- 1.87 (buckets) and 96.33 +- 0.99 (rows);
  CNTK's settings 96.44 +- 0.84; owner residuals alone 76.6 +- 9.8; none
  94.94 +- 0.36. Worker residuals alone do as well as CNTK's two, with no
  state on the owners; buckets of 512 and rows are within the seeds' spread,
  and a fixed bucket size keeps the scales' share of the bytes fixed whatever
  the leaves' row lengths.

  Args:
    axis_name: the mapped axis to average over.
    key: PRNG key or int seed (1-bit quantization is deterministic; the key
      is kept for a uniform interface).
    bucket_size: elements sharing the two reconstruction values; ``None``
      for one bucket a row of each leaf's last axis, as CNTK.
    error_feedback: as in :func:`compressed_allreduce`; ``"worker"`` by
      default.
    warmup_steps, method, min_compressed_size: as in :func:`compressed_allreduce`.
    axis_size, track_elias, exact_own_piece: as in :func:`compressed_allreduce`.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Examples:
    >>> import optax, qsgd_jax
    >>> tx = optax.chain(qsgd_jax.onebit_sgd("batch"), optax.sgd(0.1, momentum=0.9))

  References:
    Seide et al., `1-Bit Stochastic Gradient Descent and its Application to
    Data-Parallel Distributed Training of Speech DNNs`, Interspeech 2014.
  """
  base.check_static_options(
      "qsgd_jax.onebit_sgd", bucket_size=bucket_size, warmup_steps=warmup_steps,
      min_compressed_size=min_compressed_size, axis_size=axis_size, track_elias=track_elias)
  return compressed_allreduce(
      OneBit(bucket_size=bucket_size), axis_name, key=key, error_feedback=error_feedback,
      warmup_steps=warmup_steps, method=method, min_compressed_size=min_compressed_size,
      axis_size=axis_size, track_elias=track_elias, exact_own_piece=exact_own_piece,
  )
