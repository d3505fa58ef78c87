"""Bit packing of fixed-width integer codes into ``uint32`` words.

Code ``i`` of a vector of ``b``-bit codes occupies bits ``[i * b, (i + 1) * b)``
of the packed bit string, where bit ``j`` of the string is bit ``j % 32``
(least significant first) of word ``j // 32``. A vector of ``n`` codes packs
into ``ceil(n * b / 32)`` words, so the payload holds exactly ``b`` bits a code
plus at most 31 bits of padding.

When ``b`` divides 32 (1, 2, 4, 8, 16, 32 bits), each word holds ``32 / b``
whole codes: packing is a shift of a ``(words, 32 / b)`` view by the codes'
offsets and a sum over its short last axis (the bits are disjoint, so the sum
is their OR), and unpacking the broadcast shifts and a mask. Both are one
vectorized pass over contiguous memory.

Other widths work on groups of 32 codes, which fill exactly ``b`` words: each
word of a group is an OR of statically known shifted codes, so the whole pack
and unpack is a short chain of ``jax.lax`` shifts, ANDs and ORs over a
``(groups, 32)`` view, with no gather or scatter.
"""

import math

import jax
import jax.numpy as jnp

_WORD_BITS = 32
_GROUP = 32  # codes a group; a group of 32 codes of b bits fills b words.


def num_words(num_codes: int, num_bits: int) -> int:
  """Number of ``uint32`` words that ``num_codes`` codes of ``num_bits`` bits fill."""
  return math.ceil(num_codes * num_bits / _WORD_BITS)


def _check_num_bits(num_bits: int) -> None:
  if not isinstance(num_bits, int) or not 1 <= num_bits <= _WORD_BITS:
    raise ValueError(f"num_bits must be an int in [1, 32], got {num_bits!r}.")


def _pieces(num_bits: int):
  """For word ``w`` of a group, the ``(code, shift)`` pairs that land in it.

  A positive shift moves the code left (its low bits land in this word), a
  negative one moves it right (its high bits spill over from the word before).
  """
  pieces = []
  for word in range(num_bits):
    lo, hi = word * _WORD_BITS, (word + 1) * _WORD_BITS
    pieces.append([
        (code, code * num_bits - lo)
        for code in range(_GROUP)
        if code * num_bits < hi and (code + 1) * num_bits > lo
    ])
  return pieces


def pack(codes: jax.Array, num_bits: int) -> jax.Array:
  """Packs a vector of ``num_bits``-bit codes into ``uint32`` words.

  Args:
    codes: unsigned integers of shape ``[n]``, each below ``2**num_bits``
      (higher bits must be zero).
    num_bits: bits a code, in ``[1, 32]``.

  Returns:
    ``uint32[ceil(n * num_bits / 32)]``, the codes' bit string.
  """
  _check_num_bits(num_bits)
  if codes.ndim != 1:
    raise ValueError(f"pack expects a vector of codes, got shape {codes.shape}.")
  n = codes.shape[0]
  codes = codes.astype(jnp.uint32)
  if _WORD_BITS % num_bits == 0:
    return _pack_whole(codes, num_bits)
  groups = -(-n // _GROUP)
  codes = jnp.pad(codes, (0, groups * _GROUP - n))
  codes = codes.reshape(groups, _GROUP)
  words = []
  for pieces in _pieces(num_bits):
    word = jnp.zeros((groups,), jnp.uint32)
    for code, shift in pieces:
      column = codes[:, code]
      if shift >= 0:
        word = word | jax.lax.shift_left(column, jnp.uint32(shift))
      else:
        word = word | jax.lax.shift_right_logical(column, jnp.uint32(-shift))
    words.append(word)
  packed = jnp.stack(words, axis=1).reshape(groups * num_bits)
  return packed[: num_words(n, num_bits)]


def unpack(words: jax.Array, num_codes: int, num_bits: int) -> jax.Array:
  """Inverse of :func:`pack`: the first ``num_codes`` codes of a bit string.

  Args:
    words: ``uint32[ceil(num_codes * num_bits / 32)]`` from :func:`pack`.
    num_codes: static number of codes to read.
    num_bits: bits a code, in ``[1, 32]``.

  Returns:
    ``uint32[num_codes]``, each below ``2**num_bits``.
  """
  _check_num_bits(num_bits)
  expected = num_words(num_codes, num_bits)
  if words.shape != (expected,):
    raise ValueError(
        f"unpack expects {expected} words for {num_codes} codes of {num_bits} bits, "
        f"got shape {words.shape}."
    )
  words = words.astype(jnp.uint32)
  if _WORD_BITS % num_bits == 0:
    return _unpack_whole(words, num_codes, num_bits)
  groups = -(-num_codes // _GROUP)
  words = jnp.pad(words, (0, groups * num_bits - expected))
  words = words.reshape(groups, num_bits)
  mask = jnp.uint32((1 << num_bits) - 1) if num_bits < _WORD_BITS else jnp.uint32(0xFFFFFFFF)
  columns = [jnp.zeros((groups,), jnp.uint32) for _ in range(_GROUP)]
  for word, pieces in enumerate(_pieces(num_bits)):
    for code, shift in pieces:
      if shift >= 0:
        part = jax.lax.shift_right_logical(words[:, word], jnp.uint32(shift))
      else:
        part = jax.lax.shift_left(words[:, word], jnp.uint32(-shift))
      columns[code] = columns[code] | part
  codes = jnp.stack(columns, axis=1) & mask
  return codes.reshape(groups * _GROUP)[:num_codes]


def _offsets(num_bits: int) -> jax.Array:
  """Bit offsets of the ``32 / num_bits`` codes that a word holds."""
  return jnp.arange(0, _WORD_BITS, num_bits, dtype=jnp.uint32)


def _pack_whole(codes: jax.Array, num_bits: int) -> jax.Array:
  """:func:`pack` for a ``num_bits`` that divides 32."""
  per_word = _WORD_BITS // num_bits
  n = codes.shape[0]
  words = num_words(n, num_bits)
  codes = jnp.pad(codes, (0, words * per_word - n)).reshape(words, per_word)
  return jnp.sum(codes << _offsets(num_bits), axis=1, dtype=jnp.uint32)


def _unpack_whole(words: jax.Array, num_codes: int, num_bits: int) -> jax.Array:
  """:func:`unpack` for a ``num_bits`` that divides 32."""
  mask = jnp.uint32(0xFFFFFFFF >> (_WORD_BITS - num_bits))
  codes = (words[:, None] >> _offsets(num_bits)) & mask
  return codes.reshape(-1)[:num_codes]
