"""Flax NNX: an nnx.Optimizer whose chain starts with a quantized all-reduce.

In Flax 0.12 modules and optimizers are pytrees: they go through
``jax.pmap`` and ``jax.shard_map`` as they are, and their optax state keeps
its NamedTuples with ``nnx.OptArray`` variables for arrays. ``nnx.state``
turns the same state into an ``nnx.State``, each NamedTuple a mapping of its
fields.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import jax_utils, nnx
from helpers import assert_replicas_identical, host_arrays
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qsgd_jax

AXIS = "batch"
NUM_DEVICES = 8
_INPUTS = jax.random.normal(jax.random.key(1), (NUM_DEVICES * 16, 64))
_LABELS = jax.random.randint(jax.random.key(2), (NUM_DEVICES * 16,), 0, 10)


class MLP(nnx.Module):
  """64 -> 128 -> 10: the hidden kernel (8192) and the output kernel (1280) are compressed."""

  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(64, 128, rngs=rngs)
    self.out = nnx.Linear(128, 10, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.nn.relu(self.hidden(x)))


def _loss(model, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


# One object: an nnx.Optimizer keeps its transform in its pytree metadata, which
# the specs of shard_map must match.
_TX = optax.chain(
    qsgd_jax.onebit_sgd(AXIS, error_feedback="both", min_compressed_size=1024,
                        axis_size=NUM_DEVICES),
    optax.sgd(0.05, momentum=0.9))


def _create_optimizer(model):
  return nnx.Optimizer(model, _TX, wrt=nnx.Param)


def _optimizer_forms():
  optimizer = _create_optimizer(MLP(nnx.Rngs(0)))
  return {"optimizer": optimizer, "opt_state": optimizer.opt_state,
          "nnx.State": nnx.state(optimizer)}


def _is_residual(path) -> bool:
  names = {getattr(entry, "name", getattr(entry, "key", None)) for entry in path}
  return bool(names & {"local_error", "chunk_error"})


@pytest.mark.parametrize("form", ["optimizer", "opt_state", "nnx.State"])
def test_state_partition_specs_lay_nnx_residuals_along_the_axis(form):
  state = _optimizer_forms()[form]
  specs = qsgd_jax.state_partition_specs(state, AXIS)
  # The structure of the state, variables included, with a spec for each array.
  assert (jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, P))
          == jax.tree.structure(state))
  paths = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
  residuals = [spec for path, spec in paths if _is_residual(path)]
  assert residuals == [P(AXIS), P(AXIS)]  # Both kernels in one block, for each residual.
  assert all(spec == P() for path, spec in paths if not _is_residual(path))


@pytest.mark.parametrize("tx", [
    qsgd_jax.accumulate_gradients(
        optax.chain(qsgd_jax.qsgd(AXIS, error_feedback="worker"), optax.adam(1e-3)), 2),
    qsgd_jax.low_precision_decentralized(optax.sgd(0.1, momentum=0.9), AXIS),
], ids=["accumulate_gradients", "low_precision_decentralized"])
def test_state_partition_specs_of_nnx_states_match_the_optax_states(tx):
  model = MLP(nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  expected = qsgd_jax.state_partition_specs(tx.init(params), AXIS)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  # The variables hold the same arrays in the same order: so do the specs.
  is_spec = lambda x: isinstance(x, P)  # noqa: E731
  assert (jax.tree.leaves(qsgd_jax.state_partition_specs(optimizer.opt_state, AXIS), is_spec)
          == jax.tree.leaves(expected, is_spec))
  in_state = qsgd_jax.state_partition_specs(nnx.state(optimizer), AXIS)
  assert (sorted(map(str, jax.tree.leaves(in_state, is_spec)))
          == sorted(map(str, jax.tree.leaves(expected, is_spec) + [P()])))  # And the step.
  assert P(AXIS) in jax.tree.leaves(in_state, is_spec)


def test_compression_stats_are_arrays_in_every_nnx_form():
  for form, state in _optimizer_forms().items():
    stats = qsgd_jax.compression_stats(state)
    assert isinstance(stats, qsgd_jax.CompressionStats), form
    for field in stats:
      assert isinstance(field, jax.Array) and field.shape == (), form


def _devices_data(mesh=None):
  if mesh is None:  # pmap: a leading device axis.
    return (_INPUTS.reshape(NUM_DEVICES, -1, 64), _LABELS.reshape(NUM_DEVICES, -1))
  return tuple(jax.device_put(a, NamedSharding(mesh, P(AXIS))) for a in (_INPUTS, _LABELS))


def _train_step(model, optimizer, x, y):
  # Each device's own gradient: that of its (varying) copy of the model under shard_map.
  loss, grads = nnx.value_and_grad(_loss)(qsgd_jax.as_varying(model, AXIS), x, y)
  optimizer.update(model, grads)
  return model, optimizer, jax.lax.pmean(loss, AXIS)


def _train_pmap(num_steps):
  model = jax_utils.replicate(MLP(nnx.Rngs(0)))
  optimizer = jax.pmap(_create_optimizer, axis_name=AXIS)(model)
  step = jax.pmap(_train_step, axis_name=AXIS)
  losses = []
  for _ in range(num_steps):
    model, optimizer, loss = step(model, optimizer, *_devices_data())
    assert_replicas_identical(nnx.state(model))
    losses.append(float(loss[0]))
  return jax.tree.map(lambda x: x[0], nnx.state(model)), losses, optimizer


def _device_copies(tree):
  """``[devices, ...]`` of every leaf: what each device holds of it."""
  return jax.tree.map(lambda x: np.stack([np.asarray(s.data) for s in x.addressable_shards]),
                      tree)


def _train_shard_map(num_steps):
  mesh = jax.make_mesh((NUM_DEVICES,), (AXIS,))
  model = jax.device_put(MLP(nnx.Rngs(0)), NamedSharding(mesh, P()))
  specs = qsgd_jax.state_partition_specs(jax.eval_shape(_create_optimizer, model), AXIS)
  optimizer = jax.jit(jax.shard_map(
      _create_optimizer, mesh=mesh, in_specs=P(), out_specs=specs))(model)
  step = jax.jit(functools.partial(
      jax.shard_map, mesh=mesh, in_specs=(P(), specs, P(AXIS), P(AXIS)),
      out_specs=(P(), specs, P()))(_train_step))
  losses = []
  for _ in range(num_steps):
    model, optimizer, loss = step(model, optimizer, *_devices_data(mesh))
    assert_replicas_identical(_device_copies(nnx.state(model)))
    losses.append(float(loss))
  return nnx.state(model), losses, optimizer


@pytest.mark.slow
def test_nnx_optimizer_trains_under_pmap_and_shard_map_alike():
  pmap_params, pmap_losses, pmap_optimizer = _train_pmap(3)
  params, losses, optimizer = _train_shard_map(3)
  assert losses[-1] < losses[0]
  assert float(qsgd_jax.compression_stats(optimizer).compression_ratio) > 5
  chex.assert_trees_all_equal(host_arrays(params), host_arrays(pmap_params))
  np.testing.assert_array_equal(losses, pmap_losses)
  # Device 0's residuals: shard_map lays them along the axis, pmap stacks them.
  for ours, stacked in zip(jax.tree.leaves(optimizer.opt_state[0].local_error),
                           jax.tree.leaves(pmap_optimizer.opt_state[0].local_error), strict=True):
    np.testing.assert_array_equal(np.asarray(ours).reshape(stacked.shape), np.asarray(stacked))
  assert jnp.any(jnp.asarray(jax.tree.leaves(optimizer.opt_state[0].local_error)[0]) != 0)
