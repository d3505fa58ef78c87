"""Tests of low-precision decentralized SGD on a ring (DCD-PSGD)."""

import doctest
import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import references
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
from qsgd_jax._src.averaging import decentralized

AXIS = "workers"
NUM_WORKERS = 8
_NODE, _LOCAL = "node", "local"  # The hierarchical mode's ring and local axes.


def _stacked(tree, n):
  """The same pytree for each of ``n`` workers, along a new leading axis: host arrays, which
  the mapped functions place without compiling a resharding of device arrays."""
  return jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (n, *np.shape(x))), tree)


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


def test_gradients_of_replicated_params_under_shard_map_are_an_error():
  """A gradient autodiff already summed over the ring would be applied n times over."""
  mesh = jax.make_mesh((NUM_WORKERS,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))
  optimizer = low_precision_decentralized(optax.sgd(0.1), AXIS)
  params = {"w": jnp.ones((16, 16))}

  def step(params, x):
    grads = jax.grad(lambda p: jnp.sum(p["w"] @ x[0]))(params)  # Summed over AXIS.
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    return optax.apply_updates(params, updates)

  step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(AXIS)))
  x = jax.device_put(jnp.ones((NUM_WORKERS, 16)), NamedSharding(mesh, P(AXIS)))
  with pytest.raises(ValueError, match=r"leaf \['w'\] is replicated over axis 'workers'.*"
                     r"as_varying"):
    step(params, x)


# The invariant, step by step: what a worker holds of its peers is their model.


def _two_leaf_problem(num_workers):
  rng = np.random.default_rng(7)
  params = {"w": rng.normal(size=(3, 5)).astype(np.float32), "b": np.zeros(5, jnp.bfloat16)}
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


@pytest.mark.slow
@pytest.mark.parametrize(
    "compressor, bucket_bytes",
    # The leaves are b (5 bfloat16, 10 bytes) and w (15 float32). Bagua's
    # quantizer: both in one bucket, one range. MinMax: each leaf a bucket of
    # its own. QSGD in buckets of 4: the second one holds b's last element
    # and w's first three.
    [(qsgd_jax.NearestZeroAlignedMinMax(), None), (qsgd_jax.MinMax(bits=8), 1),
     (qsgd_jax.QSGD(bits=4, bucket_size=4), None)],
    ids=["nearest8_one_bucket", "minmax8_each_leaf", "qsgd4_buckets_across_leaves"],
)
@pytest.mark.parametrize("num_workers", [NUM_WORKERS, 2])
def test_replicas_equal_peers_bit_for_bit(num_workers, compressor, bucket_bytes):
  optimizer = low_precision_decentralized(
      optax.adam(0.05), AXIS, compressor=compressor, bucket_bytes=bucket_bytes, key=11)
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


@pytest.mark.parametrize("num_nodes", [4, 2])
def test_hierarchical_stats_count_the_bytes_the_hlo_sends(num_nodes):
  # Inside a node: the float32 pmean of the steps and the all-gathers of the
  # received pieces; between nodes: the pieces.
  mesh = jax.make_mesh((num_nodes, 2), (_NODE, _LOCAL), devices=jax.devices()[: 2 * num_nodes],
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  optimizer = low_precision_decentralized(optax.sgd(0.1), (_NODE, _LOCAL), key=3)

  def step(params, inputs, labels):
    params, inputs, labels = jax.tree.map(lambda x: x[0, 0], (params, inputs, labels))
    grads = jax.grad(_loss)(params, inputs, labels)
    updates, state = optimizer.update(grads, optimizer.init(params), params)
    return jax.tree.map(lambda x: x[None, None], (updates, state))

  params, inputs, labels = _two_leaf_problem(2 * num_nodes)
  params, inputs, labels = jax.tree.map(
      lambda x: x.reshape(num_nodes, 2, *x.shape[1:]), (params, inputs, labels))
  sharding = NamedSharding(mesh, P(_NODE, _LOCAL))
  arguments = jax.device_put((params, inputs, labels), sharding)
  step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P(_NODE, _LOCAL),
                               out_specs=P(_NODE, _LOCAL)))
  hlo = step.lower(*arguments).compile().as_text()
  _, state = step(*arguments)
  stats = jax.tree.map(lambda x: np.asarray(x)[0, 0], qsgd_jax.compression_stats(state))
  assert stats.wire_bits == 8 * qsgd_jax.wire_bytes(hlo)
  kinds = {c.kind for c in qsgd_jax.collectives_in_hlo(hlo)}
  assert kinds == {"all-reduce", "all-gather", "collective-permute"}
  # Between nodes only the pieces travel: the ring's collective-permutes.
  between_nodes = sum(c.bytes_sent for c in qsgd_jax.collectives_in_hlo(hlo)
                      if c.kind == "collective-permute")
  assert stats.outer_wire_bits == 8 * between_nodes


@pytest.mark.slow
@pytest.mark.parametrize("compressor", [qsgd_jax.OneBit(bucket_size=4),
                                        qsgd_jax.OneBit(bucket_size=None)],
                         ids=["buckets", "rows"])
def test_no_bucket_straddles_two_leaves(compressor):
  """One Bagua bucket of leaves: each leaf quantized as alone (deterministic 1-bit codes)."""
  optimizer = low_precision_decentralized(optax.sgd(1.0), AXIS, compressor=compressor)
  rng = np.random.default_rng(2)
  grads = {"a": rng.normal(size=(2, 3, 7)).astype(np.float32),
           "b": rng.normal(size=(2, 5)).astype(np.float32)}
  params = jax.tree.map(np.zeros_like, grads)

  def first_update(grads, params):
    return optimizer.update(grads, optimizer.init(params), params)[0]

  updates = jax.jit(jax.vmap(first_update, axis_name=AXIS))(grads, params)
  for name, grad in grads.items():
    for worker in range(2):  # Replicas start equal to params: the step is Q(-g).
      step = -grad[worker]
      if compressor.bucket_size is None:
        alone = compressor.decode(compressor.encode(jax.random.key(0), step))
      else:
        padded = np.pad(step.reshape(-1), (0, -step.size % compressor.bucket_size))
        alone = compressor.decode(compressor.encode(jax.random.key(0), padded))[: step.size]
      np.testing.assert_allclose(updates[name][worker].reshape(-1),
                                 np.asarray(alone).reshape(-1), rtol=1e-6, atol=1e-7)


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
  # Same params and gradient everywhere: the workers' quantized steps differ
  # only by the stochastic rounding of MinMax (the default rounds to nearest).
  optimizer = low_precision_decentralized(optax.sgd(1.0), AXIS, compressor=qsgd_jax.MinMax())

  @functools.partial(jax.pmap, axis_name=AXIS)
  def first_update(params, grads):
    return optimizer.update(grads, optimizer.init(params), params)[0]

  params = np.zeros((NUM_WORKERS, 1000), np.float32)
  grads = _stacked(jnp.sin(jnp.arange(1000.0)), NUM_WORKERS)
  updates = np.asarray(jax.block_until_ready(first_update(params, grads)))
  for i in range(1, NUM_WORKERS):
    assert np.mean(updates[i] != updates[0]) > 0.25  # 1/3 expected.


# Bagua's step, against the numpy reference of tests/references.py.

_LEARNING_RATE = 0.1
_BAGUA_STEPS = 3


def _as_params(flat):
  """The two-leaf tree of one worker's flat bucket: ``b`` (5) then ``w`` (3, 5), tree order."""
  return {"b": flat[:5], "w": flat[5:].reshape(3, 5)}


def _as_flat(params):
  return jnp.concatenate([params["b"], params["w"].reshape(15)])


def _bagua_step_fn(num_nodes, num_local, runner, bucket_bytes):
  """One jitted step of every worker: ``(models, lefts, rights, grads)`` to the same.

  Inputs are flat ``[nodes, (local,) 20]`` buckets; the devices of a node
  hold its model and replicas.
  """
  axis = AXIS if num_local is None else (_NODE, _LOCAL)
  optimizer = low_precision_decentralized(optax.sgd(_LEARNING_RATE), axis,
                                          bucket_bytes=bucket_bytes)

  def step(model, left, right, grads):
    params = _as_params(model)
    state = optimizer.init(params)._replace(
        left_replica=_as_params(left), right_replica=_as_params(right))
    updates, state = optimizer.update(_as_params(grads), state, params)
    return (_as_flat(optax.apply_updates(params, updates)),
            _as_flat(state.left_replica), _as_flat(state.right_replica))

  if runner == "vmap":
    if num_local is None:
      return jax.jit(jax.vmap(step, axis_name=AXIS))
    return jax.jit(jax.vmap(jax.vmap(step, axis_name=_LOCAL), axis_name=_NODE))
  if runner == "pmap":
    return jax.pmap(step, AXIS, devices=jax.devices()[:num_nodes])
  names = (AXIS,) if num_local is None else (_NODE, _LOCAL)
  shape = (num_nodes,) if num_local is None else (num_nodes, num_local)
  mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Explicit,) * len(shape),
                       devices=jax.devices()[: math.prod(shape)])
  spec = P(*names)

  def blocked(*arrays):  # Each device's block has a leading axis of 1 a mesh axis.
    outputs = step(*(a.reshape(a.shape[-1]) for a in arrays))
    return tuple(o.reshape((1,) * len(names) + o.shape) for o in outputs)

  mapped = jax.jit(jax.shard_map(blocked, mesh=mesh, in_specs=spec, out_specs=spec))
  return lambda *arrays: mapped(*(jax.device_put(a, NamedSharding(mesh, spec)) for a in arrays))


def _tie_tolerance(differences, bucket_sizes):
  """Where float rounding may flip a rounding to nearest, one step; else float rounding.

  ``differences`` are the reference's ``[n, d]`` quantizer inputs: a value
  within 1e-3 of a step of a tie between two levels may round either way.
  """
  tolerance = np.full(differences.shape, 2e-6)
  bounds = np.cumsum([0, *bucket_sizes])
  for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
    z = differences[:, start:stop].astype(np.float64)
    step = (z.max(axis=1, keepdims=True) - z.min(axis=1, keepdims=True) + 1e-7) / 255
    position = z / step
    near_tie = np.abs(position - np.floor(position) - 0.5) < 1e-3
    tolerance[:, start:stop] = np.where(near_tie, 1.01 * step + 2e-6, 2e-6)
  return tolerance


# Each runner, ring (of 4, a pair, hierarchical) and bucketing stays: ring4_pmap and
# ring4_vmap run in the slow tier (a ring of 4: ring4_shard_map_two_buckets; under pmap:
# pair_pmap_two_buckets; under vmap: pair_vmap; one bucket: pair_vmap, hierarchical4x2).
_SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "num_nodes, num_local, runner, bucket_bytes, bucket_sizes",
    [pytest.param(4, None, "pmap", None, [20], marks=_SLOW),
     (4, None, "shard_map", 20, [5, 15]),  # b (20 bytes) fills a bucket alone.
     pytest.param(4, None, "vmap", None, [20], marks=_SLOW),
     (2, None, "pmap", 20, [5, 15]),
     (2, None, "vmap", None, [20]),
     (4, 2, "shard_map", None, [20]),
     (2, 2, "vmap", 20, [5, 15])],
    ids=["ring4_pmap", "ring4_shard_map_two_buckets", "ring4_vmap", "pair_pmap_two_buckets",
         "pair_vmap", "hierarchical4x2_shard_map", "hierarchical2x2_vmap_two_buckets"],
)
def test_sgd_steps_are_baguas(num_nodes, num_local, runner, bucket_bytes, bucket_sizes):
  # Workers start apart, each with replicas of its peers' models; every step
  # is compared with Bagua's step from the state the library reached.
  step = _bagua_step_fn(num_nodes, num_local, runner, bucket_bytes)
  rng = np.random.default_rng(5)
  models = rng.normal(size=(num_nodes, 20)).astype(np.float32)
  lefts, rights = np.roll(models, 1, axis=0), np.roll(models, -1, axis=0)
  per_device = (num_nodes,) if num_local is None else (num_nodes, num_local)

  def spread(x):  # A node's model on each of its devices.
    return x if num_local is None else np.repeat(x[:, None], num_local, axis=1)

  compared = 0
  for _ in range(_BAGUA_STEPS):
    grads = rng.normal(size=(*per_device, 20)).astype(np.float32)
    local_steps = grads * np.float32(-_LEARNING_RATE)
    expected = references.bagua_decentralized_step(models, lefts, rights, local_steps,
                                                   bucket_sizes)
    outputs = jax.block_until_ready(step(spread(models), spread(lefts), spread(rights), grads))
    outputs = [np.asarray(o) for o in outputs]
    if num_local is not None:  # Every device of a node holds the same, bit for bit.
      for o in outputs:
        np.testing.assert_array_equal(o, np.repeat(o[:, :1], num_local, axis=1))
      outputs = [o[:, 0] for o in outputs]
    models, lefts, rights = outputs
    tolerance = _tie_tolerance(expected.differences, bucket_sizes)
    for actual, reference in zip(outputs, expected[:3], strict=True):
      np.testing.assert_array_less(np.abs(actual - reference), tolerance)
    np.testing.assert_array_equal(lefts, np.roll(models, 1, axis=0))
    np.testing.assert_array_equal(rights, np.roll(models, -1, axis=0))
    compared += np.sum(tolerance < 1e-5)
  # Float rounding near a tie spared only a few comparisons.
  assert compared >= 0.98 * _BAGUA_STEPS * num_nodes * 20


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


# The quadratic's convergence checks the same steps (scanned under pmap and shard_map, the
# averaged model and the consensus distance); this trains a real problem against float32.
@pytest.mark.slow
def test_digits_averaged_model_matches_all_reduce():
  train_inputs, train_labels, test_inputs, test_labels = _digits_split()
  params = _stacked({"w": np.zeros((64, 10), np.float32), "b": np.zeros(10, np.float32)},
                    NUM_WORKERS)
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


@pytest.mark.parametrize("bucket_bytes", [0, -1, 2.5, True, "10MiB"])
def test_bad_bucket_bytes_is_refused(bucket_bytes):
  with pytest.raises(ValueError, match="bucket_bytes"):
    low_precision_decentralized(optax.sgd(0.1), AXIS, bucket_bytes=bucket_bytes)


def test_no_axis_is_refused():
  with pytest.raises(ValueError, match="axis_name=None has no ring"):
    low_precision_decentralized(optax.sgd(0.1), None)


def test_empty_axis_tuple_is_refused():
  with pytest.raises(ValueError, match="at least one axis"):
    low_precision_decentralized(optax.sgd(0.1), ())


def test_hierarchical_ring_of_one_node_is_refused():
  optimizer = low_precision_decentralized(optax.sgd(0.1), (_NODE, _LOCAL))

  def step(params):
    return optimizer.update(params, optimizer.init(params), params)[0]

  step = jax.vmap(jax.vmap(step, axis_name=_LOCAL), axis_name=_NODE)
  with pytest.raises(ValueError, match="'node' has size 1"):
    step(jnp.zeros((1, 4, 3)))


def test_unbound_local_axis_is_named():
  optimizer = low_precision_decentralized(optax.sgd(0.1), (AXIS, _LOCAL))

  def step(params):
    return optimizer.update(params, optimizer.init(params), params)[0]

  with pytest.raises(NameError, match="'local' is not bound"):
    jax.vmap(step, axis_name=AXIS)(jnp.zeros((4, 3)))


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
  params = _stacked({"w": np.ones((100, 100), np.float32), "b": np.ones(100, np.float32)},
                    num_workers)
  params = jax.device_put(params, NamedSharding(mesh, P(AXIS)))
  return step.lower(params).compile().as_text()


def test_wire_carries_one_quarter_of_float32_a_neighbour():
  compressor = qsgd_jax.NearestZeroAlignedMinMax()  # The default; both leaves in one bucket.
  text = _compiled_step_text(NUM_WORKERS, compressor)
  float32_bytes = 4 * (100 * 100 + 100)
  payload_bytes = compressor.wire_bits((100 * 100 + 100,)) // 8
  received, other_collectives = _permuted_bytes(text)
  assert received == 2 * payload_bytes  # One payload from each neighbour.
  assert 0.25 <= received / 2 / float32_bytes <= 0.251
  assert not other_collectives  # No all-reduce, no all-gather.
  # The bytes do not grow with the number of workers.
  assert _permuted_bytes(_compiled_step_text(4, compressor)) == (received, set())


@pytest.mark.slow
def test_docstring_examples():
  result = doctest.testmod(decentralized, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0
