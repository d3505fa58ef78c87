"""The fused Pallas kernels against the XLA path, bit for bit, through Pallas' interpreter."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import qsgd_jax
from qsgd_jax._src.adam import sign_exchange
from qsgd_jax._src.compressors import packing, pallas_kernels


def _bits(x):
  return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint32))


def _gradient(size, seed=1):
  """Normal values with the cases the scales and rounding treat apart, in the fused buckets."""
  x = jax.random.normal(jax.random.key(seed), (size,)) * 3.0
  x = x.at[:512].set(0.0).at[512:1024].set(-0.0)  # Zero buckets.
  x = x.at[1024:1536].multiply(1e-41)  # Subnormal.
  x = x.at[1536:2048].multiply(1e37)  # Near the float32 maximum.
  x = x.at[2048].set(np.float32(3.4e38)).at[2600].set(jnp.inf).at[3100].set(-jnp.inf)
  return x.at[3700].set(jnp.nan).at[4000].set(-jnp.nan)


@pytest.mark.parametrize("bits, bucket_size, size", [
    (4, 512, 3 * 8192 + 1000),  # Whole buckets and a short one after the blocks.
    (2, 256, 2 * 8192 + 7),
    (8, 1024, 8192 + 2048 + 5),
    (16, 128, 8192 + 31),
])
@pytest.mark.slow
def test_fused_qsgd_is_the_xla_path_bit_for_bit(bits, bucket_size, size):
  compressor = qsgd_jax.QSGD(bits=bits, bucket_size=bucket_size)
  assert compressor._fused_buckets(size)
  x, key = _gradient(size), jax.random.key(7)
  expected = jax.jit(compressor._encode_xla)(key, x)
  payload = jax.jit(lambda k, x: compressor._encode_fused(k, x, interpret=True))(key, x)
  np.testing.assert_array_equal(payload.packed, expected.packed)
  np.testing.assert_array_equal(_bits(payload.scales), _bits(expected.scales))
  assert (payload.shape, payload.dtype) == (expected.shape, expected.dtype)
  decoded = jax.jit(lambda p: compressor._decode_fused(p, interpret=True))(expected)
  np.testing.assert_array_equal(_bits(decoded), _bits(jax.jit(compressor._decode_xla)(expected)))


@pytest.mark.slow
def test_the_switch_selects_the_kernels(monkeypatch):
  compressor = qsgd_jax.QSGD(bits=4)
  x, key = _gradient(8192 + 100, seed=2), jax.random.key(3)
  expected = compressor._encode_xla(key, x)
  for mode in ("interpret", "gpu"):  # "gpu" on a CPU: the XLA branch of platform_dependent.
    monkeypatch.setenv("QSGD_JAX_PALLAS", mode)
    payload = jax.jit(compressor.encode)(key, x)
    np.testing.assert_array_equal(payload.packed, expected.packed)
    np.testing.assert_array_equal(_bits(jax.jit(compressor.decode)(payload)),
                                  _bits(compressor._decode_xla(expected)))
  monkeypatch.setenv("QSGD_JAX_PALLAS", "everywhere")
  with pytest.raises(ValueError, match="QSGD_JAX_PALLAS"):
    compressor.encode(key, x)


def test_unfused_configurations_are_left_to_xla():
  assert not qsgd_jax.QSGD(bits=4, norm="l2")._fused_buckets(1 << 16)
  assert not qsgd_jax.QSGD(bits=3)._fused_buckets(1 << 16)
  assert not qsgd_jax.QSGD(bits=4, bucket_size=500)._fused_buckets(1 << 16)
  assert not qsgd_jax.QSGD(bits=4)._fused_buckets(8191)


@pytest.mark.parametrize("size", [8192, 3 * 8192 + 40, 100])
def test_sign_pack_is_packing_bit_for_bit(size):
  x = _gradient(max(size, 4096), seed=4)[:size]
  expected = packing.pack((x >= 0).astype(jnp.uint32), 1)
  np.testing.assert_array_equal(pallas_kernels.sign_pack(x, interpret=True), expected)


@pytest.mark.parametrize("row_words", [24, 512, 2 * 256 + 37])  # XLA only, fused, both.
def test_sign_unpack_rows_is_the_scaled_signs_bit_for_bit(row_words):
  words = jax.random.bits(jax.random.key(4), (3, row_words), jnp.uint32)
  scales = jnp.array([0.5, 2.0, jnp.inf], jnp.float32)
  signs = packing.unpack(words.reshape(-1), words.size * 32, 1).reshape(3, -1).astype(bool)
  expected = jnp.where(signs, np.float32(1), np.float32(-1)) * scales[:, None]
  np.testing.assert_array_equal(
      _bits(pallas_kernels.sign_unpack_rows(words, scales, interpret=True)), _bits(expected))


@pytest.mark.slow
def test_the_exchange_with_the_unpack_kernel_is_bit_for_bit(monkeypatch):
  layout = sign_exchange.sign_layout([1000, 70000], 1)
  vectors = [jax.random.normal(jax.random.key(i), (size,)) for i, size in enumerate(layout.sizes)]
  errors = (jnp.zeros(layout.worker_error_shape().shape), jnp.zeros(layout.width))
  expected = sign_exchange.exchange(vectors, *errors, layout, None)
  monkeypatch.setenv("QSGD_JAX_PALLAS", "interpret")
  got = sign_exchange.exchange(vectors, *errors, layout, None)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def _on_devices(fn, *trees, devices=2):
  """``fn`` under ``jax.shard_map`` over ``devices`` devices, every input replicated."""
  mesh = jax.make_mesh((devices,), ("batch",), devices=jax.devices()[:devices])
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P("batch")))(*trees)


@pytest.mark.slow
def test_the_kernels_type_their_outputs_under_shard_map(monkeypatch):
  # A pallas_call under shard_map must say how its outputs vary over the mesh (as its
  # operands do, here the per-device gradients), or tracing it fails. With "gpu" on a CPU
  # the kernels' branch of platform_dependent is traced and the XLA branch runs; Pallas'
  # interpreter cannot run under shard_map's varying types.
  x = _gradient(2 * 8192 + 300, seed=5).reshape(2, -1)
  tx = qsgd_jax.onebit_adam(1e-2, "batch", freeze_step=1, min_compressed_size=1024)

  def programs(x):
    x = qsgd_jax.as_varying(x, "batch") * (1.0 + jax.lax.axis_index("batch"))
    mean = qsgd_jax.quantized_pmean(x, "batch", qsgd_jax.QSGD(bits=4), jax.random.key(2),
                                    min_compressed_size=1024)
    params, state = {"w": x}, tx.init({"w": x})
    for _ in range(2):  # The float32 step, then the 1-bit exchange.
      updates, state = tx.update(params, state, params)
      params = optax.apply_updates(params, updates)
    return mean[None], params["w"][None]

  expected = _on_devices(programs, x)
  monkeypatch.setenv("QSGD_JAX_PALLAS", "gpu")
  got = _on_devices(programs, x)
  for a, b in zip(got, expected, strict=True):
    np.testing.assert_array_equal(_bits(a), _bits(b))
