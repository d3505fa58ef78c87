"""How a sparse payload carries the values it keeps: float words, or codes against scales.

Three codings, each a pair of functions from ``float32[chunks, k]`` values to
what travels and back:

* floats (:func:`float_words`): float32 or bfloat16, bit for bit in ``uint32``
  words (two bfloat16 a word);
* per-chunk scales (:func:`scaled_codes`): each chunk's largest kept
  magnitude as a float32 scale and ``b``-bit sign+magnitude codes of the
  values against it, rounded stochastically, so unbiased given the kept set;
* SparseLoCo's bin means (:func:`bin_mean_codes`): ``2**b`` bins of the
  centred values of the whole payload, each decoded to the mean of the values
  that fell into it, a table of ``1 + 2**b`` floats a payload; deterministic,
  biased.
"""

import jax
import jax.numpy as jnp
import numpy as np

from qsgd_jax._src import base
from qsgd_jax._src.compressors import packing, rounding

# SparseLoCo's quantization_range (sparseloco.py's default and every config of the paper): the
# bins span this many standard deviations of the centred values.
BIN_MEANS_RANGE = 6.0


def float_words(values: jax.Array, dtype) -> jax.Array:
  """``values`` cast to ``dtype`` (float32 or bfloat16), as ``uint32`` words, row-major."""
  if np.dtype(dtype).itemsize == 4:
    return jax.lax.bitcast_convert_type(values.astype(jnp.float32).reshape(-1), jnp.uint32)
  halves = jax.lax.bitcast_convert_type(values.astype(dtype).reshape(-1), jnp.uint16)
  return packing.pack(halves.astype(jnp.uint32), 16)


def float_values(words: jax.Array, count: int, dtype) -> jax.Array:
  """Inverse of :func:`float_words`: ``float32[count]``."""
  if np.dtype(dtype).itemsize == 4:
    return jax.lax.bitcast_convert_type(words, jnp.float32)
  halves = packing.unpack(words, count, 16).astype(jnp.uint16)
  return jax.lax.bitcast_convert_type(halves, dtype).astype(jnp.float32)


def scaled_codes(key: jax.Array, values: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
  r"""Each chunk's values as ``bits``-bit codes against its largest magnitude.

  With :math:`s = 2^{b-1} - 1` levels and the chunk's scale
  :math:`m = \max_j |v_j|`, value :math:`v_j` becomes its sign and the level
  :math:`\lfloor s |v_j| / m \rfloor`, plus one with probability the
  fraction dropped (:func:`~qsgd_jax._src.compressors.rounding.round_stochastic_to_level`):
  :math:`E[\mathrm{decode}] = v_j`. At 2 bits a kept value is :math:`\pm m` with
  probability :math:`|v_j| / m`, else 0.

  Args:
    key: a PRNG key for the rounding.
    values: ``float32[chunks, k]``.
    bits: bits a code, the sign included.

  Returns:
    ``(codes, scales)``: ``uint32[chunks, k]`` sign+level codes and
    ``float32[chunks, 1]`` scales (NaN for a chunk holding one).
  """
  top = 2 ** (bits - 1) - 1
  scale = base.bucket_max_abs(values)
  # Scaled by a power of two, so that neither a tiny scale's reciprocal nor the products
  # overflow (as QSGD does).
  normalizer = base.power_of_two_normalizer(scale)
  normalized = scale * normalizer
  inverse_step = jnp.where(normalized > 0, top / normalized, 0.0)
  level = rounding.round_stochastic_to_level(
      key, jnp.abs(values * normalizer[:, None]) * inverse_step[:, None], top)
  sign = (jax.lax.bitcast_convert_type(values, jnp.uint32) >> 31) << (bits - 1)
  return sign | level.astype(jnp.uint32), scale[:, None]


def scaled_values(codes: jax.Array, scales: jax.Array, bits: int) -> jax.Array:
  """Inverse of :func:`scaled_codes`: ``float32[chunks, k]``, no magnitude above its scale."""
  top = 2 ** (bits - 1) - 1
  level = (codes & jnp.uint32(top)).astype(jnp.float32)
  scale = scales[:, :1]
  magnitude = jnp.where(level == top, scale, level * (scale / top))
  return jnp.where((codes >> (bits - 1)) != 0, -magnitude, magnitude)


def bin_mean_codes(values: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
  r"""SparseLoCo's statistical quantizer, over every value of the payload together.

  With the values' mean :math:`\mu`, the centred values :math:`c = v - \mu`,
  their unbiased standard deviation :math:`\sigma` (0 for a single value)
  and :math:`B = 2^b` bins of width :math:`w = 6 \sigma / B` (1 where that is
  0 or not finite), a value's code is
  :math:`\mathrm{clip}(\mathrm{round}(c / w + \lfloor B / 2 \rfloor), 0, B - 1)`
  (round half to even), and bin :math:`i` decodes to :math:`\mu` plus the
  mean of the centred values coded :math:`i` (0 for an empty bin).

  Args:
    values: ``float32[chunks, k]``.
    bits: bits a code.

  Returns:
    ``(codes, table)``: ``uint32[chunks, k]`` bin indices, and
    ``float32[1, 1 + 2**bits]``, the mean then each bin's mean of the
    centred values.

  References:
    ``sparseloco.py`` (Sarfi et al. 2025, commit 276fa59), lines 309-338.
  """
  bins = 2**bits
  flat = values.reshape(-1)
  count = flat.shape[0]
  shift = jnp.mean(flat)
  centred = flat - shift
  sigma = (jnp.sqrt(jnp.sum(centred * centred) / (count - 1)) if count > 1
           else jnp.zeros((), jnp.float32))
  width = BIN_MEANS_RANGE * sigma / bins
  width = jnp.where(jnp.isfinite(width) & (width != 0), width, 1.0)
  codes = jnp.clip(jnp.round(centred / width + bins // 2), 0, bins - 1).astype(jnp.int32)
  sums = jax.ops.segment_sum(centred, codes, num_segments=bins)
  counts = jax.ops.segment_sum(jnp.ones_like(centred), codes, num_segments=bins)
  means = jnp.where(counts > 0, sums / jnp.maximum(counts, 1.0), 0.0)
  table = jnp.concatenate([shift[None], means])[None]
  return codes.astype(jnp.uint32).reshape(values.shape), table


def bin_mean_values(codes: jax.Array, table: jax.Array) -> jax.Array:
  """Inverse of :func:`bin_mean_codes`: each code's bin mean plus the shift."""
  return table[0, 1:][codes.astype(jnp.int32)] + table[0, 0]
