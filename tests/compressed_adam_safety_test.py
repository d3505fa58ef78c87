"""What the compressed Adams must never do silently: huge steps on coordinates without a
gradient, dtype failures, a zero learning rate that stalls training, a gradient already
summed over the axis. Eight simulated CPU devices (``conftest.py``), under ``jax.pmap``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qsgd_jax

N = 8
AXIS = "batch"
VOCAB, USED, WIDTH = 128, 20, 32  # An embedding of which only the first 20 rows are looked up.


def _embedding_grads(steps: int, seed: int = 0):
  """Each step's per-device gradients of a softmax loss over an embedding and an output map,
  for tokens drawn from the first ``USED`` rows: ``[step]{"embed": [N, VOCAB, WIDTH], ...}``."""
  rng = np.random.default_rng(seed)
  embed = rng.normal(size=(VOCAB, WIDTH)).astype(np.float32) * 0.1
  out = rng.normal(size=(WIDTH, VOCAB)).astype(np.float32) * 0.1
  params = {"embed": jnp.asarray(embed), "out": jnp.asarray(out)}

  def loss(params, tokens, targets):
    logits = params["embed"][tokens] @ params["out"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[:, None], 1))

  grad = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)))
  steps_grads = []
  for _ in range(steps):
    tokens = rng.integers(0, USED, size=(N, 16))
    targets = rng.integers(0, USED, size=(N, 16))
    steps_grads.append(grad(params, tokens, targets))
  return params, steps_grads


def _run(tx, params, steps_grads):
  """``tx`` under pmap from ``params`` on the given gradients; the parameters at the end."""

  def step(g, state, p):
    updates, state = tx.update(g, state, p)
    return optax.apply_updates(p, updates), state

  p = jax.tree.map(lambda x: jnp.broadcast_to(x, (N, *x.shape)), params)
  state = jax.pmap(tx.init, AXIS)(p)
  step = jax.pmap(step, AXIS)
  for g in steps_grads:
    p, state = jax.block_until_ready(step(g, state, p))
  return p, state


@pytest.mark.parametrize("make", [
    lambda: qsgd_jax.onebit_adam(1e-2, AXIS, freeze_step=4, eps=1e-9, min_compressed_size=0),
    lambda: qsgd_jax.onebit_adam(1e-2, AXIS, freeze_step="auto", eps=1e-9, min_compressed_size=0,
                                 auto_freeze_window=2, auto_freeze_tolerance=1.0),
    lambda: qsgd_jax.zero_one_adam(1e-2, AXIS, var_freeze_step=6, eps=1e-9,
                                   min_compressed_size=0, var_update_scaler=1,
                                   local_step_scaler=2, local_step_clipper=4),
], ids=["onebit_adam", "onebit_adam_auto", "zero_one_adam"])
@pytest.mark.slow
def test_rows_without_a_gradient_move_no_further_than_under_adamw(make):
  params, steps_grads = _embedding_grads(steps=16)
  p, _ = _run(make(), params, steps_grads)
  reference = optax.adamw(1e-2, eps=1e-9, weight_decay=1e-4)
  expected = reference.init(params)
  q = params
  for g in steps_grads:
    mean = jax.tree.map(lambda x: jnp.mean(x, axis=0), g)
    updates, expected = reference.update(mean, expected, q)
    q = optax.apply_updates(q, updates)
  unused_adamw = np.abs(np.asarray(q["embed"][USED:] - params["embed"][USED:])).max()
  unused = np.abs(np.asarray(p["embed"][:, USED:] - params["embed"][USED:])).max()
  assert unused <= unused_adamw + 1e-9, (unused, unused_adamw)
  # The rows that do get a gradient are trained as under AdamW.
  used = np.asarray(p["embed"][:, :USED] - params["embed"][:USED])
  used_adamw = np.asarray(q["embed"][:USED] - params["embed"][:USED])
  assert np.abs(used).max() > 0.5 * np.abs(used_adamw).max()


def test_fsdp_onebit_adam_keeps_rows_without_a_gradient_in_place():
  tx = qsgd_jax.fsdp_onebit_adam(1e-2, freeze_step=3, eps=1e-9, min_compressed_size=0)
  grads = jnp.zeros((VOCAB, WIDTH)).at[:USED].set(1.0)
  params = jnp.zeros((VOCAB, WIDTH))
  state = tx.init(params)
  update = jax.jit(tx.update)  # One program, not operation by operation.
  for step in range(8):
    # After the freeze, the rows without a gradient get a 1-bit gradient's +-scale.
    g = grads if step < 3 else grads + 0.5 * jnp.where(step % 2, 1.0, -1.0)
    updates, state = update(g, state, params)
    params = optax.apply_updates(params, updates)
  assert not np.any(np.asarray(params[USED:]))
  assert np.all(np.asarray(params[:USED]) < 0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("make", [
    lambda: qsgd_jax.zero_one_adam(1e-2, AXIS, var_freeze_step=4, min_compressed_size=0,
                                   var_update_scaler=1, local_step_scaler=2,
                                   local_step_clipper=1),
    lambda: qsgd_jax.zero_one_adam(1e-2, AXIS, var_freeze_step=4, min_compressed_size=0,
                                   var_update_scaler=1, local_step_scaler=2,
                                   local_step_clipper=2),
    lambda: qsgd_jax.onebit_adam(1e-2, AXIS, freeze_step=4, min_compressed_size=0),
], ids=["zero_one_adam", "zero_one_adam_local_steps", "onebit_adam"])
@pytest.mark.slow
def test_half_precision_parameters(make, dtype):
  tx = make()
  rng = np.random.default_rng(1)
  params = {"w": jnp.asarray(rng.normal(size=(64, 128)), dtype)}
  steps_grads = [{"w": jnp.asarray(rng.normal(size=(N, 64, 128)), dtype)} for _ in range(10)]
  p, state = _run(tx, params, steps_grads)
  state = state if isinstance(state, qsgd_jax.ZeroOneAdamState) else state[0]
  # float16's range cannot hold a squared gradient: the variance is float32 then.
  assert p["w"].dtype == dtype
  assert state.nu["w"].dtype == (jnp.float32 if dtype == jnp.float16 else dtype)
  assert int(state.count[0]) == 10 and np.all(np.isfinite(np.asarray(p["w"], np.float32)))
  reference, _ = _run(tx, jax.tree.map(lambda x: x.astype(jnp.float32), params),
                      [jax.tree.map(lambda x: x.astype(jnp.float32), g) for g in steps_grads])
  start = np.asarray(params["w"], np.float32)
  moved = np.abs(np.asarray(reference["w"][0]) - start).max()
  # Rounding flips a few signs near zero in the 1-bit exchange: all but those agree.
  difference = np.abs(np.asarray(p["w"][0], np.float32) - np.asarray(reference["w"][0]))
  tolerance = 0.1 * moved + 2 * float(jnp.finfo(dtype).eps) * np.abs(start)
  assert np.mean(difference <= tolerance) > 0.999


def _zero_at(zero_counts):
  """A learning rate of 1e-2 but at ``zero_counts``, where it is 0 (a warm restart)."""
  zeros = jnp.asarray(zero_counts)
  return lambda count: jnp.where(jnp.any(count == zeros), 0.0, 1e-2)


@pytest.mark.parametrize("make", [
    lambda lr: qsgd_jax.zero_one_adam(lr, AXIS, var_freeze_step=2, min_compressed_size=0,
                                      local_step_scaler=1, local_step_clipper=4),
    lambda lr: qsgd_jax.zero_one_adam(lr, AXIS, var_freeze_step=2, min_compressed_size=0,
                                      local_step_clipper=1),
    lambda lr: qsgd_jax.onebit_adam(lr, AXIS, freeze_step=2, min_compressed_size=0),
], ids=["zero_one_adam_local_steps", "zero_one_adam", "onebit_adam"])
@pytest.mark.slow
def test_a_zero_learning_rate_neither_stores_nan_nor_stalls(make):
  # Counts 0-1 warm up; 0/1 Adam's local interval doubles every frozen step, up to 4, so
  # that counts 3, 4, 6 and 8 synchronize: 4 and 8 after learning rates of zero only.
  tx = make(_zero_at([3, 6, 7]))
  rng = np.random.default_rng(2)
  params = {"w": jnp.asarray(rng.normal(size=(32, 64)), jnp.float32)}
  steps_grads = [{"w": jnp.asarray(rng.normal(size=(N, 32, 64)) + 1.0, jnp.float32)}
                 for _ in range(10)]
  p, state = _run(tx, params, steps_grads)
  core = state if isinstance(state, qsgd_jax.ZeroOneAdamState) else state[0]
  assert int(core.count[0]) == 10
  for leaf in jax.tree.leaves(core._replace(stats=None)):  # The stats' elias_bits are NaN.
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      assert np.all(np.isfinite(np.asarray(leaf)))
  assert np.all(np.isfinite(np.asarray(p["w"])))
  # Every step moves the parameters (the gradients' mean is far from 0) but the zero ones.
  assert np.all(np.asarray(p["w"][0]) < np.asarray(params["w"]))


@pytest.mark.parametrize("optimizer", ["onebit_adam", "zero_one_adam"])
def test_auto_freeze_with_no_compressed_leaf_runs_as_adam(optimizer):
  if optimizer == "onebit_adam":
    tx = qsgd_jax.onebit_adam(1e-2, AXIS, freeze_step="auto")
  else:
    tx = qsgd_jax.zero_one_adam(1e-2, AXIS, var_freeze_step="auto", local_step_clipper=1)
  params = {"b": jnp.zeros(16)}
  steps_grads = [{"b": jnp.ones((N, 16))}] * 3
  p, _ = _run(tx, params, steps_grads)
  np.testing.assert_allclose(np.asarray(p["b"][0]), -3e-2, rtol=1e-5)


# Both optimizers with replicated parameters (no local steps), one float32 step before 1-bit ones.
REPLICATED_ADAMS = [
    lambda: qsgd_jax.onebit_adam(1e-2, AXIS, freeze_step=1, min_compressed_size=0),
    lambda: qsgd_jax.zero_one_adam(1e-2, AXIS, var_freeze_step=1, min_compressed_size=0,
                                   local_step_clipper=1),
]


def _in_shard_map(fn):
  """``fn(params, x)`` under ``jax.shard_map`` over 8 devices, params ``{"w": zeros((16, 64))}``
  replicated and ``x`` (ones) split along the axis; its replicated result."""
  mesh = jax.make_mesh((N,), (AXIS,))
  x = jax.device_put(jnp.ones((N, 16)), NamedSharding(mesh, P(AXIS)))
  mapped = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P())
  return jax.jit(mapped)({"w": jnp.zeros((16, 64))}, x)


@pytest.mark.parametrize("make", REPLICATED_ADAMS, ids=["onebit_adam", "zero_one_adam"])
def test_a_gradient_already_summed_over_the_axis_is_refused(make):
  tx = make()

  def step(params, x):
    state = tx.init(params)
    # With respect to replicated params: autodiff sums the gradient over the axis.
    grads = jax.grad(lambda p: jnp.sum(x @ p["w"]))(params)
    return tx.update(grads, state, params)[0]

  with pytest.raises(ValueError, match=r"\['w'\] is replicated over axis 'batch'"):
    _in_shard_map(step)


def test_zero_one_adams_local_steps_under_replicated_parameters_say_what_to_do():
  mesh = jax.make_mesh((N,), (AXIS,))
  params = {"w": jnp.zeros((64, 80))}
  x = jax.device_put(jnp.ones((N, 64)), NamedSharding(mesh, P(AXIS)))

  def loss_fn(params, x):
    return jnp.mean(x @ params["w"])

  train = qsgd_jax.data_parallel(loss_fn, qsgd_jax.zero_one_adam(1e-3, AXIS, var_freeze_step=3),
                                 mesh)
  p = jax.device_put(params, NamedSharding(mesh, P()))
  with pytest.raises(ValueError, match=r"local_step_clipper=16 .* local_step_clipper=1"):
    train.step(p, train.init(p), x)


@pytest.mark.parametrize("make", REPLICATED_ADAMS, ids=["onebit_adam", "zero_one_adam"])
def test_init_and_update_in_one_shard_map(make):
  tx = make()

  def steps(params, x):
    state = tx.init(params)
    for _ in range(3):  # A float32 step, then 1-bit ones.
      grads = jax.grad(lambda p: jnp.sum(x @ p["w"]))(qsgd_jax.as_varying(params, AXIS))
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
    return params

  out = _in_shard_map(steps)
  assert np.all(np.asarray(out["w"]) < 0)
