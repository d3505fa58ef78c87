"""What :func:`qsgd_jax.diloco` checks of its arguments, state and layout, and its global copy."""

import jax
import jax.numpy as jnp

from qsgd_jax._src import axes

_OWNER = "qsgd_jax.diloco"


def check_schedule(sync_every: int, count: int, delay: int) -> None:
  if count > sync_every:
    raise ValueError(
        f"{_OWNER}: {count} fragments cannot each sync once in sync_every={sync_every} steps: "
        "pass at most sync_every fragments.")
  interval = sync_every // count
  if delay >= interval:
    raise ValueError(
        f"{_OWNER}: delay={delay} must be below the fragment interval sync_every // fragments "
        f"= {sync_every} // {count} = {interval} (as torchft requires), so that a fragment "
        "merges before the next one syncs. Lower delay or raise sync_every.")


def check_state(state, expected, state_type: type) -> None:
  """Raises where ``state`` is not laid out as this configuration's state for these params."""
  if not isinstance(state, state_type):
    raise ValueError(f"{_OWNER}: the state is a {type(state).__name__}, not a DiLoCoState: "
                     "pass the state this transformation's init returned.")
  expected_leaves, expected_tree = jax.tree_util.tree_flatten_with_path(expected)
  held_tree = jax.tree.structure(state)
  if held_tree != expected_tree:
    raise ValueError(
        f"{_OWNER}: the state's tree differs from what this configuration (inner, outer "
        "optimizer, average, fragments, delay) makes for these params: it comes from another "
        "configuration. Build it with this transformation's init.")
  for (path, want), held in zip(expected_leaves, jax.tree.leaves(state), strict=True):
    if jnp.shape(held) != want.shape or jnp.result_type(held) != want.dtype:
      raise ValueError(
          f"{_OWNER}: state leaf {jax.tree_util.keystr(path)} is "
          f"{jnp.result_type(held)}{list(jnp.shape(held))}, this step needs "
          f"{want.dtype}{list(want.shape)}: the state comes from another configuration or "
          "number of workers. Take it to this one with qsgd_jax.resize_state, or init again.")


def check_laid_out(params, parsed: axes.Axes) -> None:
  """Raises where, under ``jax.shard_map``, a parameter is replicated over the workers' outer
  axis. (Over the others of a tuple ``axis_name`` an inner optimizer may average: then the
  parameters are the same along them.)"""
  found = axes.first_replicated(params, (parsed.outer,))
  if found is not None:
    path, missing = found
    raise ValueError(
        f"{_OWNER}: params leaf {path} is replicated over axis {missing!r}, but between syncs "
        "every worker holds parameters of its own. Lay the params out along the axis: each "
        f"device's copy stacked along the first dimension, in_specs=P({parsed.name!r}) and "
        f"out_specs=P({parsed.name!r}) for them in jax.shard_map, and the state laid out by "
        "qsgd_jax.state_partition_specs (qsgd_jax.data_parallel does both).")


def check_averaged(averaged, parsed: axes.Axes) -> None:
  """Raises where, under ``jax.shard_map``, the average still differs across the workers."""
  names = axes.tracked(parsed.names) if not parsed.is_local else ()
  for leaf in averaged:
    varying = [name for name in names if name in jax.typeof(leaf).manual_axis_type.varying]
    if varying:
      raise ValueError(
          f"{_OWNER}: average returned an outer gradient that still differs across axis "
          f"{varying[0]!r}: it must average over axis_name={parsed.name!r}. Build it with the "
          f"same axis, e.g. qsgd_jax.qsgd({parsed.name!r}, bits=4, error_feedback=True).")


def check_inner_updates(updates, params, parsed: axes.Axes) -> None:
  """Raises where, under ``jax.shard_map``, an inner update differs across an axis over which
  its parameter is the same and the workers do not lie: a worker's devices would drift apart.
  """
  for (path, update), param in zip(jax.tree_util.tree_leaves_with_path(updates),
                                   jax.tree.leaves(params), strict=True):
    extra = [name for name in axes.varying_axes(update)
             if name not in axes.varying_axes(param) and name not in parsed.names]
    if extra:
      raise ValueError(
          f"{_OWNER}: the inner optimizer's update of {jax.tree_util.keystr(path)} differs "
          f"across axis {extra[0]!r}, over which the parameters are the same: a worker's "
          "devices would drift apart. Average the gradients over it in the inner optimizer "
          f"(e.g. optax.chain(qsgd_jax.compressed_allreduce(qsgd_jax.Identity(), "
          f"{extra[0]!r}), optax.adamw(...))) and lay the state out by "
          f"qsgd_jax.state_partition_specs(state, {parsed.name!r}, split_axis={extra[0]!r}), "
          "which keeps a worker's optimizer state the same on its devices.")


def check_same_everywhere(averaged, parsed: axes.Axes) -> None:
  """Raises where, under ``jax.shard_map``, the averaged outer gradient differs across an axis
  other than the workers' (whose devices then hold parameters of their own)."""
  for leaf in averaged:
    varying = [name for name in axes.varying_axes(leaf) if name not in parsed.names]
    if varying:
      raise ValueError(
          f"{_OWNER}: the averaged outer gradient differs across axis {varying[0]!r}, which "
          f"axis_name={parsed.name!r} does not average over, so the global parameters would "
          "differ there: the devices along it hold parameters of their own, or the state lies "
          f"along it. Average the inner optimizer's gradients over {varying[0]!r} (e.g. "
          f"optax.chain(qsgd_jax.compressed_allreduce(qsgd_jax.Identity(), {varying[0]!r}), "
          "optax.adamw(...))), lay the parameters out replicated over it and the state by "
          f"qsgd_jax.state_partition_specs(state, {parsed.name!r}, split_axis="
          f"{varying[0]!r}); or add it to axis_name.")


def check_same_in_worker(params, split: axes.Axes) -> None:
  """Raises where, under ``jax.shard_map``, the params are laid out per device over ``split``.

  The check reads the params' layout: the inner optimizer's steps may be
  typed varying over ``split`` though alike on every device of a worker.
  """
  names = axes.tracked(split.names)
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    varying = [name for name in names if name in axes.varying_axes(leaf)]
    if varying:
      raise ValueError(
          f"{_OWNER}: split_axis={split.name!r}, but params leaf "
          f"{jax.tree_util.keystr(path)} differs across axis {varying[0]!r}: every device of a "
          "worker must hold the same parameters. Average "
          "the gradients over that axis in the inner optimizer (e.g. optax.chain("
          f"qsgd_jax.compressed_allreduce(qsgd_jax.Identity(), {varying[0]!r}), optax.adamw("
          "...))) and lay the parameters out replicated over it, or drop split_axis.")


def from_first_device(params, parsed: axes.Axes):
  """A copy of ``params``; under ``jax.shard_map``, the first device's, the same everywhere.

  A leaf that varies over mapped axes (the workers' and any other) is
  broadcast over them from the device of index 0, so that the global copy is
  replicated, as ``P()`` lays it out.
  """
  if parsed.is_local:
    return jax.tree.map(jnp.copy, params)
  try:
    tracked = axes.tracked(parsed.names)
  except NameError:  # init outside the mapped function (e.g. jax.eval_shape).
    tracked = ()
  if not tracked:
    return jax.tree.map(jnp.copy, params)

  def broadcast(x):
    varying = axes.varying_axes(x)
    if not varying:
      return jnp.copy(x)
    first = jax.lax.axis_index(varying) == 0
    # x + 0 + ... + 0 is x exactly: a broadcast from the first device.
    return jax.lax.psum(jnp.where(first, x, jnp.zeros_like(x)), varying)

  return jax.tree.map(broadcast, params)
