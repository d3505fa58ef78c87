"""Tests of quantized_psum / quantized_pmean and of reading wire bytes from HLO.

Eight simulated CPU devices (``conftest.py``). Compiling dominates the run
time, so each compiled program serves several tests: one ``pmap`` computes
every compressor's mean of the same tree, one computes statistics over many
keys for the unbiasedness and independence tests, and so on.
"""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qsgd_jax
from qsgd_jax._src.collectives import plan, reduction

AXIS = "batch"
NUM_DEVICES = 8
KEY = jax.random.key(0)

# name: (compressor, method, bound on ||result - mean|| / ||mean|| for normal inputs).
# QSGD's bounds follow from its variance, at most (scale / s)^2 / 4 a coordinate
# and a quantization: about 0.33 for 4 bits (s = 7) and two quantizations.
VARIANTS = {
    "qsgd4_two_phase": (qsgd_jax.QSGD(bits=4), "two_phase", 0.35),
    "qsgd4_psum": (qsgd_jax.QSGD(bits=4), "psum", 0.3),
    "qsgd4_all_gather": (qsgd_jax.QSGD(bits=4), "all_gather", 0.2),
    "qsgd8_two_phase": (qsgd_jax.QSGD(bits=8), "two_phase", 0.02),
    "qsgd8_psum": (qsgd_jax.QSGD(bits=8), "psum", 0.02),
    "minmax8_two_phase": (qsgd_jax.MinMax(bits=8), "two_phase", 0.02),
    "minmax8_psum": (qsgd_jax.MinMax(bits=8), "psum", 0.02),
    "onebit_two_phase": (qsgd_jax.OneBit(), "two_phase", 1.0),
    "identity_two_phase": (qsgd_jax.Identity(), "two_phase", 1e-6),
    "cast_bf16_two_phase": (qsgd_jax.Cast(jnp.bfloat16), "two_phase", 5e-3),
}
# OneBit is biased (it needs error feedback): its bound only says it correlates
# with the mean; test_deterministic_two_phase_matches_reference pins it exactly.


def _rows(tree):
  """Host copies of a pmapped tree: leaf[d] is device d's value."""
  return jax.tree.map(np.asarray, jax.block_until_ready(tree))


def _relative_error(value, exact):
  value, exact = np.asarray(value, np.float64), np.asarray(exact, np.float64)
  return np.linalg.norm(value - exact) / np.linalg.norm(exact)


def _assert_rows_identical(tree):
  """Every device of a pmapped tree holds bit for bit the same leaves."""
  for leaf in jax.tree.leaves(tree):
    for row in leaf[1:]:
      np.testing.assert_array_equal(row, leaf[0])


def _exact_mean(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64).mean(axis=0), tree)


def _piece_len(compressor, size, num_pieces):
  """Elements of a device's piece of a leaf: whole buckets, or one bucket."""
  per_device = -(-size // num_pieces)
  bucket = getattr(compressor, "bucket_size", None)
  return per_device if bucket is None else -(-per_device // bucket) * bucket


def _collectives(hlo_text):
  return [(c.kind, c.result_type.lstrip("(").split("[")[0], c.group_size)
          for c in qsgd_jax.collectives_in_hlo(hlo_text)]


# One program, every compressor, a large leaf whose size 8 does not divide and
# a small one that goes in full precision.


def _normal_tree(poison=None):
  rng = np.random.default_rng(0)
  tree = {
      "kernel": rng.normal(size=(NUM_DEVICES, 10007)).astype(np.float32),
      "bias": rng.normal(size=(NUM_DEVICES, 100)).astype(np.float32),
  }
  if poison is not None:
    tree[poison][3, 17] = np.nan
  return tree


# QSGD at 8 bits takes the paths of QSGD at 4 bits (bits that divide 32, the same buckets):
# its tighter bounds run in the slow tier, from a program of their own, which leaves the
# program every fast test reads smaller.
_SLOW_VARIANTS = ("qsgd8_two_phase", "qsgd8_psum")
_VARIANT_PARAMS = [pytest.param(name, marks=pytest.mark.slow) if name in _SLOW_VARIANTS else name
                   for name in VARIANTS]


@functools.cache  # Called with its argument always: one program a tier.
def _every_variant_fn(slow):
  """The fast tier's variants (and a sum), or with ``slow`` the slow tier's, in one program."""
  names = [name for name in VARIANTS if (name in _SLOW_VARIANTS) == slow]

  def mean_of_each(tree, key):
    out = {}
    for name in names:
      compressor, method, _ = VARIANTS[name]
      out[name] = qsgd_jax.quantized_pmean(tree, AXIS, compressor, key, method=method)
    if not slow:
      out["minmax8_two_phase_sum"] = qsgd_jax.quantized_psum(tree, AXIS, qsgd_jax.MinMax(), key)
    return out

  mean_of_each.__name__ += "_slow" if slow else "_fast"  # Each tier's traces counted apart.
  return jax.pmap(chex.assert_max_traces(mean_of_each, n=1), axis_name=AXIS, in_axes=(0, None))


@functools.cache  # Called with both arguments always.
def _every_variant(poison, slow):
  return _rows(_every_variant_fn(slow)(_normal_tree(poison), KEY))


def _variant(name, poison=None):
  """``name``'s pmapped result, from the program of its tier."""
  return _every_variant(poison, name in _SLOW_VARIANTS)[name]


@pytest.mark.parametrize("name", _VARIANT_PARAMS)
def test_pmap_result_is_identical_on_every_device(name):
  _assert_rows_identical(_variant(name))


@pytest.mark.parametrize("name", _VARIANT_PARAMS)
def test_pmap_result_is_close_to_exact_mean(name):
  exact = _exact_mean(_normal_tree())
  result = _variant(name)
  assert _relative_error(result["kernel"][0], exact["kernel"]) < VARIANTS[name][2]
  # The small leaf is summed in float32: exact up to float rounding.
  np.testing.assert_allclose(result["bias"][0], exact["bias"], rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_equal_shapes_and_dtypes(
      jax.tree.map(lambda x: x[0], result), jax.tree.map(lambda x: x[0], _normal_tree())
  )


def test_psum_is_the_sum():
  tree = _normal_tree()
  total = _every_variant(None, False)["minmax8_two_phase_sum"]
  _assert_rows_identical(total)
  exact = jax.tree.map(lambda x: np.asarray(x, np.float64).sum(axis=0), tree)
  assert _relative_error(total["kernel"][0], exact["kernel"]) < VARIANTS["minmax8_two_phase"][2]
  np.testing.assert_allclose(total["bias"][0], exact["bias"], rtol=1e-5, atol=1e-5)


def test_second_call_with_new_key_and_values_does_not_retrace():
  _every_variant(None, False)
  jax.block_until_ready(_every_variant_fn(False)(_normal_tree(), jax.random.key(1)))


def test_deterministic_two_phase_matches_reference():
  """OneBit's two-phase mean equals a direct re-enactment of the two phases.

  Device ``d`` pads the leaf to whole buckets, cuts it into 8 pieces of whole
  buckets and encodes each; owner ``j`` adds the 7 decoded pieces ``j`` it
  received and its own piece ``j`` as it is, divides by 8 and re-encodes the
  average; everyone decodes every owner's piece.
  """
  compressor = qsgd_jax.OneBit()
  x = _normal_tree()["kernel"]
  size = x.shape[1]
  buckets = -(-size // compressor.bucket_size)
  length = -(-buckets // NUM_DEVICES) * compressor.bucket_size
  pieces = np.zeros((NUM_DEVICES, NUM_DEVICES * length), np.float32)
  pieces[:, :size] = x
  pieces = pieces.reshape(NUM_DEVICES, NUM_DEVICES, length)

  roundtrip = jax.jit(jax.vmap(lambda v: compressor.decode(compressor.encode(KEY, v))))
  sent = np.array(roundtrip(pieces.reshape(-1, length))).reshape(pieces.shape)
  own = np.arange(NUM_DEVICES)
  sent[own, own] = pieces[own, own]
  owned = sent.sum(axis=0) / NUM_DEVICES
  reference = np.asarray(roundtrip(owned)).reshape(-1)[:size]

  result = _variant("onebit_two_phase")["kernel"][0]
  np.testing.assert_allclose(result, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", _VARIANT_PARAMS)
@pytest.mark.parametrize("poison", ["kernel", "bias"])
def test_nan_on_one_device_makes_that_leaf_non_finite_everywhere(name, poison):
  result = _variant(name, poison)
  clean = "bias" if poison == "kernel" else "kernel"
  for device in range(NUM_DEVICES):
    assert not np.all(np.isfinite(result[poison][device])), f"device {device}"
  assert np.all(np.isfinite(result[clean]))


# Shard_map: the result is typed as replicated and agrees on every shard.


def test_shard_map_result_is_replicated_and_close():
  mesh = jax.make_mesh((NUM_DEVICES,), (AXIS,))
  compressor = qsgd_jax.QSGD(bits=4)

  def mean(tree):
    tree = jax.tree.map(lambda x: x[0], tree)
    return {method: qsgd_jax.quantized_pmean(tree, AXIS, compressor, KEY, method=method)
            for method in ("two_phase", "psum")}

  reduce = jax.jit(jax.shard_map(mean, mesh=mesh, in_specs=P(AXIS), out_specs=P()))
  tree = _normal_tree()
  out = jax.block_until_ready(reduce(jax.device_put(tree, NamedSharding(mesh, P(AXIS)))))
  exact = _exact_mean(tree)
  for method, result in out.items():
    for name, leaf in result.items():
      assert leaf.sharding.is_fully_replicated
      shards = [np.asarray(shard.data) for shard in leaf.addressable_shards]
      assert len(shards) == NUM_DEVICES
      _assert_rows_identical(np.stack(shards))
      bound = VARIANTS[f"qsgd4_{method}"][2] if name == "kernel" else 1e-6
      assert _relative_error(shards[0], exact[name]) < bound, (method, name)


# Statistics over many keys (vmap over keys inside pmap).

_NUM_KEYS = 256
_STAT_SIZE = 4096  # 8 pieces of one 512-bucket: both methods bucket the leaf alike.
_STAT_VARIANTS = {
    "qsgd4_two_phase": (qsgd_jax.QSGD(bits=4), "two_phase"),
    "qsgd4_psum": (qsgd_jax.QSGD(bits=4), "psum"),
    "minmax8_two_phase": (qsgd_jax.MinMax(bits=8, bucket_size=512), "two_phase"),
    "minmax8_psum": (qsgd_jax.MinMax(bits=8, bucket_size=512), "psum"),
    "qsgd4_all_gather": (qsgd_jax.QSGD(bits=4), "all_gather"),
}
# The two-phase reduction encodes, sums and re-encodes whatever the compressor: QSGD's checks
# its unbiasedness, and MinMax's own is compressors_test's (the psum method decodes MinMax's
# sum of codes its own way: it stays). MinMax's two-phase one runs in the slow tier, from a
# program of its own.
_SLOW_STAT_VARIANTS = ("minmax8_two_phase",)


def _stat_input(same_on_every_device):
  rng = np.random.default_rng(1)
  rows = 1 if same_on_every_device else NUM_DEVICES
  x = rng.normal(size=(rows, _STAT_SIZE)) + np.linspace(-1.0, 2.0, rows)[:, None]
  return np.broadcast_to(x, (NUM_DEVICES, _STAT_SIZE)).astype(np.float32)


def _stat_keys():
  return jax.random.split(jax.random.key(7), _NUM_KEYS)


@functools.cache  # Called with its argument always: one program a tier.
def _key_statistics_fn(slow):
  """The fast tier's variants, or with ``slow`` the slow tier's, in one program."""
  names = [name for name in _STAT_VARIANTS if (name in _SLOW_STAT_VARIANTS) == slow]

  def statistics(x, keys):
    out = {}
    for name in names:
      compressor, method = _STAT_VARIANTS[name]
      samples = jax.vmap(lambda key, c=compressor, m=method: qsgd_jax.quantized_pmean(
          x, AXIS, c, key, method=m, min_compressed_size=0))(keys)
      out[name] = (jnp.mean(samples, axis=0), jnp.var(samples, axis=0, ddof=1))
    return out

  return jax.pmap(statistics, axis_name=AXIS, in_axes=(0, None))


@functools.cache  # Called with both arguments always.
def _key_statistics(same_on_every_device, slow):
  """For each variant of a tier, the mean and variance over keys of the pmean, per coordinate."""
  return _rows(_key_statistics_fn(slow)(_stat_input(same_on_every_device), _stat_keys()))


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.slow) if name in _SLOW_STAT_VARIANTS else name
    for name in _STAT_VARIANTS])
def test_unbiased_over_keys(name):
  mean, variance = (v[0] for v in _key_statistics(False, name in _SLOW_STAT_VARIANTS)[name])
  exact = _stat_input(False).astype(np.float64).mean(axis=0)
  standard_error = np.sqrt(variance / _NUM_KEYS)
  assert np.all(standard_error > 0)
  z = (mean - exact) / standard_error
  assert np.max(np.abs(z)) < 5.0
  assert abs(np.mean(z)) < 5.0 / np.sqrt(z.size)


@functools.cache
def _single_device_variance(compressor):
  """Mean over coordinates of one device's quantization variance of the input row."""
  x = _stat_input(True)[0]
  samples = jax.jit(jax.vmap(lambda key: compressor.decode(compressor.encode(key, x))))(
      _stat_keys())
  return float(np.mean(np.var(np.asarray(samples, np.float64), axis=0, ddof=1)))


@pytest.mark.parametrize("name", ["qsgd4_psum", "minmax8_psum", "qsgd4_all_gather"])
def test_one_rounding_methods_average_independent_errors(name):
  """Identical inputs on every device: the mean averages 8 independent errors.

  Its variance is then 1/8 of one device's quantization variance (for the
  all-gather method, the QSGD paper's: Lemma 3.1's bound over n); a draw
  shared by the devices would leave all of it.
  """
  compressor, _ = _STAT_VARIANTS[name]
  _, variance = (v[0] for v in _key_statistics(True, False)[name])
  ratio = np.mean(variance) / _single_device_variance(compressor)
  assert 0.8 / NUM_DEVICES < ratio < 1.25 / NUM_DEVICES


def test_devices_draw_independently_two_phase_first_phase():
  """Identical inputs: the errors of what the devices send are uncorrelated.

  The final two-phase result cannot tell: averaging 8 roundings of a value
  on the grid and re-rounding the average on the same grid is, in law, one
  rounding, whether the 8 draws are shared or not. So this reads each
  device's first-phase error: the variance of their average is 1/8 of theirs
  when independent, all of it when shared.
  """
  x = _stat_input(True)

  def first_phase_errors(x):
    errors = {}
    for name, (compressor, method) in _STAT_VARIANTS.items():
      if method == "two_phase":
        reduction_plan = plan.make_plan(x, AXIS, compressor, min_compressed_size=0)
        (errors[name],) = reduction.reduce(reduction_plan, x, KEY, mean=True,
                                           want_local_error=True).local_error
    return errors

  out = _rows(jax.pmap(first_phase_errors, axis_name=AXIS)(x))
  for name, errors in out.items():
    errors = np.asarray(errors, np.float64)
    ratio = np.mean(errors.mean(axis=0) ** 2) / np.mean(errors**2)
    assert 0.8 / NUM_DEVICES < ratio < 1.25 / NUM_DEVICES, name


# The two-phase mean of MinMax(bits=8, bucket_size=512) of VARIANTS (minmax8_two_phase, close
# to the exact mean, identical everywhere, and its sum), on a larger, smooth leaf: its tighter
# bound runs in the slow tier.
@pytest.mark.slow
def test_two_phase_8bit_bucketed_minmax_within_1e3_of_exact_mean_on_smooth_inputs():
  """``MinMax(bits=8, bucket_size=512)``: relative error below 1e-3 on smooth inputs.

  A 512-element bucket of a smooth signal spans a small range, so a step is
  small; with one bucket for the whole leaf (``bucket_size=None``) a step is
  the leaf's range / 255 and the error is about 4e-3.
  """
  t = np.linspace(0.0, 4 * np.pi, 200_003)
  phases = np.arange(NUM_DEVICES)[:, None] / NUM_DEVICES
  x = (np.sin(t + phases) + 0.3 * np.cos(3 * t - phases) + 0.2 * phases).astype(np.float32)
  compressor = qsgd_jax.MinMax(bits=8, bucket_size=512)
  mean = jax.pmap(lambda v: qsgd_jax.quantized_pmean(v, AXIS, compressor, KEY), axis_name=AXIS)
  result = _rows(mean(x))
  _assert_rows_identical(result)
  assert _relative_error(result[0], x.astype(np.float64).mean(axis=0)) < 1e-3


# Edge cases.


@pytest.mark.slow
def test_odd_sizes_and_bf16_leaves():
  """Sizes 1, 7 and 10007 and a bf16 leaf, compressed or in full precision.

  Two 8-bit quantizations of values within ``[-m, m]`` err by at most two
  steps of ``2 m / 255``; casting the result back to bf16 adds ``2**-9 m``.
  """
  rng = np.random.default_rng(2)
  tree = {
      "one": rng.normal(size=(NUM_DEVICES, 1)).astype(np.float32),
      "seven": rng.normal(size=(NUM_DEVICES, 7)).astype(jnp.bfloat16),
      "odd": rng.normal(size=(NUM_DEVICES, 10007)).astype(np.float32),
  }
  minmax = qsgd_jax.MinMax(bits=8)

  def means(tree, key):
    return {
        # Every leaf compressed, even a single element.
        "two_phase": qsgd_jax.quantized_pmean(tree, AXIS, minmax, key, min_compressed_size=0),
        "psum": qsgd_jax.quantized_pmean(
            tree, AXIS, minmax, key, method="psum", min_compressed_size=0),
        # The default threshold: "one" and "seven" go in one float32 psum.
        "default": qsgd_jax.quantized_pmean(tree, AXIS, minmax, key),
    }

  out = _rows(jax.pmap(means, axis_name=AXIS, in_axes=(0, None))(tree, KEY))
  exact = _exact_mean(tree)
  for variant, result in out.items():
    _assert_rows_identical(result)
    chex.assert_trees_all_equal_shapes_and_dtypes(result, tree)
    for name, leaf in result.items():
      error = np.max(np.abs(np.asarray(leaf[0], np.float64) - exact[name]))
      magnitude = np.max(np.abs(np.asarray(tree[name], np.float64)))
      assert error <= (4 / 255 + 2**-9) * magnitude, (variant, name)


_METHODS = ("two_phase", "psum", "all_gather")


@functools.cache
def _float16_l2_means():
  """float16 gradients of about 30,000 and each method's mean of them, in one program."""
  rng = np.random.default_rng(3)
  grads = (30_000 * (1 + 0.01 * rng.normal(size=(NUM_DEVICES, 8192)))).astype(np.float16)
  compressor = qsgd_jax.QSGD(bits=4, norm="l2")
  means = jax.pmap(lambda g: {method: qsgd_jax.quantized_pmean(g, AXIS, compressor, KEY,
                                                               method=method)
                              for method in _METHODS}, axis_name=AXIS)(grads)
  return grads, _rows(means)


@pytest.mark.parametrize("method", _METHODS)
def test_float16_l2_means_decode_within_float16(method):
  # Gradients of about 30,000: a bucket's L2 norm, 30,000 * sqrt(512), is past float16's
  # largest value, 65,504; so is a decode against it, unless the scale is bounded by it.
  grads, means = _float16_l2_means()
  mean = means[method]
  assert mean.dtype == np.float16 and np.all(np.isfinite(mean))
  assert np.max(np.abs(mean)) <= np.finfo(np.float16).max
  exact = grads.astype(np.float64).mean(axis=0)
  assert abs(float(np.mean(mean[0].astype(np.float64) - exact))) < 300  # Unbiased: 1%.


def test_axis_of_size_one():
  devices = jax.devices()[:1]
  tree = jax.tree.map(lambda x: x[:1], _normal_tree())
  minmax = qsgd_jax.MinMax(bits=8)

  def means(tree, key):
    return {method: qsgd_jax.quantized_pmean(tree, AXIS, minmax, key, method=method)
            for method in ("two_phase", "psum")}

  out = _rows(jax.pmap(means, axis_name=AXIS, in_axes=(0, None), devices=devices)(tree, KEY))
  for result in out.values():
    chex.assert_trees_all_equal_shapes_and_dtypes(result, tree)
    assert _relative_error(result["kernel"], tree["kernel"]) < 0.02
    np.testing.assert_array_equal(result["bias"], tree["bias"])


def test_unbound_axis_name_raises_name_error():
  reduce = jax.pmap(
      lambda x: qsgd_jax.quantized_pmean(x, "model", qsgd_jax.QSGD(), KEY), axis_name=AXIS
  )
  with pytest.raises(NameError, match="unbound axis name: model"):
    reduce(jnp.ones((NUM_DEVICES, 8192)))
  with pytest.raises(NameError, match="unbound axis name"):
    jax.jit(lambda x: qsgd_jax.quantized_pmean(x, AXIS, qsgd_jax.QSGD(), KEY))(jnp.ones(8192))


@pytest.mark.slow
def test_non_float_leaves_keep_their_dtype():
  """Integer leaves: psum's sum, pmean's mean cast back; bools: any device's; float0 passes."""
  steps = jnp.arange(NUM_DEVICES, dtype=jnp.int32)[:, None] * jnp.ones((1, 3), jnp.int32)
  flags = jnp.zeros((NUM_DEVICES, 2), bool).at[5, 0].set(True)
  tree = {"w": jnp.ones((NUM_DEVICES, 8192)), "step": steps, "small": steps.astype(jnp.uint8),
          "flag": flags, "grad_of_int": np.zeros((NUM_DEVICES, 2), jax.dtypes.float0)}

  def reduce(t):
    return {"sum": qsgd_jax.quantized_psum(t, AXIS, qsgd_jax.QSGD(), KEY),
            "mean": qsgd_jax.quantized_pmean(t, AXIS, qsgd_jax.QSGD(), KEY),
            "cast_lax_mean": jax.lax.pmean(t["step"], AXIS).astype(jnp.int32)}

  out = jax.pmap(reduce, axis_name=AXIS)(tree)
  for reduced in ("sum", "mean"):
    for name in ("step", "small", "flag", "grad_of_int"):
      assert out[reduced][name].dtype == tree[name].dtype, (reduced, name)
    np.testing.assert_array_equal(out[reduced]["flag"], np.tile([True, False], (NUM_DEVICES, 1)))
  np.testing.assert_array_equal(out["sum"]["step"], jnp.full((NUM_DEVICES, 3), 28))
  np.testing.assert_array_equal(out["mean"]["step"], out["cast_lax_mean"])
  np.testing.assert_array_equal(out["mean"]["step"], 3)  # 3.5 rounded toward zero.
  np.testing.assert_array_equal(out["mean"]["small"], 3)
  np.testing.assert_array_equal(out["mean"]["w"], 1.0)


def test_non_compressor_raises_type_error():
  reduce = jax.pmap(lambda x: qsgd_jax.quantized_pmean(x, AXIS, "qsgd", KEY), axis_name=AXIS)
  with pytest.raises(TypeError, match="Compressor"):
    reduce(jnp.ones((NUM_DEVICES, 8)))


def test_the_internal_reduce_scatter_method_is_refused():
  """``quantized_psum_scatter`` makes the reduce-scatter; by name here it would keep one shard."""
  reduce = jax.pmap(lambda x: qsgd_jax.quantized_psum(
      x, AXIS, qsgd_jax.MinMax(), KEY, method="reduce_scatter"), axis_name=AXIS)
  with pytest.raises(ValueError, match="quantized_psum: method must be one of"):
    reduce(jnp.ones((NUM_DEVICES, NUM_DEVICES, 4096)))


def test_psum_method_with_onebit_raises_value_error():
  reduce = jax.pmap(
      lambda x: qsgd_jax.quantized_pmean(x, AXIS, qsgd_jax.OneBit(), KEY, method="psum"),
      axis_name=AXIS,
  )
  with pytest.raises(ValueError, match="shared-scale"):
    reduce(jnp.ones((NUM_DEVICES, 8192)))


# Two levels: full precision over the inner axis, quantized over the outer one.


def test_tuple_axis_reduces_inner_in_full_precision_and_outer_quantized():
  mesh = jax.make_mesh((2, 4), ("node", "local"))
  axes = ("node", "local")
  compressor = qsgd_jax.MinMax(bits=8, bucket_size=512)

  def mean(tree):
    tree = jax.tree.map(lambda x: x[0], tree)
    return {method: qsgd_jax.quantized_pmean(tree, axes, compressor, KEY, method=method)
            for method in ("two_phase", "psum")}

  tree = _normal_tree()
  tree_on_mesh = jax.device_put(tree, NamedSharding(mesh, P(axes)))
  reduce = jax.jit(jax.shard_map(mean, mesh=mesh, in_specs=P(axes), out_specs=P()))
  compiled = reduce.lower(tree_on_mesh).compile()
  out = jax.block_until_ready(compiled(tree_on_mesh))
  exact = _exact_mean(tree)
  for result in out.values():
    for name, leaf in result.items():
      shards = np.stack([np.asarray(shard.data) for shard in leaf.addressable_shards])
      assert shards.shape[0] == NUM_DEVICES
      _assert_rows_identical(shards)
      assert _relative_error(shards[0], exact[name]) < (0.02 if name == "kernel" else 1e-6)

  found = set(_collectives(compiled.as_text()))
  # Inner groups of 4 (the mesh's rows) in float32; packed codes over groups of 2.
  assert ("reduce-scatter", "f32", 4) in found and ("all-gather", "f32", 4) in found
  assert ("all-to-all", "u32", 2) in found and ("all-gather", "u32", 2) in found
  # The psum method: shared scales, then codes summed as integers over groups of 2.
  assert ("all-reduce", "s16", 2) in found
  # The small leaf: one float32 psum over all 8.
  assert ("all-reduce", "f32", 8) in found
  quantized_kinds = {kind for kind, dtype, _ in found if dtype in ("u32", "s8", "s16")}
  assert {group for kind, dtype, group in found if dtype in ("u32", "s8", "s16")} == {2}
  assert quantized_kinds == {"all-to-all", "all-gather", "all-reduce"}
  assert {group for _, dtype, group in found if dtype == "f32"} <= {2, 4, 8}


# What goes on the wire.


_HLO_TREE_SIZES = {"conv": 1000, "dense": 3000, "bias": 10, "scale": 20}
_MIN_COMPRESSED = 512


def _hlo_tree():
  return {name: jax.ShapeDtypeStruct((NUM_DEVICES, size), jnp.float32)
          for name, size in _HLO_TREE_SIZES.items()}


def _lowered(compressor, method, min_compressed_size=_MIN_COMPRESSED):
  reduce = jax.pmap(
      lambda tree: qsgd_jax.quantized_pmean(
          tree, AXIS, compressor, KEY, method=method, min_compressed_size=min_compressed_size),
      axis_name=AXIS,
  )
  return reduce.lower(_hlo_tree())


def _payload_words(compressor):
  """Words of the payload a device sends each peer in the first phase.

  With a fixed bucket size, the large leaves, each padded to whole buckets,
  lie end to end and are cut into 8 pieces of whole buckets, encoded as one
  vector each; with ``bucket_size=None``, each leaf's piece is one bucket,
  encoded alone.
  """
  sizes = [size for size in _HLO_TREE_SIZES.values() if size >= _MIN_COMPRESSED]
  if compressor.bucket_size is None:
    return sum(compressor.wire_bits((-(-size // NUM_DEVICES),)) // 32 for size in sizes)
  buckets = sum(-(-size // compressor.bucket_size) for size in sizes)
  piece = -(-buckets // NUM_DEVICES) * compressor.bucket_size
  return compressor.wire_bits((piece,)) // 32


def _check_two_phase_collectives(compressor, text):
  found = qsgd_jax.collectives_in_hlo(text)
  assert sorted(c.kind for c in found) == ["all-gather", "all-reduce", "all-to-all"]
  (all_reduce,) = [c for c in found if c.kind == "all-reduce"]
  assert all_reduce.result_type.startswith("f32[30]")  # both small leaves, fused
  words = _payload_words(compressor)
  for c in found:
    if c.kind != "all-reduce":
      assert c.result_bytes == NUM_DEVICES * words * 4, c
      assert c.group_size == NUM_DEVICES


def test_two_phase_hlo_has_one_all_to_all_one_all_gather_one_all_reduce():
  compressor = qsgd_jax.QSGD(bits=4)
  lowered = _lowered(compressor, "two_phase")
  text = lowered.compile().as_text()
  _check_two_phase_collectives(compressor, text)
  # XLA leaves the collectives' shapes alone: the unoptimized HLO counts the same.
  assert qsgd_jax.wire_bytes(lowered.as_text(dialect="hlo")) == qsgd_jax.wire_bytes(text)


def test_bucketed_pieces_of_every_leaf_are_encoded_as_one_vector():
  # 3-bit codes in buckets of 5: one leaf's piece alone would end in a part word.
  compressor = qsgd_jax.QSGD(bits=3, bucket_size=5)
  per_leaf = sum(compressor.wire_bits((_piece_len(compressor, size, NUM_DEVICES),)) // 32
                 for size in _HLO_TREE_SIZES.values() if size >= _MIN_COMPRESSED)
  assert _payload_words(compressor) < per_leaf
  _check_two_phase_collectives(
      compressor, _lowered(compressor, "two_phase").as_text(dialect="hlo"))


def test_bucket_size_none_sends_one_bucket_a_leaf_piece():
  compressor = qsgd_jax.MinMax(bits=8, bucket_size=None)
  _check_two_phase_collectives(
      compressor, _lowered(compressor, "two_phase").as_text(dialect="hlo"))


def test_psum_hlo_sums_codes_in_one_narrowest_integer_all_reduce():
  lowered = _lowered(qsgd_jax.QSGD(bits=4), "psum")
  text = lowered.compile().as_text()
  found = _collectives(text)
  assert all(kind == "all-reduce" for kind, _, _ in found)
  # Codes of both large leaves in one int8 all-reduce (|sum| <= 8 * 7); one
  # float32 max of the scales; one float32 sum of the small leaves.
  assert sorted(dtype for _, dtype, _ in found) == ["f32", "f32", "s8"]
  assert qsgd_jax.wire_bytes(lowered.as_text(dialect="hlo")) == qsgd_jax.wire_bytes(text)


@pytest.mark.parametrize(
    "compressor, dtype",
    [(qsgd_jax.QSGD(bits=8), "s16"), (qsgd_jax.MinMax(bits=8), "s16"),
     (qsgd_jax.MinMax(bits=4), "s8")],
    ids=["qsgd8", "minmax8", "minmax4"],
)
def test_psum_code_dtype_is_narrowest_that_cannot_overflow(compressor, dtype):
  found = _collectives(_lowered(compressor, "psum").as_text(dialect="hlo"))
  integer = {d for _, d, _ in found if d[0] in "su"}
  assert integer == {dtype}


def test_no_small_leaves_means_no_full_precision_all_reduce():
  found = _collectives(_lowered(qsgd_jax.QSGD(bits=4), "two_phase", 0).as_text(dialect="hlo"))
  assert sorted(kind for kind, _, _ in found) == ["all-gather", "all-to-all"]


def _resnet50_gradient_shapes():
  """ResNet-50's parameter shapes: conv kernels, BatchNorm scale and bias, the classifier."""
  shapes = {"stem/conv": (7, 7, 3, 64), "stem/bn_scale": (64,), "stem/bn_bias": (64,)}
  channels = 64
  for stage, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512), strict=True)):
    for block in range(blocks):
      prefix = f"stage{stage}/block{block}"
      convs = [(1, channels, width), (3, width, width), (1, width, 4 * width)]
      if block == 0:
        convs.append((1, channels, 4 * width))  # the projection shortcut
      for i, (k, c_in, c_out) in enumerate(convs):
        shapes[f"{prefix}/conv{i}"] = (k, k, c_in, c_out)
        shapes[f"{prefix}/bn{i}_scale"] = (c_out,)
        shapes[f"{prefix}/bn{i}_bias"] = (c_out,)
      channels = 4 * width
  shapes["dense/kernel"] = (2048, 1000)
  shapes["dense/bias"] = (1000,)
  return shapes


@pytest.mark.parametrize(
    "compressor, at_least",
    [(qsgd_jax.QSGD(bits=4), 7.0), (qsgd_jax.QSGD(bits=8), 3.8),
     (qsgd_jax.MinMax(bits=8), 3.8), (qsgd_jax.OneBit(), 16.0)],
    ids=["qsgd4", "qsgd8", "minmax8", "onebit"],
)
@pytest.mark.slow
def test_resnet50_two_phase_sends_fewer_bytes_than_float32_pmean(compressor, at_least):
  """Bytes a device sends, from the HLO, against a float32 pmean of the same tree.

  The HLO before optimization, which skips compiling (the tests above check
  that optimization leaves the collectives' bytes alone).
  ``benchmarks/collectives.py`` reads the compiled HLO of this tree and of a
  GPT-2-small-sized one.
  """
  shapes = _resnet50_gradient_shapes()
  assert sum(math.prod(s) for s in shapes.values()) == 25_557_032
  tree = {name: jax.ShapeDtypeStruct((NUM_DEVICES, *s), jnp.float32)
          for name, s in shapes.items()}
  plain = jax.pmap(lambda t: jax.lax.pmean(t, AXIS), axis_name=AXIS).lower(tree)
  plain_bytes = qsgd_jax.wire_bytes(plain.as_text(dialect="hlo"))
  assert plain_bytes == 2 * (NUM_DEVICES - 1) / NUM_DEVICES * 4 * 25_557_032
  quantized = jax.pmap(
      lambda t: qsgd_jax.quantized_pmean(t, AXIS, compressor, KEY), axis_name=AXIS
  ).lower(tree)
  text = quantized.as_text(dialect="hlo")
  assert sorted(c.kind for c in qsgd_jax.collectives_in_hlo(text)) == [
      "all-gather", "all-reduce", "all-to-all"]
  assert plain_bytes / qsgd_jax.wire_bytes(text) >= at_least


_HANDWRITTEN_HLO = """\
HloModule jit_step, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

ENTRY %main (p0: f32[1024], p1: u32[1,130], p2: u32[1,130]) -> f32[128] {
  %ar = f32[1024]{0} all-reduce(%p0), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %a2a = (u32[1,130]{1,0}, u32[1,130]{1,0}) all-to-all(%p1, %p2), replica_groups=[4,2]<=[2,4]T(1,0)
  %a2a.1 = u32[8,130]{1,0} all-to-all(%p5), channel_id=3, replica_groups={}, dimensions={0}
  %ag-start = (bf16[256]{0}, bf16[1024]{0}) all-gather-start(%p3), replica_groups=[2,4]<=[8]
  %ag-done = bf16[1024]{0} all-gather-done(%ag-start)
  %rs = f32[128]{0} reduce-scatter(%p4), replica_groups=[2,4]<=[8], dimensions={0}
  %ar-start = s16[100]{0} all-reduce-start(%p6), replica_groups={{0,1},{2,3},{4,5},{6,7}}
  %ar-done = s16[100]{0} all-reduce-done(%ar-start)
  %cp = s8[64]{0} collective-permute(%p7), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %ars = (f32[10], f32[20]) all-reduce-start(%p9, %p10), replica_groups={}, to_apply=%add
  %ags = ((f32[4], s8[8]), (f32[32], s8[64])) all-gather-start(%c, %d), replica_groups=[1,8]<=[8]
  %cps = (f32[16], f32[16], u32[], u32[]) collective-permute-start(%e), source_target_pairs={{0,1}}
  %fusion = f32[4]{0} fusion(%p8), kind=kLoop, metadata={op_name="all-reduce(x)"}
  ROOT %copy = f32[128]{0} copy(%rs)
}
"""


def test_wire_bytes_of_handwritten_hlo():
  found = qsgd_jax.collectives_in_hlo(_HANDWRITTEN_HLO)
  assert [(c.kind, c.result_bytes, c.group_size, c.bytes_sent) for c in found] == [
      ("all-reduce", 4096, 8, 2 * 7 / 8 * 4096),
      # A tuple all-to-all counts every element; [4,2]<=... is 4 groups of 2.
      ("all-to-all", 2 * 130 * 4, 2, 1 / 2 * 2 * 130 * 4),
      # Empty groups: every device of the module.
      ("all-to-all", 8 * 130 * 4, 8, 7 / 8 * 8 * 130 * 4),
      # An asynchronous start's tuple is (operand, result): the result counts.
      ("all-gather", 2048, 4, 3 / 4 * 2048),
      # A reduce-scatter's result is one shard; a device sends n - 1 of them.
      ("reduce-scatter", 512, 4, 3 * 512),
      ("all-reduce", 200, 2, 2 * 1 / 2 * 200),
      ("collective-permute", 64, 4, 64),
      # A combined all-reduce-start: its tuple is every result.
      ("all-reduce", 120, 8, 2 * 7 / 8 * 120),
      # A variadic all-gather-start: (operands, results).
      ("all-gather", 32 * 4 + 64, 8, 7 / 8 * (32 * 4 + 64)),
      # A collective-permute-start: (operand, result, context, context).
      ("collective-permute", 64, 2, 64),
  ]
  assert qsgd_jax.wire_bytes(_HANDWRITTEN_HLO) == sum(c.bytes_sent for c in found)


# Without a mesh, under vmap, and the n-times mistake under shard_map.


def test_no_axis_applies_the_compressor_locally_and_sends_nothing():
  compressor = qsgd_jax.QSGD(bits=4, bucket_size=512)
  tree = _normal_tree()
  local = jax.jit(lambda t: qsgd_jax.quantized_pmean(t, None, compressor, KEY))
  first = jax.tree.map(lambda x: x[0], tree)
  out = local(first)
  assert not qsgd_jax.collectives_in_hlo(local.lower(first).compile().as_text())
  np.testing.assert_array_equal(out["bias"], first["bias"])  # Small: as it is.
  # The kernel as the compressor sends it: within one level of its bucket's scale.
  buckets = np.pad(first["kernel"], (0, -first["kernel"].size % 512)).reshape(-1, 512)
  step = np.repeat(np.abs(buckets).max(axis=1) / compressor.levels, 512)[: first["kernel"].size]
  assert np.all(np.abs(out["kernel"] - first["kernel"]) <= step * (1 + 1e-6))
  assert not np.array_equal(out["kernel"], first["kernel"])


# The all-gather method's collective under vmap is one of the two-phase method's (its second
# phase gathers the owners' payloads), its per-device draws the same.
@pytest.mark.parametrize("method", [
    "two_phase", "psum", pytest.param("all_gather", marks=pytest.mark.slow)])
def test_vmap_with_an_axis_name_equals_pmap(method):
  compressor = qsgd_jax.QSGD(bits=4)
  tree = _normal_tree()

  def mean(t):
    return qsgd_jax.quantized_pmean(t, AXIS, compressor, KEY, method=method)

  by_vmap = jax.jit(jax.vmap(mean, axis_name=AXIS))(tree)
  # The pmap of this very reduction of this tree: the shared program's (VARIANTS's qsgd4_*).
  by_pmap = _variant(f"qsgd4_{method}")
  chex.assert_trees_all_equal(_rows(by_vmap), by_pmap)


def test_replicated_gradients_under_shard_map_are_an_error_naming_the_leaf():
  """jax.grad of replicated params is already summed over the axis: reducing it is n times."""
  mesh = jax.make_mesh((NUM_DEVICES,), (AXIS,))
  params = {"w": jnp.ones((64, 128)), "b": jnp.ones(128)}
  x = jax.device_put(jnp.ones((NUM_DEVICES, 64)), NamedSharding(mesh, P(AXIS)))

  def step(params, x, own_copy):
    if own_copy:
      params = qsgd_jax.as_varying(params, AXIS)
    grads = jax.grad(lambda p: jnp.sum(x @ p["w"] + p["b"]))(params)
    return qsgd_jax.quantized_pmean(grads, AXIS, qsgd_jax.QSGD(), KEY)

  def run(own_copy):
    return jax.jit(jax.shard_map(functools.partial(step, own_copy=own_copy), mesh=mesh,
                                 in_specs=(P(), P(AXIS)), out_specs=P()))(params, x)

  with pytest.raises(ValueError, match=r"leaf \['b'\] is replicated over axis 'batch'.*pcast"):
    run(own_copy=False)
  # With each device's own copy, the mean of 8 equal gradients: each one.
  out = run(own_copy=True)
  np.testing.assert_allclose(out["b"], 1.0)
