"""PowerSGD's compressed step on each device's own shards of a group of leaves.

Under ``jax.pmap``, or a ``jax.shard_map`` manual over every mesh axis, a
device holds whole leaves and there is one group, of every leaf. On a mesh
whose model is sharded over other axes (``fsdp``, ``tensor``), the leaves
laid out over the same mesh axes form a group
(:func:`qsgd_jax._src.shards.group`), and the group's step runs in a
``jax.shard_map`` manual over those axes: each device's block of a leaf's
matrix (its shard, seen through the matrix view) is compressed as a matrix
of its own, with its own ``P`` and ``Q``, summed over the averaged axes
alone. Factoring the whole matrix instead would need ``P = M Q`` summed
over the blocks of a row, a collective over the model axes on every step;
the blocks' factors need none, and a device sends
:math:`(n / a + m / b) r` numbers for its :math:`n / a \\times m / b` block
where the whole matrix's factors are :math:`(n + m) r`. The blocks'
approximations together have rank up to :math:`a b r`; the best rank-``r``
approximation of each block (where warm-started steps tend) is at least as
close to it as the whole matrix's best rank-``r`` approximation is there.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from qsgd_jax._src import shards
from qsgd_jax._src.powersgd import low_rank


class ShardPlan(NamedTuple):
  """PowerSGD's plan of the leaves laid out over the same mesh axes, on one device's shards.

  Attributes:
    group: the leaves (``members`` index the tree's leaves) and their layout.
    plan: the :class:`~qsgd_jax._src.powersgd.low_rank.LowRankPlan` of one
      device's shards of them: its leaf indices index ``group.members``.
    shards: the devices over the group's axes (1 for none): each memory of a
      group holds theirs end to end along its first dimension.
  """

  group: shards.ShardGroup
  plan: low_rank.LowRankPlan
  shards: int


class StepOptions(NamedTuple):
  """The options of one compressed step."""

  axis_name: object  # The averaged axes (``None``: one device).
  world: int  # The devices over them.
  warm_start: bool
  use_error_feedback: bool
  orthogonalization_epsilon: float


def make_shard_plans(tree, rank: int, min_compression_rate: float,
                     view: low_rank.MatrixView, owner: str) -> tuple[ShardPlan, ...]:
  """A :class:`ShardPlan` for each set of mesh axes ``tree``'s leaves are laid out over.

  ``float0`` leaves are in none: they pass through the step as they are.
  """
  with_path = jax.tree_util.tree_leaves_with_path(tree)
  indices = [i for i, (_, leaf) in enumerate(with_path)
             if jnp.result_type(leaf) != jax.dtypes.float0]
  mesh = jax.sharding.get_abstract_mesh()
  plans = []
  for group in shards.group([with_path[i][1] for i in indices], owner):
    members = tuple(indices[k] for k in group.members)
    local = [(with_path[i][0], jax.ShapeDtypeStruct(
        shards.local_shape(jnp.shape(with_path[i][1]), spec), jnp.result_type(with_path[i][1])))
             for i, spec in zip(members, group.specs, strict=True)]
    plans.append(ShardPlan(
        group._replace(members=members),
        low_rank.plan_leaves(local, rank, min_compression_rate, view),
        math.prod(mesh.shape[name] for name in group.axes)))
  return tuple(plans)


def memory_shapes(shard_plans, shape_of) -> list[tuple[int, ...]]:
  """Each group's memory of one kind (``shape_of(group)``, a device's) as the state holds
  it: the devices' of its shard axes end to end along the first dimension."""
  return [(shard_plan.shards * shape_of(g)[0], *shape_of(g)[1:])
          for shard_plan in shard_plans for g in shard_plan.plan.groups]


def draw_q(key: jax.Array, plan: low_rank.LowRankPlan) -> tuple[jax.Array, ...]:
  """Standard normal ``float32[count, m, r]`` a group of ``plan``: the Q a step starts from."""
  if not plan.groups:
    return ()
  keys = jax.random.split(key, len(plan.groups))
  return tuple(jax.random.normal(k, g.q_shape, jnp.float32)
               for k, g in zip(keys, plan.groups, strict=True))


def own_key(key: jax.Array, shard_axes: tuple[str, ...]) -> jax.Array:
  """``key`` for this device's shards: its draws its own, the same over the averaged axes."""
  return jax.random.fold_in(key, jax.lax.axis_index(shard_axes)) if shard_axes else key


def initial_memories(shard_plans, leaves: list, key: jax.Array, *, warm_start: bool,
                     use_error_feedback: bool):
  """``(error, q_memory, p_memory)`` before any step: one array a group of each shard plan
  (``key`` the draws' key, split a shard plan; ``leaves`` the tree's, flattened)."""
  memories = ((), (), ())
  for shard_plan, plan_key in zip(shard_plans, _keys(key, len(shard_plans)), strict=True):

    def initial(group_leaves, per_device, shared, shard_plan=shard_plan):
      del per_device
      plan, (own,) = shard_plan.plan, shared
      return group_leaves, (
          _zeros(g.matrix_shape for g in plan.groups) if use_error_feedback else (),
          draw_q(own_key(own, shard_plan.group.axes), plan) if warm_start
          else _zeros(g.q_shape for g in plan.groups),
          _zeros(g.p_shape for g in plan.groups)), ()

    group = shard_plan.group
    _, found, _ = shards.own_shards(initial, group.axes, group.specs,
                                    [leaves[i] for i in group.members], shared=(plan_key,))
    memories = tuple(held + new for held, new in zip(memories, found, strict=True))
  return memories


def compressed(shard_plans, leaves: list, memories, key: jax.Array, options: StepOptions):
  """One compressed step of every shard plan, each on this device's own shards.

  Args:
    shard_plans: the tree's shard plans (:class:`ShardPlan`).
    leaves: the updates, flattened.
    memories: the state's ``(error, q_memory)``.
    key: the step's key (split a shard plan).
    options: the step's :class:`StepOptions`.

  Returns:
    The updates averaged (not yet made NaN), the new ``(error, q_memory,
    p_memory)``, and whether every device's factors and exact means were
    finite, the same on every device of every shard.
  """
  averaged, found, nonfinite, at = list(leaves), ((), (), ()), jnp.float32(0), 0
  for shard_plan, plan_key in zip(shard_plans, _keys(key, len(shard_plans)), strict=True):
    group, count = shard_plan.group, len(shard_plan.plan.groups)
    held = tuple(memory[at:at + count] for memory in memories)
    means, new, group_nonfinite = shards.own_shards(
        functools.partial(compressed_on_shards, shard_plan.plan, options=options,
                          shard_axes=group.axes),
        group.axes, group.specs, [leaves[i] for i in group.members], held, (plan_key,))
    for i, mean in zip(group.members, means, strict=True):
      averaged[i] = mean
    found = tuple(old + more for old, more in zip(found, new, strict=True))
    nonfinite, at = nonfinite + group_nonfinite, at + count
  return averaged, found, nonfinite == 0


def compressed_on_shards(plan: low_rank.LowRankPlan, leaves, memories, shared, *,
                         options: StepOptions, shard_axes: tuple[str, ...]):
  """One group's compressed step on this device's shards of its leaves.

  Args:
    plan: the group's plan on one device's shards.
    leaves: the shards, one a member of the group.
    memories: ``(error, q_memory)``, one array a matrix shape of ``plan``.
    shared: ``(key,)``, the step's key for the group (the same on every device).
    options: the step's :class:`StepOptions`.
    shard_axes: the group's mesh axes (manual here), if any.

  Returns:
    The shards averaged (not yet made NaN by another device's non-finite
    values), the new ``(error, q_memory, p_memory)``, and how many shards'
    factors or exact means were not finite, the same on every device.
  """
  (key,), (error, q_memory) = shared, memories
  reduced = options.axis_name is not None

  def psum(values):
    return jax.lax.psum(values, options.axis_name) if values and reduced else values

  epsilon = options.orthogonalization_epsilon
  q = q_memory if options.warm_start else draw_q(own_key(key, shard_axes), plan)
  q = [low_rank.orthogonalize(x, epsilon) for x in q]
  matrices = [jnp.stack([leaves[i].astype(jnp.float32).reshape(g.rows, g.columns)
                         for i in g.leaves]) for g in plan.groups]
  if options.use_error_feedback:
    matrices = [m + e for m, e in zip(matrices, error, strict=True)]
  exact = tuple(leaves[i] for i in plan.exact)
  if exact and reduced:
    exact = jax.lax.pmean(exact, options.axis_name)
  p = psum(tuple(jnp.einsum("bnm,bmr->bnr", m, x) for m, x in zip(matrices, q, strict=True)))
  finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(x)) for x in (*p, *exact)
                              if jnp.issubdtype(x.dtype, jnp.floating)] + [True]))
  nonfinite = jnp.logical_not(finite).astype(jnp.float32)
  if shard_axes:  # Every shard of every leaf skips together.
    nonfinite = jax.lax.psum(nonfinite, shard_axes)
  p = [low_rank.orthogonalize(x, epsilon) for x in p]
  q = [x / options.world for x in psum(tuple(
      jnp.einsum("bnm,bnr->bmr", m, x) for m, x in zip(matrices, p, strict=True)))]
  averaged = list(leaves)
  for i, mean in zip(plan.exact, exact, strict=True):
    averaged[i] = mean
  new_error = []
  for g, m, left, right in zip(plan.groups, matrices, p, q, strict=True):
    out = jnp.einsum("bnr,bmr->bnm", left, right).astype(g.dtype)
    for k, i in enumerate(g.leaves):
      averaged[i] = out[k].reshape(plan.shapes[i])
    if options.use_error_feedback:
      new_error.append(m - out.astype(jnp.float32))
  return averaged, (tuple(new_error), tuple(q), tuple(p)), nonfinite


def _keys(key: jax.Array, count: int) -> list[jax.Array]:
  """A key a shard plan: ``key`` itself for one (plain data parallel, ``pmap``)."""
  return [key] if count < 2 else list(jax.random.split(key, count))


def _zeros(shapes) -> tuple[jax.Array, ...]:
  return tuple(jnp.zeros(shape, jnp.float32) for shape in shapes)
