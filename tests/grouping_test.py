"""Tests of laying leaves side by side for one encode (``_src/grouping.py``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qsgd_jax
from qsgd_jax._src import grouping


@pytest.mark.parametrize(
    "compressor, expected",
    [(qsgd_jax.QSGD(bits=4, bucket_size=8), [[0, 1, 2]]),
     (qsgd_jax.OneBit(bucket_size=8), [[0, 1, 2]]),
     (qsgd_jax.QSGD(bits=4, bucket_size=None), [[0], [1], [2]]),
     (qsgd_jax.MinMax(bits=8), [[0], [1], [2]]),
     (qsgd_jax.Cast(jnp.bfloat16), [[0], [1], [2]])],
    ids=["qsgd_buckets", "onebit_buckets", "qsgd_one_bucket", "minmax_one_bucket", "cast"],
)
def test_only_fixed_size_buckets_are_grouped(compressor, expected):
  assert grouping.groups(compressor, 3) == expected


def test_aligned_len_rounds_up_to_whole_buckets():
  compressor = qsgd_jax.QSGD(bits=4, bucket_size=8)
  assert [grouping.aligned_len(compressor, s) for s in (1, 8, 9, 16)] == [8, 8, 16, 16]
  assert grouping.aligned_len(qsgd_jax.MinMax(), 9) == 9


def test_split_inverts_join_on_the_last_axis():
  rng = np.random.default_rng(0)
  arrays = [jnp.asarray(rng.normal(size=(3, m)), jnp.float32) for m in (5, 8, 2)]
  lengths = [8, 8, 4]
  index_groups = [[0, 2], [1]]
  blocks = grouping.join(arrays, index_groups, lengths)
  assert [b.shape for b in blocks] == [(3, 12), (3, 8)]
  for array, part, length in zip(
      arrays, grouping.split(blocks, index_groups, lengths), lengths, strict=True):
    assert part.shape == (3, length)
    np.testing.assert_array_equal(part[:, : array.shape[1]], array)
    np.testing.assert_array_equal(part[:, array.shape[1]:], 0.0)


def test_one_encode_of_the_group_quantizes_each_leaf_as_alone():
  """Buckets never straddle leaves: deterministic 1-bit codes agree exactly."""
  compressor = qsgd_jax.OneBit(bucket_size=4)
  rng = np.random.default_rng(1)
  vectors = [jnp.asarray(rng.normal(size=(m,)), jnp.float32) for m in (7, 4, 13)]
  lengths = [grouping.aligned_len(compressor, v.size) for v in vectors]
  index_groups = grouping.groups(compressor, len(vectors))
  key = jax.random.key(0)
  (block,) = grouping.join(vectors, index_groups, lengths)
  together = grouping.split([compressor.decode(compressor.encode(key, block))],
                            index_groups, lengths)
  for vector, part, length in zip(vectors, together, lengths, strict=True):
    alone = compressor.decode(compressor.encode(key, jnp.pad(vector, (0, length - vector.size))))
    np.testing.assert_array_equal(part, alone)
