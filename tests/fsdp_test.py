"""Tests of FSDP compressed both ways: quantized_all_gather, fsdp_gather, fsdp_shard.

Eight simulated CPU devices (``conftest.py``). The references are
``jax.lax.all_gather`` and ``jax.lax.psum_scatter`` in float32, and ZeRO++'s
weight quantizer in numpy (``references.py``).
"""

import doctest
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import references
from helpers import assert_replicas_identical
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qsgd_jax
from qsgd_jax._src.collectives import gather as gather_module
from qsgd_jax._src.collectives import plan as plan_lib
from qsgd_jax._src.compressors import nearest_abs_max
from qsgd_jax._src.fsdp import gather as fsdp_module
from qsgd_jax._src.fsdp import shards as fsdp_shards

AXIS = "batch"
NUM_DEVICES = 8
WEIGHTS = qsgd_jax.NearestAbsMax(bits=8, bucket_size=512)
MESH = jax.make_mesh((NUM_DEVICES,), (AXIS,))
NODES = jax.make_mesh((2, 4), ("node", "local"))
BOTH = ("node", "local")


def _hlo_collectives(lowered):
  """``(kind, group size, bytes sent)`` of each collective of a lowered program, as written
  (before XLA's CPU passes, which merge a rematerialized gather into the forward one)."""
  return [(c.kind, c.group_size, c.bytes_sent)
          for c in qsgd_jax.collectives_in_hlo(lowered.as_text(dialect="hlo"))]


def _planned(reduction_plan):
  return [(c.kind, c.group_size, c.bytes_sent) for c in reduction_plan.collectives]


# The weights' quantizer.


def test_nearest_abs_max_errs_half_a_step_where_zeropp_clips_a_whole_one():
  """Against ZeRO++'s qwZ in numpy: one symmetric grid scaled by the largest magnitude,
  rounded to nearest. DeepSpeed's step is max/128 and clips its largest positive value to
  code 127, a whole step off; here the step is max/127 and every value is within half."""
  group = np.random.default_rng(0).normal(size=2048).astype(np.float32)
  group[7] = 4.5  # The largest magnitude, positive.
  compressor = qsgd_jax.NearestAbsMax(bits=8, bucket_size=2048)
  ours = np.asarray(jax.jit(lambda g: compressor.decode(compressor.encode(None, g)))(group))
  codes, theirs = references.zeropp_symmetric_quantize(group)
  assert codes[7] == 127 and abs(theirs[7] - group[7]) == pytest.approx(4.5 / 128)
  assert np.max(np.abs(ours - group)) <= 4.5 / 254 * (1 + 1e-6)
  assert ours[7] == pytest.approx(group[7], rel=1e-6)  # Within an ulp or two.
  rest = np.arange(group.size) != 7
  assert np.max(np.abs(theirs - group)[rest]) <= 4.5 / 256 * (1 + 1e-6)


# quantized_all_gather.


def _shards():
  rng = np.random.default_rng(1)
  return {
      "w": rng.normal(size=(NUM_DEVICES, 64, 96)).astype(np.float32),
      "h": rng.normal(size=(NUM_DEVICES, 70, 80)).astype(jnp.bfloat16),
      "b": rng.normal(size=(NUM_DEVICES, 5)).astype(np.float32),
      "i": np.arange(NUM_DEVICES * 3).reshape(NUM_DEVICES, 3).astype(np.int32),
  }


def _both_gathers(tree):
  return {
      "tiled": qsgd_jax.quantized_all_gather(tree, AXIS, WEIGHTS),
      "stacked": qsgd_jax.quantized_all_gather(tree, AXIS, WEIGHTS, axis=1, tiled=False),
      "exact": jax.lax.all_gather(tree, AXIS, axis=1, tiled=False),
  }


@functools.cache
def _gathered():
  shards = _shards()
  gather = jax.pmap(_both_gathers, axis_name=AXIS)
  return shards, jax.tree.map(np.asarray, gather(shards)), gather.lower(shards)


def test_gather_is_lax_all_gather_within_half_a_step_and_bit_identical_everywhere():
  shards, out, _ = _gathered()
  assert_replicas_identical(out["tiled"])
  assert_replicas_identical(out["stacked"])
  for name in shards:
    exact = out["exact"][name]
    assert out["stacked"][name].shape == exact.shape and out["stacked"][name].dtype == exact.dtype
    np.testing.assert_array_equal(out["tiled"][name][0],
                                  np.concatenate(list(out["stacked"][name][0].swapaxes(0, 1))))
  for name in ("b", "i"):  # Sent as they are.
    np.testing.assert_array_equal(out["stacked"][name], out["exact"][name])
  # Every shard as WEIGHTS decodes it on its owner, alone (both leaves in one program).
  alone = jax.jit(lambda leaves: [jax.vmap(lambda x: WEIGHTS.decode(WEIGHTS.encode(None, x)))(
      leaf) for leaf in leaves])([shards[name].astype(np.float32) for name in ("w", "h")])
  for name, leaf_alone in zip(("w", "h"), alone, strict=True):
    np.testing.assert_array_equal(out["stacked"][name][0].swapaxes(0, 1),
                                  np.asarray(leaf_alone.astype(shards[name].dtype)))
  w = shards["w"].reshape(NUM_DEVICES, -1, 512).astype(np.float64)
  bound = np.abs(w).max(axis=2, keepdims=True) / 254 * (1 + 1e-6)  # Half a step a bucket.
  error = np.abs(out["stacked"]["w"][0].swapaxes(0, 1).reshape(w.shape) - w)
  assert np.all(error <= bound)


def test_gather_sends_bool_leaves_bit_for_bit():
  # A mask: one byte an element, as jax.lax.all_gather sends it, beside a compressed leaf.
  rng = np.random.default_rng(2)
  shards = {"mask": rng.random((NUM_DEVICES, 4099)) < 0.5,
            "flag": rng.random((NUM_DEVICES, 3)) < 0.5,
            "w": rng.normal(size=(NUM_DEVICES, 4096)).astype(np.float32)}
  out = jax.pmap(_both_gathers, axis_name=AXIS)(shards)
  for name in ("mask", "flag"):
    for form in ("tiled", "stacked"):
      assert out[form][name].dtype == np.bool_
    np.testing.assert_array_equal(out["stacked"][name], out["exact"][name])
    np.testing.assert_array_equal(out["tiled"][name][0], shards[name].reshape(-1))


def test_gather_wire_bytes_are_the_plans():
  shards, _, lowered = _gathered()
  one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), shards)
  planned = []
  for axis, tiled in ((0, True), (1, False)):
    planned += _planned(plan_lib.make_plan(
        one, AXIS, WEIGHTS, method=plan_lib.GATHER, axis_sizes={AXIS: NUM_DEVICES},
        scatter_dimension=axis, tiled=tiled))
  found = _hlo_collectives(lowered)
  assert found[:2] == planned  # Then jax.lax's own, four all-gathers.
  # "w" and "h" as 12 and 11 buckets of 8-bit codes and a float32 scale, then "b" and "i".
  words = 23 * 512 * 8 / 32 + 23 + 5 + 3
  assert found[0][2] == (NUM_DEVICES - 1) / NUM_DEVICES * NUM_DEVICES * 4 * words


def test_gather_over_two_axes_is_the_gather_over_their_devices():
  w = np.random.default_rng(2).normal(size=(NUM_DEVICES * 64, 96)).astype(np.float32)
  x = jax.device_put(w, NamedSharding(NODES, P(BOTH)))
  gather = jax.jit(jax.shard_map(lambda s: qsgd_jax.quantized_all_gather(s, BOTH, WEIGHTS),
                                 mesh=NODES, in_specs=P(BOTH), out_specs=P()))
  flat = jax.pmap(lambda s: qsgd_jax.quantized_all_gather(s, AXIS, WEIGHTS),
                  axis_name=AXIS)(w.reshape(NUM_DEVICES, 64, 96))
  np.testing.assert_array_equal(gather(x), flat[0])
  planned = plan_lib.make_plan(jax.ShapeDtypeStruct((64, 96), jnp.float32), BOTH, WEIGHTS,
                               method=plan_lib.GATHER, axis_sizes={"node": 2, "local": 4},
                               tiled=True)
  found = _hlo_collectives(gather.lower(x))
  assert found == _planned(planned) and [c[:2] for c in found] == [("all-gather", 2),
                                                                  ("all-gather", 4)]


# Leaves of odd sizes, from just over 1,024 elements (128 a device) to 70,000: flattened
# (FlatShard) or sharded by rows, so that each device's share is just past a bucket, or far
# from one, or under one.
ODD_SIZES = {"a": (1025,), "b": (8, 257), "c": (2049,), "d": (3, 1367), "e": (4097,),
             "f": (24, 683), "g": (5, 7, 331), "h": (16385,), "i": (33333,), "j": (69999,)}
ODD_THRESHOLD = 1024


def _odd_gather(shards, forward):
  """Each device's gathered copy of ``shards``, stacked along the axis."""
  params = qsgd_jax.fsdp_gather(shards, AXIS, forward=forward,
                                min_compressed_size=ODD_THRESHOLD)
  return jax.tree.map(lambda a: a[None], params)


@pytest.mark.slow
@pytest.mark.parametrize("bits, most", [(8, 8.5), (4, 4.5)])
def test_gather_sends_at_most_half_a_bit_more_a_coordinate_whatever_the_shape(bits, most):
  """Buckets of 2,048 padded a share of 1,024 (8,192 elements over 8 devices) to 2,048: 16
  bits a coordinate. Each share is now cut into buckets that fit it; and each leaf decodes
  as accurately as in buckets of 2,048, bit-identical on every device."""
  weights = qsgd_jax.NearestAbsMax(bits=bits)
  rng = np.random.default_rng(11)
  params = {name: rng.normal(size=shape).astype(np.float32) for name, shape in ODD_SIZES.items()}
  shards = qsgd_jax.fsdp_shard(params, MESH, AXIS, min_sharded_size=ODD_THRESHOLD)
  specs = jax.tree.map(lambda a: a.sharding.spec, shards)
  for name, shape in ODD_SIZES.items():
    one = jax.jit(jax.shard_map(functools.partial(_odd_gather, forward=weights), mesh=MESH,
                                in_specs=(specs[name],), out_specs=P(AXIS)))
    sent = [c for c in qsgd_jax.collectives_in_hlo(one.lower(shards[name]).compile().as_text())
            if c.kind == "all-gather"]
    size = math.prod(shape)
    assert len(sent) == 1
    assert 8 * sent[0].bytes_sent / ((NUM_DEVICES - 1) / NUM_DEVICES * size) <= most, name
  gather = jax.jit(jax.shard_map(functools.partial(_odd_gather, forward=weights), mesh=MESH,
                                 in_specs=(specs,), out_specs=P(AXIS)))
  out = jax.tree.map(np.asarray, gather(shards))
  assert_replicas_identical(out)
  in_buckets_of_2048 = jax.jit(jax.vmap(lambda v: weights.decode(weights.encode(None, v))))
  for name, value in params.items():
    share = -(-value.size // NUM_DEVICES)
    rows = np.pad(value.reshape(-1), (0, NUM_DEVICES * share - value.size))
    before = np.asarray(in_buckets_of_2048(rows.reshape(NUM_DEVICES, share)))
    before = before.reshape(-1)[:value.size]
    error = out[name][0].reshape(-1) - value.reshape(-1)
    assert np.max(np.abs(error)) <= np.abs(value).max() / (2 * weights.levels) * (1 + 1e-6)
    assert np.sqrt(np.mean(error**2)) <= 1.02 * np.sqrt(np.mean((before - value.reshape(-1))**2))


# fsdp_gather.


def _params():
  rng = np.random.default_rng(3)
  return {
      "w1": rng.normal(size=(64, 128)).astype(np.float32) / 8,  # Sharded along rows.
      "w2": rng.normal(size=(128, 40)).astype(np.float32) / 11,
      "odd": rng.normal(size=(9, 500)).astype(np.float32) / 3,  # 9 rows: a FlatShard.
      "b": rng.normal(size=(40,)).astype(np.float32),  # Small: replicated.
  }


def _local_loss(params, x):
  hidden = jnp.tanh(x @ params["w1"])
  out = hidden @ params["w2"] + params["b"] + (x[:, :9] @ params["odd"])[:, :40]
  return jnp.mean(out**2)


def _exact_shard_gradient(params, x):
  """The float32 FSDP gradient at ``params``: each device's own, ``psum_scatter``-ed (along
  rows, or flattened and padded for a FlatShard), and the replicated leaf's ``psum``."""
  grads = jax.grad(lambda p: _local_loss(p, x) / NUM_DEVICES)(qsgd_jax.as_varying(params, AXIS))
  out = {}
  for name, g in grads.items():
    if name == "b":
      out[name] = jax.lax.psum(g, AXIS)
    elif name == "odd":
      flat = jnp.pad(g.reshape(-1), (0, -g.size % NUM_DEVICES))
      out[name] = qsgd_jax.FlatShard(jax.lax.psum_scatter(flat, AXIS, tiled=True), g.shape)
    else:
      out[name] = jax.lax.psum_scatter(g, AXIS, tiled=True)
  return out


def _fsdp_loss(shards, x, **kwargs):
  params = qsgd_jax.fsdp_gather(shards, AXIS, min_compressed_size=4096, **kwargs)
  return jax.lax.pmean(_local_loss(params, x), AXIS), params


@functools.cache
def _gradients():
  """In one program: fsdp_gather's gradient without compression, with 8-bit weights and
  gradients, the float32 gradient at the weights those decoded to, and the weights."""
  shards = qsgd_jax.fsdp_shard(_params(), MESH, AXIS)
  specs = jax.tree.map(lambda a: a.sharding.spec, shards)
  x = np.random.default_rng(4).normal(size=(NUM_DEVICES * 4, 64)).astype(np.float32)
  x = jax.device_put(x, NamedSharding(MESH, P(AXIS)))

  @functools.partial(jax.shard_map, mesh=MESH, in_specs=(specs, P(AXIS)),
                     out_specs=(specs, specs, specs, P(AXIS)))
  def gradients(shards, x):
    identity = dict(forward=qsgd_jax.Identity(), backward=qsgd_jax.Identity())
    exact = jax.grad(lambda s: _fsdp_loss(s, x, **identity)[0])(shards)
    quantized = dict(backward=qsgd_jax.QSGD(bits=8), key=jax.random.key(5))
    compressed, decoded = jax.grad(lambda s: _fsdp_loss(s, x, **quantized), has_aux=True)(
        shards)
    at_decoded = _exact_shard_gradient(jax.lax.stop_gradient(decoded), x)
    # Each device's copy of the gathered weights, stacked along the axis.
    return exact, compressed, at_decoded, jax.tree.map(lambda a: a[None], decoded)

  return shards, x, jax.tree.map(np.asarray, jax.jit(gradients)(shards, x))


def _whole(tree):
  """A tree of global shard arrays (or FlatShards) as the whole parameters, in numpy."""
  def whole(leaf):
    if isinstance(leaf, qsgd_jax.FlatShard):
      return np.asarray(leaf.shard)[:math.prod(leaf.shape)].reshape(leaf.shape)
    return np.asarray(leaf)
  return jax.tree.map(whole, tree, is_leaf=lambda x: isinstance(x, qsgd_jax.FlatShard))


def test_fsdp_shard_lays_out_rows_flat_shards_and_replicated_leaves():
  shards = qsgd_jax.fsdp_shard(_params(), MESH, AXIS)
  assert shards["w1"].sharding.spec == P(AXIS) and shards["b"].sharding.spec == P()
  odd = shards["odd"]
  assert isinstance(odd, qsgd_jax.FlatShard) and odd.shape == (9, 500)
  assert odd.shard.shape == (NUM_DEVICES * 563,) and odd.shard.sharding.spec == P(AXIS)
  np.testing.assert_array_equal(np.asarray(odd.shard)[4500:], 0.0)
  jax.tree.map(np.testing.assert_array_equal, _whole(shards), _params())


class _HostLeaf:
  """A leaf on the host that hands out slices only: reading it whole is an error."""

  def __init__(self, value):
    self.value, self.reads = value, []

  shape = property(lambda self: self.value.shape)
  dtype = property(lambda self: self.value.dtype)

  def __getitem__(self, index):
    self.reads.append(self.value[index].size)
    return self.value[index]

  def __array__(self, *args, **kwargs):
    raise AssertionError("fsdp_shard read the whole leaf")


def test_fsdp_shard_gives_each_device_its_shard_and_builds_no_whole_leaf():
  params = _params()
  host = {"w1": _HostLeaf(params["w1"]), "odd": _HostLeaf(params["odd"].astype(np.float64))}
  shards = qsgd_jax.fsdp_shard(host, MESH, AXIS)
  assert shards["w1"].sharding.spec == P(AXIS) and shards["odd"].shard.dtype == np.float32
  np.testing.assert_array_equal(np.asarray(shards["w1"]), params["w1"])
  np.testing.assert_array_equal(_whole(shards)["odd"], params["odd"])
  # One read a device: its rows, or the rows that hold its part of the flattened leaf.
  assert host["w1"].reads == [64 * 128 // NUM_DEVICES] * NUM_DEVICES
  assert len(host["odd"].reads) == NUM_DEVICES and max(host["odd"].reads) <= 3 * 500
  # On devices: the same layout, by one program whose output is sharded.
  on_devices = qsgd_jax.fsdp_shard(jax.tree.map(jnp.asarray, params), MESH, AXIS)
  assert jax.tree.map(lambda a: a.sharding, on_devices) == jax.tree.map(
      lambda a: a.sharding, qsgd_jax.fsdp_shard(params, MESH, AXIS))
  jax.tree.map(np.testing.assert_array_equal, _whole(on_devices), params)


def test_a_flat_shard_under_the_gathers_threshold_is_an_error_naming_both_thresholds():
  """fsdp_shard's min_sharded_size and fsdp_gather's min_compressed_size are one threshold:
  a leaf sharded under the gather's would go in float32, unsaid."""
  shards = qsgd_jax.fsdp_shard({"odd": np.ones((9, 300), np.float32)}, MESH, AXIS,
                               min_sharded_size=1024)

  def gather(**kwargs):
    return jax.shard_map(lambda s: qsgd_jax.fsdp_gather(s, AXIS, **kwargs)["odd"][None],
                         mesh=MESH, out_specs=P(AXIS))

  with pytest.raises(ValueError, match=r"leaf \['odd'\] is a FlatShard of 2700 elements, "
                     r"under min_compressed_size=4096.*pass fsdp_gather the min_sharded_size"):
    _trace(gather(), shards)
  found = _hlo_collectives(_trace(gather(min_compressed_size=1024), shards))
  assert [c[0] for c in found] == ["all-gather"] and found[0][2] < 2700  # 8 bits, not 32.


@pytest.mark.slow
def test_uncompressed_gradient_is_float32_fsdp():
  shards, x, (exact, *_) = _gradients()
  params = _params()
  x = np.asarray(x)
  reference = jax.grad(lambda p: jnp.mean(jnp.stack([
      _local_loss(p, x[4 * d:4 * (d + 1)]) for d in range(NUM_DEVICES)])))(params)
  for name, g in _whole(exact).items():
    np.testing.assert_allclose(g, reference[name], rtol=2e-5, atol=1e-6, err_msg=name)
  np.testing.assert_array_equal(np.asarray(exact["odd"].shard)[4500:], 0.0)
  del shards


def test_gradient_is_the_reduce_scatter_of_the_float32_gradient_within_the_bound():
  """The float32 gradient at the decoded weights, reduce-scattered: 8-bit QSGD's within 2%;
  the padding of the FlatShard exactly zero; the replicated leaf's exact.

  Stochastic rounding errs at most half a step, RMS, a coordinate: a bucket's largest
  magnitude over 254, about 1/80 of its RMS for a bucket of 512 roughly Gaussian values.
  The 7 shards that cross the wire err independently, and the 8 devices' gradients
  differ, so their sum's error is about sqrt(7/8) / 80 of its norm: about 1.2%.
  """
  _, _, (_, compressed, at_decoded, _) = _gradients()
  for name in ("w1", "w2", "odd"):
    g, reference = _whole(compressed)[name], _whole(at_decoded)[name]
    assert np.linalg.norm(g - reference) / np.linalg.norm(reference) < 0.02, name
  np.testing.assert_array_equal(np.asarray(compressed["odd"].shard)[4500:], 0.0)
  np.testing.assert_allclose(compressed["b"], at_decoded["b"], rtol=1e-5)


def test_every_device_computes_with_the_same_weights_within_half_a_step():
  _, _, (*_, decoded) = _gradients()
  assert_replicas_identical(decoded)  # [device, ...] a leaf.
  for name, value in _params().items():
    if name == "b":
      np.testing.assert_array_equal(decoded[name][0], value)
      continue
    blocks = np.abs(value).max()  # A bucket's largest magnitude is at most the leaf's.
    assert np.max(np.abs(decoded[name][0] - value)) <= blocks / 254 * (1 + 1e-6), name


def test_gradient_under_pmap_is_float32_fsdp():
  """Under jax.pmap every leaf is a shard (nothing is typed replicated)."""
  w = np.random.default_rng(6).normal(size=(NUM_DEVICES, 8, 64)).astype(np.float32)
  x = np.random.default_rng(7).normal(size=(NUM_DEVICES, 4, 64)).astype(np.float32)

  def local(gather, shard, x):
    return jax.grad(lambda s: jnp.sum(jnp.tanh(x @ gather(s).T)))(shard)

  grads = jax.pmap(lambda s, x: (
      local(lambda s: qsgd_jax.fsdp_gather(s, AXIS, forward=qsgd_jax.Identity(),
                                           backward=qsgd_jax.Identity()), s, x),
      local(lambda s: jax.lax.all_gather(s, AXIS, tiled=True), s, x)), axis_name=AXIS)(w, x)
  np.testing.assert_allclose(grads[0], grads[1], atol=1e-5)


def _layers(gather, policy):
  """A scan over 3 layers, each gathering its weights inside a checkpoint."""
  def layer(x, w):
    return jnp.tanh(x @ gather(w)), None
  return jax.checkpoint(layer, policy=policy)


def _step_collectives(axis_name, mesh, policy=qsgd_jax.fsdp_remat_policy):
  spec = P(axis_name)
  w = jax.ShapeDtypeStruct((3, 512, 512), jnp.float32,
                           sharding=NamedSharding(mesh, P(None, axis_name)))
  x = jax.ShapeDtypeStruct((16, 512), jnp.float32, sharding=NamedSharding(mesh, spec))
  layer = _layers(lambda w: qsgd_jax.fsdp_gather(w, axis_name), policy)

  def grads(ws, x):
    return jax.grad(lambda ws: jax.lax.pmean(jnp.sum(jax.lax.scan(layer, x, ws)[0]),
                                             axis_name))(ws)

  step = jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=(P(None, axis_name), spec),
                               out_specs=P(None, axis_name)))
  return _hlo_collectives(step.lower(w, x))


def test_remat_gathers_again_in_the_backward_pass_and_bytes_are_the_plans():
  """A scan body: the forward gather, the backward's gather again, the reduce-scatter."""
  shard = jax.ShapeDtypeStruct((64, 512), jnp.float32)
  sizes = {AXIS: NUM_DEVICES}
  gather = _planned(plan_lib.make_plan(shard, AXIS, qsgd_jax.NearestAbsMax(),
                                       method=plan_lib.GATHER, axis_sizes=sizes, tiled=True))
  scatter = _planned(plan_lib.make_plan(
      jax.ShapeDtypeStruct((512, 512), jnp.float32), AXIS, qsgd_jax.QSGD(bits=4),
      method=plan_lib.REDUCE_SCATTER, axis_sizes=sizes, tiled=True))
  assert _step_collectives(AXIS, MESH) == gather + gather + scatter
  # Without the policy's secondary name, nothing is gathered again: autodiff keeps the
  # decoded weights (as JAX's tutorial policy, which saves all but all_gather, would).
  tutorial = _step_collectives(AXIS, MESH, lambda op, *_, **__: str(op) != "all_gather")
  assert tutorial == gather + scatter


def test_hpz_gathers_only_over_the_inner_axis_in_the_backward_pass():
  found = _step_collectives(BOTH, NODES)
  assert [c[:2] for c in found] == [
      ("all-gather", 2), ("all-gather", 4),  # Forward: over the nodes, then within each.
      ("all-gather", 4),  # Backward: within the node, from the secondary copy.
      ("reduce-scatter", 4), ("all-to-all", 2)]  # float32 within, quantized across.
  planned = plan_lib.make_plan(
      jax.ShapeDtypeStruct((512, 512), jnp.float32), BOTH, qsgd_jax.QSGD(bits=4),
      method=plan_lib.REDUCE_SCATTER, axis_sizes={"node": 2, "local": 4}, tiled=True)
  assert found[3:] == _planned(planned)
  # Across nodes: the forward's 8-bit gather and a quarter of the gradient at 4 bits.
  assert planned.outer_wire_bits / 8 == found[4][2]


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.relu(nn.Dense(200)(x))


class _Model(nn.Module):
  """Flax linen: each block's parameters gathered inside it (``nn.map_variables``), under
  ``nn.remat``."""

  gather: bool = True

  @nn.compact
  def __call__(self, x):
    def gather(variables):
      return qsgd_jax.fsdp_gather(variables, AXIS) if self.gather else variables

    for i in range(2):
      block = nn.remat(nn.map_variables(_Block, "params", trans_in_fn=gather, init=True),
                       policy=qsgd_jax.fsdp_remat_policy)
      x = block(name=f"block{i}")(x)
    return nn.Dense(10)(x)


@pytest.mark.slow
def test_flax_blocks_gather_their_parameters_under_nn_remat():
  params = _Model(gather=False).init(jax.random.key(0), jnp.zeros((1, 60)))["params"]
  shards = qsgd_jax.fsdp_shard(params, MESH, AXIS)  # 60 rows of block0: a FlatShard.
  assert isinstance(shards["block0"]["Dense_0"]["kernel"], qsgd_jax.FlatShard)

  def loss(shards, x):
    return jax.lax.pmean(jnp.mean(_Model().apply({"params": shards}, x) ** 2), AXIS)

  x = jax.ShapeDtypeStruct((64, 60), jnp.float32, sharding=NamedSharding(MESH, P(AXIS)))
  with jax.set_mesh(MESH):
    grads = jax.jit(jax.grad(jax.shard_map(loss, mesh=MESH, out_specs=P())))
    lowered = grads.lower(shards, x)
  found = [c[0] for c in _hlo_collectives(lowered)]
  # Two blocks gather forward, the second again backward; two gradients scattered.
  assert found.count("all-gather") == 3 and found.count("all-to-all") == 2
  assert jax.tree.structure(lowered.out_info) == jax.tree.structure(shards)


# Bad input.


def _trace(f, *args):
  return jax.jit(f).lower(*args)


def test_onebit_and_keyless_stochastic_compressors_are_refused_with_the_reason():
  w = jnp.zeros((NUM_DEVICES, 4096))
  with pytest.raises(ValueError, match="cannot be all-gathered.*error feedback"):
    jax.pmap(lambda s: qsgd_jax.fsdp_gather(s, AXIS, forward=qsgd_jax.OneBit()),
             axis_name=AXIS)(w)
  with pytest.raises(ValueError, match="backward.*cannot be all-gathered"):
    jax.pmap(lambda s: qsgd_jax.fsdp_gather(s, AXIS, backward=qsgd_jax.OneBit()),
             axis_name=AXIS)(w)
  with pytest.raises(ValueError, match="rounds stochastically and needs a key"):
    jax.pmap(lambda s: qsgd_jax.quantized_all_gather(s, AXIS, qsgd_jax.QSGD()),
             axis_name=AXIS)(w)


def test_a_flat_shard_of_another_mesh_and_an_unbound_axis_are_errors_naming_them():
  shards = qsgd_jax.fsdp_shard({"odd": jnp.ones((9, 500))},
                               jax.make_mesh((4,), (AXIS,), devices=jax.devices()[:4]), AXIS)
  local = qsgd_jax.FlatShard(jnp.zeros(NUM_DEVICES * 1125), shards["odd"].shape)
  sharded = jax.device_put(local.shard, NamedSharding(MESH, P(AXIS)))
  with pytest.raises(ValueError, match=r"leaf \['odd'\].*another mesh.*fsdp_shard"):
    _trace(jax.shard_map(lambda s: qsgd_jax.fsdp_gather({"odd": s}, AXIS)["odd"], mesh=MESH,
                         out_specs=P()),  # in_specs: the argument's sharding.
           qsgd_jax.FlatShard(sharded, (9, 500)))
  with pytest.raises(NameError, match="'model' is not bound"):
    jax.pmap(lambda s: qsgd_jax.fsdp_gather(s, "model"), axis_name=AXIS)(jnp.zeros((8, 4)))
  with pytest.raises(ValueError, match=r"leaf <root> varies over some of the axes"):
    _trace(jax.shard_map(lambda s: qsgd_jax.fsdp_gather(s, BOTH), mesh=NODES,
                         in_specs=P("node"), out_specs=P("node")),
           jax.device_put(jnp.zeros((8, 4)), NamedSharding(NODES, P("node"))))


@pytest.mark.parametrize("gather", ["lax", "fsdp_gather"])
def test_a_gradient_reduced_already_is_a_trace_time_error(gather):
  """JAX's tutorial differentiates through jax.lax.all_gather, whose derivative is a
  float32 psum_scatter; fsdp_gather's is the quantized one. Either way the gradient of
  the shards is reduced already, and reduce-scattering it again is an error."""
  gathers = {"lax": lambda w: jax.lax.all_gather(w, AXIS, tiled=True),
             "fsdp_gather": lambda w: qsgd_jax.fsdp_gather(w, AXIS)}
  layer = _layers(gathers[gather], qsgd_jax.fsdp_remat_policy)

  def step(ws, x):
    grads = jax.grad(lambda ws: jnp.sum(jax.lax.scan(layer, x, ws)[0]))(ws)
    return qsgd_jax.quantized_psum_scatter(grads, AXIS, qsgd_jax.QSGD(), 0,
                                           scatter_dimension=1, tiled=True)

  w = jax.ShapeDtypeStruct((3, 64, 64), jnp.float32, sharding=NamedSharding(MESH, P(None, AXIS)))
  x = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=NamedSharding(MESH, P(AXIS)))
  message = {"lax": "already summed over axis 'batch' by a reduce_scatter.*fsdp_gather",
             "fsdp_gather": "already the result of the library's quantized reduce-scatter"}
  with pytest.raises(ValueError, match=message[gather]):
    _trace(jax.shard_map(step, mesh=MESH, in_specs=(P(None, AXIS), P(AXIS)),
                         out_specs=P(None, AXIS)), w, x)


# Slow, as the other docstring examples (docs_test.py runs every public name's): each example
# compiles programs of its own for what the tests above check.
@pytest.mark.slow
@pytest.mark.parametrize("module", [nearest_abs_max, gather_module, fsdp_module, fsdp_shards])
def test_docstring_examples(module):
  result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0
