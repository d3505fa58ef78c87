"""Tests of low-precision decentralized SGD on a ring (DCD-PSGD)."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import backend_compiles
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sklearn.datasets import load_digits

import qsgd_jax
from qsgd_jax import (
  LowPrecisionDecentralizedState,
  averaged_params,
  consensus_distance,
  low_precision_decentralized,
)

AXIS = "workers"
NUM_WORKERS = 8


def _stacked(tree, n):
  """The same pytree for each of ``n`` workers, along a new leading axis."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), tree)


def _roll(tree, shift):
  """Worker ``i`` gets worker ``i - shift``'s slice."""
  return jax.tree.map(lambda x: np.roll(np.asarray(x), shift, axis=0), tree)


def _assert_replicas_are_peers(params, state):
  """The left replica of worker i is worker i - 1's params, the right one i + 1's."""
  chex.assert_trees_all_equal(_roll(params, 1), jax.tree.map(np.asarray, state.left_replica))
  chex.assert_trees_all_equal(_roll(params, -1), jax.tree.map(np.asarray, state.right_replica))


# A quadratic per worker: f_i(x) = ||x - c_i||^2 / 2, whose sum is least at mean(c).

_QUADRATIC_STEPS = 300


def _quadratic_optimizer():
  # Decentralized SGD with a constant step stays O(step) away from consensus on
  # heterogeneous objectives; a step decaying to zero lets every worker reach the optimum.
  schedule = optax.cosine_decay_schedule(0.2, _QUADRATIC_STEPS)
  return low_precision_decentralized(optax.sgd(schedule), AXIS, key=3)


def _train_quadratic(params, target):
  """One worker's run; ``params`` and ``target`` are this worker's ``[dim]`` slices."""
  optimizer = _quadratic_optimizer()

  def step(carry, _):
    params, state = carry
    updates, state = optimizer.update(params - target, state, params)
    return (optax.apply_updates(params, updates), state), None

  (params, state), _ = jax.lax.scan(
      step, (params, optimizer.init(params)), length=_QUADRATIC_STEPS
  )
  return params, state, consensus_distance(params, AXIS), averaged_params(params, AXIS)


def _quadratic_problem():
  targets = 3.0 * np.random.default_rng(1).normal(size=(NUM_WORKERS, 16)).astype(np.float32)
  return np.zeros((NUM_WORKERS, 16), np.float32), targets


def _check_quadratic(params, state, distance, average, targets):
  optimum = targets.mean(axis=0)
  params = np.asarray(params)
  np.testing.assert_allclose(params, np.broadcast_to(optimum, params.shape), atol=2e-2)
  np.testing.assert_allclose(np.asarray(average), np.broadcast_to(optimum, params.shape), atol=2e-2)
  np.testing.assert_array_less(np.asarray(distance), 1e-2)
  _assert_replicas_are_peers(params, state)


def test_quadratic_converges_under_pmap():
  params, targets = _quadratic_problem()
  outputs = jax.pmap(_train_quadratic, AXIS)(params, targets)
  _check_quadratic(*jax.block_until_ready(outputs), targets)


def test_quadratic_converges_under_shard_map():
  mesh = jax.make_mesh((NUM_WORKERS,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))
  sharding = NamedSharding(mesh, P(AXIS))

  def train(params, target):  # Each worker's block has a leading axis of 1.
    outputs = _train_quadratic(params[0], target[0])
    return jax.tree.map(lambda x: x[None], outputs)

  train = jax.jit(jax.shard_map(train, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
  params, targets = _quadratic_problem()
  outputs = train(jax.device_put(params, sharding), jax.device_put(targets, sharding))
  _check_quadratic(*jax.block_until_ready(outputs), targets)


# The invariant, step by step: what a worker holds of its peers is their model.


def _two_leaf_problem(num_workers):
  rng = np.random.default_rng(7)
  params = {"w": rng.normal(size=(3, 5)).astype(np.float32), "b": jnp.zeros(5, jnp.bfloat16)}
  inputs = rng.normal(size=(num_workers, 4, 3)).astype(np.float32)
  labels = rng.normal(size=(num_workers, 4, 5)).astype(np.float32)
  return _stacked(params, num_workers), inputs, labels


def _loss(params, inputs, labels):
  predictions = inputs @ params["w"] + params["b"].astype(jnp.float32)
  return 0.5 * jnp.mean(jnp.square(predictions - labels))


def _pmapped_training(optimizer, num_workers):
  """Pmapped ``init`` and ``step``; ``init`` passes params through, so every step's
  inputs have the same shardings and only the first step compiles."""
  pmap = functools.partial(jax.pmap, axis_name=AXIS, devices=jax.devices()[:num_workers])

  @pmap
  def init(params):
    return params, optimizer.init(params)

  @pmap
  def step(params, state, inputs, labels):
    grads = jax.grad(_loss)(params, inputs, labels)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state, updates

  return init, step


@pytest.mark.parametrize(
    "compressor",
    # MinMax: one bucket a leaf, each leaf encoded alone. QSGD in buckets of 4:
    # the leaves (15 and 5 elements, one bf16) side by side in one encode.
    [qsgd_jax.MinMax(bits=8), qsgd_jax.QSGD(bits=4, bucket_size=4)],
    ids=["minmax8_each_leaf", "qsgd4_leaves_side_by_side"],
)
@pytest.mark.parametrize("num_workers", [NUM_WORKERS, 2])
def test_replicas_equal_peers_bit_for_bit(num_workers, compressor):
  optimizer = low_precision_decentralized(optax.adam(0.05), AXIS, compressor=compressor, key=11)
  init, step = _pmapped_training(optimizer, num_workers)
  params, inputs, labels = _two_leaf_problem(num_workers)
  params, state = jax.block_until_ready(init(params))
  _assert_replicas_are_peers(params, state)
  for _ in range(4):
    params, state, updates = jax.block_until_ready(step(params, state, inputs, labels))
    _assert_replicas_are_peers(params, state)
  assert np.any(np.asarray(updates["w"]) != 0.0)  # QSGD may round some to zero.
  assert np.asarray(params["b"]).dtype == jnp.bfloat16


@pytest.mark.parametrize("num_workers", [NUM_WORKERS, 2])
def test_stats_count_the_bytes_the_hlo_sends(num_workers):
  optimizer = low_precision_decentralized(optax.sgd(0.1), AXIS, key=3)
  init, step = _pmapped_training(optimizer, num_workers)
  params, inputs, labels = _two_leaf_problem(num_workers)
  params, state = jax.block_until_ready(init(params))
  assert np.all(np.isnan(np.asarray(qsgd_jax.compression_stats(state).wire_bits)))
  hlo = step.lower(params, state, inputs, labels).compile().as_text()
  _, state, _ = jax.block_until_ready(step(params, state, inputs, labels))
  stats = jax.tree.map(lambda x: float(np.asarray(x)[0]), qsgd_jax.compression_stats(state))
  assert stats.wire_bits == 8 * qsgd_jax.wire_bytes(hlo)  # The ring messages, nothing else.
  num_params = 3 * 5 + 5
  assert stats.float32_bits == pytest.approx(2 * (num_workers - 1) / num_workers * 32 * num_params)
  assert stats.compression_ratio == pytest.approx(stats.float32_bits / stats.wire_bits)


def test_second_step_does_not_recompile():
  optimizer = low_precision_decentralized(optax.sgd(0.1), AXIS)
  init, step = _pmapped_training(optimizer, NUM_WORKERS)
  params, inputs, labels = _two_leaf_problem(NUM_WORKERS)
  params, state = init(params)
  params, state, _ = jax.block_until_ready(step(params, state, inputs, labels))
  with backend_compiles() as compiles:
    params, state, _ = jax.block_until_ready(step(params, state, inputs, labels))
  assert not compiles
  assert isinstance(state, LowPrecisionDecentralizedState)


def test_workers_draw_their_own_rounding():
  # Same params and gradient everywhere: the workers' quantized steps differ only by rounding.
  optimizer = low_precision_decentralized(optax.sgd(1.0), AXIS)

  @functools.partial(jax.pmap, axis_name=AXIS)
  def first_update(params, grads):
    return optimizer.update(grads, optimizer.init(params), params)[0]

  params = jnp.zeros((NUM_WORKERS, 1000))
  grads = _stacked(jnp.sin(jnp.arange(1000.0)), NUM_WORKERS)
  updates = np.asarray(jax.block_until_ready(first_update(params, grads)))
  for i in range(1, NUM_WORKERS):
    assert np.mean(updates[i] != updates[0]) > 0.25  # 1/3 expected.


# Digits: the averaged decentralized model against float32 all-reduce.

_DIGITS_STEPS = 150


def _digits_split():
  data = load_digits()
  order = np.random.default_rng(0).permutation(len(data.target))
  inputs = (data.data[order] / 16.0).astype(np.float32)
  labels = data.target[order].astype(np.int32)
  per_worker = 1440 // NUM_WORKERS
  train_inputs = inputs[:1440].reshape(NUM_WORKERS, per_worker, -1)
  train_labels = labels[:1440].reshape(NUM_WORKERS, per_worker)
  return train_inputs, train_labels, inputs[1440:], labels[1440:]


def _digits_loss(params, inputs, labels):
  logits = inputs @ params["w"] + params["b"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _train_digits(optimizer, average_gradients):
  """Softmax regression, 150 full-batch steps on each worker's shard."""

  def train(params, inputs, labels):
    def step(carry, _):
      params, state = carry
      grads = jax.grad(_digits_loss)(params, inputs, labels)
      if average_gradients:
        grads = jax.lax.pmean(grads, AXIS)
      updates, state = optimizer.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), None

    (params, _), _ = jax.lax.scan(step, (params, optimizer.init(params)), length=_DIGITS_STEPS)
    return averaged_params(params, AXIS), consensus_distance(params, AXIS)

  return jax.pmap(train, AXIS)


def _accuracy(params, inputs, labels):
  logits = inputs @ params["w"] + params["b"]
  return 100.0 * float(np.mean(np.argmax(logits, axis=1) == labels))


def test_digits_averaged_model_matches_all_reduce():
  train_inputs, train_labels, test_inputs, test_labels = _digits_split()
  params = _stacked({"w": jnp.zeros((64, 10)), "b": jnp.zeros(10)}, NUM_WORKERS)
  inner = optax.sgd(0.5, momentum=0.9)
  all_reduce, _ = _train_digits(inner, average_gradients=True)(params, train_inputs, train_labels)
  decentralized, distance = _train_digits(
      low_precision_decentralized(inner, AXIS), average_gradients=False
  )(params, train_inputs, train_labels)
  all_reduce, decentralized, distance = jax.block_until_ready(
      (all_reduce, decentralized, distance)
  )
  first = functools.partial(jax.tree.map, lambda x: np.asarray(x[0]))
  reference = _accuracy(first(all_reduce), test_inputs, test_labels)
  accuracy = _accuracy(first(decentralized), test_inputs, test_labels)
  assert reference > 90.0
  assert accuracy > reference - 2.0, (accuracy, reference)
  # The workers' models stay within a few percent of their average (1.7% measured).
  average_norm = math.sqrt(sum(np.sum(x**2) for x in jax.tree.leaves(first(decentralized))))
  assert float(distance[0]) < 0.05 * average_norm


# Errors.


def test_axis_of_size_one_is_refused():
  optimizer = low_precision_decentralized(optax.sgd(0.1), AXIS)

  def step(params):
    return optimizer.update(params, optimizer.init(params), params)[0]

  with pytest.raises(ValueError, match="at least 2 workers"):
    jax.pmap(step, AXIS, devices=jax.devices()[:1])(jnp.zeros((1, 3)))


def test_unbound_axis_is_named():
  optimizer = low_precision_decentralized(optax.sgd(0.1), AXIS)
  params = jnp.zeros(3)
  with pytest.raises(NameError, match="is not bound"):
    optimizer.update(params, optimizer.init(params), params)


def test_update_without_params_is_refused():
  optimizer = low_precision_decentralized(optax.sgd(0.1), AXIS)
  params = jnp.zeros(3)
  with pytest.raises(ValueError, match="needs the worker's params"):
    optimizer.update(params, optimizer.init(params))


@pytest.mark.parametrize("compressor", [None, "MinMax", lambda x: x])
def test_non_compressor_is_refused(compressor):
  with pytest.raises(TypeError, match="must be a qsgd_jax.Compressor"):
    low_precision_decentralized(optax.sgd(0.1), AXIS, compressor=compressor)


def test_unknown_topology_is_refused():
  with pytest.raises(ValueError, match="topology"):
    low_precision_decentralized(optax.sgd(0.1), AXIS, topology="torus")


def test_integer_parameter_is_named():
  optimizer = low_precision_decentralized(optax.sgd(0.1), AXIS)
  with pytest.raises(TypeError, match=r"\['layer'\]\['count'\]"):
    optimizer.init({"layer": {"count": jnp.zeros(2, jnp.int32), "w": jnp.zeros(2)}})


# What goes on the wire, read from the compiled HLO.

def _permuted_bytes(hlo_text):
  """Bytes a device receives through collective permutes, and the other collectives' kinds."""
  collectives = qsgd_jax.collectives_in_hlo(hlo_text)
  permuted = sum(c.result_bytes for c in collectives if c.kind == "collective-permute")
  return permuted, {c.kind for c in collectives} - {"collective-permute"}


def _compiled_step_text(num_workers, compressor):
  mesh = jax.make_mesh(
      (num_workers,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,),
      devices=jax.devices()[:num_workers],
  )
  optimizer = low_precision_decentralized(optax.sgd(0.1), AXIS, compressor=compressor)

  def step(params):
    params = jax.tree.map(lambda x: x[0], params)
    updates, state = optimizer.update(params, optimizer.init(params), params)
    return jax.tree.map(lambda x: x[None], (updates, state))

  step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
  params = _stacked({"w": jnp.ones((100, 100)), "b": jnp.ones(100)}, num_workers)
  params = jax.device_put(params, NamedSharding(mesh, P(AXIS)))
  return step.lower(params).compile().as_text()


def test_wire_carries_one_quarter_of_float32_a_neighbour():
  compressor = qsgd_jax.MinMax(bits=8)
  text = _compiled_step_text(NUM_WORKERS, compressor)
  float32_bytes = 4 * (100 * 100 + 100)
  payload_bytes = (compressor.wire_bits((100, 100)) + compressor.wire_bits((100,))) // 8
  received, other_collectives = _permuted_bytes(text)
  assert received == 2 * payload_bytes  # One payload from each neighbour.
  assert 0.25 <= received / 2 / float32_bytes <= 0.251
  assert not other_collectives  # No all-reduce, no all-gather.
  # The bytes do not grow with the number of workers.
  assert _permuted_bytes(_compiled_step_text(4, compressor)) == (received, set())
