r"""Elias omega coding of QSGD level vectors, as in Section 3.2 of the paper.

A QSGD-quantized vector is a float32 scale :math:`\|v\|` and integer levels
:math:`\ell_i = \mathrm{sgn}(v_i)\, s\, \xi_i(v, s)`. This module writes the
paper's variable-length bit string for it, bit for bit, and reads it back.

**Elias omega code.** For an integer :math:`k \ge 1`, :math:`\omega(1)` is
``0``; for :math:`k \ge 2` it is :math:`\omega` without its final ``0`` of
:math:`\lfloor \log_2 k \rfloor` (the bit length of :math:`k` minus one),
then the binary digits of :math:`k`, then ``0``. So ``2 -> 10 0``,
``4 -> 10 100 0``, ``16 -> 10 100 10000 0``, and the code length is

.. math::

  |\omega(k)| = 1 + \sum_{j \ge 0,\ k_j > 1} (\lfloor \log_2 k_j \rfloor + 1),
  \qquad k_0 = k,\ k_{j+1} = \lfloor \log_2 k_j \rfloor,

about :math:`\log_2 k + 2 \log_2 \log_2 k` bits. Bit lengths come from
``jax.lax.clz``; for 32-bit integers the recursion is at most 4 deep.

**Bit strings.** Both variants start with the 32 raw bits of the float32
norm, and are written most significant bit first: bit ``p`` of the string is
bit ``31 - p % 32`` of word ``p // 32``.

* ``"sparse"`` (the paper's main code): for each nonzero level in order,
  :math:`\omega(\text{gap})`, one sign bit (1 for negative) and
  :math:`\omega(|\ell_i|)`, where the gap of the first nonzero is its position
  counted from 1 and that of a later one the index distance to the previous
  nonzero. A zero vector is the norm alone. Theorem 3.2 bounds the expected
  length for L2 scaling by
  :math:`(3 + (3/2 + o(1)) \log_2(2(s^2+n)/(s(s+\sqrt n))))\, s(s+\sqrt n) + 32`.
* ``"dense"`` (the paper's code for :math:`s = \sqrt n`): for every coordinate
  one sign bit and :math:`\omega'(|\ell_i|) = \omega(|\ell_i| + 1)`. At
  :math:`s = \sqrt n` Corollary 3.3 bounds the sparse code by
  :math:`2.8 n + 32` bits (Gaussian vectors measure 2.76 bits a coordinate
  at :math:`n = 10^4` to :math:`10^6`); the dense code pays a sign bit on
  every coordinate, zeros included, and measures 3.31.

The library's wire format stays fixed-width packed, since collectives need
static shapes; this codec gives exact size accounting (:func:`encoded_bits`)
and is a working codec for storage or point-to-point transfer.

**Parallel coding.** :func:`encode` computes every coordinate's record
length, places the records with a prefix sum, and adds each record, in
pieces of at most 32 bits, into the one or two words each piece touches
(disjoint bits, so adding is OR). :func:`decode` computes, at every bit
position, the length of the omega code that would start there, which gives
where a record starting there would end (``"dense"``: a sign bit and a
code; ``"sparse"``: a gap code, a sign bit and a code). The records that
really start are found from bit 32 in chunks of 8192 bits: each chunk is
walked from its first bit (a guess); walks from every other possible entry
stop as soon as they meet the guessed walk (omega codes resynchronize within
a few records), which gives each chunk's entry-to-exit map; a scan over the
chunks threads the true entries; and a last walk from each true entry,
spliced onto the guessed walk, lists every record start. All walks advance
all their lanes at once.

References:
  Alistarh, Grubic, Li, Tomioka and Vojnovic, "QSGD: Communication-Efficient
  SGD via Gradient Quantization and Encoding", NeurIPS 2017.

  Elias, "Universal codeword sets and representations of the integers",
  IEEE Transactions on Information Theory 21(2), 1975.
"""

import functools
from typing import Literal

import jax
import jax.numpy as jnp

Variant = Literal["sparse", "dense"]

_WORD_BITS = 32
_NORM_BITS = 32
# Groups before the last in an omega code of a 32-bit integer: 31 -> 4 -> 2.
_HEAD_GROUPS = 3
# Longest omega code the decoder parses at an arbitrary position (the longest
# one of a 32-bit integer has 43 bits); longer candidates are clamped.
_MAX_CODE_BITS = 64
# Bits a decoding chunk; see the module docstring.
_CHUNK_BITS = 8192
_MAX_LEVEL_LIMIT = 2**31 - 2
_MAX_STRING_BITS = 2**31 - 1 - 2 * _CHUNK_BITS


def _check_variant(variant: str) -> None:
  if variant not in ("sparse", "dense"):
    raise ValueError(f"variant must be 'sparse' or 'dense', got {variant!r}.")


def _check_max_level(max_level: int) -> None:
  if not isinstance(max_level, int) or not 1 <= max_level <= _MAX_LEVEL_LIMIT:
    raise ValueError(f"max_level must be an int in [1, 2**31 - 2], got {max_level!r}.")


def _check_levels(levels: jax.Array) -> jax.Array:
  levels = jnp.asarray(levels)
  if levels.ndim != 1 or not jnp.issubdtype(levels.dtype, jnp.integer):
    raise ValueError(
        f"levels must be a vector of integers, got {levels.dtype} of shape {levels.shape}."
    )
  return levels.astype(jnp.int32)


def _bit_length(x: jax.Array) -> jax.Array:
  """Bit length of ``uint32`` values (0 for 0), as ``uint32``."""
  return jnp.uint32(_WORD_BITS) - jax.lax.clz(x)


def _static_omega_length(k: int) -> int:
  """``|omega(k)|`` of a Python integer ``k >= 1``."""
  length = 1
  while k > 1:
    length += k.bit_length()
    k = k.bit_length() - 1
  return length


def _static_omega_parts(k: int) -> tuple[int, int]:
  """Lengths of the head (all groups but the last) and tail of ``omega(k)``."""
  if k == 1:
    return 0, 1
  tail = k.bit_length() + 1
  return _static_omega_length(k) - tail, tail


@jax.jit
def omega_length(k: jax.Array) -> jax.Array:
  r"""Length in bits of the Elias omega code of each element.

  Computes :math:`|\omega(k)| = 1 + \sum_{j,\, k_j > 1} \mathrm{bitlen}(k_j)`
  with :math:`k_0 = k` and :math:`k_{j+1} = \mathrm{bitlen}(k_j) - 1`, all
  elements at once with ``jax.lax.clz`` (4 rounds cover 32-bit integers).

  Args:
    k: integers of any shape; values are read as unsigned 32-bit integers.

  Returns:
    ``int32`` lengths of the same shape; 0 where ``k <= 0`` (no code).

  Examples:
    >>> import jax.numpy as jnp
    >>> from qsgd_jax import elias
    >>> elias.omega_length(jnp.array([1, 2, 3, 4, 8, 15, 16]))
    Array([ 1,  3,  3,  6,  7,  7, 11], dtype=int32)

  References:
    Elias, "Universal codeword sets and representations of the integers",
    1975.
  """
  k = jnp.asarray(k)
  positive = k > 0
  n = k.astype(jnp.uint32)
  length = jnp.ones(k.shape, jnp.uint32)
  for _ in range(_HEAD_GROUPS + 1):
    width = _bit_length(n)
    grows = n > 1
    length = jnp.where(grows, length + width, length)
    n = jnp.where(grows, width - 1, n)
  return jnp.where(positive, length, 0).astype(jnp.int32)


def _omega_parts(k: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Head and tail of ``omega(k)`` for ``uint32`` values ``1 <= k < 2**31``.

  The code is ``head`` (the groups that write the bit length, at most 10 bits)
  followed by ``tail`` (the binary digits of ``k`` and the final ``0``, at
  most 32 bits), each returned as a right-aligned value and a length.

  Returns:
    ``(head, head_length, tail, tail_length)``, all ``uint32``.
  """
  width = _bit_length(k)
  long = k > 1
  tail = jnp.where(long, jax.lax.shift_left(k, jnp.uint32(1)), 0).astype(jnp.uint32)
  tail_length = jnp.where(long, width + 1, 1).astype(jnp.uint32)
  head = jnp.zeros_like(k)
  head_length = jnp.zeros_like(k)
  n = width - 1
  for _ in range(_HEAD_GROUPS):
    grows = n > 1
    group_width = _bit_length(n)
    head = jnp.where(grows, head | jax.lax.shift_left(n, head_length), head)
    head_length = jnp.where(grows, head_length + group_width, head_length)
    n = jnp.where(grows, group_width - 1, n)
  return head, head_length, tail, tail_length


def _magnitudes(levels: jax.Array) -> jax.Array:
  """``|levels|`` as ``uint32`` (exact for ``int32`` minimum too)."""
  return jnp.where(levels < 0, -levels, levels).astype(jnp.uint32)


def _prefix_sum(x: jax.Array) -> jax.Array:
  """Inclusive prefix sum of a vector, by an associative scan (faster than cumsum on CPU).

  The scan reads its input at each of its levels, and XLA on CPU fuses the
  code that computes ``x`` into each of them, computing it again every time.
  An identity scatter, which XLA does not fuse into its consumers, first
  stores ``x``.
  """
  index = jnp.arange(x.shape[0], dtype=jnp.int32)
  stored = jnp.zeros_like(x).at[index].set(x, indices_are_sorted=True, unique_indices=True)
  return jax.lax.associative_scan(jnp.add, stored)


def _gaps(nonzero: jax.Array) -> jax.Array:
  """Each coordinate's index minus that of the nonzero before it (``-1`` if none)."""
  index = jnp.arange(nonzero.shape[0], dtype=jnp.int32)
  last = jax.lax.associative_scan(jnp.maximum, jnp.where(nonzero, index, -1))
  previous = jnp.concatenate([jnp.full((1,), -1, jnp.int32), last[:-1]])
  return index - previous


@functools.partial(jax.jit, static_argnames=("variant",))
def encoded_bits(levels: jax.Array, *, variant: Variant) -> jax.Array:
  r"""Exact length in bits of the Elias encoding of a level vector.

  With :math:`g_j` the gaps between nonzeros (the first counted from
  position 1),

  .. math::

    \text{sparse: } 32 + \sum_{\ell_i \ne 0} (|\omega(g_i)| + 1 + |\omega(|\ell_i|)|),
    \qquad
    \text{dense: } 32 + \sum_i (1 + |\omega(|\ell_i| + 1)|).

  Equal to the ``num_bits`` that :func:`encode` returns, without building
  the string, and without a ``max_level`` limit.

  Args:
    levels: integer vector of signed levels
      :math:`\mathrm{sgn}(v_i)\, s\, \xi_i`.
    variant: ``"sparse"`` or ``"dense"``.

  Returns:
    ``int32`` scalar, exact (it wraps past ``2**31 - 1`` bits, where
    :func:`encode` refuses a vector; :func:`total_bits` is the count of a
    vector of any length, in float32).

  Examples:
    >>> import jax.numpy as jnp
    >>> from qsgd_jax import elias
    >>> levels = jnp.array([0, 0, 3, -1, 0])
    >>> int(elias.encoded_bits(levels, variant="sparse"))  # 32 + (3+1+3) + (1+1+1)
    42
    >>> int(elias.encoded_bits(levels, variant="dense"))  # 32 + 2+2+(1+6)+(1+3)+2
    49

  References:
    Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient
    Quantization and Encoding", 2017, Section 3.2.
  """
  return _NORM_BITS + jnp.sum(_coordinate_bits(levels, variant), dtype=jnp.int32)


@functools.partial(jax.jit, static_argnames=("variant",))
def total_bits(levels: jax.Array, *, variant: Variant) -> jax.Array:
  """:func:`encoded_bits` as a ``float32`` scalar that cannot wrap, for statistics.

  The same count, exact up to ``2**24`` bits and within float32's rounding
  past it (chunks summed exactly in int32, their totals in float32), for a
  vector of any length: a billion levels at 4 bits take about ``1.2e10``
  bits, past what an int32 holds.

  Examples:
    >>> import jax.numpy as jnp
    >>> from qsgd_jax import elias
    >>> float(elias.total_bits(jnp.array([0, 0, 3, -1, 0]), variant="sparse"))
    42.0
  """
  return _NORM_BITS + sum_counts(_coordinate_bits(levels, variant))


def _coordinate_bits(levels: jax.Array, variant: Variant) -> jax.Array:
  """``int32`` bits each coordinate adds to the string, each below ``2**7``."""
  _check_variant(variant)
  levels = _check_levels(levels)
  magnitude = _magnitudes(levels)
  if variant == "dense":
    return 1 + omega_length(magnitude + 1)
  nonzero = levels != 0
  gap_bits = omega_length(_gaps(nonzero))
  return jnp.where(nonzero, gap_bits + 1 + omega_length(magnitude), 0)


# Counts summed in int32 a chunk at a time: 2**16 counts below 2**15 stay below 2**31.
_COUNT_CHUNK = 2**16


def sum_counts(counts: jax.Array) -> jax.Array:
  """The ``float32`` sum of non-negative ``int32`` counts below ``2**15``, without wrapping.

  JAX runs without 64-bit integers, and an int32 sum wraps past ``2**31 - 1``:
  the Elias bits of a billion-parameter payload, about ``1.2e10``, would come
  out negative or small. Each chunk of ``2**16`` counts is summed exactly in
  int32 (below ``2**31``), and the chunks' totals in float32: a statistic
  needs no exactness past ``2**24``, and float32 holds ``1e10`` within a
  relative ``6e-8`` a rounding (pairs of uint32 words would be exact, at the
  cost of carry logic a size estimate does not need).

  Args:
    counts: ``int32`` array of non-negative counts, each below ``2**15``.

  Returns:
    ``float32[]``, the sum.
  """
  counts = counts.reshape(-1)
  chunk = max(1, min(_COUNT_CHUNK, counts.size))
  counts = jnp.pad(counts, (0, -counts.size % chunk))
  chunk_totals = jnp.sum(counts.reshape(-1, chunk), axis=1, dtype=jnp.int32)
  return jnp.sum(chunk_totals.astype(jnp.float32))


def _max_record_bits(size: int, max_level: int, variant: Variant) -> int:
  """Longest record: the most bits one coordinate's code can take."""
  if variant == "dense":
    return 1 + _static_omega_length(max_level + 1)
  return _static_omega_length(max(size, 1)) + 1 + _static_omega_length(max_level)


def capacity_words(size: int, *, variant: Variant, max_level: int = 127) -> int:
  r"""Number of ``uint32`` words that hold any encoding of ``size`` levels.

  Every level vector with :math:`|\ell_i| \le` ``max_level`` encodes within
  :math:`32 + n\, (1 + |\omega(\text{max\_level} + 1)|)` bits (dense) or
  :math:`32 + n\, (2 + |\omega(\text{max\_level})|)` bits (sparse: a record
  with gap :math:`g` costs at most :math:`g` times a record with gap 1, since
  :math:`|\omega(g)| \le 3g - 2`, and the gaps add up to at most :math:`n`).

  Args:
    size: number of coordinates :math:`n`.
    variant: ``"sparse"`` or ``"dense"``.
    max_level: largest level magnitude to hold, in ``[1, 2**31 - 2]``.

  Returns:
    The static capacity, in words.

  Examples:
    >>> from qsgd_jax import elias
    >>> elias.capacity_words(1000, variant="dense", max_level=7)  # 8 bits each
    251
  """
  _check_variant(variant)
  _check_max_level(max_level)
  if variant == "dense":
    per_coordinate = 1 + _static_omega_length(max_level + 1)
  else:
    per_coordinate = 2 + _static_omega_length(max_level)
  total = _NORM_BITS + size * per_coordinate
  if total > _MAX_STRING_BITS:
    raise ValueError(f"{size} levels may need {total} bits, past the int32 bit positions.")
  return -(-total // _WORD_BITS)


def _code_segments(values: jax.Array, largest: int):
  """``omega(values)`` as head and tail segments, for values up to ``largest``."""
  head, head_length, tail, tail_length = _omega_parts(values)
  head_max, tail_max = _static_omega_parts(largest)
  return [(head, head_length, head_max), (tail, tail_length, tail_max)]


def _segments(levels: jax.Array, max_level: int, variant: Variant):
  """Each coordinate's record as ``(value, length, static max length)`` segments."""
  magnitude = _magnitudes(levels)
  negative = (levels < 0).astype(jnp.uint32)
  sign = [(negative, jnp.ones_like(negative), 1)]
  if variant == "dense":
    return sign + _code_segments(magnitude + 1, max_level + 1)
  nonzero = levels != 0
  gap = _gaps(nonzero).astype(jnp.uint32)
  segments = (_code_segments(gap, levels.shape[0]) + sign
              + _code_segments(jnp.maximum(magnitude, 1), max_level))
  return [(jnp.where(nonzero, value, 0), jnp.where(nonzero, length, 0), largest)
          for value, length, largest in segments]


def _merge(segments):
  """Joins consecutive segments while their static max lengths fit 32 bits."""
  pieces = []
  for value, length, largest in segments:
    if largest == 0:
      continue
    if pieces and pieces[-1][2] + largest <= _WORD_BITS:
      value_before, length_before, largest_before = pieces[-1]
      value = jax.lax.shift_left(value_before, length) | value
      pieces[-1] = (value, length_before + length, largest_before + largest)
    else:
      pieces.append((value, length, largest))
  return [(value, length.astype(jnp.int32)) for value, length, _ in pieces]


@functools.partial(jax.jit, static_argnames=("variant", "max_level"))
def encode(
    levels: jax.Array,
    norm: jax.Array,
    *,
    variant: Variant,
    max_level: int = 127,
) -> tuple[jax.Array, jax.Array]:
  r"""Elias-encodes a QSGD level vector and its norm into ``uint32`` words.

  The bit string is the one described in the module docstring (32 norm bits,
  then the ``"sparse"`` or ``"dense"`` records), most significant bit first:
  bit ``p`` is bit ``31 - p % 32`` of ``words[p // 32]``. Bits past
  ``num_bits`` are zero.

  Overflow: levels with :math:`|\ell_i| >` ``max_level`` do not fit the
  static capacity. If any level does, ``num_bits`` is ``-1`` and every word is
  zero; check ``num_bits < 0`` (it works inside ``jit``).

  Args:
    levels: integer vector of signed levels
      :math:`\ell_i = \mathrm{sgn}(v_i)\, s\, \xi_i` (``int32`` range).
    norm: the scale :math:`\|v\|`, stored as float32.
    variant: ``"sparse"`` or ``"dense"``.
    max_level: largest magnitude the buffer holds (QSGD's ``s``); sets the
      capacity, see :func:`capacity_words`.

  Returns:
    ``(words, num_bits)``: ``uint32[capacity_words(n, ...)]`` and the
    ``int32`` count of bits used (equal to :func:`encoded_bits`), or ``-1``
    on overflow.

  Examples:
    >>> import jax.numpy as jnp
    >>> from qsgd_jax import elias
    >>> words, num_bits = elias.encode(jnp.array([0, 3]), 1.0, variant="sparse")
    >>> int(num_bits)  # norm, omega(2) = 100, sign 0, omega(3) = 110
    39
    >>> hex(int(words[1]))  # 1000110 then zeros
    '0x8c000000'

  References:
    Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient
    Quantization and Encoding", 2017, Section 3.2.
  """
  _check_variant(variant)
  _check_max_level(max_level)
  levels = _check_levels(levels)
  num_words = capacity_words(levels.shape[0], variant=variant, max_level=max_level)
  pieces = _merge(_segments(levels, max_level, variant))
  record_bits = sum(length for _, length in pieces)
  start = _NORM_BITS + _prefix_sum(record_bits) - record_bits
  indices, values = [], []
  for value, length in pieces:
    word = start // _WORD_BITS
    end = (start % _WORD_BITS + length).astype(jnp.uint32)
    fits = end <= _WORD_BITS
    indices += [word, word + 1]
    values.append(jnp.where(fits, jax.lax.shift_left(value, _WORD_BITS - end),
                            jax.lax.shift_right_logical(value, end - _WORD_BITS)))
    values.append(jnp.where(fits, 0, jax.lax.shift_left(value, 2 * _WORD_BITS - end)))
    start = start + length
  norm_bits = jax.lax.bitcast_convert_type(jnp.asarray(norm, jnp.float32), jnp.uint32)
  words = jnp.zeros((num_words,), jnp.uint32).at[0].set(norm_bits)
  words = words.at[jnp.concatenate(indices)].add(jnp.concatenate(values), mode="drop")
  overflow = jnp.any(_magnitudes(levels) > max_level)
  num_bits = _NORM_BITS + jnp.sum(record_bits, dtype=jnp.int32)
  return jnp.where(overflow, 0, words), jnp.where(overflow, -1, num_bits)


def _window(first: jax.Array, second: jax.Array, offset: jax.Array) -> jax.Array:
  """The 32 bits at ``offset`` (``uint32`` in ``[0, 64)``) of 64 bits ``first second``.

  Shifts by 32 or more give zero in XLA, so each term vanishes where it
  does not apply.
  """
  return (jax.lax.shift_left(first, offset)
          | jax.lax.shift_right_logical(second, _WORD_BITS - offset)
          | jax.lax.shift_left(second, offset - _WORD_BITS))


def _parse_omega(first: jax.Array, second: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Reads the omega code at the top of the 64 bits ``first second``.

  From ``n = 1``: a ``0`` ends the code with value ``n``; a ``1`` starts a
  group of ``n + 1`` bits that becomes the new ``n``. Bits that are not a
  code of a 32-bit integer give some length in ``[1, 64]``.

  Returns:
    ``(length, value)``: ``int32`` length and ``uint32`` value.
  """
  offset = jnp.zeros_like(first)
  n = jnp.ones_like(first)
  done = jnp.zeros(first.shape, bool)
  length = jnp.full(first.shape, _MAX_CODE_BITS, jnp.uint32)
  for group in range(_HEAD_GROUPS + 2):
    window = _window(first, second, offset)
    ends = ~done & (jax.lax.shift_right_logical(window, jnp.uint32(31)) == 0)
    length = jnp.where(ends, offset + 1, length)
    done = done | ends
    if group == _HEAD_GROUPS + 1:
      break
    width = n + 1
    n = jnp.where(done, n, jax.lax.shift_right_logical(window, _WORD_BITS - width))
    offset = jnp.where(done, offset, jnp.minimum(offset + width, _MAX_CODE_BITS - 1))
  length = jnp.minimum(length, _MAX_CODE_BITS).astype(jnp.int32)
  return length, n


def _read(words: jax.Array, position: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The 64 bits from bit ``position`` of the string, as two ``uint32``."""
  word = position // _WORD_BITS
  offset = (position % _WORD_BITS).astype(jnp.uint32)
  first, second, third = words[word], words[word + 1], words[word + 2]
  return _window(first, second, offset), _window(second, third, offset)


def _code_lengths(words: jax.Array, num_positions: int) -> jax.Array:
  """Length of the omega code that would start at each of the first bit positions."""
  rows = -(-num_positions // _WORD_BITS)
  offset = jnp.arange(_WORD_BITS, dtype=jnp.uint32)[None, :]
  first = _window(words[:rows, None], words[1:rows + 1, None], offset)
  second = _window(words[1:rows + 1, None], words[2:rows + 2, None], offset)
  return _parse_omega(first, second)[0].reshape(-1)


def _next_record(code_bits: jax.Array, position: jax.Array, variant: Variant,
                 max_record: int) -> jax.Array:
  """Where the record after the one starting at ``position`` would start."""
  if variant == "dense":
    length = 1 + code_bits[position + 1]
  else:
    gap_bits = code_bits[position]
    length = gap_bits + 1 + code_bits[position + gap_bits + 1]
  return position + jnp.minimum(length, max_record)


def _record_starts(code_bits: jax.Array, stop: jax.Array, capacity: int, variant: Variant,
                   max_record: int, max_records: int) -> jax.Array:
  """Bit positions of the first ``max_records`` records (``capacity`` where none).

  Records start at bit 32, each one where the one before ends, and before
  ``stop``. Chunk ``c`` covers bits ``[32 + c K, 32 + (c + 1) K)`` and its
  first record starts less than ``max_record`` bits into it. Each chunk is
  first walked from its first bit (a guess); a walk from any other entry
  joins the guessed one after a few records (omega codes resynchronize), so
  walks from every entry stop there and reuse its count and exit.
  """
  step = functools.partial(_next_record, code_bits, variant=variant, max_record=max_record)
  min_record = 2 if variant == "dense" else 3
  max_per_chunk = -(-_CHUNK_BITS // min_record)
  num_chunks = -(-(capacity - _NORM_BITS) // _CHUNK_BITS)
  chunk_start = _NORM_BITS + _CHUNK_BITS * jnp.arange(num_chunks, dtype=jnp.int32)
  chunk_end = chunk_start + _CHUNK_BITS
  chunk_stop = jnp.minimum(chunk_end, stop)
  unlisted = code_bits.shape[0]

  def walk(position, stop_at, listing=True):
    """Walks lanes from ``position`` while ``stop_at(position)`` is false.

    Returns the final positions, the number of records each lane walked
    and, if ``listing``, the ``[max_per_chunk, lanes]`` positions it walked
    (then ``unlisted``, past every position). Lanes that stop stay stopped,
    so the lanes still walking have all walked ``row`` records.
    """
    def body(state):
      position, count, listed, row, _ = state
      active = ~stop_at(position)
      if listing:
        listed = listed.at[row].set(jnp.where(active, position, unlisted))
      position = jnp.where(active, step(position), position)
      return position, count + active, listed, row + 1, active.any()

    shape = (max_per_chunk,) + position.shape if listing else (0,)
    listed = jnp.full(shape, unlisted, jnp.int32)
    state = (position, jnp.zeros(position.shape, jnp.int32), listed, 0, jnp.array(True))
    position, count, listed, _, _ = jax.lax.while_loop(lambda state: state[4], body, state)
    return position, count, listed

  # The guess: each chunk walked from its first bit.
  guess_exit, guess_count, guessed = walk(chunk_start, lambda position: position >= chunk_stop)
  visited = jnp.zeros(code_bits.shape, bool).at[guessed].set(True, mode="drop")

  def joined_or_out(stop_at):
    return lambda position: (position >= stop_at) | visited[position]

  def guess_rank(position):
    """Index of each lane's position in its chunk's guessed walk."""
    return jax.vmap(jnp.searchsorted, in_axes=(1, 0))(guessed, position)

  # Every entry offset, walked until it joins the guess or leaves the chunk.
  entry = chunk_start[:, None] + jnp.arange(max_record, dtype=jnp.int32)[None, :]
  position, count, _ = walk(entry, joined_or_out(chunk_stop[:, None]), listing=False)
  joined = position < chunk_stop[:, None]
  exit_offset = jnp.where(joined, guess_exit[:, None], position) - chunk_end[:, None]
  exit_offset = jnp.clip(exit_offset, 0, max_record - 1)
  count = count + jnp.where(joined, guess_count[:, None] - guess_rank(position), 0)

  def enter(carry, chunk):
    """Carries the entry offset and first record index from chunk to chunk."""
    offset, first = carry
    exit_offsets, counts = chunk
    return (exit_offsets[offset], first + counts[offset]), (offset, first)

  (_, num_records), (entry_offset, first_record) = jax.lax.scan(
      enter, (jnp.int32(0), jnp.int32(0)), (exit_offset, count))

  # The true walk: its own records until it joins the guess, then the guess's.
  position, own_count, listed = walk(chunk_start + entry_offset, joined_or_out(chunk_stop))
  join_rank = guess_rank(position)
  record = jnp.arange(max_records, dtype=jnp.int32)
  chunk = jnp.searchsorted(first_record, record, side="right", method="scan_unrolled") - 1
  index = record - first_record[chunk]
  own = index < own_count[chunk]
  row = jnp.clip(jnp.where(own, index, index - own_count[chunk] + join_rank[chunk]),
                 0, max_per_chunk - 1)
  starts = jnp.where(own, listed[row, chunk], guessed[row, chunk])
  return jnp.where(record < num_records, starts, capacity)


@functools.partial(jax.jit, static_argnames=("size", "variant", "max_level"))
def decode(
    words: jax.Array,
    num_bits: jax.Array,
    size: int,
    *,
    variant: Variant,
    max_level: int = 127,
) -> tuple[jax.Array, jax.Array]:
  r"""Inverse of :func:`encode`: the levels and norm of an Elias bit string.

  The sparse string has no terminator: records are read up to ``num_bits``.
  Record starts are found in parallel (see the module docstring), so the
  work is proportional to the capacity of ``words``, not to ``num_bits``.

  Args:
    words: ``uint32`` words from :func:`encode` (any length that holds the
      string).
    num_bits: bits used, from :func:`encode`. A negative value (the overflow
      flag) decodes to all-zero levels.
    size: static number of coordinates :math:`n`.
    variant: ``"sparse"`` or ``"dense"``, as encoded.
    max_level: as encoded: it bounds a record's length, which the parallel
      parse needs.

  Returns:
    ``(levels, norm)``: ``int32[size]`` levels and the float32 norm, exactly
    as encoded.

  Examples:
    >>> import jax.numpy as jnp
    >>> from qsgd_jax import elias
    >>> levels = jnp.array([0, 3, 0, -1, 2])
    >>> words, num_bits = elias.encode(levels, 0.5, variant="sparse", max_level=3)
    >>> decoded, norm = elias.decode(words, num_bits, 5, variant="sparse", max_level=3)
    >>> decoded, norm
    (Array([ 0,  3,  0, -1,  2], dtype=int32), Array(0.5, dtype=float32))

  References:
    Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient
    Quantization and Encoding", 2017, Section 3.2.
  """
  _check_variant(variant)
  _check_max_level(max_level)
  words = jnp.asarray(words, jnp.uint32)
  if words.ndim != 1 or words.shape[0] < 1:
    raise ValueError(f"words must be a non-empty vector, got shape {words.shape}.")
  norm = jax.lax.bitcast_convert_type(words[0], jnp.float32)
  capacity = _WORD_BITS * words.shape[0]
  if size == 0 or capacity <= _NORM_BITS:
    return jnp.zeros((size,), jnp.int32), norm
  if capacity > _MAX_STRING_BITS:
    raise ValueError(f"{words.shape[0]} words is past the int32 bit positions.")
  max_record = _max_record_bits(size, max_level, variant)
  # Walks reach ``capacity + max_record``; codes are parsed up to 65 bits
  # past that, each reading 64 bits.
  num_positions = capacity + max_record + _MAX_CODE_BITS + 1
  padding = -(-(num_positions + 2 * _MAX_CODE_BITS) // _WORD_BITS) - words.shape[0] + 2
  padded = jnp.concatenate([words, jnp.zeros((padding,), jnp.uint32)])
  code_bits = _code_lengths(padded, num_positions)
  stop = jnp.clip(num_bits, 0, capacity)
  starts = _record_starts(code_bits, stop, capacity, variant, max_record, size)
  found = starts < capacity
  if variant == "dense":
    negative = _read(padded, starts)[0] >= jnp.uint32(2**31)
    code = _parse_omega(*_read(padded, starts + 1))[1]
    magnitude = (code - 1).astype(jnp.int32)
    levels = jnp.where(found, jnp.where(negative, -magnitude, magnitude), 0)
    return levels, norm
  gap_bits, gap = _parse_omega(*_read(padded, starts))
  negative = _read(padded, starts + gap_bits)[0] >= jnp.uint32(2**31)
  magnitude = _parse_omega(*_read(padded, starts + gap_bits + 1))[1].astype(jnp.int32)
  index = _prefix_sum(gap.astype(jnp.int32)) - 1
  index = jnp.where(found, index, size)
  levels = jnp.zeros((size,), jnp.int32).at[index].set(
      jnp.where(negative, -magnitude, magnitude), mode="drop")
  return levels, norm
