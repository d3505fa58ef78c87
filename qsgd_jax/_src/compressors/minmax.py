"""Min-max scaling with stochastic rounding (QSGD-TF's quantizer)."""

import dataclasses
import math

import jax
import jax.numpy as jnp

from qsgd_jax._src import base
from qsgd_jax._src.compressors import packing, rounding

# The step rounds to at most 2 ulps of the range above ``(M - m) / (2**b - 1)``, and
# each step down removes at least half an ulp: 4 corrections always suffice.
_STEP_CORRECTIONS = 4


@dataclasses.dataclass(frozen=True)
class MinMax(base.PackedBuckets, base.SharedScaleCompressor):
  r"""Min-max quantization with ``2**bits - 1`` intervals and stochastic rounding.

  Each bucket's range :math:`[m, M]` (its minimum and maximum) is cut into
  ``2**bits - 1`` equal steps of :math:`u = (M - m) / (2^b - 1)`; a value
  :math:`x` becomes the code :math:`c = \lfloor (x - m)/u \rfloor`, plus one
  with probability :math:`(x - m)/u - \lfloor (x - m)/u \rfloor`, and decodes
  to :math:`m + c u`. So :math:`E[m + c u] = x` (unbiased) and
  :math:`|m + c u - x| < u`: the error is within one step. A constant bucket
  decodes exactly.

  On the wire: ``bits`` bits a coordinate, bit-packed into ``uint32`` words,
  plus the bucket's minimum and maximum as two float32:
  ``ceil(n * bits / 32) * 32 + 64 * num_buckets`` bits; with the default
  buckets of 512, 8.125 bits a coordinate for ``bits=8``.

  With ``bits=8`` and the default ``bucket_size=512`` this is QSGD-TF's
  quantizer (``mpi_ops_gpu.cu.cc``): buckets of 512 consecutive elements,
  each sending its float32 maximum and minimum, codes
  :math:`\lfloor (x - m)/u + \text{uniform} \rfloor` on the grid through
  the minimum. (QSGD-TF's uniform draws are multiples of :math:`10^{-6}`,
  these of :math:`2^{-24}`.) Bagua's ``MinMaxUInt8`` is not this quantizer:
  it rounds to nearest on a grid through zero, deterministically; that is
  :class:`~qsgd_jax.NearestZeroAlignedMinMax`.

  Attributes:
    bits: bits a code, in ``[1, 16]``.
    bucket_size: coordinates a bucket, each with its own minimum and maximum;
      512 (default) as in QSGD-TF; ``None`` is one bucket for the whole array.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> q = qsgd_jax.MinMax(bits=8)
    >>> x = jnp.linspace(0.0, 255.0, 256)
    >>> bool(jnp.all(q.decode(q.encode(jax.random.key(0), x)) == x))
    True

  References:
    Zhang et al., `ZipML: Training Linear Models with End-to-End Low Precision
    <https://arxiv.org/abs/1611.05402>`_, ICML 2017; QSGD-TF
    (ganshaoduo/QSGD-TF, ``horovod/tensorflow/mpi_ops_gpu.cu.cc``).
  """

  bits: int = 8
  bucket_size: int | None = 512

  unbiased = True
  scale_reductions = ("min", "max")

  def __post_init__(self):
    base.check_int_in_range("MinMax", "bits", self.bits, 1, 16)
    base.check_bucket_size("MinMax", self.bucket_size)

  @property
  def num_steps(self) -> int:
    """Intervals of a bucket's range, ``2**bits - 1``."""
    return 2**self.bits - 1

  @property
  def code_range(self) -> tuple[int, int]:
    return 0, self.num_steps

  def local_scales(self, x: jax.Array) -> jax.Array:
    x = base.as_float32(x, "MinMax.local_scales").reshape(-1)
    return jnp.concatenate([self._bucket_scales(buckets, x.dtype) for buckets, _, _ in
                            base.bucket_parts(x, self._bucket_len(x.size), mode="edge")])

  def _bucket_scales(self, buckets: jax.Array, dtype) -> jax.Array:
    """``float32[num_buckets, 2]``: each bucket's minimum and maximum."""
    del dtype  # The same for every input dtype.
    high, low = base.bucket_max_min(buckets)
    return jnp.stack([low, high], axis=1)

  def integer_codes(self, key: jax.Array, x: jax.Array, scales: jax.Array) -> jax.Array:
    """Codes in ``[0, 2**bits - 1]`` against per-bucket ``(min, max)`` ``scales``."""
    x = base.as_float32(x, "MinMax.integer_codes")
    return jnp.concatenate([
        self._bucket_codes(key, buckets, part_scales, start).reshape(-1)[:size]
        for buckets, start, size, part_scales in self._parts_and_scales(x, scales)
    ])

  def _parts_and_scales(self, x: jax.Array, scales: jax.Array, num_bits: int | None = None):
    """``x``'s buckets as :func:`base.bucket_parts` (no padded copy of ``x``), with scales."""
    return base.bucket_parts_with_scales(
        x.reshape(-1), self._bucket_len(x.size), scales, mode="edge", num_bits=num_bits
    )

  def _bucket_codes(
      self, key: jax.Array, buckets: jax.Array, scales: jax.Array, start: int
  ) -> jax.Array:
    """``int32[num_buckets, bucket_len]`` codes of ``buckets``, element ``start`` on.

    ``(x - m) / u`` is computed as ``(x f - m f) / (u f)`` with ``f`` a power
    of two that brings the bucket's largest magnitude to ``[1, 4)``: the same
    float for ordinary buckets, while the range of a bucket near the float32
    maximum (``M - m`` overflows when the signs differ) and the reciprocal of
    a tiny step stay finite.
    """
    normalizer, low, step = self._normalized(scales)
    inverse_step = jnp.where(step > 0, 1.0 / jnp.where(step > 0, step, 1.0), 0.0)
    # NaN (from non-finite input) lands on the top code; the bucket's
    # non-finite range marks it on decode.
    y = (buckets * normalizer[:, None] - low[:, None]) * inverse_step[:, None]
    return rounding.round_stochastic_to_level(key, y, self.num_steps, start)

  def _normalized(self, scales: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each bucket's power of two ``f``, ``m f`` and ``u f``."""
    low, high = scales[:, 0], scales[:, 1]
    normalizer = base.power_of_two_normalizer(jnp.maximum(jnp.abs(low), jnp.abs(high)))
    low, high = low * normalizer, high * normalizer
    return normalizer, low, (high - low) / self.num_steps

  def decode_code_sum(self, total, scales, count, shape):
    """``count * min + total * step``: the sum of ``count`` devices' values.

    Computed on the normalized scale (see ``_bucket_codes``) and scaled back.
    The step is the largest float at most ``u`` for which the top code decodes
    to at most the maximum (rounding up could take it past, and past the
    float32 maximum to ``inf``): every decoded value lies in ``[m, M]``.
    """
    total = base.to_buckets(total, self._bucket_len(math.prod(shape))).astype(jnp.float32)
    normalizer, low, step = self._normalized(scales)
    high = scales[:, 1] * normalizer

    def correct(_, step):
      return jnp.where(low + self.num_steps * step > high, jnp.nextafter(step, 0.0), step)

    # A loop, which XLA computes on its own, rather than fusing its body into
    # the decoding and running it once an element.
    step = jax.lax.fori_loop(0, _STEP_CORRECTIONS, correct, step)
    values = count * low[:, None] + total * step[:, None]
    return base.from_buckets(values * (1.0 / normalizer)[:, None], shape)

  def encode(self, key: jax.Array, x: jax.Array) -> base.Payload:
    dtype = jnp.asarray(x).dtype
    x = base.as_float32(x, "MinMax.encode")
    scales = self.local_scales(x)
    return self._pack(key, self._parts_and_scales(x, scales, self.bits), scales, x.shape, dtype)

  def _pack(self, key: jax.Array, parts, scales: jax.Array, shape, dtype) -> base.Payload:
    """The payload of ``parts``, ``(buckets, start, size, part_scales)`` each, end to end."""
    words = [
        packing.pack_prefix(
            self._bucket_codes(key, buckets, part_scales, start).astype(jnp.uint32), size, self.bits
        )
        for buckets, start, size, part_scales in parts
    ]
    return base.Payload(packed=jnp.concatenate(words), scales=scales, shape=shape, dtype=dtype)

  def decode(self, payload: base.Payload) -> jax.Array:
    size = math.prod(payload.shape)
    codes = packing.unpack(payload.packed, size, self.bits)
    return self.decode_code_sum(codes, payload.scales, 1, payload.shape).astype(payload.dtype)
