"""Bagua's min-max quantizer: deterministic rounding to a grid aligned at zero."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from qsgd_jax._src import base
from qsgd_jax._src.compressors import packing

# Bagua adds this to a bucket's range before dividing by it, so that a
# constant bucket gets a large but finite scale.
_RANGE_EPSILON = np.float32(1e-7)


@dataclasses.dataclass(frozen=True)
class NearestZeroAlignedMinMax(base.FixedBuckets, base.Compressor):
  r"""Min-max quantization rounded to nearest on a grid through zero (Bagua's ``MinMaxUInt8``).

  With :math:`L = 2^b - 1` (255 for ``bits=8``), a bucket with minimum
  :math:`m` and maximum :math:`M` gets, in float32,

  .. math::

    s = \frac{L}{M - m + 10^{-7}}, \qquad u = \operatorname{rint}(M s),
    \qquad l = u - L,

  a value :math:`x` becomes the code :math:`c = \min(\operatorname{rint}(x s),
  u) - l \in [0, L]` and decodes to :math:`(c + l) / s`. The levels are the
  multiples :math:`k / s` of the step :math:`1/s \approx (M - m)/L`, so the
  grid passes through zero: zero, and any multiple of the step, decodes
  exactly. Rounding to the nearest level (``rint``, ties to even) errs by at
  most half a step, :math:`|\hat x - x| \le 1/(2s)`; the error is a
  deterministic function of :math:`x`, so the quantizer is biased.
  Against stochastic rounding on the same step (:class:`~qsgd_jax.MinMax`),
  whose error at fraction :math:`p` of a step has variance :math:`p(1-p)`
  steps squared (:math:`1/6` on average), rounding to nearest has mean
  squared error :math:`1/12` of a step squared: half the mean squared error,
  :math:`1/\sqrt{2}` of the RMS error.

  This is the arithmetic of Bagua's CUDA kernels (``bagua_kernels.cu``,
  ``compress_float_to_uint8`` and ``decompress_uint8_to_float``) for float32
  input: the bucket's minimum and maximum travel as float32, and decoding
  recomputes :math:`s`, :math:`u` and :math:`l` from them. Bagua converts
  :math:`\min(\operatorname{rint}(x s), u) - l` to ``uint8`` without bounds;
  where float rounding puts it outside :math:`[0, L]` (a bucket whose range
  is tiny against its magnitude, e.g. a constant bucket away from zero, or
  non-finite input) that conversion is undefined, and here the code is
  clamped to :math:`[0, L]` (NaN to 0). A bucket holding NaN or an infinity
  decodes to non-finite values.

  On the wire: ``bits`` bits a coordinate, bit-packed into ``uint32`` words,
  plus the bucket's minimum and maximum as two float32:
  ``ceil(n * bits / 32) * 32 + 64 * num_buckets`` bits. (Bagua lays a chunk
  out as a 32-byte header holding the minimum and maximum, then one byte a
  code, padded to 32 bytes.)

  Attributes:
    bits: bits a code, in ``[1, 16]``; Bagua's quantizer is ``bits=8``.
    bucket_size: coordinates a bucket, each with its own minimum and maximum;
      ``None`` (default) is one bucket for the whole array, which is what
      Bagua's low-precision decentralized algorithm does with each of its
      buckets of tensors (:func:`qsgd_jax.low_precision_decentralized` groups
      the leaves into such buckets).

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> q = qsgd_jax.NearestZeroAlignedMinMax()
    >>> x = jnp.array([-1.0, 0.0, 0.25, 3.0])
    >>> y = q.decode(q.encode(jax.random.key(0), x))
    >>> bool(y[1] == 0.0), bool(jnp.max(jnp.abs(y - x)) <= 0.5 * 4.0 / 255)
    (True, True)

  References:
    Tang et al., `Communication Compression for Decentralized Training
    <https://arxiv.org/abs/1803.06443>`_, NeurIPS 2018; Bagua's
    ``MinMaxUInt8`` compression (BaguaSys/bagua, ``bagua_kernels.cu``).
  """

  bits: int = 8
  bucket_size: int | None = None

  deterministic = True
  unbiased = False

  def __post_init__(self):
    base.check_int_in_range("NearestZeroAlignedMinMax", "bits", self.bits, 1, 16)
    base.check_bucket_size("NearestZeroAlignedMinMax", self.bucket_size)

  @property
  def num_steps(self) -> int:
    """Steps between the lowest and the highest code, ``2**bits - 1``."""
    return 2**self.bits - 1

  def _grid(self, low: jax.Array, high: jax.Array):
    """Each bucket's scale :math:`s`, top level :math:`u`, bottom level :math:`l`, and shrink.

    The values are quantized times ``shrink``: 1 for every bucket whose range
    and scale are normal floats, where the arithmetic is Bagua's; for a range
    past the float32 maximum (values of both signs near it), or so wide that
    ``s`` would underflow, the power of two that brings the bucket's magnitude
    to ``[1, 2)`` (exact: values keep every bit).
    """
    steps = jnp.float32(self.num_steps)
    width = high - low
    extreme = jnp.isinf(width) | (steps / (width + _RANGE_EPSILON) < jnp.finfo(jnp.float32).tiny)
    extreme &= jnp.isfinite(high) & jnp.isfinite(low)
    magnitude = jnp.maximum(jnp.abs(high), jnp.abs(low))
    shrink = jnp.where(extreme, base.power_of_two_normalizer(magnitude), jnp.float32(1.0))
    scale = steps / (high * shrink - low * shrink + _RANGE_EPSILON)
    top = jnp.rint(high * shrink * scale)
    return scale, top, top - steps, shrink

  def encode(self, key: jax.Array, x: jax.Array) -> base.Payload:
    del key  # Deterministic.
    dtype = jnp.asarray(x).dtype
    x = base.as_float32(x, "NearestZeroAlignedMinMax.encode")
    # Edge padding repeats the last value, so it changes no bucket's minimum or maximum.
    buckets = base.to_buckets(x.reshape(-1), self._bucket_len(x.size), mode="edge")
    high, low = base.bucket_max_min(buckets)
    scale, top, bottom, shrink = self._grid(low, high)
    shrunk = buckets * shrink[:, None]
    level = jnp.minimum(jnp.rint(shrunk * scale[:, None]), top[:, None]) - bottom[:, None]
    level = jnp.where(level >= 0, level, 0.0)  # Also NaN, which compares false.
    codes = jnp.minimum(level, jnp.float32(self.num_steps)).astype(jnp.uint32)
    return base.Payload(
        packed=packing.pack_prefix(codes, x.size, self.bits),
        scales=jnp.stack([low, high], axis=1),
        shape=x.shape,
        dtype=dtype,
    )

  def decode(self, payload: base.Payload) -> jax.Array:
    size = math.prod(payload.shape)
    codes = packing.unpack(payload.packed, size, self.bits)
    codes = base.to_buckets(codes, self._bucket_len(size)).astype(jnp.float32)
    low, high = payload.scales[:, 0], payload.scales[:, 1]
    scale, _, bottom, shrink = self._grid(low, high)
    levels = codes + bottom[:, None]
    # A true division, as Bagua's kernel does: XLA would otherwise multiply by
    # the reciprocal of a broadcast divisor, which can differ in the last bit.
    values = levels / jax.lax.optimization_barrier(jnp.broadcast_to(scale[:, None], levels.shape))
    values = values / shrink[:, None]
    # The top level may decode up to half a step past the bucket's maximum: where that
    # leaves the output dtype's range, clamp to the bucket's range, where the input was.
    largest = jnp.float32(jnp.finfo(payload.dtype).max)
    values = jnp.where(jnp.abs(values) <= largest, values,
                       jnp.clip(values, low[:, None], high[:, None]))
    return base.from_buckets(values, payload.shape).astype(payload.dtype)
