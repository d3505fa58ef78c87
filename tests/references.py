"""Numpy references of the systems qsgd_jax reproduces, for tests to compare against.

Each function is one system's step, written from its published description and
its source (read, not copied), in plain numpy on small arrays. Workers are the
leading axis of every array: ``x[i]`` is worker ``i``'s. Randomness is an input
(uniform draws in ``[0, 1)``), so that a test can feed the same draws to the
library or compare statistics.

* :func:`bagua_compress`, :func:`bagua_decompress`,
  :func:`bagua_buckets` and :func:`bagua_decentralized_step`: Bagua's
  ``LowPrecisionDecentralizedAlgorithm`` (BaguaSys/bagua,
  ``rust/bagua-core/bagua-core-internal/kernels/bagua_kernels.cu``,
  ``src/comm_ops/decentralized_low_precision_synchronous.rs``,
  ``src/communicators/mod.rs``, ``bagua/torch_api/algorithms/decentralized.py``,
  ``bagua/service/autotune_task_manager.py``).
* :func:`cntk_quantize_1bit`, :func:`cntk_unquantize_1bit` and
  :func:`cntk_onebit_aggregate`: CNTK's 1-bit SGD aggregation
  (microsoft/CNTK, ``Source/Math/ValueQuantizer.h``,
  ``Source/Math/ColumnQuantizer.h``, ``Source/1BitSGD/MatrixQuantizer.h``,
  ``Source/1BitSGD/AllReduceDistGradAggregator.h``).
* :func:`qsgd_tf_allreduce`: QSGD-TF's two rounds (ganshaoduo/QSGD-TF,
  ``horovod/tensorflow/mpi_ops.cc``, ``mpi_ops_gpu.cu.cc``).
* :func:`qsgd_quantize` and :func:`qsgd_all_gather_mean`: Algorithm 1 of
  Alistarh et al., QSGD (NeurIPS 2017).
* :func:`zeropp_symmetric_quantize`: ZeRO++'s weight quantizer, qwZ
  (deepspeedai/DeepSpeed, ``csrc/includes/quantization_utils.h``,
  ``csrc/includes/conversion_utils.h``,
  ``deepspeed/runtime/zero/partition_parameters.py``).
"""

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

# Bagua.

_BAGUA_LEVELS = np.float32(255)
_BAGUA_EPSILON = np.float32(1e-7)


def _bagua_grid(minimum, maximum):
  """Bagua's scale and lowest level of a chunk: float32, as its kernels compute them."""
  scale = _BAGUA_LEVELS / (np.float32(maximum) - np.float32(minimum) + _BAGUA_EPSILON)
  top = np.rint(np.float32(maximum) * scale)
  return scale, top, np.float32(top - _BAGUA_LEVELS)


def bagua_compress(chunk: np.ndarray) -> tuple[np.ndarray, np.float32, np.float32]:
  """Bagua's ``MinMaxUInt8`` compression of one chunk (``compress_float_to_uint8``).

  Args:
    chunk: float32 vector.

  Returns:
    ``(codes, minimum, maximum)``: ``uint8`` codes, one an element, and the
    chunk's float32 minimum and maximum, which travel with them.

  Raises:
    ValueError: where a code falls outside ``[0, 255]``, which Bagua's
      unchecked float-to-``uint8`` conversion leaves undefined.
  """
  chunk = np.asarray(chunk, np.float32)
  minimum, maximum = chunk.min(), chunk.max()
  scale, top, bottom = _bagua_grid(minimum, maximum)
  levels = np.minimum(np.rint(chunk * scale), top) - bottom
  if np.any((levels < 0) | (levels > 255)):
    raise ValueError("a code outside [0, 255]: undefined in Bagua's kernel")
  return levels.astype(np.uint8), minimum, maximum


def bagua_decompress(codes: np.ndarray, minimum, maximum) -> np.ndarray:
  """Bagua's decompression of one chunk: ``(code + lowest level) / scale``, float32."""
  scale, _, bottom = _bagua_grid(minimum, maximum)
  return (codes.astype(np.float32) + bottom) / scale


def bagua_buckets(leaf_bytes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
  """Bagua's default bucketing (``split_bucket_by_bucket_size``), of one dtype.

  Whole tensors, in order, join the open bucket, which closes as soon as it
  holds ``bucket_bytes`` or more (Bagua's default is 10 MiB); the last bucket
  may hold less.

  Args:
    leaf_bytes: bytes of each tensor, in order.
    bucket_bytes: the bucket size in bytes.

  Returns:
    The tensor indices of each bucket.
  """
  buckets, current, filled = [], [], 0
  for index, size in enumerate(leaf_bytes):
    current.append(index)
    filled += size
    if filled >= bucket_bytes:
      buckets.append(current)
      current, filled = [], 0
  if current:
    buckets.append(current)
  return buckets


class BaguaStep(NamedTuple):
  """What :func:`bagua_decentralized_step` returns; every array is float32 ``[n, d]``.

  Attributes:
    models: each worker's (node's) model after the step.
    left_replicas: each worker's copy of its left peer's new model.
    right_replicas: each worker's copy of its right peer's new model.
    differences: the model differences :math:`z_i` each worker compressed.
  """

  models: np.ndarray
  left_replicas: np.ndarray
  right_replicas: np.ndarray
  differences: np.ndarray


def bagua_decentralized_step(models, left_replicas, right_replicas, local_steps,
                             bucket_sizes: Sequence[int] | None = None) -> BaguaStep:
  """One step of Bagua's low-precision decentralized SGD on a ring of ``n`` workers.

  The bucket is the flattened concatenation of a worker's parameters (Bagua's
  ``weight``); after its optimizer step it holds ``models + local_steps``.
  Worker ``i`` mixes in its peers' replicas (left ``i - 1``, right ``i + 1``,
  weight 1/3 each, itself 1/3; with two workers the single peer is both),
  compresses the difference from its model, one chunk (one minimum and
  maximum) a Bagua bucket, sends it to both peers, and adds the decompressed
  difference to its model and the received ones to its replicas. Bagua's
  order of float32 operations is kept: ``t = w + u``, ``t += L / 3``,
  ``t += R / 3``, ``t -= 5/3 w``.

  With ``local_steps`` of shape ``[n, k, d]`` this is Bagua's hierarchical
  mode (its default): ``n`` nodes of ``k`` workers, which share their node's
  model and replicas. The node averages its workers' stepped models in full
  precision (an intra-node reduce to the leader), the leaders run the ring
  step, and the leader broadcasts the new model to its node.

  Args:
    models: float32 ``[n, d]``, each worker's model before the step.
    left_replicas: float32 ``[n, d]``, worker ``i``'s copy of worker ``i - 1``'s model.
    right_replicas: float32 ``[n, d]``, worker ``i``'s copy of worker ``i + 1``'s model.
    local_steps: float32 ``[n, d]`` (or ``[n, k, d]``), what each worker's
      optimizer adds to its model (``-lr * grad`` for plain SGD).
    bucket_sizes: elements of each Bagua bucket, in order, summing to ``d``;
      ``None`` is one bucket.

  Returns:
    A :class:`BaguaStep`.
  """
  models = np.asarray(models, np.float32)
  left, right = np.asarray(left_replicas, np.float32), np.asarray(right_replicas, np.float32)
  stepped = models[:, None] + np.asarray(local_steps, np.float32).reshape(len(models), -1,
                                                                         models.shape[1])
  t = stepped.mean(axis=1, dtype=np.float32)
  third = np.float32(1.0 / 3.0)
  t = t + left * third
  t = t + right * third
  t = t + models * np.float32(-5.0 / 3.0)
  bounds = np.cumsum([0, *(bucket_sizes or [models.shape[1]])])
  decoded = np.empty_like(t)
  for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
    for worker in range(len(t)):
      decoded[worker, start:stop] = bagua_decompress(*bagua_compress(t[worker, start:stop]))
  from_left = np.roll(decoded, 1, axis=0)  # Worker i receives worker i - 1's.
  from_right = np.roll(decoded, -1, axis=0)
  return BaguaStep(models + decoded, left + from_left, right + from_right, t)


# CNTK.


def cntk_quantize_1bit(values: np.ndarray, zero_threshold: bool = True):
  """CNTK's 1-bit quantization of each row (a CNTK column) of a matrix.

  A row-major row here is a column of CNTK's column-major matrices. With
  ``zero_threshold`` (CNTK's default, ``zeroThresholdFor1Bit``) an element's
  bit is ``value >= 0``, and the two reconstruction values are the means of
  the negative and of the non-negative elements (an empty side counts as one
  element of sum zero). Otherwise the threshold is the row's mean and the
  values are the mean minus and plus the mean absolute deviation from it.
  CNTK does not send the two values but the quantization range
  ``[lower, upper]`` around their midpoint, twice as wide as their distance,
  from which :func:`cntk_unquantize_1bit` recovers them.

  Args:
    values: float32 ``[rows, columns]``, what is quantized (gradient plus
      residual).
    zero_threshold: CNTK's ``zeroThresholdFor1Bit``.

  Returns:
    ``(bits, lower, upper)``: bool ``[rows, columns]`` and float32 ``[rows]`` twice.
  """
  values = np.asarray(values, np.float32)
  count = np.float32(values.shape[1])
  if zero_threshold:
    threshold = np.zeros((values.shape[0], 1), np.float32)
  else:
    threshold = values.sum(axis=1, keepdims=True, dtype=np.float32) / count
  high = values >= threshold
  sum_low = np.where(high, 0, values).sum(axis=1, dtype=np.float32)
  sum_high = np.where(high, values, 0).sum(axis=1, dtype=np.float32)
  num_low, num_high = (~high).sum(axis=1), high.sum(axis=1)
  if zero_threshold:
    mean_low = sum_low / np.maximum(num_low, 1).astype(np.float32)
    mean_high = sum_high / np.maximum(num_high, 1).astype(np.float32)
    middle = np.float32(0.5) * (mean_low + mean_high)
    radius = np.float32(2) * (mean_high - middle)
  else:
    middle = threshold[:, 0]
    num_low, num_high = num_low.astype(np.float32), num_high.astype(np.float32)
    deviation = ((num_low * middle - sum_low) + (sum_high - num_high * middle)) / count
    radius = np.float32(2) * deviation
  return high, (middle - radius).astype(np.float32), (middle + radius).astype(np.float32)


def cntk_unquantize_1bit(bits, lower, upper) -> np.ndarray:
  """CNTK's ``ValueQuantizer::Unquantize`` for 1 bit: ``lower + (bit + 1/2) (upper - lower) / 2``.

  A range narrower than ``1e-36`` reconstructs every element to ``lower``.
  """
  lower = np.asarray(lower, np.float32)[:, None]
  upper = np.asarray(upper, np.float32)[:, None]
  step = np.where(upper - lower < np.float32(1e-36), np.float32(0),
                  (upper - lower) / np.float32(2))
  return (bits.astype(np.float32) + np.float32(0.5)) * step + lower


def _cntk_round_trip(values, zero_threshold):
  return cntk_unquantize_1bit(*cntk_quantize_1bit(values, zero_threshold))


def _even_parts(size: int, num_parts: int) -> list[slice]:
  """Consecutive slices of ``range(size)``; the first ``size % num_parts`` one element longer."""
  per_part, extra = divmod(size, num_parts)
  starts = [per_part * k + min(extra, k) for k in range(num_parts + 1)]
  return [slice(starts[k], starts[k + 1]) for k in range(num_parts)]


def cntk_stripes(rows: int, num_workers: int) -> list[slice]:
  """CNTK's ``GetStripeForNode``: each worker's stripe of whole rows (CNTK columns)."""
  return _even_parts(rows, num_workers)


class CntkAggregation(NamedTuple):
  """What :func:`cntk_onebit_aggregate` returns.

  Attributes:
    total: float32 ``[rows, columns]``, the aggregated gradient every worker
      ends with: the *sum* over workers (CNTK divides by the sample count
      later, in the learner).
    worker_residuals: float32 ``[n, rows, columns]``, each worker's new residual.
    owner_residuals: float32 ``[n, rows, columns]``, each stripe owner's new
      residual on its own stripe's rows, zero elsewhere.
  """

  total: np.ndarray
  worker_residuals: np.ndarray
  owner_residuals: np.ndarray


def cntk_onebit_aggregate(gradients, worker_residuals, owner_residuals, *,
                          zero_threshold: bool = True,
                          quantize_own_stripe: bool = True) -> CntkAggregation:
  """One aggregation of CNTK's ``AllReduceDistGradAggregator`` with 1-bit quantization.

  1. Worker ``i`` quantizes ``gradients[i] + worker_residuals[i]`` row by row
     and keeps the quantization error as its new residual.
  2. The rows are cut into stripes of whole rows (:func:`cntk_stripes`);
     worker ``k`` owns stripe ``k`` and sums the decoded stripes of the
     other workers in worker order, starting from its own decoded stripe
     (``quantize_own_stripe``, which every CNTK entry point sets:
     ``useQuantizationForSelfStripe = true``) or from its raw gradient there.
  3. The owner quantizes that sum plus its owner residual row by row, keeps the
     error as its new owner residual, and broadcasts the codes; every worker,
     the owner too, decodes every stripe.

  Args:
    gradients: float32 ``[n, rows, columns]``, one matrix a worker (one
      gradient leaf, rows being CNTK columns).
    worker_residuals: float32 ``[n, rows, columns]``.
    owner_residuals: float32 ``[n, rows, columns]``; only worker ``k``'s
      stripe rows of ``owner_residuals[k]`` are read.
    zero_threshold: CNTK's ``zeroThresholdFor1Bit`` (default true).
    quantize_own_stripe: CNTK's ``useQuantizationForSelfStripe``.

  Returns:
    A :class:`CntkAggregation`.
  """
  gradients = np.asarray(gradients, np.float32)
  num_workers, rows, _ = gradients.shape
  inputs = gradients + np.asarray(worker_residuals, np.float32)
  sent = np.stack([_cntk_round_trip(v, zero_threshold) for v in inputs])
  total = np.zeros_like(gradients[0])
  new_owner_residuals = np.zeros_like(gradients)
  for owner, stripe in enumerate(cntk_stripes(rows, num_workers)):
    if stripe.start == stripe.stop:
      continue
    start = sent[owner, stripe] if quantize_own_stripe else gradients[owner, stripe]
    summed = start + sum(sent[j, stripe] for j in range(num_workers) if j != owner)
    summed = summed + np.asarray(owner_residuals, np.float32)[owner, stripe]
    total[stripe] = _cntk_round_trip(summed, zero_threshold)
    new_owner_residuals[owner, stripe] = summed - total[stripe]
  return CntkAggregation(total, inputs - sent, new_owner_residuals)


# QSGD-TF.

_QSGD_TF_BUCKET = 512


def _qsgd_tf_round_trip(chunk, uniforms):
  """QSGD-TF's stochastic 8-bit min-max quantization of a chunk, 512 elements a bucket."""
  decoded = np.empty_like(chunk)
  for start in range(0, chunk.size, _QSGD_TF_BUCKET):
    bucket = slice(start, start + _QSGD_TF_BUCKET)
    low, high = chunk[bucket].min(), chunk[bucket].max()
    unit = (high - low) / np.float32(255)
    if unit == 0:  # QSGD-TF divides by zero here; a constant bucket is exact.
      decoded[bucket] = low
      continue
    codes = np.minimum(np.floor((chunk[bucket] - low) / unit + uniforms[bucket]), 255)
    decoded[bucket] = low + codes.astype(np.float32) * unit
  return decoded


def qsgd_tf_chunks(size: int, num_workers: int) -> list[slice]:
  """QSGD-TF's partition of the fused vector into one chunk a worker."""
  return _even_parts(size, num_workers)


def qsgd_tf_allreduce(gradients, first_uniforms, second_uniforms) -> np.ndarray:
  """QSGD-TF's quantized all-reduce of the fused gradient vector: the sum every worker gets.

  The workers' tensors are fused into one float32 vector and cut into ``n``
  chunks (:func:`qsgd_tf_chunks`); worker ``k`` owns chunk ``k``.

  1. Every worker quantizes every chunk but its own and sends it to the
     chunk's owner. The owner adds the decoded chunks, in worker order, to
     its own chunk in full precision.
  2. The owner quantizes the sum and sends it to every worker; every worker,
     the owner too, decodes it.

  Quantization: buckets of 512 consecutive elements from the chunk's start
  (the last one shorter), each sending its float32 maximum and minimum;
  ``unit = (max - min) / 255``, code ``floor((x - min) / unit + u)`` with a
  uniform draw ``u`` (QSGD-TF draws ``(curand() % 1000001) / 1e6``, so its
  ``u`` can be 1 and a maximum can reach the code 256, which its ``uint8``
  cast leaves undefined; here ``u < 1`` and the code is capped at 255), and
  the decoded value ``min + code * unit``.

  Args:
    gradients: float32 ``[n, d]``, each worker's fused gradient vector.
    first_uniforms: ``[n, d]`` draws in ``[0, 1)``: ``first_uniforms[j, e]``
      rounds element ``e`` of worker ``j`` in round 1 (unused for ``j``'s own chunk).
    second_uniforms: ``[d]`` draws in ``[0, 1)``: element ``e``'s owner
      rounds the sum with ``second_uniforms[e]`` in round 2.

  Returns:
    float32 ``[d]``, the sum over workers (Horovod's average divides it by ``n``).
  """
  gradients = np.asarray(gradients, np.float32)
  num_workers, size = gradients.shape
  total = np.empty(size, np.float32)
  for owner, chunk in enumerate(qsgd_tf_chunks(size, num_workers)):
    summed = gradients[owner, chunk].copy()
    for worker in range(num_workers):
      if worker != owner:
        summed += _qsgd_tf_round_trip(gradients[worker, chunk], first_uniforms[worker, chunk])
    total[chunk] = _qsgd_tf_round_trip(summed, second_uniforms[chunk])
  return total


# The QSGD paper.


def qsgd_quantize(vector, uniforms, levels: int, bucket_size: int | None = None,
                  norm: str = "l2") -> np.ndarray:
  r"""The QSGD quantizer :math:`Q_s`, decoded, bucket by bucket.

  Each bucket of ``bucket_size`` consecutive elements (``None``: the whole
  vector, as in the paper's Algorithm 1) is scaled by its norm
  :math:`\|v\|` (``"l2"``, the paper's; or ``"max"``, its experiments'
  variant); element :math:`v_i` becomes
  :math:`\|v\| \operatorname{sgn}(v_i) \ell_i / s` with
  :math:`\ell_i = \lfloor s |v_i| / \|v\| + u_i \rfloor`, which is
  :math:`\lfloor s |v_i| / \|v\| \rfloor` plus one with probability the
  fractional part. A zero bucket stays zero.

  Args:
    vector: float ``[d]``.
    uniforms: ``[d]`` draws in ``[0, 1)``.
    levels: :math:`s`, the number of non-zero levels.
    bucket_size: elements a bucket, or ``None``.
    norm: ``"l2"`` or ``"max"``.

  Returns:
    float64 ``[d]``, the decoded :math:`Q_s(v)`.
  """
  vector = np.asarray(vector, np.float64)
  size = bucket_size or vector.size
  decoded = np.zeros_like(vector)
  for start in range(0, vector.size, size):
    bucket = slice(start, start + size)
    scale = np.linalg.norm(vector[bucket]) if norm == "l2" else np.abs(vector[bucket]).max()
    if scale == 0:
      continue
    level = np.floor(levels * np.abs(vector[bucket]) / scale + uniforms[bucket])
    decoded[bucket] = scale * np.sign(vector[bucket]) * level / levels
  return decoded


def qsgd_all_gather_mean(gradients, uniforms, levels: int, bucket_size: int | None = None,
                         norm: str = "l2") -> np.ndarray:
  """The gradient every worker applies in QSGD's Algorithm 1: the mean of all decoded gradients.

  Every worker quantizes its own gradient once (:func:`qsgd_quantize`) and
  broadcasts it; every worker decodes all ``n`` of them and averages. There
  is no second quantization, so the mean's error is the average of ``n``
  independent unbiased errors (Lemma 3.1's variance bound, divided by ``n``).

  Args:
    gradients: float ``[n, d]``, each worker's gradient.
    uniforms: ``[n, d]`` draws in ``[0, 1)``, each worker's own.
    levels, bucket_size, norm: as in :func:`qsgd_quantize`.

  Returns:
    float64 ``[d]``, the same on every worker.
  """
  decoded = [qsgd_quantize(g, u, levels, bucket_size, norm) for g, u in zip(gradients, uniforms,
                                                                            strict=True)]
  return np.mean(decoded, axis=0)


# DeepSpeed ZeRO++.


def zeropp_symmetric_quantize(group, num_bits: int = 8) -> tuple[np.ndarray, np.ndarray]:
  """ZeRO++'s symmetric quantization of one group of weights (qwZ), and its decoding.

  DeepSpeed at ab9dfcb: ``CUDAQuantizer.quantize`` (``partition_parameters.py``)
  quantizes a flattened parameter in groups of about 8000 elements, 8 bits,
  ``Symmetric``. ``Params<Type::Symmetric, numBits>`` (``quantization_utils.h``,
  lines 51-95): the scale is ``2**num_bits / (2 * max|x|)``, 1 for a zero
  group; a value becomes ``conversion::to<int32_t>(x * scale)``, which is
  ``__float2int_rn``, round to nearest even (``conversion_utils.h``), clamped
  to ``[-2**(num_bits - 1), 2**(num_bits - 1) - 1]``; the group stores
  ``1 / scale``, and a code decodes to ``q * (1 / scale)``.

  Args:
    group: float32 vector, one group.
    num_bits: 8 (or 4).

  Returns:
    ``(codes, decoded)``: int32 codes and float32 decoded values.
  """
  group = np.asarray(group, np.float32)
  largest = np.float32(np.abs(group).max())
  scale = np.float32(1.0) if largest == 0 else np.float32(2**num_bits) / (np.float32(2) * largest)
  codes = np.clip(np.rint(group * scale), -(2 ** (num_bits - 1)), 2 ** (num_bits - 1) - 1)
  return codes.astype(np.int32), codes.astype(np.float32) * (np.float32(1) / scale)
