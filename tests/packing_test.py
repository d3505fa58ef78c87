"""Tests of bit packing: the documented layout, bit for bit, and round trips.

The layout is checked against a pure-Python reference that builds the bit
string literally: code ``i`` fills bits ``[i * b, (i + 1) * b)``, and bit ``j``
of the string is bit ``j % 32`` of word ``j // 32``. Compiling dominates the
run time, so each width compiles one program (for a fixed length) that all
its hypothesis examples reuse.
"""

import functools

import hypothesis
import jax
import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from qsgd_jax._src.compressors import packing

# Three full groups of 32 codes and a partial fourth: whole words, a partial
# last word, and (for widths that do not divide 32) codes spanning two words.
LENGTH = 100
WIDTHS = tuple(range(1, 33))


def _reference_pack(codes, num_bits: int) -> np.ndarray:
  """The documented layout, one bit at a time."""
  bit_string = [(int(code) >> j) & 1 for code in codes for j in range(num_bits)]
  words = [
      sum(bit << j for j, bit in enumerate(bit_string[start : start + 32]))
      for start in range(0, len(bit_string), 32)
  ]
  return np.array(words, dtype=np.uint32)


@functools.cache
def _pack_and_round_trip(num_codes: int, num_bits: int):
  """One compiled program a shape: the packed words and their unpacking."""

  def run(codes):
    words = packing.pack(codes, num_bits)
    return words, packing.unpack(words, num_codes, num_bits)

  return jax.jit(run)


def _codes(num_bits: int, length: int = LENGTH):
  return hnp.arrays(np.uint32, length, elements=st.integers(0, 2**num_bits - 1))


@pytest.mark.slow
@hypothesis.settings(max_examples=1000, deadline=None, derandomize=True)
@hypothesis.given(data=st.data(), num_bits=st.sampled_from(WIDTHS))
def test_pack_matches_reference_layout_and_round_trips(data, num_bits):
  codes = data.draw(_codes(num_bits), label="codes")
  words, unpacked = _pack_and_round_trip(LENGTH, num_bits)(codes)
  assert words.dtype == np.uint32 and unpacked.dtype == np.uint32
  np.testing.assert_array_equal(np.asarray(words), _reference_pack(codes, num_bits))
  np.testing.assert_array_equal(np.asarray(unpacked), codes)


@pytest.mark.parametrize("num_bits", [1, 3, 8, 13, 32])
@pytest.mark.parametrize("num_codes", [0, 1, 31, 33])
def test_lengths_at_group_edges(num_codes, num_bits):
  codes = np.random.default_rng(num_bits).integers(0, 2**num_bits, num_codes, dtype=np.uint64)
  codes = codes.astype(np.uint32)
  words, unpacked = _pack_and_round_trip(num_codes, num_bits)(codes)
  assert words.shape == (packing.num_words(num_codes, num_bits),)
  assert words.shape == (-(-num_codes * num_bits // 32),)
  np.testing.assert_array_equal(np.asarray(words), _reference_pack(codes, num_bits))
  np.testing.assert_array_equal(np.asarray(unpacked), codes)


@pytest.mark.parametrize("num_bits", [1, 4, 7, 32])
def test_all_ones_fill_exactly_the_needed_bits(num_bits):
  # n * b bits set, then zero padding to the end of the last word.
  codes = np.full(LENGTH, 2**num_bits - 1, np.uint32)
  words, _ = _pack_and_round_trip(LENGTH, num_bits)(codes)
  total_bits = LENGTH * num_bits
  set_bits = sum(bin(int(word)).count("1") for word in np.asarray(words))
  assert set_bits == total_bits
  assert len(words) * 32 - total_bits < 32


def test_rejects_bad_arguments():
  with pytest.raises(ValueError, match="num_bits"):
    packing.pack(np.zeros(4, np.uint32), 0)
  with pytest.raises(ValueError, match="num_bits"):
    packing.pack(np.zeros(4, np.uint32), 33)
  with pytest.raises(ValueError, match="vector"):
    packing.pack(np.zeros((2, 2), np.uint32), 4)
  with pytest.raises(ValueError, match="expects 2 words"):
    packing.unpack(np.zeros(3, np.uint32), 16, 4)
