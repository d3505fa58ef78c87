"""Tests of DiLoCo and Streaming DiLoCo (qsgd_jax.diloco) against NumPy references."""

import chex
import diloco_reference as reference
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qsgd_jax
from qsgd_jax import DiLoCoState, diloco

AXIS = "workers"
WORKERS = 8


def _params():
  """A Flax-like tree: three top-level modules, four leaves."""
  rng = np.random.default_rng(0)
  return {"params": {
      "Block_0": {"kernel": rng.normal(size=(4, 3)).astype(np.float32)},
      "Block_1": {"bias": rng.normal(size=(3,)).astype(np.float32),
                  "kernel": rng.normal(size=(4, 3)).astype(np.float32)},
      "Embed_0": {"embedding": rng.normal(size=(5, 3)).astype(np.float32)},
  }}


# Leaves in jax.tree.leaves order: Block_0/kernel, Block_1/bias, Block_1/kernel, Embed_0.
_TWO_FRAGMENTS = (0, 1, 1, 0)


def _targets(steps, workers=WORKERS, seed=1):
  """Worker m's target at step t, one a leaf: its gradient is params - target."""
  rng = np.random.default_rng(seed)
  leaves = jax.tree.leaves(_params())
  return [[rng.normal(size=(workers, *x.shape)).astype(np.float32) for x in leaves]
          for _ in range(steps)]


def _reference_grad(targets):
  return lambda m, t, theta: [x - c[m] for x, c in zip(theta, targets[t], strict=True)]


def _stack(tree, n=WORKERS):
  return jax.tree.map(lambda x: np.broadcast_to(x, (n, *np.shape(x))).copy(), tree)


def _step(tx):
  def step(params, state, target):
    grads = jax.tree.map(lambda x, c: x - c, params, target)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return step


def _run_pmap(tx, targets, steps):
  """Local params and state after every step, under jax.pmap."""
  treedef = jax.tree.structure(_params())
  params = _stack(_params())
  state = jax.pmap(tx.init, axis_name=AXIS)(params)
  step = jax.pmap(_step(tx), axis_name=AXIS)
  history = []
  for t in range(steps):
    params, state = jax.block_until_ready(
        step(params, state, jax.tree.unflatten(treedef, targets[t])))
    history.append((params, state))
  return history


def _run_shard_map(tx, targets, steps):
  """The same under jax.shard_map, params laid out along the axis (a leading axis each)."""
  mesh = jax.make_mesh((WORKERS,), (AXIS,))
  treedef = jax.tree.structure(_params())
  specs = qsgd_jax.state_partition_specs(jax.eval_shape(tx.init, _params()), AXIS)
  own = lambda tree: jax.tree.map(lambda x: x[0], tree)  # noqa: E731
  stacked = lambda tree: jax.tree.map(lambda x: x[None], tree)  # noqa: E731
  init = jax.jit(jax.shard_map(lambda p: tx.init(own(p)), mesh=mesh, in_specs=P(AXIS),
                               out_specs=specs))
  step = jax.jit(jax.shard_map(
      lambda p, s, c: (lambda out: (stacked(out[0]), out[1]))(_step(tx)(own(p), s, own(c))),
      mesh=mesh, in_specs=(P(AXIS), specs, P(AXIS)), out_specs=(P(AXIS), specs)))
  put = lambda tree: jax.device_put(tree, NamedSharding(mesh, P(AXIS)))  # noqa: E731
  params = put(_stack(_params()))
  state = init(params)
  history = []
  for t in range(steps):
    params, state = jax.block_until_ready(
        step(params, state, put(jax.tree.unflatten(treedef, targets[t]))))
    history.append((params, state))
  return history


_RUNS = {"pmap": _run_pmap, "shard_map": _run_shard_map}


def _check_against(history, local_history, global_history, shard_map=False):
  for t, ((params, state), local, global_) in enumerate(
      zip(history, local_history, global_history, strict=True)):
    got = [np.asarray(x) for x in jax.tree.leaves(params)]
    for m in range(WORKERS):
      for leaf, want in zip(got, local[m], strict=True):
        np.testing.assert_allclose(leaf[m], want, rtol=2e-5, atol=2e-5,
                                   err_msg=f"step {t}, worker {m}")
    held = [np.asarray(x) for x in jax.tree.leaves(state.global_params)]
    for leaf, want in zip(held, global_, strict=True):
      copies = [leaf] if shard_map else list(leaf)
      for copy in copies:  # The global copy: the same bits on every device.
        np.testing.assert_array_equal(copy, copies[0])
        np.testing.assert_allclose(copy, want, rtol=2e-5, atol=2e-5, err_msg=f"step {t}")


@pytest.mark.parametrize("mapping", ["pmap", "shard_map"])
def test_algorithm1_matches_reference(mapping):
  sync_every, rounds = 3, 3
  targets = _targets(sync_every * rounds)
  tx = diloco(optax.sgd(0.1), AXIS, sync_every=sync_every)
  history = _RUNS[mapping](tx, targets, sync_every * rounds)
  local, global_ = reference.diloco(
      jax.tree.leaves(_params()), _reference_grad(targets), workers=WORKERS, rounds=rounds,
      sync_every=sync_every, inner=reference.SGD(0.1),
      outer=reference.SGD(0.7, momentum=0.9, nesterov=True))
  _check_against(history, local, global_, shard_map=mapping == "shard_map")


@pytest.mark.parametrize("mapping", ["pmap", "shard_map"])
def test_streaming_matches_reference(mapping):
  sync_every, steps = 4, 11
  targets = _targets(steps)
  tx = diloco(optax.adam(0.05), AXIS, sync_every=sync_every, fragments=2, delay=1, alpha=0.5)
  history = _RUNS[mapping](tx, targets, steps)
  local, global_ = reference.streaming_diloco(
      jax.tree.leaves(_params()), _reference_grad(targets), workers=WORKERS, steps=steps,
      sync_every=sync_every, fragment_of=_TWO_FRAGMENTS, inner=reference.Adam(0.05),
      outer=reference.SGD(0.7, momentum=0.9, nesterov=True), delay=1, alpha=0.5)
  _check_against(history, local, global_, shard_map=mapping == "shard_map")
