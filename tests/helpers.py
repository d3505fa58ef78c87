"""Helpers shared by the test modules; pytest puts `tests/` on the path, so `import helpers`."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def is_key(x) -> bool:
  """Whether ``x`` is a typed PRNG key array."""
  return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def host_arrays(tree):
  """``tree`` as numpy arrays, typed PRNG keys as their key data."""
  return jax.tree.map(lambda x: np.asarray(jax.random.key_data(x) if is_key(x) else x), tree)


def placed_like(like, array):
  """The host copy ``array`` of ``like`` (a typed key's key data), placed on the devices as
  ``like`` is: a restored state then runs the programs compiled for ``like``'s layout, rather
  than compiling them again for arrays on one device."""
  if is_key(like):
    data = jax.device_put(array, jax.random.key_data(like).sharding)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(like))
  return jax.device_put(array, like.sharding)


def assert_replicas_identical(tree):
  """Every row (device) of every leaf equals row 0 bit for bit."""
  for leaf in jax.tree.leaves(host_arrays(tree)):
    np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape))


def apply_step(tx, params, state, grads):
  """One step of ``tx``: the new params and state."""
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


@contextlib.contextmanager
def backend_compiles():
  """Yields a list that gets one entry (its duration) each time XLA compiles a program."""
  durations = []

  def listener(event, duration, **kwargs):
    del kwargs
    if event == _BACKEND_COMPILE:
      durations.append(duration)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield durations
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
