"""What the DiLoCo tests share: a small Flax-like model, each worker's targets, and a step
under ``jax.shard_map`` with every device's parameters its own."""

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qsgd_jax

AXIS = "workers"
WORKERS = 8


def example_params():
  """A Flax-like tree: three top-level modules, four leaves."""
  rng = np.random.default_rng(0)
  return {"params": {
      "Block_0": {"kernel": rng.normal(size=(4, 3)).astype(np.float32)},
      "Block_1": {"bias": rng.normal(size=(3,)).astype(np.float32),
                  "kernel": rng.normal(size=(4, 3)).astype(np.float32)},
      "Embed_0": {"embedding": rng.normal(size=(5, 3)).astype(np.float32)},
  }}


# Leaves in jax.tree.leaves order: Block_0/kernel, Block_1/bias, Block_1/kernel, Embed_0.
TWO_FRAGMENTS = (0, 1, 1, 0)


def example_targets(steps, workers=WORKERS, seed=1):
  """Worker m's target at step t, one a leaf: its gradient is params - target."""
  rng = np.random.default_rng(seed)
  leaves = jax.tree.leaves(example_params())
  return [[rng.normal(size=(workers, *x.shape)).astype(np.float32) for x in leaves]
          for _ in range(steps)]


def reference_grad(targets):
  """``grad(m, t, theta)`` of the NumPy references: worker ``m``'s gradient at step ``t``."""
  return lambda m, t, theta: [x - c[m] for x, c in zip(theta, targets[t], strict=True)]


def stack(tree, n=WORKERS):
  """``tree`` with every leaf copied ``n`` times along a new first axis."""
  return jax.tree.map(lambda x: np.broadcast_to(x, (n, *np.shape(x))).copy(), tree)


def step_with_params_per_device(tx, mesh):
  """Inits ``tx`` and takes one step under ``jax.shard_map`` over both axes of ``mesh``,
  every device holding parameters of its own (laid out along both axes), its gradient the
  parameters themselves."""
  both = mesh.axis_names
  with jax.set_mesh(mesh):  # Binds a split_axis's size for init under jax.eval_shape.
    specs = qsgd_jax.state_partition_specs(jax.eval_shape(tx.init, example_params()), both)
  own = lambda tree: jax.tree.map(lambda x: x[0], tree)  # noqa: E731

  def step(params, state):
    params = own(params)
    updates, state = tx.update(params, state, params)
    return jax.tree.map(lambda x: x[None], optax.apply_updates(params, updates)), state

  init = jax.shard_map(lambda p: tx.init(own(p)), mesh=mesh, in_specs=P(both), out_specs=specs)
  run = jax.shard_map(step, mesh=mesh, in_specs=(P(both), specs), out_specs=(P(both), specs))
  params = jax.device_put(stack(example_params()), NamedSharding(mesh, P(both)))
  return jax.jit(run)(params, jax.jit(init)(params))
