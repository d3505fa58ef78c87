"""Arguments as users pass them: integer-like seeds, and optax.inject_hyperparams."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_replicas_identical, host_arrays

import qsgd_jax

AXIS = "batch"
NUM_DEVICES = 8
_STATIC_QSGD_OPTIONS = ("bits", "bucket_size", "warmup_steps", "min_compressed_size")


def _state_key(tx):
  return jax.random.key_data(tx.init(jnp.zeros(8192)).key)


@pytest.mark.parametrize("seed", [
    np.int64(3), np.uint8(3), jnp.int32(3), jnp.array(3, jnp.uint32), np.array(3)],
    ids=["np.int64", "np.uint8", "jnp.int32", "jnp.uint32", "0-d np.ndarray"])
def test_integer_like_seeds_give_the_key_of_their_python_int(seed):
  expected = jax.random.key_data(jax.random.key(3))
  for factory in (qsgd_jax.qsgd, qsgd_jax.onebit_sgd):
    np.testing.assert_array_equal(_state_key(factory(AXIS, key=seed)), expected)
  decentralized = qsgd_jax.low_precision_decentralized(optax.sgd(0.1), AXIS, key=seed)
  np.testing.assert_array_equal(
      jax.random.key_data(decentralized.init(jnp.zeros(8)).key), expected)


def test_a_traced_seed_gives_the_key_of_its_value():
  init = jax.jit(lambda seed: qsgd_jax.qsgd(AXIS, key=seed).init(jnp.zeros(8192)).key)
  np.testing.assert_array_equal(jax.random.key_data(init(jnp.int32(3))),
                                jax.random.key_data(jax.random.key(3)))


@pytest.mark.parametrize("seed", [True, np.bool_(False), 1.5, jnp.zeros(3, jnp.int32)],
                         ids=["bool", "np.bool_", "float", "int32[3]"])
def test_other_keys_are_type_errors(seed):
  with pytest.raises(TypeError, match="integer seed"):
    qsgd_jax.qsgd(AXIS, key=seed).init(jnp.zeros(8192))


def _pmap_updates(tx, grads):
  state = jax.pmap(tx.init, axis_name=AXIS)(jnp.zeros((NUM_DEVICES, 8192)))
  return jax.pmap(tx.update, axis_name=AXIS)(grads, state)


def _gradients():
  return jax.random.normal(jax.random.key(0), (NUM_DEVICES, 8192))


@pytest.mark.parametrize("factory, owner", [
    (qsgd_jax.qsgd, "qsgd_jax.qsgd"), (qsgd_jax.onebit_sgd, "qsgd_jax.onebit_sgd")])
def test_inject_hyperparams_without_static_args_names_them(factory, owner):
  tx = optax.inject_hyperparams(factory)(AXIS)
  with pytest.raises(TypeError, match=rf"{owner}: .*bucket_size.*static_args=\("):
    jax.pmap(tx.init, axis_name=AXIS)(jnp.zeros((NUM_DEVICES, 8192)))


def test_inject_hyperparams_with_static_args_matches_the_plain_transform():
  injected = optax.inject_hyperparams(qsgd_jax.qsgd, static_args=_STATIC_QSGD_OPTIONS)(
      AXIS, bits=8, key=5, method="psum")
  updates, state = _pmap_updates(injected, _gradients())
  # The seed is the one traced hyperparameter; the key it gives is the same.
  assert set(state.hyperparams) == {"key"}
  expected, _ = _pmap_updates(qsgd_jax.qsgd(AXIS, bits=8, key=5, method="psum"),
                              _gradients())
  chex.assert_trees_all_equal(host_arrays(updates), host_arrays(expected))
  assert_replicas_identical(updates)


# The transform inside optax.inject_hyperparams under pmap is the test above's; a learning
# rate that changes between steps, transforms_test's
# test_inject_hyperparams_learning_rate_changes_mid_run. This schedule of a whole chain: slow.
@pytest.mark.slow
def test_inject_hyperparams_of_a_chain_schedules_the_learning_rate():
  tx = optax.inject_hyperparams(
      lambda learning_rate: optax.chain(qsgd_jax.qsgd(AXIS, track_elias=False),
                                       optax.sgd(learning_rate)))(
          learning_rate=optax.linear_schedule(1.0, 0.0, transition_steps=2))
  state = jax.pmap(tx.init, axis_name=AXIS)(jnp.zeros((NUM_DEVICES, 8192)))
  update = jax.pmap(tx.update, axis_name=AXIS)
  first, state = update(_gradients(), state)
  second, state = update(_gradients(), state)
  # The same quantized mean (the key is split in between) at learning rates 1 and 0.5.
  np.testing.assert_allclose(np.abs(second).mean() / np.abs(first).mean(), 0.5, rtol=0.02)
  assert_replicas_identical(second)
