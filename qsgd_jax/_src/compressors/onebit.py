"""CNTK's 1-bit quantization: one sign bit an element, two values a bucket."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from qsgd_jax._src import base
from qsgd_jax._src.compressors import packing

_FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class OneBit(base.Compressor):
  r"""1-bit quantization of 1-bit SGD (Seide et al. 2014).

  Each element sends one bit, set when it is negative. A bucket :math:`B`
  sends two float32 reconstruction values, the mean of its non-negative
  entries :math:`a = \mathrm{mean}\{x_i \ge 0\}` and the mean of its negative
  ones :math:`b = \mathrm{mean}\{x_i < 0\}` (zero for an empty side); an
  element decodes to :math:`a` or :math:`b` by its bit. This is the
  reconstruction that minimizes the squared error given the signs, and it
  keeps the bucket's sum: :math:`\sum_i \hat x_i = \sum_i x_i`.

  It is deterministic and biased: use it with error feedback (the residual
  :math:`x - \hat x` added to the next step's gradient), as
  :func:`qsgd_jax.onebit_sgd` does.

  On the wire: ``ceil(n / 32) * 32 + 64 * num_buckets`` bits.

  Attributes:
    bucket_size: consecutive elements a bucket. ``None`` groups the array as
      a ``(-1, shape[-1])`` matrix, one bucket a row (CNTK's per-column
      quantization of a row-major matrix); a vector is one bucket.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> q = qsgd_jax.OneBit(bucket_size=None)
    >>> x = jnp.array([[1.0, 3.0, -2.0], [-1.0, -3.0, 4.0]])
    >>> q.decode(q.encode(jax.random.key(0), x))
    Array([[ 2.,  2., -2.],
           [-2., -2.,  4.]], dtype=float32)

  References:
    Seide et al., `1-Bit Stochastic Gradient Descent and its Application to
    Data-Parallel Distributed Training of Speech DNNs
    <https://www.microsoft.com/en-us/research/publication/1-bit-stochastic-gradient-descent-and-application-to-data-parallel-distributed-training-of-speech-dnns/>`_,
    Interspeech 2014.
  """

  bucket_size: int | None = 512

  deterministic = True

  def __post_init__(self):
    base.check_bucket_size("OneBit", self.bucket_size)

  def bucket_length(self, shape: tuple[int, ...]) -> int | None:
    """``bucket_size``, or with ``None`` the length of a row (the last axis)."""
    if self.bucket_size is None:
      return shape[-1] if shape else 1
    return self.bucket_size

  def _bucket_len(self, shape: tuple[int, ...]) -> int:
    size = math.prod(shape)
    if self.bucket_size is None:
      return max(1, shape[-1] if shape else 1)
    return max(1, min(self.bucket_size, size))

  def encode(self, key: jax.Array, x: jax.Array) -> base.Payload:
    del key  # Deterministic.
    dtype = jnp.asarray(x).dtype
    x = base.as_float32(x, "OneBit.encode")
    parts = base.bucket_parts(x.reshape(-1), self._bucket_len(x.shape), num_bits=1)
    return _pack(parts, x.shape, dtype)

  def encode_concatenated(self, key: jax.Array, parts) -> base.Payload:
    shape = (sum(part.shape[0] for part in parts), *parts[0].shape[1:])
    buckets = base.concatenated_parts(
        [base.as_float32(part, "OneBit.encode_concatenated") for part in parts],
        self._bucket_len(shape), 1)
    if buckets is None:
      return super().encode_concatenated(key, parts)
    return _pack(buckets, shape, parts[0].dtype)

  def decode(self, payload: base.Payload) -> jax.Array:
    size = math.prod(payload.shape)
    negative = packing.unpack(payload.packed, size, 1).astype(bool)
    negative = base.to_buckets(negative, self._bucket_len(payload.shape))
    values = jnp.where(negative, payload.scales[:, 1:], payload.scales[:, :1])
    return base.from_buckets(values, payload.shape).astype(payload.dtype)


def _pack(parts, shape: tuple[int, ...], dtype) -> base.Payload:
  """The payload of ``parts``, ``(buckets, start, size)`` each as from
  :func:`base.bucket_parts`, end to end."""
  words, scales = [], []
  for buckets, _, size in parts:
    bucket_len = buckets.shape[1]
    # Elements a bucket (the last one may be short), static.
    sizes = np.full(buckets.shape[0], bucket_len, np.int32)
    if size:
      sizes[-1] = size - (buckets.shape[0] - 1) * bucket_len
    words.append(packing.pack_prefix((buckets < 0).astype(jnp.uint32), size, 1))
    scales.append(_side_means(buckets, sizes))
  return base.Payload(packed=jnp.concatenate(words), scales=jnp.concatenate(scales),
                      shape=shape, dtype=dtype)


def _side_means(buckets: jax.Array, sizes: np.ndarray) -> jax.Array:
  """Each bucket's means of its non-negative and of its negative entries, ``[num_buckets, 2]``.

  Each side's sum and count is one two-operand reduction, a float and an
  integer sum, which XLA on CPU vectorizes in one pass over the elements
  (it runs a reduction of two float sums as a scalar loop, and hands a plain
  float sum of a computed array to a library after writing that array out).
  The padding (zeros, past ``sizes``) adds nothing to the sums and is taken
  out of the counts. A side with no entries has mean zero.

  A float32 sum of entries near the float32 maximum overflows although their
  mean is finite, so the entries are summed scaled by ``2**-k``, ``2**k`` at
  least twice the bucket length: no sum can overflow. The scaling is exact
  (and commutes with the rounding of the sums) for entries of magnitude at
  least ``2**(k - 126)``; smaller ones (below about ``1e-35`` for buckets of
  512) count as zeros, as subnormal ones do where XLA flushes them.

  A finite scaled sum is clipped to the largest float whose quotient cannot
  round past the float32 maximum, so a mean of finite entries is finite.
  The division comes last: XLA then computes the means on their own rather
  than fusing the clipping into every decoded element.
  """
  exponent = int(buckets.shape[1]).bit_length() + 1
  scaled = buckets * np.float32(2.0**-exponent)
  negative = buckets < 0

  def masked_sum(mask):
    return jax.lax.reduce(
        (jnp.where(mask, scaled, 0.0), mask.astype(jnp.int32)),
        (np.float32(0), np.int32(0)),
        lambda a, b: (a[0] + b[0], a[1] + b[1]),
        (1,),
    )

  sides = (masked_sum(~negative), masked_sum(negative))
  sums, counts = (jnp.stack(side, axis=1) for side in zip(*sides, strict=True))
  padding = np.stack([buckets.shape[1] - sizes, np.zeros_like(sizes)], axis=1)
  # Exact: counts are integers below 2**24, scaled by a power of two.
  divisors = jnp.maximum(counts - padding, 1).astype(jnp.float32) * np.float32(2.0**-exponent)
  bound = jnp.nextafter(_FLOAT32_MAX * divisors, 0.0)  # At most _FLOAT32_MAX * divisors.
  sums = jnp.where(jnp.isfinite(sums), jnp.clip(sums, -bound, bound), sums)
  return sums / divisors
