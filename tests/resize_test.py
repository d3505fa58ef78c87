"""qsgd_jax.resize_state: states saved on 8 devices, resumed on 4 and on 2.

What each rule keeps is checked on the arrays (the residuals' mean over
workers, the owners' pieces end to end), and the resized states take a step
on the new devices, under pmap's stacked layout and shard_map's.
"""

import functools
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import host_arrays
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qsgd_jax

AXIS = "batch"
SAVED = 8
# 8192 + 128 + 1000 elements, each leaf padded to buckets of 512: a segment of 19 buckets,
# cut into pieces of 3 buckets on 8 devices, 5 on 4 and 10 on 2.
_PARAMS = {"w": jnp.zeros((64, 128)), "b": jnp.zeros(128), "v": jnp.zeros(1000)}
_SEGMENT = 19 * 512


def _optimizer():
  return optax.chain(
      qsgd_jax.onebit_sgd(AXIS, error_feedback="both", min_compressed_size=0),
      optax.sgd(0.1, momentum=0.9))


def _grads(count, seed):
  keys = jax.random.split(jax.random.key(seed), len(_PARAMS))
  return {name: jax.random.normal(key, (count, *x.shape))
          for key, (name, x) in zip(keys, _PARAMS.items(), strict=True)}


@functools.cache
def _pmap_step(count):
  tx = _optimizer()
  devices = jax.devices()[:count]

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  init = jax.pmap(tx.init, axis_name=AXIS, devices=devices)
  return init, jax.pmap(step, axis_name=AXIS, devices=devices)


def _stacked(tree, count):
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (count, *x.shape)), tree)


@pytest.fixture(scope="module")
def trained():
  """Params and state after three steps on 8 devices, pmap's layout."""
  init, step = _pmap_step(SAVED)
  params = _stacked(_PARAMS, SAVED)
  state = init(params)
  for seed in range(3):
    params, state = jax.block_until_ready(step(params, state, _grads(SAVED, seed)))
  return params, state


def _owner_vector(chunk_error: np.ndarray) -> np.ndarray:
  """The owners' pieces of the segment end to end: ``[n, 1, rows, 512]`` to a vector."""
  return np.asarray(chunk_error).reshape(-1)


@pytest.mark.slow
@pytest.mark.parametrize("count", [4, 2])
def test_pmap_state_from_8_devices_keeps_what_error_feedback_owes_and_steps(trained, count):
  params, state = trained
  init, step = _pmap_step(count)
  target = init(_stacked(_PARAMS, count))
  resized = qsgd_jax.resize_state(jax.device_get(state), target, from_devices=SAVED,
                                  to_devices=count, stacked=True)
  assert jax.tree.structure(resized) == jax.tree.structure(target)
  for got, want in zip(jax.tree.leaves(resized), jax.tree.leaves(target), strict=True):
    assert (got.shape, got.dtype) == (want.shape, want.dtype)

  saved, new = state[0], resized[0]
  # Worker residuals: every new device holds the saved devices' mean.
  (saved_local,), (new_local,) = saved.local_error, new.local_error
  assert new_local.shape == (count, _SEGMENT)
  np.testing.assert_allclose(new_local, np.broadcast_to(
      np.asarray(saved_local).mean(axis=0), new_local.shape), rtol=1e-6, atol=1e-7)
  assert np.asarray(saved_local).any()
  # Owner residuals: the same vector, cut at other boundaries; past the segment, zeros.
  (saved_owned,), (new_owned,) = saved.chunk_error, new.chunk_error
  assert new_owned.shape == (count, 1, 19 // count + 1, 512)
  old_vector, new_vector = _owner_vector(saved_owned), _owner_vector(new_owned)
  np.testing.assert_array_equal(new_vector[:_SEGMENT], old_vector[:_SEGMENT])
  np.testing.assert_array_equal(new_vector[_SEGMENT:], 0)
  # Replicated state (the key, the count, the momentum) is copied.
  np.testing.assert_array_equal(new.count, np.full(count, 3))
  np.testing.assert_array_equal(jax.random.key_data(new.key),
                                np.asarray(jax.random.key_data(saved.key))[:count])
  np.testing.assert_array_equal(resized[1][0].trace["w"],
                                np.asarray(state[1][0].trace["w"])[:count])

  params, stepped = jax.block_until_ready(
      step(_stacked(jax.tree.map(lambda x: np.asarray(x)[0], params), count), resized,
           _grads(count, 9)))
  assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(host_arrays(params)))
  assert np.asarray(stepped[0].count)[0] == 4


@pytest.mark.slow
def test_shard_map_layout_from_8_devices_to_4_steps_there():
  mesh8 = jax.make_mesh((SAVED,), (AXIS,))
  mesh4 = jax.make_mesh((4,), (AXIS,), devices=jax.devices()[:4])

  def loss(params, batch):
    return sum(jnp.mean((params[name] - batch[name]) ** 2) for name in params)

  def train(mesh, params, state, seed):
    program = qsgd_jax.data_parallel(loss, _optimizer(), mesh, AXIS)
    batch = jax.device_put(_grads(mesh.size, seed), NamedSharding(mesh, P(AXIS)))
    return program, program.step(params, state, batch)

  params = jax.device_put(_PARAMS, NamedSharding(mesh8, P()))
  program8 = qsgd_jax.data_parallel(loss, _optimizer(), mesh8, AXIS)
  state = program8.init(params)
  _, (params, state, _) = train(mesh8, params, state, 0)

  program4 = qsgd_jax.data_parallel(loss, _optimizer(), mesh4, AXIS)
  params4 = jax.device_put(jax.device_get(params), NamedSharding(mesh4, P()))
  abstract = program4.abstract_state(params4)
  resized = qsgd_jax.resize_state(jax.device_get(state), abstract, from_devices=SAVED,
                                  to_devices=4)
  (saved_local,), (new_local,) = state[0].local_error, resized[0].local_error
  assert new_local.shape == (4 * _SEGMENT,)  # Four devices' residuals end to end.
  np.testing.assert_allclose(
      np.asarray(new_local).reshape(4, -1),
      np.broadcast_to(np.asarray(saved_local).reshape(SAVED, -1).mean(axis=0), (4, _SEGMENT)),
      rtol=1e-6, atol=1e-7)
  old_vector, new_vector = (_owner_vector(state[0].chunk_error[0]),
                            _owner_vector(resized[0].chunk_error[0]))
  np.testing.assert_array_equal(new_vector[:_SEGMENT], old_vector[:_SEGMENT])

  placed = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), resized, abstract)
  _, (params4, state4, value) = train(mesh4, params4, placed, 1)
  assert np.isfinite(float(value))
  assert int(state4[0].count) == 2


class _Buffers(NamedTuple):
  """A state of another family: a worker's error and an owner's piece, a device each."""

  error: jax.Array
  server: jax.Array
  count: jax.Array


qsgd_jax.resize.register(_Buffers, "error", qsgd_jax.resize.mean, residual=True)
qsgd_jax.resize.register(_Buffers, "server", qsgd_jax.resize.pieces(), residual=True)


def test_a_registered_state_resizes_by_its_rules_and_drop_zeroes_its_residuals():
  rng = np.random.default_rng(0)
  saved = {"buffers": _Buffers(rng.normal(size=(SAVED, 6)).astype(np.float32),
                               np.arange(SAVED * 5, dtype=np.float32).reshape(SAVED, 5),
                               np.full(SAVED, 7, np.int32))}
  target = {"buffers": _Buffers(jax.ShapeDtypeStruct((2, 6), jnp.float32),
                                jax.ShapeDtypeStruct((2, 20), jnp.float32),
                                jax.ShapeDtypeStruct((2,), jnp.int32))}
  resized = qsgd_jax.resize_state(saved, target, from_devices=SAVED, to_devices=2,
                                  stacked=True)["buffers"]
  np.testing.assert_allclose(resized.error, np.tile(saved["buffers"].error.mean(0), (2, 1)),
                             rtol=1e-6)
  np.testing.assert_array_equal(resized.server.reshape(-1), np.arange(40))  # 8 x 5 as 2 x 20.
  np.testing.assert_array_equal(resized.count, [7, 7])

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    dropped = qsgd_jax.resize_state(saved, target, from_devices=SAVED, to_devices=2,
                                    stacked=True, drop=True)["buffers"]
  message, = [str(w.message) for w in caught]
  assert "dropped the error-feedback residuals _Buffers.error, _Buffers.server saved on 8" \
      in message and "\n" not in message
  assert not dropped.error.any() and not dropped.server.any()
  np.testing.assert_array_equal(dropped.count, [7, 7])


def test_accumulated_gradients_are_averaged_and_decentralized_workers_restart_from_worker_0():
  rng = np.random.default_rng(1)
  params = {"w": jnp.zeros((4, 3))}
  accumulate = qsgd_jax.accumulate_gradients(optax.sgd(0.1), every_k_steps=4)
  ring = qsgd_jax.low_precision_decentralized(optax.sgd(0.1, momentum=0.9), AXIS)
  models = rng.normal(size=(SAVED, 4, 3)).astype(np.float32)
  saved = list(jax.device_get(_stacked((accumulate.init(params), ring.init(params)), SAVED)))
  saved[0] = saved[0]._replace(accumulated=(rng.normal(size=(SAVED, 12)).astype(np.float32),))
  # Every replica holds its peer's model: worker i's left one is worker i - 1's.
  saved[1] = saved[1]._replace(left_replica={"w": np.roll(models, 1, axis=0)},
                               right_replica={"w": np.roll(models, -1, axis=0)})
  target = jax.eval_shape(lambda: _stacked((accumulate.init(params), ring.init(params)), 4))
  accumulated, decentralized = qsgd_jax.resize_state(
      (saved[0], saved[1]), target, from_devices=SAVED, to_devices=4, stacked=True)
  np.testing.assert_allclose(accumulated.accumulated[0],
                             np.tile(saved[0].accumulated[0].mean(0), (4, 1)), rtol=1e-6)
  for replica in (decentralized.left_replica, decentralized.right_replica):
    np.testing.assert_array_equal(replica["w"], np.broadcast_to(models[0], (4, 4, 3)))


def test_owner_residuals_of_stacked_whole_leaf_segments_are_refused_naming_the_leaf():
  # One scale a leaf: both leaves are whole-leaf segments of one width, stacked in one block.
  params = {"a": jnp.zeros(4096), "b": jnp.zeros(4096)}

  def init_on(count):
    return _stacked(qsgd_jax.qsgd(AXIS, bucket_size=None, error_feedback="owner",
                                  min_compressed_size=0, axis_size=count).init(params), count)

  saved = jax.device_get(init_on(SAVED))
  with pytest.raises(ValueError, match=r"resize_state: \.chunk_error: blocks .* cannot be "
                     r"matched .*\(8 devices saved it, 4 now\)\. Pass drop=True"):
    qsgd_jax.resize_state(saved, jax.eval_shape(lambda: init_on(4)), from_devices=SAVED,
                          to_devices=4, stacked=True)
  with pytest.warns(UserWarning, match="dropped"):
    qsgd_jax.resize_state(saved, jax.eval_shape(lambda: init_on(4)), from_devices=SAVED,
                          to_devices=4, stacked=True, drop=True)


def test_other_mismatches_name_the_leaf_and_both_device_counts():
  saved = {"step": np.zeros((), np.float32), "table": np.zeros((SAVED * 3,), np.float32)}
  with pytest.raises(ValueError, match=r"resize_state: \['table'\]: .*\(8 devices saved it, 2 "
                     r"now\)"):
    qsgd_jax.resize_state(saved, {"step": jnp.zeros(()), "table": jnp.zeros((6,))},
                          from_devices=SAVED, to_devices=2)
  with pytest.raises(ValueError, match=r"saved tree differs from the target's"):
    qsgd_jax.resize_state(saved, {"step": jnp.zeros(())}, from_devices=SAVED, to_devices=2)
  with pytest.raises(ValueError, match="another configuration"):
    qsgd_jax.resize_state(saved, {"step": jnp.zeros(()), "table": jnp.zeros((6,))},
                          from_devices=2, to_devices=2)
  with pytest.raises(ValueError, match="to_devices must be a positive int"):
    qsgd_jax.resize_state(saved, saved, from_devices=SAVED, to_devices=0)
