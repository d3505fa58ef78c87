"""The QSGD stochastic quantizer Q_s, bucketed, packed into sign+magnitude codes."""

import dataclasses
import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from qsgd_jax._src import base
from qsgd_jax._src.compressors import elias, packing, pallas_kernels, rounding

_MAX_BITS = 16
# ``scale * (1 / s)`` exceeds ``scale / s`` by less than 2 ulps of the scale, and
# each step down removes at least half an ulp: 4 corrections always suffice.
_STEP_CORRECTIONS = 4


class EliasSize(NamedTuple):
  """Bits of the paper's Elias coding of a QSGD payload, all buckets together.

  Each bucket is one coded vector: its 32-bit scale, then its levels.

  Attributes:
    sparse: ``float32[]``, every bucket in the sparse variant.
    dense: ``float32[]``, every bucket in the dense variant.
    smaller: ``float32[]``, each bucket in whichever variant is shorter for it.

  Counts in float32, which cannot wrap as an int32 sum would past ``2**31``
  bits (a billion-parameter payload takes about ``1.2e10``): exact up to
  ``2**24`` bits, within float32's rounding past it
  (:func:`qsgd_jax.elias.total_bits`).

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> q = qsgd_jax.QSGD(bits=4, bucket_size=512)
    >>> x = jax.random.normal(jax.random.key(0), (4096,))
    >>> size = q.elias_bits(q.encode(jax.random.key(1), x))
    >>> bool(size.smaller == jnp.minimum(size.sparse, size.dense))
    True
  """

  sparse: jax.Array
  dense: jax.Array
  smaller: jax.Array


@dataclasses.dataclass(frozen=True)
class QSGD(base.PackedBuckets, base.SharedScaleCompressor):
  r"""QSGD's stochastic quantizer :math:`Q_s`, applied per bucket.

  A vector is cut into buckets of ``bucket_size`` consecutive coordinates
  (of the array flattened in row-major order; the last bucket may be short).
  For a bucket :math:`v` with scale :math:`\|v\|` (the L2 norm, the paper's
  choice, or the max-abs norm) each coordinate becomes

  .. math::

    Q_s(v_i) = \|v\| \cdot \mathrm{sgn}(v_i) \cdot \ell_i / s,

  where :math:`\ell_i` is :math:`\lfloor s |v_i| / \|v\| \rfloor`, plus one
  with probability :math:`s |v_i| / \|v\| - \lfloor s |v_i| / \|v\| \rfloor`.
  Hence :math:`E[Q_s(v)] = v` (unbiased, to the rounding resolution of
  ``rounding.py``), and for the L2 norm (Lemma 3.1)
  :math:`E\|Q_s(v) - v\|^2 \le \min(n/s^2, \sqrt{n}/s) \|v\|^2` and
  :math:`E\|Q_s(v)\|_0 \le s(s + \sqrt{n})`. The max norm gives smaller
  variance (each coordinate's error is at most :math:`\|v\|_\infty / s`).

  Every finite input, up to the float32 maximum, decodes finite: scales,
  steps and their reciprocals are computed on a scale normalized by a power
  of two, and no decoded magnitude exceeds its bucket's scale. An L2 norm
  above the largest value of the input's dtype is sent as that value, still
  at least every :math:`|v_i|`, which is all unbiasedness needs of a scale.

  On the wire: each coordinate is a ``bits``-bit sign+magnitude code
  (the sign of :math:`v_i` in the top bit, :math:`\ell_i` below; a negative
  :math:`v_i` with :math:`\ell_i = 0` keeps its sign bit and decodes to
  zero), bit-packed into ``uint32`` words, and each bucket sends its scale
  as one float32: ``ceil(n * bits / 32) * 32 + 32 * num_buckets`` bits. The
  paper's variable-length Elias coding of the same levels is in
  :mod:`qsgd_jax.elias`; the wire stays fixed width because collectives need
  static shapes.

  Attributes:
    bits: bits a code; ``s = 2**(bits - 1) - 1`` levels. In ``[2, 16]``.
    bucket_size: coordinates a bucket; ``None`` is one bucket for the whole
      array.
    norm: ``"max"`` (default) or ``"l2"``.
    levels: the number of levels ``s`` directly, in ``[1, 2**15 - 1]``;
      ``bits`` then defaults to the fewest that hold ``2 s + 1`` codes.
    largest_scale: with ``norm="l2"``, the largest scale a bucket is sent
      with where all its magnitudes are at most this (``None``: the largest
      value of the input's dtype). The collectives quantize in float32 the
      sums of leaves of narrower dtypes, and set it to the narrowest one's
      largest value: a float16 leaf's mean then decodes within float16.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> q = qsgd_jax.QSGD(bits=4, bucket_size=512)
    >>> x = jnp.linspace(-1.0, 1.0, 1000)
    >>> payload = q.encode(jax.random.key(0), x)
    >>> q.decode(payload).shape
    (1000,)
    >>> q.wire_bits(x.shape)  # 4 bits a coordinate plus two float32 scales
    4064

  References:
    Alistarh et al., `QSGD: Communication-Efficient SGD via Gradient
    Quantization and Encoding <https://arxiv.org/abs/1610.02132>`_, NeurIPS 2017.
  """

  bits: int | None = None
  bucket_size: int | None = 512
  norm: Literal["max", "l2"] = "max"
  levels: int | None = None
  largest_scale: float | None = None

  unbiased = True
  scale_reductions = ("max",)

  def __post_init__(self):
    if self.levels is None:
      bits = 4 if self.bits is None else self.bits
      base.check_int_in_range("QSGD", "bits", bits, 2, _MAX_BITS)
      object.__setattr__(self, "bits", bits)
      object.__setattr__(self, "levels", 2 ** (bits - 1) - 1)
    else:
      base.check_int_in_range("QSGD", "levels", self.levels, 1, 2 ** (_MAX_BITS - 1) - 1)
      fewest = 1 + math.ceil(math.log2(self.levels + 1))
      if self.bits is None:
        object.__setattr__(self, "bits", fewest)
      elif self.bits != fewest:
        raise ValueError(
            f"QSGD: levels={self.levels} packs into bits={fewest}, got bits={self.bits!r}; "
            "give one of bits or levels."
        )
    base.check_bucket_size("QSGD", self.bucket_size)
    if self.norm not in ("max", "l2"):
      raise ValueError(f"QSGD: norm must be 'max' or 'l2', got {self.norm!r}.")
    if self.largest_scale is not None and not (
        isinstance(self.largest_scale, int | float) and not isinstance(self.largest_scale, bool)
        and self.largest_scale > 0):
      raise ValueError(
          f"QSGD: largest_scale must be a positive float or None, got {self.largest_scale!r}.")

  def bounded_to(self, largest: float) -> "QSGD":
    if self.norm != "l2" or (self.largest_scale is not None and self.largest_scale <= largest):
      return self
    return dataclasses.replace(self, largest_scale=float(largest))

  @property
  def code_range(self) -> tuple[int, int]:
    return -self.levels, self.levels

  def local_scales(self, x: jax.Array) -> jax.Array:
    x = jnp.asarray(x)
    parts = self._parts(base.as_float32(x, "QSGD.local_scales"))
    return jnp.concatenate([self._bucket_scales(buckets, x.dtype) for buckets, _, _ in parts])

  def _bucket_scales(self, buckets: jax.Array, dtype) -> jax.Array:
    """``float32[num_buckets, 1]``: each bucket's norm, for an input of ``dtype``."""
    if self.norm == "max":
      return base.bucket_max_abs(buckets)[:, None]
    largest = float(jnp.finfo(dtype).max)
    if self.largest_scale is not None:
      largest = min(largest, self.largest_scale)
    return _l2_norms(buckets, largest)[:, None]

  def integer_codes(self, key: jax.Array, x: jax.Array, scales: jax.Array) -> jax.Array:
    """Signed levels ``sgn(x_i) * l_i`` in ``[-s, s]`` against ``scales``."""
    x = base.as_float32(x, "QSGD.integer_codes")
    codes = []
    for buckets, start, size, part_scales in self._parts_and_scales(x, scales):
      level = self._bucket_levels(key, buckets, part_scales, start)
      codes.append(jnp.where(buckets < 0, -level, level).reshape(-1)[:size])
    return jnp.concatenate(codes)

  def _parts(self, x: jax.Array) -> list:
    """``x``'s buckets as :func:`base.bucket_parts`: no padded copy of ``x``."""
    return base.bucket_parts(x.reshape(-1), self._bucket_len(x.size))

  def _parts_and_scales(self, x: jax.Array, scales: jax.Array, num_bits: int | None = None):
    return base.bucket_parts_with_scales(
        x.reshape(-1), self._bucket_len(x.size), scales, num_bits=num_bits
    )

  def _bucket_levels(
      self, key: jax.Array, buckets: jax.Array, scales: jax.Array, start: int
  ) -> jax.Array:
    """``int32[num_buckets, bucket_len]`` levels ``l_i`` of ``|buckets|``.

    ``start`` is the index of the buckets' first element in the whole array
    (for the random draws).
    """
    y = self._scaled_magnitudes(buckets, scales)
    return rounding.round_stochastic_to_level(key, y, self.levels, start)

  def _scaled_magnitudes(self, buckets: jax.Array, scales: jax.Array) -> jax.Array:
    """``s |v_i| / ||v||`` of each element, in ``[0, s]`` (NaN for non-finite input).

    Computed as ``(|v_i| f) (s / (||v|| f))`` with ``f`` a power of two that
    brings the scale to ``[1, 4)``: the same float for ordinary scales, and
    neither the reciprocal of a tiny scale nor the product overflows.
    """
    scale = scales[:, 0]
    normalizer = base.power_of_two_normalizer(scale)
    normalized = scale * normalizer
    # Zero buckets get all levels 0. Non-finite input gives NaN, which the
    # rounding puts on s; the bucket's non-finite scale marks it on decode.
    inverse_step = jnp.where(normalized > 0, self.levels / normalized, 0.0)
    return jnp.abs(buckets * normalizer[:, None]) * inverse_step[:, None]

  def decode_code_sum(self, total, scales, count, shape):
    del count  # Levels add linearly: the sum decodes like one device's codes.
    return self._dequantize(total, scales, shape)

  def encode(self, key: jax.Array, x: jax.Array) -> base.Payload:
    x = jnp.asarray(x)
    if self._fused_buckets(x.size):
      return pallas_kernels.dispatch(self._encode_xla, self._encode_fused, key, x)
    return self._encode_xla(key, x)

  def _fused_buckets(self, size: int) -> int:
    """Leading buckets that :mod:`pallas_kernels` can encode and decode (0: none)."""
    if self.norm != "max":  # A float sum in another order would give other scales.
      return 0
    return pallas_kernels.qsgd_fused_buckets(self.bits, self._bucket_len(size), size)

  def _encode_fused(self, key: jax.Array, x: jax.Array, *, interpret: bool) -> base.Payload:
    """:meth:`encode` with the fused kernel, bit for bit: the buckets past its blocks the
    XLA way, their words and scales written in place."""
    dtype = x.dtype
    flat = base.as_float32(x, "QSGD.encode").reshape(-1)
    size = flat.shape[0]
    bucket_len = self._bucket_len(size)
    fused = self._fused_buckets(size) * bucket_len
    words, scales = pallas_kernels.qsgd_encode(
        pallas_kernels.seed_words(key), flat, levels=self.levels, bits=self.bits,
        bucket_len=bucket_len, interpret=interpret)
    if fused < size:
      rest = flat[fused:]
      parts = base.bucket_parts(rest, bucket_len, num_bits=self.bits)
      rest_scales = [self._bucket_scales(buckets, dtype) for buckets, _, _ in parts]
      tail = self._pack(key, [(buckets, fused + start, count, part_scales) for
                              (buckets, start, count), part_scales in zip(parts, rest_scales,
                                                                         strict=True)],
                        jnp.concatenate(rest_scales), rest.shape, dtype)
      words = words.at[fused * self.bits // 32:].set(tail.packed)
      scales = scales.at[fused // bucket_len:].set(tail.scales[:, 0])
    return base.Payload(packed=words, scales=scales[:, None], shape=x.shape, dtype=dtype)

  def _encode_xla(self, key: jax.Array, x: jax.Array) -> base.Payload:
    dtype = x.dtype
    scales = self.local_scales(x)
    x = base.as_float32(x, "QSGD.encode")
    return self._pack(key, self._parts_and_scales(x, scales, self.bits), scales, x.shape, dtype)

  def _pack(self, key: jax.Array, parts, scales: jax.Array, shape, dtype) -> base.Payload:
    """The payload of ``parts``, ``(buckets, start, size, part_scales)`` each, end to end."""
    words = []
    for buckets, start, size, part_scales in parts:
      level = self._bucket_levels(key, buckets, part_scales, start)
      # The sign bit is x's own (a negative value whose level is 0 keeps it:
      # it decodes to 0 all the same).
      sign = (jax.lax.bitcast_convert_type(buckets, jnp.uint32) >> 31) << (self.bits - 1)
      words.append(packing.pack_prefix(sign | level.astype(jnp.uint32), size, self.bits))
    return base.Payload(packed=jnp.concatenate(words), scales=scales, shape=shape, dtype=dtype)

  def _dequantize(self, levels: jax.Array, scales: jax.Array, shape) -> jax.Array:
    """``levels * step``, computed on the normalized scale and scaled back.

    On the scale normalized as in ``_bucket_levels`` the step is a normal
    float even when ``||v|| / s`` is not (a subnormal step is flushed to zero
    by XLA on CPU, and loses bits elsewhere).
    """
    levels = base.to_buckets(levels, self._bucket_len(math.prod(shape)))
    scale = scales[:, 0]
    normalizer = base.power_of_two_normalizer(scale)
    step = self._steps(scale * normalizer)
    values = levels.astype(jnp.float32) * step[:, None] * (1.0 / normalizer)[:, None]
    return base.from_buckets(values, shape)

  def _steps(self, scale: jax.Array) -> jax.Array:
    """Each bucket's step ``scale / s``, the largest float at most that with ``s * step <= scale``.

    ``scale * (1 / s)`` can round so that the top level decodes a few ulps
    above the scale (to ``inf`` at the float32 maximum); stepping it down to
    the next float below, at most a few times, makes every decoded magnitude
    ``|l * step| <= scale``, since rounding is monotone.
    """
    def correct(_, step):
      return jnp.where(step * self.levels > scale, jnp.nextafter(step, 0.0), step)

    # A loop, which XLA computes on its own, rather than fusing its body into
    # the decoding and running it once an element.
    return jax.lax.fori_loop(0, _STEP_CORRECTIONS, correct, scale * (1.0 / self.levels))

  def signed_levels(self, payload: base.Payload) -> jax.Array:
    """The integer levels ``sgn(v_i) * l_i`` of a payload, ``int32[size]``."""
    size = math.prod(payload.shape)
    codes = packing.unpack(payload.packed, size, self.bits)
    level = (codes & jnp.uint32(2 ** (self.bits - 1) - 1)).astype(jnp.int32)
    negative = (codes >> (self.bits - 1)).astype(bool)
    return jnp.where(negative, -level, level)

  def elias_bits(self, payload: base.Payload) -> EliasSize:
    """Exact size of the payload's levels under :mod:`qsgd_jax.elias` coding.

    The wire itself stays fixed-width (``wire_bits``): collectives need static
    shapes. This is the size the paper's variable-length code would take.
    """
    size = math.prod(payload.shape)
    bucket_len = self._bucket_len(size)
    levels = base.to_buckets(self.signed_levels(payload), bucket_len)
    # Each bucket's count, and their sum, in float32: an int32 sum wraps past 2**31 bits.
    sparse = jax.vmap(lambda v: elias.total_bits(v, variant="sparse"))(levels)
    dense = jax.vmap(lambda v: elias.total_bits(v, variant="dense"))(levels)
    # The last bucket's zero padding: free when sparse, 2 bits each when dense.
    padding = levels.size - size
    dense = dense.at[-1].add(-padding * (1 + elias.omega_length(jnp.int32(1))).astype(jnp.float32))
    return EliasSize(
        sparse=jnp.sum(sparse), dense=jnp.sum(dense), smaller=jnp.sum(jnp.minimum(sparse, dense))
    )

  def decode(self, payload: base.Payload) -> jax.Array:
    if self._fused_buckets(math.prod(payload.shape)):
      return pallas_kernels.dispatch(self._decode_xla, self._decode_fused, payload)
    return self._decode_xla(payload)

  def _decode_xla(self, payload: base.Payload) -> jax.Array:
    values = self._dequantize(self.signed_levels(payload), payload.scales, payload.shape)
    return values.astype(payload.dtype)

  def _decode_fused(self, payload: base.Payload, *, interpret: bool) -> jax.Array:
    """:meth:`decode` with the fused kernel, bit for bit (the steps as ``_dequantize``'s)."""
    size = math.prod(payload.shape)
    bucket_len = self._bucket_len(size)
    scale = payload.scales[:, 0]
    normalizer = base.power_of_two_normalizer(scale)
    values = pallas_kernels.qsgd_decode(
        payload.packed, self._steps(scale * normalizer), 1.0 / normalizer, size=size,
        bits=self.bits, bucket_len=bucket_len, interpret=interpret)
    fused = self._fused_buckets(size) * bucket_len
    if fused < size:
      codes = packing.unpack(payload.packed[fused * self.bits // 32:], size - fused, self.bits)
      level = (codes & jnp.uint32(2 ** (self.bits - 1) - 1)).astype(jnp.int32)
      signed = jnp.where((codes >> (self.bits - 1)).astype(bool), -level, level)
      tail = self._dequantize(signed, payload.scales[fused // bucket_len:], (size - fused,))
      values = values.at[fused:].set(tail)
    return values.reshape(payload.shape).astype(payload.dtype)


def _l2_norms(buckets: jax.Array, largest: float) -> jax.Array:
  """Each bucket's L2 norm, ``float32[num_buckets]``, without overflow or underflow.

  A plain float32 sum of squares overflows for values above about ``1e19``
  and loses the squares below the smallest normal float (values below about
  ``1e-19``). Here a first pass finds each bucket's largest magnitude, and a
  second sums the squares of the values scaled by a power of two that brings
  it to ``[1, 4)``, where neither can happen. Scaling by a power of two is
  exact and commutes with the square root, so for ordinary buckets the norm
  is the float the plain sum gives. (The second pass finds the magnitudes
  again: an integer-and-float reduction, which XLA on CPU vectorizes, where a
  lone float sum of a computed array would be handed to a library after
  writing that array out. Two passes always, rather than a second pass under
  a ``cond`` when needed: a ``cond`` would make XLA write out a copy of its
  operand, the input, whenever that is not already an array in memory.)

  A norm above ``largest``, the maximum of the input's dtype (or of a
  narrower dtype the result is cast to), becomes ``max(largest, max_i
  |v_i|)``: still at least every magnitude in the bucket, which is all that
  unbiasedness needs of a scale, and every decoded value, at most the scale,
  then fits the dtype wherever the values do.
  """
  normalizer = base.power_of_two_normalizer(base.bucket_max_abs(buckets))
  magnitude, sum_of_squares = base.bucket_max_abs_and_sum_of_squares(buckets, normalizer)
  norms = jnp.sqrt(sum_of_squares) / normalizer
  return jnp.where(jnp.isfinite(magnitude),
                   jnp.minimum(norms, jnp.maximum(largest, magnitude)), norms)
