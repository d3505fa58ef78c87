"""Averages over the data axis of a mesh whose model is sharded over the others (data x fsdp x
tensor, as Flax lm1b lays it out): each device compresses and sends its own shard."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import qsgd_jax

AXES = ("data", "fsdp", "tensor")
MODEL = ("fsdp", "tensor")
SPECS = {"w1": P(None, "fsdp"), "w2": P("fsdp", "tensor"), "b": P("tensor"), "scale": P()}
SHAPES = {"w1": (64, 256), "w2": (256, 64), "b": (64,), "scale": (64,)}


def _mesh(kind=AxisType.Auto):
  return jax.make_mesh((2, 2, 2), AXES, axis_types=(kind,) * 3)


def _params(mesh, specs=SPECS):
  rng = np.random.default_rng(0)
  return {name: jax.device_put(rng.normal(size=shape).astype(np.float32) / 8,
                               NamedSharding(mesh, specs[name]))
          for name, shape in SHAPES.items()}


def _batch(rows=16):
  return np.random.default_rng(1).normal(size=(rows, 64)).astype(np.float32)


def _loss(params, x):
  hidden = jnp.tanh(x @ params["w1"])
  return jnp.mean((hidden @ params["w2"] * params["scale"] + params["b"]) ** 2)


def _run(tx, mesh, steps=2, **options):
  init, step, abstract_state = qsgd_jax.data_parallel(_loss, tx, mesh, "data", **options)
  params = _params(mesh)
  state = init(params)
  for _ in range(steps):
    params, state, _ = jax.block_until_ready(step(params, state, _batch()))
  hlo = step.lower(params, state, _batch()).compile().as_text()
  return params, state, hlo, abstract_state(_params(mesh))


def _compilers_step(mesh, learning_rate, steps=2):
  """float32 data parallel as the compiler runs it: a plain jit step, the batch split over
  the data axis, the gradients' all-reduce the compiler's own."""

  @jax.jit
  def step(params, x):
    grads = jax.grad(_loss)(params, x)
    return jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)

  params = _params(mesh)
  x = jax.device_put(_batch(), NamedSharding(mesh, P("data")))
  for _ in range(steps):
    params = jax.block_until_ready(step(params, x))
  return params, step.lower(params, x).compile().as_text()


def _specs(tree):
  return jax.tree.map(lambda x: x.sharding.spec, tree)


def _data_replicas_agree(tree):
  """Every device of a data group holds the same bits as its peers in the other groups."""
  for leaf in jax.tree.leaves(tree):
    by_index = {}
    for shard in leaf.addressable_shards:
      by_index.setdefault(str(shard.index), []).append(np.asarray(shard.data))
    for copies in by_index.values():
      for copy in copies[1:]:
        np.testing.assert_array_equal(copy, copies[0])


@pytest.fixture(scope="module")
def qsgd_run():
  tx = optax.chain(qsgd_jax.qsgd("data", bits=4, error_feedback=True), optax.adam(1e-2))
  return _run(tx, _mesh())


def test_a_float32_average_is_the_compilers_step():
  mesh = _mesh()
  tx = optax.chain(qsgd_jax.compressed_allreduce(qsgd_jax.Identity(), "data"), optax.sgd(0.1))
  params, _, _, _ = _run(tx, mesh)
  expected, _ = _compilers_step(mesh, 0.1)
  chex.assert_trees_all_close(params, expected, rtol=1e-5, atol=1e-6)
  assert _specs(params) == SPECS


def test_parameters_and_state_keep_the_models_layout(qsgd_run):
  params, state, _, abstract_state = qsgd_run
  assert _specs(params) == SPECS
  compressed, (adam, _) = state
  # Adam's moments as the parameters; the residuals each device's own: along the data axis
  # and the axes of the shards they belong to (a segment a set of axes; the two vectors go in
  # float32, under min_compressed_size, and keep none).
  assert _specs(adam.mu) == SPECS and _specs(adam.nu) == SPECS
  assert [e.sharding.spec for e in compressed.local_error] == [
      P(("data", "fsdp")), P(("data", "fsdp", "tensor"))]
  chex.assert_trees_all_equal_shapes(abstract_state, state)
  assert jax.tree.map(lambda s: s.sharding, abstract_state) == jax.tree.map(
      lambda x: x.sharding, state)
  _data_replicas_agree(params)


def test_only_the_compressed_exchange_crosses_the_data_axis(qsgd_run):
  _, _, hlo, _ = qsgd_run
  mesh = _mesh()
  _, float32_hlo = _compilers_step(mesh, 0.1)
  for collective in qsgd_jax.collectives_in_hlo(hlo):
    # The packed payloads are exchanged over the data axis alone; what crosses it besides
    # them is all-reduced (float32 leaves under min_compressed_size, scalars).
    if collective.result_type.startswith(("u32", "(u32")):
      assert not collective.crosses(mesh, MODEL), collective
    elif collective.crosses(mesh, "data"):
      assert collective.kind == "all-reduce", collective
  across = qsgd_jax.wire_bytes(hlo, mesh=mesh, across="data")
  float32_across = qsgd_jax.wire_bytes(float32_hlo, mesh=mesh, across="data")
  assert across < float32_across / 5
  within = qsgd_jax.wire_bytes(hlo) - across
  float32_within = qsgd_jax.wire_bytes(float32_hlo) - float32_across
  assert within <= 1.1 * float32_within


def test_an_explicit_mesh_gives_the_automatic_ones_layout():
  tx = optax.chain(qsgd_jax.qsgd("data", bits=8), optax.sgd(0.1))
  auto_params, _, _, _ = _run(tx, _mesh(), steps=1)
  explicit_params, _, hlo, _ = _run(tx, _mesh(AxisType.Explicit), steps=1)
  assert _specs(explicit_params) == SPECS
  chex.assert_trees_all_equal(jax.device_get(explicit_params), jax.device_get(auto_params))
  assert not [c for c in qsgd_jax.collectives_in_hlo(hlo)
              if c.crosses(_mesh(), MODEL) and c.result_type.startswith(("u32", "(u32"))]


def test_the_batch_splits_over_further_axes_when_asked():
  tx = optax.chain(qsgd_jax.compressed_allreduce(qsgd_jax.Identity(), "data"), optax.sgd(0.1))
  over_data, _, _, _ = _run(tx, _mesh(), steps=1)
  over_both, _, _, _ = _run(tx, _mesh(), steps=1, batch_axes="fsdp")
  chex.assert_trees_all_close(over_both, over_data, rtol=1e-5, atol=1e-6)


def test_a_hand_written_step_is_data_parallels():
  """The recipe of the meshes guide: a jax.shard_map manual over the data axis, the update
  with the model axes explicit."""
  mesh = _mesh()
  tx = optax.chain(qsgd_jax.qsgd("data", bits=4, error_feedback=True), optax.adam(1e-2))
  init, step, abstract_state = qsgd_jax.data_parallel(_loss, tx, mesh, "data")
  params = _params(mesh)
  state_specs = jax.tree.map(lambda s: s.sharding.spec, abstract_state(params))
  in_the_group = jax.tree.map(  # Over the model axes inside a data group: the data axis out.
      lambda spec: P(*(tuple(n for n in (e if isinstance(e, tuple) else (e,)) if n != "data")
                       or None for e in spec)), state_specs,
      is_leaf=lambda x: isinstance(x, P))
  over_data = qsgd_jax.state_partition_specs(abstract_state(params), "data")

  @jax.sharding.explicit_axes(axes=MODEL, in_sharding=(SPECS, in_the_group, SPECS))
  def update(grads, state, params):  # The params updated with the layout explicit too.
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def train_step(params, state, x):
    grads = jax.grad(_loss)(qsgd_jax.as_varying(params, "data"), x)
    return update(grads, state, params)

  hand = jax.jit(jax.shard_map(train_step, mesh=mesh, in_specs=(P(), over_data, P("data")),
                               out_specs=(P(), over_data), axis_names={"data"}))
  state = init(params)
  by_hand = hand(params, state, _batch())
  by_data_parallel = step(params, state, _batch())[:2]
  chex.assert_trees_all_equal(jax.device_get(by_hand), jax.device_get(by_data_parallel))


def test_params_laid_out_over_the_data_axis_are_an_error():
  mesh = _mesh()
  tx = optax.chain(qsgd_jax.qsgd("data"), optax.sgd(0.1))
  init, _, _ = qsgd_jax.data_parallel(_loss, tx, mesh, "data")
  with pytest.raises(ValueError, match=r"\['w1'\] is laid out over the data axis .*fsdp_gather"):
    init(_params(mesh, {**SPECS, "w1": P("data", "fsdp")}))


def test_a_data_axis_of_one_device_is_an_error():
  mesh = jax.make_mesh((1, 4, 2), AXES, axis_types=(AxisType.Auto,) * 3)
  with pytest.raises(ValueError, match=r"data axes \('data',\) have one device"):
    qsgd_jax.data_parallel(_loss, qsgd_jax.qsgd("data"), mesh, "data")


def test_a_batch_that_does_not_split_over_the_data_groups_is_an_error():
  mesh = _mesh()
  tx = optax.chain(qsgd_jax.qsgd("data"), optax.sgd(0.1))
  init, step, _ = qsgd_jax.data_parallel(_loss, tx, mesh, "data", batch_axes="fsdp")
  params = _params(mesh)
  with pytest.raises(ValueError, match=r"batch leaf <root> has 6 rows .* multiple of 4"):
    step(params, init(params), _batch(6))
  with pytest.raises(ValueError, match="batch_axes names 'data'"):
    qsgd_jax.data_parallel(_loss, tx, mesh, "data", batch_axes="data")


def test_an_update_over_automatic_model_axes_is_an_error():
  """Inside a shard_map manual over the data axis alone, the compiler's layout of the other
  axes is unknown: the transform says how to make it known rather than gather the leaves."""
  mesh = _mesh()
  tx = qsgd_jax.qsgd("data")

  def train_step(params, x):
    grads = jax.grad(_loss)(qsgd_jax.as_varying(params, "data"), x)
    return tx.update(grads, tx.init(params))[0]

  with pytest.raises(ValueError, match=r"\('fsdp', 'tensor'\) are neither manual .*explicit_axes"):
    jax.jit(jax.shard_map(train_step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
                          axis_names={"data"}))(_params(mesh), _batch())


def test_diloco_keeps_a_copy_a_data_group_laid_out_as_the_params():
  mesh = _mesh()
  average = qsgd_jax.qsgd("data", bits=4, error_feedback=True)
  tx = qsgd_jax.diloco(optax.adam(1e-2), "data", sync_every=2, outer_optimizer=optax.sgd(1.0),
                       average=average)
  params, state, hlo, _ = _run(tx, mesh, steps=3)
  # Each data group's own copy, stacked along the data axis; the global copy as the params.
  assert _specs(params) == {name: P("data", *spec) for name, spec in SPECS.items()}
  assert _specs(state.global_params) == SPECS
  assert _specs(state.inner_state[0].mu) == _specs(params)
  _data_replicas_agree(state.global_params)
  assert not [c for c in qsgd_jax.collectives_in_hlo(hlo)
              if c.crosses(mesh, MODEL) and c.result_type.startswith(("u32", "(u32"))]
