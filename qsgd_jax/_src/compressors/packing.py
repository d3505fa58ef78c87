"""Bit packing of fixed-width integer codes into ``uint32`` words.

Code ``i`` of a vector of ``b``-bit codes occupies bits ``[i * b, (i + 1) * b)``
of the packed bit string, where bit ``j`` of the string is bit ``j % 32``
(least significant first) of word ``j // 32``. A vector of ``n`` codes packs
into ``ceil(n * b / 32)`` words, so the payload holds exactly ``b`` bits a code
plus at most 31 bits of padding.

When ``b`` divides 32 (1, 2, 4, 8, 16 or 32 bits) each word holds ``32 / b``
whole codes: packing shifts a ``(words, 32 / b)`` view of the codes by their
offsets and sums its short last axis (the bits are disjoint, so the sum is
their OR); unpacking broadcasts each word against the offsets, shifts and
masks. Either is one vectorized pass over contiguous memory.

Other widths work on groups of 32 codes, which fill exactly ``b`` words. Where
each code of a group starts, and whether it spills into the next word, is
fixed by ``b`` alone, a small static table: packing shifts every code into
place in its first word (and its spill into the second) and sums, for each
word, the pieces that land there, one masked reduction over a
``(groups, b, 32)`` broadcast; unpacking gathers each code's first and second
word, shifts and masks. Both compile to a handful of operations for any ``b``.

Packing ends in a reduction, which XLA does not fuse into the reduction's
consumers: a program that packs and then unpacks (``decode(encode(x))`` under
one ``jit``) writes the words out once, rather than recomputing every code,
random draw included, once for each code that shares its word.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

_WORD_BITS = 32
_GROUP = 32  # codes a group; a group of 32 codes of b bits fills b words.


def num_words(num_codes: int, num_bits: int) -> int:
  """Number of ``uint32`` words that ``num_codes`` codes of ``num_bits`` bits fill."""
  return math.ceil(num_codes * num_bits / _WORD_BITS)


def _check_num_bits(num_bits: int) -> None:
  if not isinstance(num_bits, int) or not 1 <= num_bits <= _WORD_BITS:
    raise ValueError(f"num_bits must be an int in [1, 32], got {num_bits!r}.")


def _mask(num_bits: int) -> jax.Array:
  return jnp.uint32(0xFFFFFFFF >> (_WORD_BITS - num_bits))


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
  codes = codes.astype(jnp.uint32)
  if _WORD_BITS % num_bits == 0:
    return _pack_whole_codes(codes, num_bits)
  return _pack_groups(codes, num_bits)


def pack_prefix(codes: jax.Array, num_codes: int, num_bits: int) -> jax.Array:
  """:func:`pack` of the first ``num_codes`` of ``codes``, any shape, row-major.

  For the codes of a padded array (buckets): rather than slicing the codes and
  padding them back to whole words, which XLA would fuse into the packing
  loop and run element by element, it zeroes the codes past ``num_codes``,
  packs them all, and cuts the words. Codes with nothing to cut whose rows
  fill whole words are packed row by row, in their own shape: XLA then
  computes the codes in the loop order of the packing without dividing flat
  indices back into rows.
  """
  _check_num_bits(num_bits)
  shape = codes.shape
  if codes.size == num_codes and shape and _WORD_BITS % num_bits == 0:
    per_word = _WORD_BITS // num_bits
    if shape[-1] % per_word == 0:
      rows = codes.astype(jnp.uint32).reshape(*shape[:-1], shape[-1] // per_word, per_word)
      return _shift_and_sum(rows, num_bits).reshape(-1)
  codes = codes.reshape(-1)
  if codes.size != num_codes:
    codes = jnp.where(jnp.arange(codes.size) < num_codes, codes, 0)
  return pack(codes, num_bits)[: num_words(num_codes, num_bits)]


def _shift_and_sum(codes: jax.Array, num_bits: int) -> jax.Array:
  """Each code shifted to its offset in the word, summed over the last axis."""
  offsets = np.arange(0, _WORD_BITS, num_bits, dtype=np.uint32)
  return jnp.sum(codes << offsets, axis=-1, dtype=jnp.uint32)


def _pack_whole_codes(codes: jax.Array, num_bits: int) -> jax.Array:
  """:func:`pack` for a ``num_bits`` that divides 32."""
  n = codes.shape[0]
  words = num_words(n, num_bits)
  per_word = _WORD_BITS // num_bits
  codes = jnp.pad(codes, (0, words * per_word - n)).reshape(words, per_word)
  return _shift_and_sum(codes, num_bits)


def _pack_groups(codes: jax.Array, num_bits: int) -> jax.Array:
  """:func:`pack` for any ``num_bits``, 32 codes (``num_bits`` words) at a time."""
  n = codes.shape[0]
  groups = -(-n // _GROUP)
  codes = jnp.pad(codes, (0, groups * _GROUP - n)).reshape(groups, _GROUP)
  first, offset, spills = _group_table(num_bits)
  low = codes << offset  # Its part in its first word, high bits shifted out.
  high = jnp.where(spills, codes >> np.where(spills, _WORD_BITS - offset, 0).astype(np.uint32), 0)
  word = np.arange(num_bits)[:, None]
  pieces = jnp.where(first == word, low[:, None, :], 0) | jnp.where(
      (first + 1 == word) & spills, high[:, None, :], 0
  )
  return jnp.sum(pieces, axis=2, dtype=jnp.uint32).reshape(-1)[: num_words(n, num_bits)]


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
    offsets = np.arange(0, _WORD_BITS, num_bits, dtype=np.uint32)
    codes = (words[:, None] >> offsets) & _mask(num_bits)
    return codes.reshape(-1)[:num_codes]
  groups = -(-num_codes // _GROUP)
  words = jnp.pad(words, (0, groups * num_bits - expected)).reshape(groups, num_bits)
  first, offset, spills = _group_table(num_bits)
  low = words[:, first] >> offset
  # A spilling code's high bits open the next word, above the 32 - offset bits
  # its first word holds; the other codes take nothing from there.
  next_word = np.minimum(first + 1, num_bits - 1)
  high = words[:, next_word] << np.where(spills, _WORD_BITS - offset, 0).astype(np.uint32)
  codes = (low | jnp.where(spills, high, 0)) & _mask(num_bits)
  return codes.reshape(-1)[:num_codes]


def _group_table(num_bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """For the 32 codes of a group: first word, bit offset there, and whether they spill."""
  start = np.arange(_GROUP) * num_bits
  offset = (start % _WORD_BITS).astype(np.uint32)
  return start // _WORD_BITS, offset, offset + num_bits > _WORD_BITS
