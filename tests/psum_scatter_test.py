"""Tests of quantized_psum_scatter, and of FSDP training with it.

Eight simulated CPU devices (``conftest.py``). ``jax.lax.psum_scatter`` is the
reference: the same shards, the same shapes, and close values.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qsgd_jax
from qsgd_jax._src.collectives import plan as plan_lib

AXIS = "batch"
NUM_DEVICES = 8
KEY = jax.random.key(0)


def _tree():
  rng = np.random.default_rng(0)
  return {
      "kernel": rng.normal(size=(NUM_DEVICES, 64, 320)).astype(np.float32),
      "bias": rng.normal(size=(NUM_DEVICES, 16, 8)).astype(np.float32),
      "count": np.arange(NUM_DEVICES * 8 * 16).reshape(NUM_DEVICES, 8, 16).astype(np.int32),
  }


def _scatter(compressor, **kwargs):
  def f(tree):
    return {
        "quantized": qsgd_jax.quantized_psum_scatter(tree, AXIS, compressor, KEY,
                                                     min_compressed_size=1000, **kwargs),
        "exact": jax.lax.psum_scatter(tree, AXIS, **kwargs),
    }
  return jax.pmap(f, axis_name=AXIS)


@pytest.mark.parametrize("kwargs", [
    dict(tiled=True), dict(tiled=True, scatter_dimension=1), dict(tiled=False)],
    ids=["tiled", "tiled_dim1", "untiled"])
def test_shards_are_those_of_lax_psum_scatter(kwargs):
  tree = _tree()
  if not kwargs.get("tiled"):  # One shard a device along the first dimension.
    tree = jax.tree.map(lambda x: x[:, :NUM_DEVICES], tree)
  out = _scatter(qsgd_jax.Identity(), **kwargs)(tree)
  for name in tree:
    exact, quantized = np.asarray(out["exact"][name]), np.asarray(out["quantized"][name])
    assert quantized.shape == exact.shape and quantized.dtype == exact.dtype, name
    np.testing.assert_allclose(quantized, exact, rtol=1e-5, atol=1e-5)


# Bounds from QSGD's variance, at most (scale / s)^2 / 4 a coordinate: one scale for a
# shard of 2560 Gaussians is about 3.5 sigma, so with s = 7 the error of the sum of 7
# quantized shards and 1 exact one is at most sqrt(7 / 8) * 3.5 / 14 ~ 0.23 of its norm.
@pytest.mark.parametrize("compressor, bound", [
    (qsgd_jax.QSGD(bits=8), 0.01), (qsgd_jax.MinMax(bits=8), 0.01),
    (qsgd_jax.QSGD(bits=4, bucket_size=None), 0.25)], ids=["qsgd8", "minmax8", "qsgd4_one_scale"])
def test_quantized_shards_are_close_and_integers_exact(compressor, bound):
  out = _scatter(compressor, tiled=True)(_tree())
  exact, quantized = np.asarray(out["exact"]["kernel"]), np.asarray(out["quantized"]["kernel"])
  assert np.linalg.norm(quantized - exact) / np.linalg.norm(exact) < bound
  np.testing.assert_array_equal(out["quantized"]["count"], out["exact"]["count"])
  np.testing.assert_allclose(out["quantized"]["bias"], out["exact"]["bias"], rtol=1e-5)


def test_unbiased_over_keys():
  x = jnp.asarray(np.random.default_rng(3).normal(size=(NUM_DEVICES, 4096)), jnp.float32)
  keys = jax.random.split(jax.random.key(5), 400)

  def statistics(x, keys):
    samples = jax.vmap(lambda key: qsgd_jax.quantized_psum_scatter(
        x, AXIS, qsgd_jax.QSGD(bits=2), key, tiled=True, min_compressed_size=0))(keys)
    return jnp.mean(samples, axis=0), jnp.var(samples, axis=0, ddof=1)

  mean, variance = jax.pmap(statistics, axis_name=AXIS, in_axes=(0, None))(x, keys)
  exact = np.asarray(x, np.float64).sum(axis=0).reshape(NUM_DEVICES, -1)
  z = (np.asarray(mean) - exact) / np.sqrt(np.asarray(variance) / len(keys))
  assert np.max(np.abs(z)) < 5.0 and abs(np.mean(z)) < 5.0 / np.sqrt(z.size)


def test_sends_one_all_to_all_half_the_bytes_of_the_two_phase_all_reduce():
  shapes = {"w": jax.ShapeDtypeStruct((NUM_DEVICES, 512, 1024), jnp.float32)}
  scatter = jax.pmap(lambda t: qsgd_jax.quantized_psum_scatter(
      t, AXIS, qsgd_jax.QSGD(bits=4), KEY, tiled=True), axis_name=AXIS).lower(shapes)
  allreduce = jax.pmap(lambda t: qsgd_jax.quantized_psum(
      t, AXIS, qsgd_jax.QSGD(bits=4), KEY), axis_name=AXIS).lower(shapes)
  found = qsgd_jax.collectives_in_hlo(scatter.as_text(dialect="hlo"))
  assert [c.kind for c in found] == ["all-to-all"]
  ratio = found[0].bytes_sent / qsgd_jax.wire_bytes(allreduce.as_text(dialect="hlo"))
  assert ratio == 0.5
  planned = plan_lib.make_plan(
      {"w": jax.ShapeDtypeStruct((512, 1024), jnp.float32)}, AXIS, qsgd_jax.QSGD(bits=4),
      method=plan_lib.REDUCE_SCATTER, axis_sizes={AXIS: NUM_DEVICES}, tiled=True)
  assert planned.wire_bits == 8 * found[0].bytes_sent


@pytest.mark.parametrize("shape, kwargs, message", [
    ((16, 5), dict(tiled=False), "must have the axis size 8"),
    ((16,), dict(tiled=True, scatter_dimension=1), "out of range"),
])
def test_leaves_that_do_not_split_are_errors_naming_them(shape, kwargs, message):
  f = jax.pmap(lambda t: qsgd_jax.quantized_psum_scatter(
      t, AXIS, qsgd_jax.QSGD(), KEY, **kwargs), axis_name=AXIS)
  with pytest.raises(ValueError, match=rf"leaf \['w'\].*{message}"):
    f({"w": jnp.zeros((NUM_DEVICES, *shape))})


def test_uneven_leaves_are_padded_and_the_padding_is_zero():
  """13 rows on 8 devices: shards of 2 rows, the last 3 of the 16 padding, exactly zero
  (MinMax would decode a zero to its bucket's grid, which need not pass through 0)."""
  y = np.random.default_rng(2).normal(size=(NUM_DEVICES, 13, 400)).astype(np.float32)
  out = np.asarray(jax.pmap(lambda t: qsgd_jax.quantized_psum_scatter(
      t, AXIS, qsgd_jax.MinMax(bits=8), KEY, tiled=True), axis_name=AXIS)(y))
  assert out.shape == (NUM_DEVICES, 2, 400)
  rows = out.reshape(16, 400)
  np.testing.assert_array_equal(rows[13:], 0.0)
  np.testing.assert_allclose(rows[:13], y.sum(axis=0), atol=0.05 * np.abs(y.sum(axis=0)).max())


def test_two_level_axes_sum_over_the_inner_axis_first():
  """Over ("node", "local"): the shards of P(("node", "local")), a float32 reduce-scatter
  over the inner axis, and a quantized all-to-all over the outer one only."""
  mesh = jax.make_mesh((2, 4), ("node", "local"))
  both = P(("node", "local"))
  f = jax.jit(jax.shard_map(lambda g: qsgd_jax.quantized_psum_scatter(
      g[0], ("node", "local"), qsgd_jax.QSGD(bits=8), KEY, tiled=True), mesh=mesh,
      in_specs=both, out_specs=both))
  g = np.random.default_rng(4).normal(size=(NUM_DEVICES, 515, 20)).astype(np.float32)
  x = jax.device_put(jnp.asarray(g), NamedSharding(mesh, both))
  out = np.asarray(f(x))  # Every device's shard of 65 rows, end to end: 515 and 5 padding.
  assert out.shape == (520, 20)
  exact = g.sum(axis=0)
  np.testing.assert_array_equal(out[515:], 0.0)
  assert np.linalg.norm(out[:515] - exact) / np.linalg.norm(exact) < 0.01
  found = [(c.kind, c.group_size) for c in qsgd_jax.collectives_in_hlo(
      f.lower(x).compile().as_text())]
  assert found == [("reduce-scatter", 4), ("all-to-all", 2)]


# FSDP: parameters and optimizer state sharded over the data axis.


def _fsdp_problem():
  rng = np.random.default_rng(1)
  params = {"w1": rng.normal(size=(64, 128)).astype(np.float32) / 8,
            "w2": rng.normal(size=(128, 32)).astype(np.float32) / 11}
  teacher = rng.normal(size=(64, 32)).astype(np.float32) / 8
  x = rng.normal(size=(NUM_DEVICES, 32, 64)).astype(np.float32)
  return params, x, np.tanh(x @ teacher)


def _loss(params, x, y):
  return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


@functools.cache
def _fsdp_step(quantized: bool):
  """One FSDP step under shard_map: all-gather params, reduce-scatter gradients."""
  mesh = jax.make_mesh((NUM_DEVICES,), (AXIS,))
  tx = optax.adam(3e-3)

  def step(shards, opt_state, key, x, y):
    full = jax.tree.map(lambda s: jax.lax.all_gather(s, AXIS, tiled=True), shards)
    loss, grads = jax.value_and_grad(_loss)(full, x[0], y[0])
    if quantized:
      summed = qsgd_jax.quantized_psum_scatter(grads, AXIS, qsgd_jax.QSGD(bits=8), key,
                                               tiled=True)
    else:
      summed = jax.lax.psum_scatter(grads, AXIS, tiled=True)
    updates, opt_state = tx.update(jax.tree.map(lambda g: g / NUM_DEVICES, summed),
                                   opt_state, shards)
    return optax.apply_updates(shards, updates), opt_state, jax.lax.pmean(loss, AXIS)

  sharded = P(AXIS)
  # Adam's moments are sharded like the parameters; its step count is replicated.
  state_specs = jax.tree.map(lambda leaf: P() if leaf.ndim == 0 else sharded,
                             jax.eval_shape(tx.init, _fsdp_problem()[0]))
  step = jax.jit(jax.shard_map(
      step, mesh=mesh, in_specs=(sharded, state_specs, P(), sharded, sharded),
      out_specs=(sharded, state_specs, P())))
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=sharded, out_specs=state_specs))
  return mesh, init, step


def _train_fsdp(quantized: bool, num_steps: int = 30):
  mesh, init, step = _fsdp_step(quantized)
  params, x, y = _fsdp_problem()
  shards = jax.device_put(params, NamedSharding(mesh, P(AXIS)))
  x, y = (jax.device_put(a, NamedSharding(mesh, P(AXIS))) for a in (x, y))
  opt_state = init(shards)
  losses = []
  for i in range(num_steps):
    shards, opt_state, loss = jax.block_until_ready(
        step(shards, opt_state, jax.random.key(i), x, y))
    losses.append(float(loss))
  return jax.tree.map(np.asarray, shards), losses, step.lower(
      shards, opt_state, jax.random.key(0), x, y).compile().as_text()


# Thirty steps of each through the reduce-scatter the tests above check (its values with
# QSGD(bits=8), under jit(shard_map), its bytes as the plan gives them; fsdp_test's gradients):
# a training run, in the slow tier.
@pytest.mark.slow
def test_fsdp_training_matches_float32_fsdp_with_half_the_bytes():
  exact_params, exact_losses, exact_hlo = _train_fsdp(quantized=False)
  params, losses, hlo = _train_fsdp(quantized=True)
  assert losses[-1] < 0.5 * losses[0]
  np.testing.assert_allclose(losses, exact_losses, rtol=0.02)
  for name in params:
    relative = np.linalg.norm(params[name] - exact_params[name]) / np.linalg.norm(
        exact_params[name])
    assert relative < 0.01, (name, relative)
  # The gradients' reduce-scatter: float32 against packed 8-bit codes.
  grads = [c for c in qsgd_jax.collectives_in_hlo(exact_hlo) if c.kind == "reduce-scatter"]
  codes = [c for c in qsgd_jax.collectives_in_hlo(hlo) if c.kind == "all-to-all"]
  assert 3.9 < sum(c.bytes_sent for c in grads) / sum(c.bytes_sent for c in codes) < 4.0
