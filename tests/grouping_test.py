"""Tests of batching leaves into blocks for a few encodes (``_src/grouping.py``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qsgd_jax
from qsgd_jax._src import grouping

KEY = jax.random.key(0)


def _arrays(*shapes, dtype=np.float32, seed=0):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.normal(size=shape), dtype) for shape in shapes]


@pytest.mark.parametrize(
    "compressor", [qsgd_jax.QSGD(bits=4, bucket_size=8), qsgd_jax.OneBit(bucket_size=8)],
    ids=["qsgd", "onebit"],
)
def test_fixed_buckets_lay_every_array_side_by_side_in_whole_buckets(compressor):
  layout = grouping.layout(compressor, _arrays((3, 1), (3, 8), (3, 9)))
  assert layout.side_by_side
  assert layout.groups == ((0, 1, 2),)
  assert layout.lengths == (8, 8, 16)
  assert layout.block_sizes() == [(1, 32)]


@pytest.mark.parametrize(
    "compressor",
    [qsgd_jax.QSGD(bits=4, bucket_size=None), qsgd_jax.MinMax(bits=8, bucket_size=None),
     qsgd_jax.Cast(jnp.bfloat16)],
    ids=["qsgd_one_bucket", "minmax_one_bucket", "cast"],
)
def test_other_compressors_stack_arrays_of_one_shape_and_dtype(compressor):
  arrays = [*_arrays((4,), (6,), (4,)), jnp.zeros((4,), jnp.bfloat16)]
  layout = grouping.layout(compressor, arrays)
  assert not layout.side_by_side
  assert layout.groups == ((0, 2), (1,), (3,))
  assert layout.block_sizes() == [(2, 4), (1, 6), (1, 4)]


@pytest.mark.parametrize(
    "compressor",
    [qsgd_jax.QSGD(bits=4, bucket_size=8), qsgd_jax.MinMax(bits=8, bucket_size=None)],
    ids=["side_by_side", "stacked"],
)
def test_split_inverts_join(compressor):
  arrays = _arrays((3, 5), (3, 8), (3, 5))
  layout = grouping.layout(compressor, arrays)
  blocks = layout.join(arrays)
  assert [b.shape[0] for b in blocks] == [batch for batch, _ in layout.block_sizes()]
  for array, part in zip(arrays, layout.split(blocks), strict=True):
    np.testing.assert_array_equal(part[:, : array.shape[1]], array)
    np.testing.assert_array_equal(part[:, array.shape[1]:], 0.0)


@pytest.mark.parametrize(
    "compressor",
    [qsgd_jax.OneBit(bucket_size=4), qsgd_jax.OneBit(bucket_size=None)],
    ids=["side_by_side", "stacked"],
)
def test_one_batched_encode_quantizes_each_array_as_alone(compressor):
  """Deterministic 1-bit codes agree exactly: buckets never straddle arrays."""
  vectors = _arrays((7,), (4,), (13,), (7,), seed=1)
  layout = grouping.layout(compressor, vectors)
  payloads = grouping.encode_blocks(compressor, KEY, layout.join(vectors))
  together = layout.split(grouping.decode_blocks(compressor, payloads))
  for vector, part, length in zip(vectors, together, layout.lengths, strict=True):
    alone = compressor.decode(compressor.encode(KEY, jnp.pad(vector, (0, length - vector.size))))
    np.testing.assert_array_equal(part, alone)


def test_every_element_of_a_block_draws_its_own_rounding():
  compressor = qsgd_jax.QSGD(bits=2, bucket_size=None)
  same = _arrays((4096,)) * 2
  layout = grouping.layout(compressor, same)
  (payload,) = grouping.encode_blocks(compressor, KEY, layout.join(same))
  assert not np.array_equal(payload.packed[0], payload.packed[1])
