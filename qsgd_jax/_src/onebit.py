"""CNTK's 1-bit quantization: one sign bit an element, two values a bucket."""

import dataclasses
import math

import jax
import jax.numpy as jnp

from qsgd_jax._src import base, packing


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
    flat = x.reshape(-1)
    bucket_len = self._bucket_len(x.shape)
    buckets = base.to_buckets(flat, bucket_len)
    valid = base.to_buckets(jnp.ones(flat.shape, bool), bucket_len)
    negative = buckets < 0
    scales = jnp.stack(
        [_masked_mean(buckets, valid & ~negative), _masked_mean(buckets, valid & negative)],
        axis=1,
    )
    return base.Payload(
        packed=packing.pack_prefix(negative.astype(jnp.uint32), flat.size, 1),
        scales=scales,
        shape=x.shape,
        dtype=dtype,
    )

  def decode(self, payload: base.Payload) -> jax.Array:
    size = math.prod(payload.shape)
    negative = packing.unpack(payload.packed, size, 1).astype(bool)
    negative = base.to_buckets(negative, self._bucket_len(payload.shape))
    values = jnp.where(negative, payload.scales[:, 1:], payload.scales[:, :1])
    return base.from_buckets(values, payload.shape).astype(payload.dtype)


def _masked_mean(buckets: jax.Array, mask: jax.Array) -> jax.Array:
  """Per-bucket mean of the entries under ``mask``; zero where none are.

  The masked sum and the count are one two-operand reduction, which XLA on CPU
  computes in one pass over ``buckets``; a plain float sum of the masked array
  would first write that whole array out.
  """
  total, count = jax.lax.reduce(
      (jnp.where(mask, buckets, 0.0), mask.astype(jnp.int32)),
      (jnp.float32(0), jnp.int32(0)),
      lambda a, b: (a[0] + b[0], a[1] + b[1]),
      (1,),
  )
  return total / jnp.maximum(count, 1).astype(jnp.float32)
