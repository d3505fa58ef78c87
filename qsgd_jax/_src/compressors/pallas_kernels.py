"""Fused Pallas kernels for QSGD's encode and decode and for 1-bit sign packing, on GPU.

XLA compiles QSGD's encode to several kernels, the first of which (the
bucket scales) reads the whole array before the quantizing kernel reads it
again. The kernels here read each block of buckets once, in one program: its
largest magnitude, the stochastic levels and the packed words, written once;
the decode reads the words once and writes the floats once. The 1-bit kernels
pack the signs ``x >= 0`` of a vector 32 to a word, and unpack words into
``+-scale`` rows.

Every kernel computes the same bits as the XLA path it replaces
(:mod:`qsgd_jax._src.compressors.qsgd`, :mod:`qsgd_jax._src.compressors.packing`): the same float
operations in the same order, and the random draws of
:func:`qsgd_jax._src.compressors.rounding.uniform_grid`, a hash of the element's index and
two words drawn from the key, which the kernel takes as an operand. The one
operation a GPU compiler computes differently is float32 division (Triton's
``/`` is an approximate ``div.full.f32``): on GPU the kernel divides with an
inline ``div.rn.f32``, as XLA's own division does.

The XLA path stays the default and the portable reference. On an H100 (JAX
0.11.2) the kernels give the XLA path's bits and QSGD's encode moves 1.8x the
bytes a second (one read of the array, not XLA's two), but a training step
with them was no faster within the spread (``docs/results.md``). They run
where ``QSGD_JAX_PALLAS`` says, read when a function is traced:

* ``off`` (the default): never;
* ``gpu``: on CUDA GPUs, lowered with Pallas' Triton backend, selected with
  ``jax.lax.platform_dependent`` (other platforms keep the XLA path);
* ``interpret``: everywhere, through Pallas' interpreter (slow; for tests).

Only configurations whose blocks Triton can hold are fused (a power-of-two
bucket whose codes fill whole words, ``bits`` dividing 32, the max norm, at
least one block of buckets); the buckets past the last whole block go the XLA
way, their random draws those of their place in the array.
"""

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from qsgd_jax._src.compressors import packing, rounding

_ENV = "QSGD_JAX_PALLAS"
_MODES = ("off", "gpu", "interpret")
_WORD_BITS = 32
_MAGNITUDE_BITS = 0x7FFFFFFF
# Elements a program encodes or decodes: enough to hide memory latency, few
# enough for a Triton block's registers.
_BLOCK_ELEMENTS = 8192
_SIGN_BLOCK_WORDS = 256  # Words a program of the 1-bit kernels packs or unpacks.


def mode() -> str:
  """Where the fused kernels run: ``QSGD_JAX_PALLAS``, ``off`` unless set."""
  value = os.environ.get(_ENV, "off")
  if value not in _MODES:
    raise ValueError(f"{_ENV} must be one of {_MODES}, got {value!r}.")
  return value


def dispatch(xla_fn, kernel_fn, *args):
  """``xla_fn(*args)``, or ``kernel_fn(*args, interpret=...)`` where :func:`mode` says."""
  match mode():
    case "off":
      return xla_fn(*args)
    case "interpret":
      return kernel_fn(*args, interpret=True)
  return jax.lax.platform_dependent(
      *args, cuda=functools.partial(kernel_fn, interpret=False), default=xla_fn)


def _compiler_params(interpret: bool):
  if interpret:
    return None
  from jax.experimental.pallas import triton as pallas_triton  # noqa: PLC0415
  return pallas_triton.CompilerParams(num_warps=4, num_stages=1)


def _divide(numerator: jax.Array, denominator: jax.Array, interpret: bool) -> jax.Array:
  """IEEE float32 division, rounded to nearest: XLA's ``/`` on every backend."""
  if interpret:
    return numerator / denominator
  from jax.experimental.pallas import triton as pallas_triton  # noqa: PLC0415
  (quotient,) = pallas_triton.elementwise_inline_asm(
      "div.rn.f32 $0, $1, $2;", args=[numerator, denominator], constraints="=r,r,r",
      pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(numerator.shape, jnp.float32)])
  return quotient


def _out_type(shape, dtype, *operands: jax.Array) -> jax.ShapeDtypeStruct:
  """A kernel's output type: under ``shard_map``, varying over every axis an operand varies over."""
  varying = frozenset().union(*(jax.typeof(x).manual_axis_type.varying for x in operands))
  return jax.ShapeDtypeStruct(shape, dtype,
                              manual_axis_type=jax.sharding.ManualAxisType(varying=varying))


def _uint32(x) -> jax.Array:
  return jax.lax.convert_element_type(x, jnp.uint32)


def _float_bits(x: jax.Array, dtype) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, dtype)


# QSGD on the leading whole blocks of buckets of a flat vector. The operands are the whole
# vectors, unsliced (XLA would copy a slice into a buffer of its own for the kernel), and
# the grid covers the leading blocks only; the caller writes the rest in place.


def qsgd_block_buckets(bits: int, bucket_len: int) -> int | None:
  """Buckets a program of the fused QSGD kernels takes, or None where they do not apply."""
  if (_WORD_BITS % bits or bucket_len & (bucket_len - 1) or bucket_len * bits < _WORD_BITS
      or bucket_len > _BLOCK_ELEMENTS):
    return None
  return _BLOCK_ELEMENTS // bucket_len


def qsgd_fused_buckets(bits: int, bucket_len: int, size: int) -> int:
  """How many of the leading buckets of ``size`` elements the fused kernels take."""
  block = qsgd_block_buckets(bits, bucket_len)
  if block is None:
    return 0
  return size // bucket_len // block * block


def _normalizer(magnitude: jax.Array) -> jax.Array:
  """:func:`base.power_of_two_normalizer`, in operations a kernel holds."""
  exponent = (_float_bits(magnitude, jnp.int32) >> 23) & 0xFF
  return _float_bits(jnp.minimum(jnp.maximum(254 - exponent, 1), 253) << 23, jnp.float32)


def _qsgd_encode_kernel(seed_ref, x_ref, words_ref, scales_ref, *, levels: int, bits: int,
                        interpret: bool):
  """One block of buckets: its scales, stochastic levels and packed words, one read of it."""
  (rows,) = scales_ref.shape
  per_word = _WORD_BITS // bits
  words = words_ref.shape[0] // rows
  x = x_ref[...].reshape(rows, words, per_word)
  # base.bucket_max_abs: the largest magnitude's bits, NaN above infinity.
  magnitude_bits = jnp.max(jnp.max(_float_bits(x, jnp.int32) & _MAGNITUDE_BITS, axis=2), axis=1)
  scale = _float_bits(magnitude_bits, jnp.float32)
  scales_ref[...] = scale
  # QSGD._scaled_magnitudes.
  normalizer = _normalizer(scale)
  normalized = scale * normalizer
  inverse_step = jnp.where(
      normalized > 0, _divide(jnp.full_like(normalized, levels), normalized, interpret), 0.0)
  y = jnp.abs(x * normalizer[:, None, None]) * inverse_step[:, None, None]
  # rounding.uniform_grid: the hash of index * (a | 1) + c, mod 2**32.
  multiplier = seed_ref[0] | jnp.uint32(1)
  first = _uint32(pl.program_id(0)) * jnp.uint32(rows * words * per_word)
  row = _uint32(jnp.arange(rows, dtype=jnp.int32))[:, None, None] * jnp.uint32(words * per_word)
  column = (_uint32(jnp.arange(words, dtype=jnp.int32))[None, :, None] * jnp.uint32(per_word)
            + _uint32(jnp.arange(per_word, dtype=jnp.int32))[None, None, :])
  counter = seed_ref[1] + multiplier * (first + row + column)
  draw = rounding.mix(counter) >> (32 - rounding.UNIFORM_BITS)
  # rounding.round_stochastic_to_level.
  floor = jnp.floor(y)
  threshold = (y - floor) * jnp.float32(2**rounding.UNIFORM_BITS)
  up = _float_bits(draw, jnp.int32).astype(jnp.float32) < threshold
  shifted = _float_bits(floor + jnp.float32(rounding.MANTISSA), jnp.int32)
  level = jnp.minimum(shifted - jnp.int32(rounding.MANTISSA_BITS) + up.astype(jnp.int32),
                      jnp.int32(levels))
  # QSGD._pack: x's sign bit above the level, then packing.pack's shifted sum.
  sign = (_float_bits(x, jnp.uint32) >> 31) << (bits - 1)
  codes = sign | _uint32(level)
  offsets = _uint32(jnp.arange(per_word, dtype=jnp.int32) * bits)[None, None, :]
  words_ref[...] = jnp.sum(codes << offsets, axis=2, dtype=jnp.uint32).reshape(rows * words)


def qsgd_encode(seed: jax.Array, flat: jax.Array, *, levels: int, bits: int, bucket_len: int,
                interpret: bool) -> tuple[jax.Array, jax.Array]:
  """The fused encode of the leading :func:`qsgd_fused_buckets` buckets of ``flat``.

  Args:
    seed: ``uint32[2]``, :func:`seed_words` of the key.
    flat: ``float32[n]``, the whole vector; its first element is element 0 of
      the random draws.
    levels: QSGD's ``s``.
    bits: bits a code, dividing 32.
    bucket_len: elements a bucket, a power of two.
    interpret: run through Pallas' interpreter.

  Returns:
    ``(words, scales)`` of the sizes the whole vector's payload has,
    ``uint32[ceil(n * bits / 32)]`` and ``float32[ceil(n / bucket_len)]``, of
    which the fused buckets' words and scales are written (the rest is for the
    caller to fill).
  """
  (size,) = flat.shape
  block = qsgd_block_buckets(bits, bucket_len)
  block_words = block * bucket_len * bits // _WORD_BITS
  num_buckets = -(-size // bucket_len)
  kernel = functools.partial(_qsgd_encode_kernel, levels=levels, bits=bits, interpret=interpret)
  return pl.pallas_call(
      kernel,
      out_shape=(_out_type((packing.num_words(size, bits),), jnp.uint32, seed, flat),
                 _out_type((num_buckets,), jnp.float32, seed, flat)),
      grid=(qsgd_fused_buckets(bits, bucket_len, size) // block,),
      in_specs=[pl.BlockSpec((2,), lambda i: (0,)),
                pl.BlockSpec((block * bucket_len,), lambda i: (i,))],
      out_specs=(pl.BlockSpec((block_words,), lambda i: (i,)),
                 pl.BlockSpec((block,), lambda i: (i,))),
      compiler_params=_compiler_params(interpret),
      interpret=interpret,
      name="qsgd_encode",
  )(seed, flat)


def _qsgd_decode_kernel(words_ref, step_ref, inverse_normalizer_ref, out_ref, *, bits: int):
  """One block of buckets: signed levels times each bucket's step, one read of the words."""
  (rows,) = step_ref.shape
  per_word = _WORD_BITS // bits
  words = words_ref.shape[0] // rows
  offsets = _uint32(jnp.arange(per_word, dtype=jnp.int32) * bits)[None, None, :]
  packed = words_ref[...].reshape(rows, words)
  codes = (packed[:, :, None] >> offsets) & jnp.uint32(2**bits - 1)
  level = (codes & jnp.uint32(2 ** (bits - 1) - 1)).astype(jnp.int32)
  signed = jnp.where((codes >> (bits - 1)) != 0, -level, level)
  step = step_ref[...][:, None, None]
  inverse_normalizer = inverse_normalizer_ref[...][:, None, None]
  values = signed.astype(jnp.float32) * step * inverse_normalizer
  out_ref[...] = values.reshape(rows * words * per_word)


def qsgd_decode(words: jax.Array, steps: jax.Array, inverse_normalizers: jax.Array, *,
                size: int, bits: int, bucket_len: int, interpret: bool) -> jax.Array:
  """The fused decode of the leading :func:`qsgd_fused_buckets` buckets of a payload.

  Args:
    words: ``uint32[ceil(size * bits / 32)]``, the payload's packed codes.
    steps: ``float32[num_buckets]``, each bucket's step on its normalized
      scale, as ``QSGD._dequantize`` computes it.
    inverse_normalizers: ``float32[num_buckets]``, ``1 / normalizer``.
    size: elements of the vector.
    bits, bucket_len, interpret: as in :func:`qsgd_encode`.

  Returns:
    ``float32[size]``, of which the fused buckets are written.
  """
  block = qsgd_block_buckets(bits, bucket_len)
  block_words = block * bucket_len * bits // _WORD_BITS
  return pl.pallas_call(
      functools.partial(_qsgd_decode_kernel, bits=bits),
      out_shape=_out_type((size,), jnp.float32, words, steps, inverse_normalizers),
      grid=(qsgd_fused_buckets(bits, bucket_len, size) // block,),
      in_specs=[pl.BlockSpec((block_words,), lambda i: (i,)),
                pl.BlockSpec((block,), lambda i: (i,)),
                pl.BlockSpec((block,), lambda i: (i,))],
      out_specs=pl.BlockSpec((block * bucket_len,), lambda i: (i,)),
      compiler_params=_compiler_params(interpret),
      interpret=interpret,
      name="qsgd_decode",
  )(words, steps, inverse_normalizers)


# 1-bit: 32 signs a word.


def _sign_pack_kernel(x_ref, words_ref):
  (words,) = words_ref.shape
  offsets = _uint32(jnp.arange(_WORD_BITS, dtype=jnp.int32))[None, :]
  signs = _uint32((x_ref[...].reshape(words, _WORD_BITS) >= 0).astype(jnp.int32))
  words_ref[...] = jnp.sum(signs << offsets, axis=1, dtype=jnp.uint32)


def sign_pack(x: jax.Array, *, interpret: bool) -> jax.Array:
  """``packing.pack((x >= 0).astype(uint32), 1)`` of a float32 vector, fused.

  The kernel packs whole blocks of ``_SIGN_BLOCK_WORDS`` words; the words
  after them are packed the XLA way and written in place.
  """
  (n,) = x.shape
  fused_words = n // (_WORD_BITS * _SIGN_BLOCK_WORDS) * _SIGN_BLOCK_WORDS
  fused = fused_words * _WORD_BITS
  if not fused_words:
    return packing.pack((x >= 0).astype(jnp.uint32), 1)
  words = pl.pallas_call(
      _sign_pack_kernel,
      out_shape=_out_type((packing.num_words(n, 1),), jnp.uint32, x),
      grid=(fused_words // _SIGN_BLOCK_WORDS,),
      in_specs=[pl.BlockSpec((_SIGN_BLOCK_WORDS * _WORD_BITS,), lambda i: (i,))],
      out_specs=pl.BlockSpec((_SIGN_BLOCK_WORDS,), lambda i: (i,)),
      compiler_params=_compiler_params(interpret),
      interpret=interpret,
      name="sign_pack",
  )(x)
  if fused == n:
    return words
  return words.at[fused_words:].set(packing.pack((x[fused:] >= 0).astype(jnp.uint32), 1))


def _sign_unpack_kernel(words_ref, scales_ref, out_ref):
  _, words = words_ref.shape
  offsets = _uint32(jnp.arange(_WORD_BITS, dtype=jnp.int32))[None, None, :]
  bits = (words_ref[...][:, :, None] >> offsets) & jnp.uint32(1)
  plus_minus = jnp.where(bits != 0, jnp.float32(1), jnp.float32(-1))
  out_ref[...] = (plus_minus * scales_ref[...][:, :, None]).reshape(1, words * _WORD_BITS)


def sign_unpack_rows(words: jax.Array, scales: jax.Array, *, interpret: bool) -> jax.Array:
  """Rows of packed signs as ``+-scale``: ``float32[rows, row_words * 32]``.

  ``words`` is ``uint32[rows, row_words]``, ``scales`` ``float32[rows]``:
  element ``j`` of row ``k`` is ``scales[k]`` where bit ``j`` of the row is
  set and ``-scales[k]`` where not, the bits of ``sign_exchange``'s
  ``+-1`` rows times their scales. The kernel unpacks each row's whole blocks
  of ``_SIGN_BLOCK_WORDS`` words; the words after them are unpacked the XLA
  way and written in place.
  """
  rows, row_words = words.shape
  scales = scales.reshape(rows, 1).astype(jnp.float32)
  fused_words = row_words // _SIGN_BLOCK_WORDS * _SIGN_BLOCK_WORDS
  if not fused_words:
    return _unpacked_signs(words, scales)
  out = pl.pallas_call(
      _sign_unpack_kernel,
      out_shape=_out_type((rows, row_words * _WORD_BITS), jnp.float32, words, scales),
      grid=(rows, fused_words // _SIGN_BLOCK_WORDS),
      in_specs=[pl.BlockSpec((1, _SIGN_BLOCK_WORDS), lambda k, i: (k, i)),
                pl.BlockSpec((1, 1), lambda k, i: (k, 0))],
      out_specs=pl.BlockSpec((1, _SIGN_BLOCK_WORDS * _WORD_BITS), lambda k, i: (k, i)),
      compiler_params=_compiler_params(interpret),
      interpret=interpret,
      name="sign_unpack",
  )(words, scales)
  if fused_words == row_words:
    return out
  return out.at[:, fused_words * _WORD_BITS:].set(
      _unpacked_signs(words[:, fused_words:], scales))


def _unpacked_signs(words: jax.Array, scales: jax.Array) -> jax.Array:
  """The XLA way of :func:`sign_unpack_rows`, ``scales`` as ``float32[rows, 1]``."""
  rows, row_words = words.shape
  bits = packing.unpack(words.reshape(-1), words.size * _WORD_BITS, 1).reshape(rows, -1)
  return jnp.where(bits != 0, jnp.float32(1), jnp.float32(-1)) * scales


def seed_words(key: jax.Array) -> jax.Array:
  """The two words :func:`rounding.uniform_grid` draws from ``key``, ``uint32[2]``."""
  return jax.random.bits(key, (2,), jnp.uint32)

