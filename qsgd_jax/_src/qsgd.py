"""The QSGD stochastic quantizer Q_s, bucketed, packed into sign+magnitude codes."""

import dataclasses
import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from qsgd_jax._src import base, elias, packing, rounding

_MAX_BITS = 16


class EliasSize(NamedTuple):
  """Bits of the paper's Elias coding of a QSGD payload, all buckets together.

  Each bucket is one coded vector: its 32-bit scale, then its levels.

  Attributes:
    sparse: ``int32[]``, every bucket in the sparse variant.
    dense: ``int32[]``, every bucket in the dense variant.
    smaller: ``int32[]``, each bucket in whichever variant is shorter for it.
  """

  sparse: jax.Array
  dense: jax.Array
  smaller: jax.Array


@dataclasses.dataclass(frozen=True)
class QSGD(base.SharedScaleCompressor):
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

  On the wire: each coordinate is a ``bits``-bit sign+magnitude code
  (sign in the top bit, :math:`\ell_i` below), bit-packed into ``uint32``
  words, and each bucket sends its scale as one float32:
  ``ceil(n * bits / 32) * 32 + 32 * num_buckets`` bits. The paper's
  variable-length Elias coding of the same levels is in
  :mod:`qsgd_jax.elias`; the wire stays fixed width because collectives need
  static shapes.

  Attributes:
    bits: bits a code; ``s = 2**(bits - 1) - 1`` levels. In ``[2, 16]``.
    bucket_size: coordinates a bucket; ``None`` is one bucket for the whole
      array.
    norm: ``"max"`` (default) or ``"l2"``.
    levels: the number of levels ``s`` directly, in ``[1, 2**15 - 1]``;
      ``bits`` then defaults to the fewest that hold ``2 s + 1`` codes.

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

  def bucket_length(self, shape: tuple[int, ...]) -> int | None:
    return self.bucket_size

  def _bucket_len(self, size: int) -> int:
    return max(1, size if self.bucket_size is None else min(self.bucket_size, size))

  @property
  def code_range(self) -> tuple[int, int]:
    return -self.levels, self.levels

  def local_scales(self, x: jax.Array) -> jax.Array:
    buckets = self._buckets(base.as_float32(x, "QSGD.local_scales"))
    if self.norm == "max":
      # max |v_i| as max(max v_i, -min v_i): one pass over the input itself.
      high, low = base.bucket_max_min(buckets)
      return jnp.maximum(high, -low)[:, None]
    return jnp.sqrt(jnp.sum(buckets * buckets, axis=1, keepdims=True))

  def integer_codes(self, key: jax.Array, x: jax.Array, scales: jax.Array) -> jax.Array:
    """Signed levels ``sgn(x_i) * l_i`` in ``[-s, s]`` against ``scales``."""
    x = base.as_float32(x, "QSGD.integer_codes")
    return self._bucket_levels(key, self._buckets(x), scales).reshape(-1)[: x.size]

  def _bucket_levels(self, key: jax.Array, buckets: jax.Array, scales: jax.Array) -> jax.Array:
    """``int32[num_buckets, bucket_len]`` signed levels of ``buckets``."""
    scale = scales[:, 0]
    safe_scale = jnp.where(scale > 0, scale, 1.0)
    # Non-finite input gives NaN, which lands on s; the bucket's non-finite
    # scale marks it on decode.
    y = jnp.abs(buckets) * (self.levels / safe_scale)[:, None]
    level = rounding.round_stochastic_to_level(key, y, self.levels)
    return jnp.where(buckets < 0, -level, level)

  def decode_code_sum(self, total, scales, count, shape):
    del count  # Levels add linearly: the sum decodes like one device's codes.
    return self._dequantize(total, scales, shape)

  def encode(self, key: jax.Array, x: jax.Array) -> base.Payload:
    dtype = jnp.asarray(x).dtype
    x = base.as_float32(x, "QSGD.encode")
    scales = self.local_scales(x)
    level = self._bucket_levels(key, self._buckets(x), scales)
    sign = (level < 0).astype(jnp.uint32) << (self.bits - 1)
    codes = sign | jnp.abs(level).astype(jnp.uint32)
    return base.Payload(
        packed=packing.pack_prefix(codes, x.size, self.bits),
        scales=scales,
        shape=x.shape,
        dtype=dtype,
    )

  def _buckets(self, x: jax.Array) -> jax.Array:
    return base.to_buckets(x.reshape(-1), self._bucket_len(x.size))

  def _dequantize(self, levels: jax.Array, scales: jax.Array, shape) -> jax.Array:
    levels = base.to_buckets(levels, self._bucket_len(math.prod(shape)))
    values = levels.astype(jnp.float32) * (scales * (1.0 / self.levels))
    return base.from_buckets(values, shape)

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
    sparse = jax.vmap(lambda v: elias.encoded_bits(v, variant="sparse"))(levels)
    dense = jax.vmap(lambda v: elias.encoded_bits(v, variant="dense"))(levels)
    # The last bucket's zero padding: free when sparse, 2 bits each when dense.
    padding = levels.size - size
    dense = dense.at[-1].add(-padding * elias.omega_length(jnp.int32(1)) - padding)
    return EliasSize(
        sparse=jnp.sum(sparse), dense=jnp.sum(dense), smaller=jnp.sum(jnp.minimum(sparse, dense))
    )

  def decode(self, payload: base.Payload) -> jax.Array:
    values = self._dequantize(self.signed_levels(payload), payload.scales, payload.shape)
    return values.astype(payload.dtype)
