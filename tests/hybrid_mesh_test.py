"""Averages over the data axis of a mesh whose model is sharded over the others (data x fsdp x
tensor, as Flax lm1b lays it out): each device compresses and sends its own shard."""

import functools

import chex
import deepspeed_reference as ds
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import sparse_reference
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import qsgd_jax
from qsgd_jax._src import shards

AXES = ("data", "fsdp", "tensor")
MODEL = ("fsdp", "tensor")
SPECS = {"w1": P(None, "fsdp"), "w2": P("fsdp", "tensor"), "b": P("tensor"), "scale": P()}
SHAPES = {"w1": (64, 256), "w2": (256, 64), "b": (64,), "scale": (64,)}
# How each leaf is laid out for the exchange: spread over the model axes it is whole over.
EXCHANGED = {"w1": P(None, ("fsdp", "tensor")), "w2": P("fsdp", "tensor"),
             "b": P(("tensor", "fsdp")), "scale": P(("fsdp", "tensor"))}


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


@functools.cache  # Several tests read it: compiled once.
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


def _specs_in_the_group(abstract_state):
  """Each state leaf's spec over the model axes inside a data group: its sharding's, the data
  axis out."""
  return jax.tree.map(
      lambda shape: P(*(tuple(n for n in (e if isinstance(e, tuple) else (e,)) if n != "data")
                        or None for e in shape.sharding.spec)), abstract_state)


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


def test_a_float32_average_is_the_compilers_step_sending_a_share_of_each_leaf():
  mesh = _mesh()
  tx = optax.chain(qsgd_jax.compressed_allreduce(qsgd_jax.Identity(), "data"), optax.sgd(0.1))
  params, _, hlo, _ = _run(tx, mesh)
  expected, _ = _compilers_step(mesh, 0.1)
  chex.assert_trees_all_close(params, expected, rtol=1e-5, atol=1e-6)
  assert _specs(params) == SPECS
  # Every leaf spread over the 4 devices of a group: each sends a quarter of the model, where
  # the compiler's step sends w1 and b whole over tensor and scale whole over both (a float32
  # all-reduce over 2 devices sends 4 bytes an element; besides, a few scalars: the loss's
  # mean, the non-finite flag).
  quarter = sum(np.prod(shape) for shape in SHAPES.values()) / 4
  assert 4 * quarter <= qsgd_jax.wire_bytes(hlo, mesh=mesh, across="data") <= 4 * quarter + 16


def test_gather_back_undoes_the_spread_in_one_all_gather_a_set_of_axes_and_dtype():
  # A data group's devices: the model axes alone (the data axis is manual where this runs).
  mesh = jax.make_mesh((2, 2), MODEL, axis_types=(AxisType.Explicit,) * 2,
                       devices=jax.devices()[:4])
  whole = NamedSharding(mesh, P())
  leaves = [*_params(mesh).values(), jax.device_put(jnp.ones((8, 32)), whole),
            jax.device_put(jnp.arange(128, dtype=jnp.bfloat16), whole)]

  @jax.jit
  def round_trip(leaves):
    spread, specs = shards.spread(leaves)
    assert [shards.spec_of(x) for x in spread] == [
        *EXCHANGED.values(), P(None, ("fsdp", "tensor")), P(("fsdp", "tensor"))]
    return shards.gather_back(spread, specs)

  with jax.set_mesh(mesh):
    out = round_trip(leaves)
    hlo = round_trip.lower(leaves).compile().as_text()
  chex.assert_trees_all_equal(out, leaves)
  assert [shards.spec_of(x) for x in out] == [shards.spec_of(x) for x in leaves]
  # Spread over tensor: w1's piece; over fsdp: b's; over both: float32 scale's and the (8, 32)
  # leaf's, joined, and the bfloat16 leaf's. An all-gather for each set of axes and dtype (w2
  # is sharded over both already), each gathering [devices, pieces' elements].
  gathers = sorted(c.result_type.split("{")[0].split("[")[1]
                   for c in qsgd_jax.collectives_in_hlo(hlo) if c.kind == "all-gather")
  assert gathers == ["2,16]", "2,4096]", "4,32]", "4,80]"], gathers


@pytest.mark.slow
def test_parameters_and_state_keep_the_models_layout(qsgd_run):
  params, state, _, abstract_state = qsgd_run
  assert _specs(params) == SPECS
  compressed, (adam, _) = state
  # Adam's moments as the parameters; the residuals each device's own: along the data axis
  # and the model axes, over which every leaf is spread for the exchange (one segment; the two
  # vectors go in float32, under min_compressed_size, and keep none).
  assert _specs(adam.mu) == SPECS and _specs(adam.nu) == SPECS
  assert [e.sharding.spec for e in compressed.local_error] == [P(("data", "fsdp", "tensor"))]
  chex.assert_trees_all_equal_shapes(abstract_state, state)
  assert jax.tree.map(lambda s: s.sharding, abstract_state) == jax.tree.map(
      lambda x: x.sharding, state)
  _data_replicas_agree(params)


@pytest.mark.slow
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
  assert within <= 1.1 * (float32_within + _gather_back_bytes())


@pytest.mark.slow
def test_an_explicit_mesh_gives_the_automatic_ones_layout():
  tx = optax.chain(qsgd_jax.qsgd("data", bits=8), optax.sgd(0.1))
  auto_params, _, _, _ = _run(tx, _mesh(), steps=1)
  explicit_params, _, hlo, _ = _run(tx, _mesh(AxisType.Explicit), steps=1)
  assert _specs(explicit_params) == SPECS
  chex.assert_trees_all_equal(jax.device_get(explicit_params), jax.device_get(auto_params))
  assert not [c for c in qsgd_jax.collectives_in_hlo(hlo)
              if c.crosses(_mesh(), MODEL) and c.result_type.startswith(("u32", "(u32"))]


@pytest.mark.slow
def test_the_batch_splits_over_further_axes_when_asked():
  tx = optax.chain(qsgd_jax.compressed_allreduce(qsgd_jax.Identity(), "data"), optax.sgd(0.1))
  over_data, _, _, _ = _run(tx, _mesh(), steps=1)
  over_both, _, _, _ = _run(tx, _mesh(), steps=1, batch_axes="fsdp")
  chex.assert_trees_all_close(over_both, over_data, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_hand_written_step_is_data_parallels():
  """The recipe of the meshes guide: a jax.shard_map manual over the data axis, the update
  with the model axes explicit."""
  mesh = _mesh()
  tx = optax.chain(qsgd_jax.qsgd("data", bits=4, error_feedback=True), optax.adam(1e-2))
  init, step, abstract_state = qsgd_jax.data_parallel(_loss, tx, mesh, "data")
  params = _params(mesh)
  in_the_group = _specs_in_the_group(abstract_state(params))
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
  init, _, abstract_state = qsgd_jax.data_parallel(_loss, qsgd_jax.qsgd("data"), mesh, "data")
  abstract_state(_params(mesh))  # What resize_state needs to resume on one data group.
  with pytest.raises(ValueError, match=r"data axes \('data',\) have one device"):
    init(_params(mesh))


def test_a_batch_that_does_not_split_over_the_data_groups_is_an_error():
  mesh = _mesh()
  tx = optax.chain(qsgd_jax.qsgd("data"), optax.sgd(0.1))
  init, step, _ = qsgd_jax.data_parallel(_loss, tx, mesh, "data", batch_axes="fsdp")
  params = _params(mesh)
  with pytest.raises(ValueError, match=r"batch leaf <root> has 6 rows .* multiple of 4"):
    step(params, init(params), _batch(6))
  with pytest.raises(ValueError, match="batch_axes names 'data'"):
    qsgd_jax.data_parallel(_loss, tx, mesh, "data", batch_axes="data")


@pytest.mark.parametrize("make", [
    lambda: qsgd_jax.qsgd("data"),
    lambda: qsgd_jax.scale_by_demo(1e-2, "data", chunk=8, k=4),
    lambda: qsgd_jax.sparseloco_average("data", chunk=8)], ids=["qsgd", "demo", "sparseloco"])
def test_an_update_over_automatic_model_axes_is_an_error(make):
  """Inside a shard_map manual over the data axis alone, the compiler's layout of the other
  axes is unknown: the transform says how to make it known rather than gather the leaves."""
  mesh = _mesh()
  tx = make()

  def train_step(params, x):
    grads = jax.grad(_loss)(qsgd_jax.as_varying(params, "data"), x)
    return tx.update(grads, tx.init(params))[0]

  with pytest.raises(ValueError, match=r"\('fsdp', 'tensor'\) are neither manual .*explicit_axes"):
    jax.jit(jax.shard_map(train_step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
                          axis_names={"data"}))(_params(mesh), _batch())


@pytest.mark.slow
def test_top_k_with_error_feedback_gathers_each_devices_shard_across_the_data_axis():
  """The sparse exchange on the hybrid mesh: each device's top-k of its own part of each leaf,
  all-gathered over the data axis alone; the parameters keep their layout and every data group
  the same bits."""
  mesh = _mesh()
  topk = qsgd_jax.TopK(density=1 / 16, chunk=64, value_bits=8)
  tx = optax.chain(qsgd_jax.compressed_allreduce(topk, "data", error_feedback=True,
                                                 min_compressed_size=0), optax.sgd(0.1))
  params, state, hlo, _ = _run(tx, mesh)
  assert _specs(params) == SPECS
  _data_replicas_agree(params)
  assert not _payloads_crossing_model_axes(hlo, mesh)
  # What crosses is what the transform counts (its payloads, of each device's quarter of the
  # model), to within the step's scalars.
  across = qsgd_jax.wire_bytes(hlo, mesh=mesh, across="data")
  assert abs(float(state[0].stats.wire_bits) / 8 - across) <= 16
  float32_across, _ = _float32_bytes(mesh)
  assert across * 20 <= float32_across


@pytest.mark.slow
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


@pytest.mark.slow
def test_demo_exchanges_the_top_components_of_each_devices_own_part():
  """DeMo on the hybrid mesh: each device's momentum is laid out as its parameters, the DCT's
  blocks are of its own part, and only their top components cross the data axis (a schedule
  of the learning rate, traced, is no closure of the exchange on each part)."""
  mesh = _mesh()
  tx = qsgd_jax.demo(optax.linear_schedule(1e-2, 1e-3, 10), "data", chunk=8, k=4)
  params, state, hlo, abstract_state = _run(tx, mesh)
  assert _specs(params) == SPECS
  demo_state = state[0]
  assert _specs_in_the_group(demo_state.momentum) == _specs_of_leaves(SPECS)
  _data_replicas_agree(params)
  assert not _payloads_crossing_model_axes(hlo, mesh)
  across = qsgd_jax.wire_bytes(hlo, mesh=mesh, across="data")
  assert abs(float(demo_state.stats.wire_bits) / 8 - across) <= 16
  # 4 of each 64-element block, a 6-bit index and a float32 value each: about a tenth of the
  # float32 average's bytes.
  float32_across, _ = _float32_bytes(mesh)
  assert across * 8 <= float32_across
  chex.assert_trees_all_equal_shapes(abstract_state, state)


@pytest.mark.slow
def test_sparseloco_keeps_its_error_feedback_laid_out_as_the_params():
  mesh = _mesh()
  average = qsgd_jax.sparseloco_average("data", density=1 / 16, chunk=8)
  tx = qsgd_jax.diloco(optax.adam(1e-2), "data", sync_every=2, outer_optimizer=optax.sgd(1.0),
                       average=average)
  params, state, hlo, _ = _run(tx, mesh, steps=3)
  assert _specs(state.global_params) == SPECS
  _data_replicas_agree(state.global_params)
  (fragment,) = state.fragments
  error = fragment.average_state.error
  assert _specs_in_the_group(error) == _specs_of_leaves(SPECS)
  assert float(jnp.abs(error[0]).sum()) > 0  # What a round left unsent.
  assert not _payloads_crossing_model_axes(hlo, mesh)


def test_sparseloco_on_a_sharded_model_is_sparseloco_py_on_each_devices_part():
  """Two rounds of SparseLoCo's outer average over the data axis, the model laid out over fsdp
  (w) or over nothing (b): each device's part of each leaf (a quarter of its columns, w spread
  over tensor too and b over both) averaged as ``sparseloco.py`` averages a whole leaf."""
  mesh = _mesh(AxisType.Explicit)
  specs = {"b": P(), "w": P(None, "fsdp")}
  rng = np.random.default_rng(3)
  deltas = {"b": rng.normal(size=(2, 32)).astype(np.float32),
            "w": rng.normal(size=(2, 8, 64)).astype(np.float32)}
  tx = qsgd_jax.sparseloco_average("data", density=0.1, chunk=8, error_decay=0.9)

  def two_rounds(deltas):
    state = tx.init(jax.tree.map(lambda x: x[0], deltas))
    averages = []
    for scale in (1.0, 2.0):
      average, state = tx.update(jax.tree.map(lambda x, scale=scale: scale * x[0], deltas), state)
      averages.append(average)
    return averages, [e[None] for e in state.error]

  with jax.set_mesh(mesh):
    given = {name: jax.device_put(x, NamedSharding(mesh, P("data", *specs[name])))
             for name, x in deltas.items()}
    averages, errors = jax.jit(jax.shard_map(
        two_rounds, in_specs=P("data"), out_specs=(P(), P("data")),
        axis_names={"data"}))(given)
  # Device (f, t)'s part: the quarter 2f + t of the leaf's columns.
  for part in range(4):
    def of_part(x, part=part):
      width = x.shape[-1] // 4
      return x[..., part * width:(part + 1) * width]
    expected_errors = [[np.zeros(8), np.zeros((8, 16))] for _ in range(2)]
    for round_index, scale in enumerate((1.0, 2.0)):
      expected, expected_errors = sparse_reference.sparseloco_round(
          expected_errors, [[scale * of_part(deltas[name][w]) for name in ("b", "w")]
                            for w in range(2)], density=0.1, chunk=8, bits=2, decay=0.9)
      for name, want in zip(("b", "w"), expected, strict=True):
        np.testing.assert_allclose(of_part(np.asarray(averages[round_index][name])), want,
                                   rtol=1e-5, atol=1e-6)
    for w in range(2):
      for got, want in zip(errors, expected_errors[w], strict=True):
        np.testing.assert_allclose(of_part(np.asarray(got)[w]), want, rtol=1e-5, atol=1e-5)
  assert [shards.spec_of(x) for x in jax.tree.leaves(averages[0])] == [P(None), P(None, "fsdp")]


def _specs_of_leaves(specs):
  """The ``PartitionSpec`` of each leaf of a dict of the params, in the order of its leaves
  (as :func:`_specs_in_the_group` gives them, ``None`` for a whole dimension)."""
  return tuple(P(*(spec or (None,))) for spec in jax.tree.leaves(
      specs, is_leaf=lambda x: isinstance(x, P)))


# The library's other families: the compressed Adams, PowerSGD and decentralized SGD.


def _payloads_crossing_model_axes(hlo, mesh):
  """The collectives of packed payloads (``uint32`` words) whose groups span a model axis."""
  return [c for c in qsgd_jax.collectives_in_hlo(hlo)
          if c.crosses(mesh, MODEL) and c.result_type.startswith(("u32", "(u32"))]


def _cheapest_branch_bytes(hlo, mesh):
  """``(across, within)``: the bytes a device sends across the data axis and inside its data
  group in the step's branch that sends the fewest across (after a freeze, a warm-up)."""
  across = qsgd_jax.wire_bytes_by_branch(hlo, mesh=mesh, across="data")
  total = qsgd_jax.wire_bytes_by_branch(hlo)
  (branches,) = across.conditionals
  cheapest = int(np.argmin(branches))
  return across.sent(cheapest), total.sent(cheapest) - across.sent(cheapest)


def _gather_back_bytes():
  """What a device sends inside its group to gather the spread leaves' means back: float32
  of its shard of each, ``(k - 1) / k`` of it for a leaf spread over ``k`` more devices."""
  sent = 0.0
  for name, shape in SHAPES.items():
    held = np.prod(shape) / (2 if name in ("w1", "b") else 4 if name == "w2" else 1)
    spread_over = 4 * held / np.prod(shape)
    sent += 4 * held * (spread_over - 1) / spread_over
  return sent


def _float32_bytes(mesh):
  """``(across, within)`` of the compiler's float32 step."""
  _, hlo = _compilers_step(mesh, 0.1)
  across = qsgd_jax.wire_bytes(hlo, mesh=mesh, across="data")
  return across, qsgd_jax.wire_bytes(hlo) - across


_host_grad = jax.jit(jax.grad(_loss))  # One program for every group's gradient.


def _group_gradients(params):
  """Each data group's gradient of its half of the batch, computed on the host."""
  x = _batch()
  host = jax.device_get(params)
  return [jax.device_get(_host_grad(host, x[8 * g:8 * (g + 1)])) for g in range(2)]


def _blocks(name, layout=EXCHANGED):
  """The index ranges of each device's block of a leaf (rows, columns) as ``layout`` lays it
  out: as it is exchanged, or (PowerSGD, which does not spread leaves) as the model is."""
  rows, columns = SHAPES[name]
  row_spec, column_spec = layout[name]
  row_blocks = 1 if row_spec is None else 2
  column_blocks = {None: 1, "tensor": 2, "fsdp": 2}.get(column_spec, 4)
  r, c = rows // row_blocks, columns // column_blocks
  return [(slice(i * r, (i + 1) * r), slice(j * c, (j + 1) * c))
          for i in range(row_blocks) for j in range(column_blocks)]


@pytest.fixture(scope="module")
def onebit_steps():
  """1-bit Adam through data_parallel: the state after its warm-up step, after its first
  frozen step, and the step's program."""
  tx = qsgd_jax.onebit_adam(1e-2, "data", freeze_step=1)
  return _steps_around(tx, before=1)


@pytest.fixture(scope="module")
def zero_one_run():
  tx = qsgd_jax.zero_one_adam(1e-2, "data", var_freeze_step=1, local_step_clipper=1)
  return _run(tx, _mesh(), steps=3)


@pytest.fixture(scope="module")
def powersgd_steps():
  """PowerSGD (rank 2) then SGD at 1 through data_parallel: the params and state before and
  after its first compressed step, and the step's program."""
  tx = optax.chain(qsgd_jax.powersgd("data", rank=2, start_iter=2), optax.sgd(1.0))
  return _steps_around(tx, before=2)


def _steps_around(tx, before):
  mesh = _mesh()
  init, step, abstract_state = qsgd_jax.data_parallel(_loss, tx, mesh, "data")
  params = _params(mesh)
  state = init(params)
  for _ in range(before):
    params, state, _ = jax.block_until_ready(step(params, state, _batch()))
  after = jax.block_until_ready(step(params, state, _batch()))[:2]
  hlo = step.lower(*after, _batch()).compile().as_text()
  return (params, state), after, hlo, abstract_state(_params(mesh))


def _compressed_adam_core(state):
  return state[0] if isinstance(state[0], qsgd_jax.ScaleByOneBitAdamState) else state


@pytest.mark.slow
@pytest.mark.parametrize("run", ["onebit_steps", "zero_one_run"])
def test_compressed_adams_keep_the_layout_and_send_signs_across_the_data_axis(run, request):
  found = request.getfixturevalue(run)
  params, state = found[1] if run == "onebit_steps" else found[:2]
  hlo, abstract_state = found[-2:]
  mesh = _mesh()
  core = _compressed_adam_core(state)
  assert _specs(params) == SPECS
  assert _specs(core.mu) == SPECS and _specs(core.nu) == SPECS
  # One error a group of compressed leaves (w1 and w2, both exchanged over both model axes),
  # each device's own.
  for errors in (core.worker_error, core.server_error):
    assert [e.sharding.spec for e in errors] == [P(("data", "fsdp", "tensor"))]
  assert jax.tree.map(lambda s: s.sharding, abstract_state) == jax.tree.map(
      lambda x: x.sharding, state)
  _data_replicas_agree((params, core.mu, core.nu))
  assert not _payloads_crossing_model_axes(hlo, mesh)
  across, within = _cheapest_branch_bytes(hlo, mesh)
  float32_across, float32_within = _float32_bytes(mesh)
  assert across * 20 <= float32_across
  assert within <= 1.1 * (float32_within + _gather_back_bytes())
  # The last step was a 1-bit one: its stats count what a device sent of its own shards (all
  # of it across the data axis), to within the HLO's scalar all-reduces.
  assert abs(float(core.stats.wire_bits) / 8 - across) <= 16


def test_onebit_adam_exchanges_each_shard_as_deepspeed_does(onebit_steps):
  """The first frozen step's momentum of each device's block is DeepSpeed's 1-bit average of
  the two data groups' momenta of that block, as if each block were a tensor of its own."""
  (params, state), (_, after), _, _ = onebit_steps
  mu = jax.device_get(state[0].mu)
  new_mu = jax.device_get(after[0].mu)
  for name in ("w1", "w2"):
    local = [0.9 * mu[name] + 0.1 * grads[name] for grads in _group_gradients(params)]
    for rows, columns in _blocks(name):
      vectors = [m[rows, columns].reshape(-1) for m in local]
      padded = ds.padded_size(vectors[0].size, 2)
      expected = ds.compressed_allreduce(
          vectors, [np.zeros(padded, np.float32) for _ in range(2)],
          [np.zeros(padded // 2, np.float32) for _ in range(2)])
      np.testing.assert_allclose(new_mu[name][rows, columns].reshape(-1), expected,
                                 rtol=1e-5, atol=1e-8, err_msg=name)


@pytest.mark.slow
def test_powersgd_compresses_each_devices_block_as_a_matrix(powersgd_steps):
  """The first compressed step's update of each block is the projection of the data groups'
  mean block onto the span of that block times its own Q (Vogels et al., Algorithm 1 from
  a zero error), and the exact leaves' update the mean."""
  (params, state), (new_params, new_state), _, _ = powersgd_steps
  grads = _group_gradients(params)
  moved = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), jax.device_get(params),
                       jax.device_get(new_params))
  q_memory = dict(zip(("w1", "w2"), jax.device_get(state[0].q_memory), strict=True))
  for name, mean in jax.tree.map(lambda a, b: (a + b) / 2, *grads).items():
    if name not in q_memory:
      np.testing.assert_allclose(moved[name], mean, rtol=1e-4, atol=1e-7, err_msg=name)
      continue
    for (rows, columns), q in zip(_blocks(name, SPECS), q_memory[name], strict=True):
      block = mean[rows, columns].astype(np.float64)
      basis, _ = np.linalg.qr(block @ q)
      expected = basis @ basis.T @ block
      np.testing.assert_allclose(moved[name][rows, columns], expected, rtol=0,
                                 atol=1e-4 * np.abs(expected).max(), err_msg=name)
  assert [e.sharding.spec for e in new_state[0].error] == [P(("data", "fsdp")),
                                                           P(("data", "fsdp", "tensor"))]
  for memory in (new_state[0].q_memory, new_state[0].p_memory):
    assert [m.sharding.spec for m in memory] == [P("fsdp"), P(("fsdp", "tensor"))]
  _data_replicas_agree((new_params, new_state[0].q_memory, new_state[0].p_memory))


def test_powersgd_sends_its_factors_across_the_data_axis_alone(powersgd_steps):
  _, (_, state), hlo, _ = powersgd_steps
  mesh = _mesh()
  for collective in qsgd_jax.collectives_in_hlo(hlo):
    if collective.crosses(mesh, "data"):  # The factors' and exact leaves' all-reduces.
      assert not collective.crosses(mesh, MODEL), collective
  across, within = _cheapest_branch_bytes(hlo, mesh)
  float32_across, float32_within = _float32_bytes(mesh)
  assert across * 10 <= float32_across
  assert within <= 1.1 * float32_within
  assert abs(float(state[0].stats.wire_bits) / 8 - across) <= 16  # A device's own blocks.


def _along_data(spec):
  """A leaf's spec over the mesh when each worker's copy lies end to end along its first
  dimension over the data axis: the data axis, then the model axes of that dimension."""
  first = spec[0] if len(spec) else None
  names = ("data",) + (() if first is None else (first,) if isinstance(first, str) else first)
  return P(names, *spec[1:])


@pytest.fixture(scope="module")
def decentralized_run():
  """Decentralized SGD by a hand-written step: a jax.shard_map manual over the data axis, a
  model a data group (its copy end to end along the first dimension), the update with the
  model axes explicit. data_parallel takes no optimizer whose models differ between syncs
  but DiLoCo."""
  mesh = _mesh()
  tx = qsgd_jax.low_precision_decentralized(optax.sgd(0.1), "data")
  host = jax.device_get(_params(mesh))
  whole = {name: _along_data(spec) for name, spec in SPECS.items()}
  params = {name: jax.device_put(np.concatenate([x, x]), NamedSharding(mesh, whole[name]))
            for name, x in host.items()}
  shapes = jax.eval_shape(tx.init, host)
  over_data = qsgd_jax.state_partition_specs(shapes, "data")
  # Over the model axes: the replicas as the params, the key and stats whole.
  in_the_group = jax.tree.map(lambda _: P(), shapes)._replace(left_replica=SPECS,
                                                              right_replica=SPECS)
  state_specs = jax.tree.map(lambda _: P(), shapes)._replace(left_replica=whole,
                                                             right_replica=whole)

  def train_step(params, state, x):
    grads = jax.grad(_loss)(params, x)  # Each worker's params are its own: varying over data.
    update = jax.sharding.explicit_axes(tx.update, axes=MODEL,
                                        in_sharding=(SPECS, in_the_group, SPECS))
    updates, state = update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def named(specs):
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                        is_leaf=lambda x: isinstance(x, P))

  init = jax.jit(jax.shard_map(
      jax.sharding.explicit_axes(tx.init, axes=MODEL, in_sharding=(SPECS,)), mesh=mesh,
      in_specs=P("data"), out_specs=over_data, axis_names={"data"}),
      out_shardings=named(state_specs))
  step = jax.jit(jax.shard_map(train_step, mesh=mesh, in_specs=(P("data"), over_data, P("data")),
                               out_specs=(P("data"), over_data), axis_names={"data"}),
                 out_shardings=(named(whole), named(state_specs)))
  state = init(params)
  for _ in range(2):
    params, state = jax.block_until_ready(step(params, state, _batch()))
  return params, state, step.lower(params, state, _batch()).compile().as_text(), whole


@pytest.mark.slow
def test_decentralized_replicas_are_each_shards_peers_model(decentralized_run):
  params, state, hlo, whole = decentralized_run
  mesh = _mesh()
  assert _specs(params) == whole
  assert _specs(state.left_replica) == whole and _specs(state.right_replica) == whole
  # With two workers both replicas hold the one peer's model, bit for bit, shard by shard.
  for name, x in jax.device_get(params).items():
    own = np.split(x, 2)
    for replica in (state.left_replica, state.right_replica):
      peers = np.split(np.asarray(replica[name]), 2)
      np.testing.assert_array_equal(peers[0], own[1], err_msg=name)
      np.testing.assert_array_equal(peers[1], own[0], err_msg=name)
  assert not _payloads_crossing_model_axes(hlo, mesh)
  across = qsgd_jax.wire_bytes(hlo, mesh=mesh, across="data")
  float32_across, float32_within = _float32_bytes(mesh)
  # One byte an element (and a scale a bucket) to the one peer, against float32's all-reduce.
  assert across * 3.5 <= float32_across
  assert qsgd_jax.wire_bytes(hlo) - across <= 1.1 * float32_within
  assert float(state.stats.wire_bits) / 8 == across  # A device's own shards.


@pytest.mark.parametrize("make", [
    lambda axis: qsgd_jax.onebit_adam(1e-2, axis, freeze_step=1),
    lambda axis: qsgd_jax.zero_one_adam(1e-2, axis, var_freeze_step=1, local_step_clipper=1),
    lambda axis: optax.chain(qsgd_jax.powersgd(axis, start_iter=2), optax.sgd(0.1)),
    lambda axis: qsgd_jax.low_precision_decentralized(optax.sgd(0.1), axis),
], ids=["onebit_adam", "zero_one_adam", "powersgd", "low_precision_decentralized"])
def test_an_axis_a_leaf_is_laid_out_over_or_the_mesh_lacks_is_an_error(make):
  mesh = _mesh()
  params = _params(mesh)
  for axis, message in (
      ("fsdp", r"leaf \['w1'\] is laid out over the axis 'fsdp'.*qsgd_jax.fsdp_gather"),
      ("batch", r"axis_name 'batch' is not an axis of the mesh, whose axes are \('data'")):
    init, _, _ = qsgd_jax.data_parallel(_loss, make(axis), mesh, "data")
    with pytest.raises(ValueError, match=message):
      init(params)


def test_resize_moves_a_state_between_numbers_of_data_groups(powersgd_steps, onebit_steps):
  """Per-device errors are the data groups' rows of each shard's: a state saved on two data
  groups resumes on one with the same model axes; another layout of the model is an error."""
  powersgd = optax.chain(qsgd_jax.powersgd("data", rank=2, start_iter=2), optax.sgd(1.0))
  _, (_, state), _, _ = powersgd_steps

  def target(tx, mesh):
    return qsgd_jax.data_parallel(_loss, tx, mesh, "data").abstract_state(_params(mesh))

  one_group = jax.make_mesh((1, 2, 2), AXES, axis_types=(AxisType.Auto,) * 3)
  resized = qsgd_jax.resize_state(state, target(powersgd, one_group), from_devices=2,
                                  to_devices=1)
  for saved, error in zip(state[0].error, resized[0].error, strict=True):
    halves = np.split(np.asarray(saved), 2)  # Each data group's errors of its shards.
    np.testing.assert_allclose(error, (halves[0] + halves[1]) / 2, rtol=1e-6)
  chex.assert_trees_all_equal(resized[0].q_memory, jax.device_get(state[0].q_memory))
  other_model = jax.make_mesh((1, 4, 2), AXES, axis_types=(AxisType.Auto,) * 3)
  with pytest.raises(ValueError, match="model axes"):
    qsgd_jax.resize_state(state, target(powersgd, other_model), from_devices=2, to_devices=1)
  onebit = qsgd_jax.onebit_adam(1e-2, "data", freeze_step=1)
  _, (_, onebit_state), _, _ = onebit_steps
  onebit_target = target(onebit, one_group)
  with pytest.raises(ValueError, match="drop=True"):
    qsgd_jax.resize_state(onebit_state, onebit_target, from_devices=2, to_devices=1)
  with pytest.warns(UserWarning, match="worker_error"):
    dropped = qsgd_jax.resize_state(onebit_state, onebit_target, from_devices=2, to_devices=1,
                                    drop=True)
  chex.assert_trees_all_equal_shapes(dropped[0].worker_error, onebit_target[0].worker_error)
  assert not any(np.any(e) for e in dropped[0].worker_error)


@pytest.mark.parametrize("run, make", [
    ("onebit_steps", lambda: qsgd_jax.onebit_adam(1e-2, "data", freeze_step=1)),
    ("powersgd_steps", lambda: optax.chain(qsgd_jax.powersgd("data", rank=2, start_iter=2),
                                           optax.sgd(1.0))),
], ids=["onebit_adam", "powersgd"])
def test_a_non_finite_gradient_in_one_shard_skips_the_step_on_every_device(run, make, request):
  """A NaN in one element of one data group's gradient, in one block of w2: every device of
  every shard of every leaf skips the compressed step together, its state kept."""
  mesh = _mesh()
  tx = make()
  _, (params, state), _, abstract_state = request.getfixturevalue(run)
  in_the_group = _specs_in_the_group(abstract_state)
  over_data = qsgd_jax.state_partition_specs(abstract_state, "data")

  def update(grads, state, params):
    grads = jax.tree.map(lambda g: g[0], grads)  # This data group's.
    return jax.sharding.explicit_axes(tx.update, axes=MODEL,
                                      in_sharding=(SPECS, in_the_group, SPECS))(grads, state,
                                                                                params)

  update = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(P("data"), over_data, P()),
                                 out_specs=(P(), over_data), axis_names={"data"}))
  by_group = _group_gradients(params)
  grads = {name: np.stack([g[name] for g in by_group]) for name in SHAPES}
  grads["w2"][0, 0, 0] = np.nan
  grads = {name: jax.device_put(g, NamedSharding(mesh, P("data", *SPECS[name])))
           for name, g in grads.items()}
  updates, new_state = jax.block_until_ready(update(grads, state, params))
  skipped = 0.0 if run == "onebit_steps" else np.nan  # apply_if_finite's zeros; the NaN.
  for name, leaf in jax.device_get(updates).items():
    np.testing.assert_array_equal(leaf, np.full(leaf.shape, skipped, np.float32), err_msg=name)
  core, new_core = state[0], new_state[0]
  kept = (("worker_error", "server_error", "mu", "nu", "count") if run == "onebit_steps"
          else ("error", "q_memory", "p_memory"))
  for field in kept:
    chex.assert_trees_all_equal(jax.device_get(getattr(new_core, field)),
                                jax.device_get(getattr(core, field)))


@pytest.mark.slow
def test_onebit_adams_auto_freeze_is_one_decision_on_every_device():
  """The variance's shares are read from the whole variance (every shard's), so every device
  freezes at the same count."""
  tx = qsgd_jax.onebit_adam(1e-2, "data", freeze_step="auto", auto_freeze_window=2,
                            auto_freeze_tolerance=1.0)
  _, state, _, _ = _run(tx, _mesh(), steps=3)
  core = state[0]
  # The window is full after the second update, where any drift is within the tolerance.
  assert {int(shard.data) for shard in core.freeze_count.addressable_shards} == {2}
  _data_replicas_agree((core.variance_history, core.nu))
