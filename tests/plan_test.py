"""Tests of the reduction plan (``_src/plan.py``): what it says is sent is what the HLO sends.

The plan decides, from static shapes, every collective a quantized reduction
issues; the compiled program is the truth about what goes on the wire. Each
case here compiles one reduction under ``jit(shard_map)`` on the 8 simulated
devices and compares the two lists collective by collective.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qsgd_jax
from qsgd_jax._src.collectives import exchange, layout, reduction
from qsgd_jax._src.collectives import plan as plan_lib

KEY = jax.random.key(0)
# Two leaves of one shape (one stacked block when buckets are not fixed), odd
# sizes that no piece length divides, and small leaves that go in float32.
_TREE = {
    "conv_a": (3, 3, 16, 32),
    "conv_b": (3, 3, 16, 32),
    "dense": (1001, 7),
    "bias": (32,),
    "scale": (7,),
}
_MIN_COMPRESSED = 1000

CASES = {
    "qsgd4_two_phase": (qsgd_jax.QSGD(bits=4), "two_phase", "batch"),
    "qsgd3_two_phase": (qsgd_jax.QSGD(bits=3, bucket_size=100), "two_phase", "batch"),
    "minmax8_unbucketed_two_phase": (qsgd_jax.MinMax(bits=8, bucket_size=None), "two_phase",
                                     "batch"),
    "onebit_two_phase": (qsgd_jax.OneBit(), "two_phase", "batch"),
    "bf16_two_phase": (qsgd_jax.Cast(jnp.bfloat16), "two_phase", "batch"),
    "qsgd4_psum": (qsgd_jax.QSGD(bits=4), "psum", "batch"),
    "qsgd4_all_gather": (qsgd_jax.QSGD(bits=4), "all_gather", "batch"),
    "onebit_rows_all_gather": (qsgd_jax.OneBit(bucket_size=None), "all_gather", "batch"),
    "minmax8_unbucketed_psum": (qsgd_jax.MinMax(bits=8, bucket_size=None), "psum", "batch"),
    "qsgd4_two_level_two_phase": (qsgd_jax.QSGD(bits=4), "two_phase", ("node", "local")),
    "onebit_rows_two_level_two_phase": (qsgd_jax.OneBit(bucket_size=None), "two_phase",
                                        ("node", "local")),
    "minmax8_two_level_psum": (qsgd_jax.MinMax(bits=8, bucket_size=512), "psum",
                               ("node", "local")),
}


def _mesh(axis_name):
  if isinstance(axis_name, tuple):
    return jax.make_mesh((2, 4), axis_name)
  return jax.make_mesh((8,), (axis_name,))


def _global_tree():
  rng = np.random.default_rng(0)
  return {name: rng.normal(size=(8, *shape)).astype(np.float32) for name, shape in _TREE.items()}


def _compiled_reduction(compressor, method, axis_name):
  mesh = _mesh(axis_name)
  spec = P(axis_name)

  def mean(tree):
    tree = jax.tree.map(lambda x: x[0], tree)
    return qsgd_jax.quantized_pmean(tree, axis_name, compressor, KEY, method=method,
                                    min_compressed_size=_MIN_COMPRESSED)

  tree = jax.device_put(_global_tree(), NamedSharding(mesh, spec))
  reduce = jax.jit(jax.shard_map(mean, mesh=mesh, in_specs=spec, out_specs=P()))
  return reduce.lower(tree).compile()


def _plan(compressor, method, axis_name):
  sizes = {"node": 2, "local": 4} if isinstance(axis_name, tuple) else {axis_name: 8}
  shapes = {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in _TREE.items()}
  return plan_lib.make_plan(shapes, axis_name, compressor, method=method,
                            min_compressed_size=_MIN_COMPRESSED, axis_sizes=sizes)


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_plan_lists_the_collectives_of_the_compiled_program(name):
  compressor, method, axis_name = CASES[name]
  planned = _plan(compressor, method, axis_name)
  text = _compiled_reduction(compressor, method, axis_name).as_text()
  as_planned = sorted((c.kind, c.result_bytes, c.group_size, c.bytes_sent)
                      for c in planned.collectives)
  as_compiled = sorted((c.kind, c.result_bytes, c.group_size, c.bytes_sent)
                       for c in qsgd_jax.collectives_in_hlo(text))
  assert as_planned == as_compiled
  assert planned.wire_bits == 8 * qsgd_jax.wire_bytes(text)


@pytest.mark.parametrize("method", ["two_phase", plan_lib.REDUCE_SCATTER])
def test_plan_lists_integer_leaves_and_the_reduce_scatter(method):
  """Integer leaves go by jax.lax's own collectives; the reduce-scatter, by one all-to-all."""
  mesh = _mesh("batch")
  rng = np.random.default_rng(0)
  tree = {"w": rng.normal(size=(8, 64, 300)).astype(np.float32),
          "v": rng.normal(size=(8, 16, 100)).astype(np.float32),
          "b": rng.normal(size=(8, 8, 5)).astype(np.float32),
          "steps": np.ones((8, 16, 3), np.int32)}
  compressor = qsgd_jax.QSGD(bits=4)

  def reduce(t):
    t = jax.tree.map(lambda x: x[0], t)
    if method == "two_phase":
      return qsgd_jax.quantized_psum(t, "batch", compressor, KEY, min_compressed_size=1000)
    return qsgd_jax.quantized_psum_scatter(t, "batch", compressor, KEY, tiled=True,
                                           min_compressed_size=1000)

  tree_on_mesh = jax.device_put(tree, NamedSharding(mesh, P("batch")))
  out_specs = P() if method == "two_phase" else P("batch")
  text = jax.jit(jax.shard_map(reduce, mesh=mesh, in_specs=P("batch"), out_specs=out_specs)
                 ).lower(tree_on_mesh).compile().as_text()
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), tree)
  planned = plan_lib.make_plan(shapes, "batch", compressor, method=method,
                               min_compressed_size=1000, axis_sizes={"batch": 8}, tiled=True)
  assert planned.integer == (1,) and planned.full_precision == (0,)
  as_planned = sorted((c.kind, c.result_bytes, c.group_size) for c in planned.collectives)
  as_compiled = sorted((c.kind, c.result_bytes, c.group_size)
                       for c in qsgd_jax.collectives_in_hlo(text))
  assert as_planned == as_compiled


def test_plan_decides_leaves_segments_and_blocks():
  planned = _plan(qsgd_jax.QSGD(bits=4, bucket_size=512), "two_phase", "batch")
  # Tree order is sorted keys: bias, conv_a, conv_b, dense, scale.
  assert planned.compressed == (1, 2, 3)
  assert planned.full_precision == (0, 4)
  # One segment: 4608 = 9 buckets twice, then 7007 padded to 14 buckets.
  (segment,) = planned.segments
  assert segment.leaves == (1, 2, 3) and segment.offsets == (0, 4608, 9216)
  assert segment.run == 512 and segment.length == segment.full_length == 16384
  # Padding paid once: 32 buckets cut into 8 pieces of 4 (per leaf: 2 + 2 + 2).
  assert planned.blocks == (plan_lib.Block((0,), 8, 2048, (4, 512)),)
  assert [s.shape for s in planned.local_error_shapes()] == [(16384,)]
  assert [s.shape for s in planned.owner_error_shapes()] == [(1, 4, 512)]

  whole = _plan(qsgd_jax.MinMax(bits=8, bucket_size=None), "two_phase", "batch")
  # One scale a leaf: a segment each; pieces of one width are stacked.
  assert [s.leaves for s in whole.segments] == [(1,), (2,), (3,)]
  assert [s.run for s in whole.segments] == [None, None, None]
  assert whole.blocks == (plan_lib.Block((0, 1), 8, 576, (576,)),
                          plan_lib.Block((2,), 8, 876, (876,)))

  rows = _plan(qsgd_jax.OneBit(bucket_size=None), "two_phase", "batch")
  # One bucket a row: leaves of one row length share a segment of whole rows.
  assert [(s.leaves, s.run) for s in rows.segments] == [((1, 2), 32), ((3,), 7)]
  assert [b.element_shape for b in rows.blocks] == [(36, 32), (126, 7)]  # 288 / 8, 1001 / 8

  two_level = _plan(qsgd_jax.QSGD(bits=4), "two_phase", ("node", "local"))
  assert two_level.outer_size == 2 and two_level.inner_size == 4
  # A quarter of the segment after the inner reduce-scatter, then halves.
  assert two_level.segments[0].length == 4096
  assert two_level.blocks[0].width == 2048


def test_residuals_have_the_shapes_the_plan_gives():
  compressor = qsgd_jax.OneBit()
  mesh = _mesh("batch")
  planned = _plan(compressor, "two_phase", "batch")

  def residuals(tree):
    tree = jax.tree.map(lambda x: x[0], tree)
    reduction_plan = plan_lib.make_plan(tree, "batch", compressor,
                                        min_compressed_size=_MIN_COMPRESSED)
    zeros = tuple(jnp.zeros(s.shape) for s in reduction_plan.owner_error_shapes())
    out = reduction.reduce(reduction_plan, tree, KEY, mean=True, want_local_error=True,
                           owner_error=zeros)
    return [e[None] for e in out.local_error], [e[None] for e in out.owner_error]

  tree = jax.device_put(_global_tree(), NamedSharding(mesh, P("batch")))
  local_error, owner_error = jax.jit(jax.shard_map(
      residuals, mesh=mesh, in_specs=P("batch"), out_specs=P("batch")))(tree)
  assert [e.shape[1:] for e in local_error] == [s.shape for s in planned.local_error_shapes()]
  assert [e.shape[1:] for e in owner_error] == [s.shape for s in planned.owner_error_shapes()]


def test_plans_are_cached_and_hashable():
  first = _plan(qsgd_jax.QSGD(bits=4), "two_phase", "batch")
  assert _plan(qsgd_jax.QSGD(bits=4), "two_phase", "batch") is first
  assert hash(first) == hash(_plan(qsgd_jax.QSGD(bits=4), "two_phase", "batch"))
  assert _plan(qsgd_jax.QSGD(bits=8), "two_phase", "batch") != first


def test_unknown_axis_size_is_an_error_only_where_it_matters():
  shapes = {"w": jax.ShapeDtypeStruct((8192,), jnp.float32)}
  unknown = plan_lib.make_plan(shapes, "batch", qsgd_jax.QSGD(), axis_sizes={},
                               owner="compressed_allreduce")
  # Worker residuals over one axis do not depend on its size...
  assert [s.shape for s in unknown.local_error_shapes()] == [(8192,)]
  # ...the owners' pieces do.
  with pytest.raises(ValueError, match=r"compressed_allreduce.*axis 'batch'.*axis_size="):
    unknown.owner_error_shapes()


@pytest.mark.parametrize("axis_name, error", [
    ((), ValueError), (3, TypeError), (("batch", 1), TypeError), ((None,), TypeError)])
def test_axis_names_are_checked(axis_name, error):
  shapes = {"w": jax.ShapeDtypeStruct((8192,), jnp.float32)}
  with pytest.raises(error, match="axis_name"):
    plan_lib.make_plan(shapes, axis_name, qsgd_jax.QSGD(), axis_sizes={})


# Executing the layout: segments and blocks, outside any mapped function.


def _leaves(*shapes, seed=0):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in shapes]


@functools.partial(jax.jit, static_argnums=0)
def _roundtrip_by_blocks(reduction_plan, leaves):
  """Each leaf after one batched encode and decode of the plan's blocks."""
  blocks = layout.join(reduction_plan, layout.segment_vectors(reduction_plan, leaves))
  payloads = exchange.encode_blocks(reduction_plan.compressor, KEY, blocks, batch_dims=2)
  decoded = exchange.decode_blocks(reduction_plan.compressor, payloads, batch_dims=2)
  return layout.segment_leaves(reduction_plan, layout.split(reduction_plan, decoded))


# The plan lays out buckets of 4 alike whatever the compressor: NearestZeroAlignedMinMax's
# blocks are OneBit's (its batched encode, compressors_test's _edge_cases under vmap).
@pytest.mark.parametrize(
    "compressor",
    [qsgd_jax.OneBit(bucket_size=4), qsgd_jax.OneBit(bucket_size=None),
     pytest.param(qsgd_jax.NearestZeroAlignedMinMax(bucket_size=4), marks=pytest.mark.slow)],
    ids=["buckets", "rows", "zero_aligned_buckets"])
def test_one_batched_encode_quantizes_each_leaf_as_alone(compressor):
  """Deterministic codes agree exactly: buckets (rows) never straddle leaves."""
  leaves = _leaves((7,), (3, 4), (13,), (2, 4), (5, 7), seed=1)
  reduction_plan = plan_lib.make_plan(leaves, "batch", compressor, method="all_gather",
                                      min_compressed_size=0, axis_sizes={"batch": 8})
  together = _roundtrip_by_blocks(reduction_plan, leaves)

  def alone(leaf):
    if compressor.bucket_size is None:
      return compressor.decode(compressor.encode(KEY, leaf))
    padded = jnp.pad(leaf.reshape(-1), (0, -leaf.size % compressor.bucket_size))
    return compressor.decode(compressor.encode(KEY, padded))[: leaf.size].reshape(leaf.shape)

  # Each leaf encoded on its own, in one program: compiling dominates.
  each_alone = jax.jit(lambda leaves: [alone(leaf) for leaf in leaves])(leaves)
  for i, leaf_alone in enumerate(each_alone):
    np.testing.assert_array_equal(together[i], leaf_alone)


@pytest.mark.parametrize("compressor, method", [
    (qsgd_jax.QSGD(bits=4, bucket_size=8), "two_phase"),
    (qsgd_jax.QSGD(bits=4, bucket_size=8), "psum"),
    (qsgd_jax.MinMax(bits=8, bucket_size=None), "two_phase"),
    (qsgd_jax.MinMax(bits=8, bucket_size=None), "psum"),
    (qsgd_jax.OneBit(bucket_size=None), "two_phase"),
], ids=["runs_two_phase", "runs_psum", "whole_two_phase", "whole_psum", "rows_two_phase"])
def test_split_inverts_join_and_leaves_invert_segments(compressor, method):
  leaves = _leaves((3, 5), (3, 8), (3, 5), (40,))
  reduction_plan = plan_lib.make_plan(leaves, "batch", compressor, method=method,
                                      min_compressed_size=0, axis_sizes={"batch": 8})

  @jax.jit  # One program, as the reductions run them: compiling dominates.
  def layouts(leaves):
    vectors = layout.segment_vectors(reduction_plan, leaves)
    blocks = layout.join(reduction_plan, vectors)
    return (vectors, blocks, layout.split(reduction_plan, blocks),
            layout.segment_leaves(reduction_plan, vectors))

  vectors, blocks, split, back = layouts(leaves)
  assert [v.size for v in vectors] == [s.length for s in reduction_plan.segments]
  for block, data in zip(reduction_plan.blocks, blocks, strict=True):
    assert data.shape == (len(block.segments), block.rows, *block.element_shape)
  for vector, vector_back in zip(vectors, split, strict=True):
    np.testing.assert_array_equal(vector_back, vector)
  for i, leaf in enumerate(leaves):
    np.testing.assert_array_equal(back[i], leaf)


def test_every_element_of_a_block_draws_its_own_rounding():
  compressor = qsgd_jax.QSGD(bits=2, bucket_size=None)
  same = _leaves((4096,)) * 2
  reduction_plan = plan_lib.make_plan(same, "batch", compressor, method="all_gather",
                                      min_compressed_size=0, axis_sizes={"batch": 8})
  (block,) = reduction_plan.blocks
  assert block.segments == (0, 1)  # Stacked: one encode for both.
  (payload,) = jax.jit(lambda leaves: exchange.encode_blocks(
      compressor, KEY, layout.join(reduction_plan, layout.segment_vectors(reduction_plan, leaves)),
      batch_dims=2))(same)
  assert not np.array_equal(payload.packed[0], payload.packed[1])


@pytest.mark.slow
@pytest.mark.parametrize("compressor", [
    qsgd_jax.QSGD(bits=4, bucket_size=8),
    qsgd_jax.QSGD(bits=3, bucket_size=5),
    qsgd_jax.MinMax(bits=8, bucket_size=None),
    qsgd_jax.OneBit(bucket_size=None),
], ids=["runs", "runs_not_whole_words", "whole", "rows"])
def test_block_parts_are_the_blocks_join_writes_out(compressor):
  """The two-phase sum reads the leaves in place: the same pieces, bit for bit, and so the
  same payloads as an encode of the written-out blocks."""
  leaves = _leaves((3, 5), (3, 8), (3, 5), (40,), (7, 8), seed=2)
  reduction_plan = plan_lib.make_plan(leaves, "batch", compressor, method="two_phase",
                                      min_compressed_size=0, axis_sizes={"batch": 8})

  @jax.jit  # One program: op by op, the many small slices would each compile.
  def both_ways(leaves):
    written = layout.join(reduction_plan, layout.segment_vectors(reduction_plan, leaves))
    parts = layout.block_parts(reduction_plan, layout.segment_parts(reduction_plan, leaves))
    materialized = [layout.materialize(p) for p in parts]
    pieces = [[layout.piece(p, jnp.int32(j)) for j in (0, 5, 7)] for p in parts]
    from_parts, rows = exchange.encode_block_parts(compressor, KEY, parts)
    from_written = exchange.encode_blocks(compressor, KEY, written, batch_dims=2)
    return written, materialized, pieces, from_parts, rows, from_written

  written, materialized, pieces, from_parts, rows, from_written = both_ways(leaves)
  for block, in_parts, block_pieces in zip(written, materialized, pieces, strict=True):
    np.testing.assert_array_equal(in_parts, block)
    for j, piece in zip((0, 5, 7), block_pieces, strict=True):
      np.testing.assert_array_equal(piece, block[:, j])
  np.testing.assert_array_equal(
      rows, jnp.concatenate([exchange.device_rows(p, 8) for p in from_parts], axis=1))
  for a, b in zip(jax.tree.leaves(from_parts), jax.tree.leaves(from_written), strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("compressor", [qsgd_jax.QSGD(bits=4), qsgd_jax.OneBit()],
                         ids=["qsgd4", "onebit"])
def test_two_phase_sum_of_leaves_in_place_is_that_of_written_segments(compressor,
                                                                       monkeypatch):
  """With nothing to add the two-phase sum encodes the leaves where they lie; adding a zero
  residual writes the segments out first. Results and payloads agree bit for bit."""
  mesh = _mesh("batch")
  shapes = {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in _TREE.items()}
  reduction_plan = plan_lib.make_plan(shapes, "batch", compressor,
                                      min_compressed_size=_MIN_COMPRESSED,
                                      axis_sizes={"batch": 8})
  assert not reduction._reads_leaves_in_place(reduction_plan, None)  # Too small to pay.
  monkeypatch.setattr(reduction, "IN_PLACE_MIN_ELEMENTS", 0)
  assert reduction._reads_leaves_in_place(reduction_plan, None)
  assert not reduction._reads_leaves_in_place(reduction_plan, ())  # A residual to add.
  zeros = tuple(jnp.zeros(s.shape, s.dtype) for s in reduction_plan.local_error_shapes())

  def both(tree):
    tree = jax.tree.map(lambda x: x[0], tree)
    in_place = reduction.reduce(reduction_plan, tree, KEY, mean=True)
    written = reduction.reduce(reduction_plan, tree, KEY, mean=True, local_error=zeros)
    return (in_place.tree, in_place.payloads), (written.tree, written.payloads)

  tree = jax.device_put(_global_tree(), NamedSharding(mesh, P("batch")))
  in_place, written = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=P("batch"),
                                            out_specs=P("batch")))(tree)
  for a, b in zip(jax.tree.leaves(in_place), jax.tree.leaves(written), strict=True):
    np.testing.assert_array_equal(a, b)
