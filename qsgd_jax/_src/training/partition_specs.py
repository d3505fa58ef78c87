"""``PartitionSpec`` trees of the library's optax states, for ``jax.shard_map``."""

from collections.abc import Mapping

import jax
import optax
from jax.sharding import PartitionSpec

from qsgd_jax._src import axes, stats
from qsgd_jax._src.accumulation import AccumulationState
from qsgd_jax._src.adam.onebit_adam import ScaleByOneBitAdamState
from qsgd_jax._src.adam.zero_one_adam import ZeroOneAdamState
from qsgd_jax._src.averaging.allreduce import CompressedAllReduceState
from qsgd_jax._src.averaging.decentralized import LowPrecisionDecentralizedState
from qsgd_jax._src.diloco.exchange import SplitAverageState
from qsgd_jax._src.diloco.fragment import DelayedFragmentState
from qsgd_jax._src.diloco.transform import DiLoCoState
from qsgd_jax._src.fsdp.onebit_state import FSDPOneBitErrorState
from qsgd_jax._src.powersgd.transform import PowerSGDState
from qsgd_jax._src.sparse.demo import ScaleByDemoState
from qsgd_jax._src.sparse.dgc import ScaleByDGCState
from qsgd_jax._src.sparse.sparseloco import SparseLoCoState

# The fields every instance has, whatever the parameters and options: a Flax
# NNX State drops empty tuples, so a state's other fields may be missing there.
_ALWAYS_PRESENT = {
    AccumulationState: ("mini_step",),
    CompressedAllReduceState: ("key", "count", "stats"),
    DiLoCoState: ("count", "stats", "global_params"),
    DelayedFragmentState: ("outer_gradient", "averaged_gradient"),
    SplitAverageState: ("state",),
    FSDPOneBitErrorState: ("warm_up_left",),
    LowPrecisionDecentralizedState: ("key", "stats"),
    ScaleByOneBitAdamState: ("count", "worker_error", "server_error", "freeze_count", "stats"),
    ZeroOneAdamState: ("count", "worker_error", "server_error", "variance_interval",
                       "local_interval", "learning_rate_sum", "freeze_count", "stats"),
    PowerSGDState: ("key", "count", "stats"),
    ScaleByDemoState: ("count", "momentum", "stats"),
    ScaleByDGCState: ("count", "momentum", "velocity", "stats"),
    SparseLoCoState: ("error", "stats"),
    optax.MultiStepsState: ("mini_step", "gradient_step", "acc_grads"),
}


def state_partition_specs(opt_state, axis_name: axes.AxisName,
                          split_axis: axes.AxisName | None = None):
  """``PartitionSpec`` tree of an optax state for ``jax.shard_map``.

  * In a :class:`~qsgd_jax.CompressedAllReduceState` the residuals differ per
    device and lie along ``axis_name`` (each device holds its own vectors);
    the key, the count and the stats are replicated.
  * In a :class:`~qsgd_jax.LowPrecisionDecentralizedState` every worker has
    its own model, so the replicas and the inner optimizer's arrays lie along
    ``axis_name`` (with the parameters' layout); the key, the stats and the
    scalars (step counts) are replicated.
  * In a :class:`~qsgd_jax.ScaleByOneBitAdamState` (:func:`~qsgd_jax.onebit_adam`)
    the 1-bit exchange's worker and server errors (one array a group of
    compressed leaves) lie along ``axis_name``; the moments and the rest are
    replicated.
  * In a :class:`~qsgd_jax.ZeroOneAdamState` the errors lie along
    ``axis_name``; with local steps (a non-empty ``accumulator``), the
    accumulator and the first moment lie along the outer axis (the first of
    ``axis_name``: with inner axes each node steps on its own average, with
    the parameters' per-node layout); the variance and the counters are
    replicated.
  * In a :class:`~qsgd_jax.FSDPOneBitErrorState`
    (:func:`~qsgd_jax.keep_fsdp_onebit_error`) the worker errors lie along
    ``axis_name``; the switch's count is replicated. (FSDP's moments are the
    parameters' shards: lay them out as the parameters.)
  * In a :class:`~qsgd_jax.PowerSGDState` each device's error lies along
    ``axis_name``; the key, the count, the P and Q memories (the same on
    every device: they come from all-reduces) and the stats are replicated.
  * In a :class:`~qsgd_jax.ScaleByDemoState` (:func:`~qsgd_jax.demo`) each
    device's momentum, and in a :class:`~qsgd_jax.SparseLoCoState` each
    device's error feedback, lie along ``axis_name``; in a
    :class:`~qsgd_jax.ScaleByDGCState` (:func:`~qsgd_jax.dgc`) the momenta
    and velocities of the leaves it compresses (two or more dimensions) do,
    the others' are replicated; counts and stats are replicated.
  * In a :class:`~qsgd_jax.DiLoCoState` (:func:`~qsgd_jax.diloco`, with
    ``axis_name`` its workers' axis) each worker's own arrays lie along
    ``axis_name``: its inner optimizer's state (every leaf stored with a
    leading axis of one) and, in a :class:`~qsgd_jax.DelayedFragmentState`,
    its outer gradient before the exchange. Inside the inner state, what
    these rules lay out per device (the residuals of an average over a
    worker's devices) lies along ``axis_name`` and ``split_axis``. The
    fragments' average states are laid out by these same rules (a
    compressed average's residuals along the axis); a
    :class:`~qsgd_jax.SplitAverageState` (of ``diloco(...,
    split_axis=...)``: each device's own part) lies along ``axis_name`` and
    ``split_axis``. The count, the stats, the global parameters, the outer
    optimizers' states and the averaged outer gradients are the same on
    every device and replicated. On a two-level mesh with DiLoCo over the
    outer axis and the inner optimizer averaging over the inner one, pass
    ``split_axis`` the inner one (whether or not ``diloco`` splits its
    exchange): a worker's parameters and optimizer state are then the same
    on its devices, its residuals each device's own.
  * In an :class:`~qsgd_jax.AccumulationState` each device's running mean of
    its gradients lies along ``axis_name`` and the mini-step counter is
    replicated; the wrapped state inside is laid out by these same rules.
  * In an ``optax.MultiStepsState`` (``optax.MultiSteps``) each device's
    accumulated gradients, ``acc_grads``, lie along ``axis_name``; the
    counters and ``skip_state`` are replicated; ``inner_opt_state`` is laid
    out by these same rules. A scalar parameter's ``acc_grads`` differs per
    device but has no dimension to lie along: a ``ValueError`` names it.
  * Every other leaf is replicated (``P()``): other states (optax's own,
    their wrappers', the library's states nested inside them) hold what is
    the same on every device once the gradients are averaged. From its
    shapes alone a state cannot tell which of its arrays the update makes
    per device; :func:`~qsgd_jax.data_parallel` finds out by tracing the
    update, and lays out along the axes it varies over each leaf of a state
    this function does not know that the update makes per device.

  On a mesh whose model is sharded over other axes (``fsdp``, ``tensor``)
  and averaged over ``axis_name``, these are the specs over ``axis_name``, as
  a ``jax.shard_map`` manual over it alone takes them. Over the other axes
  each array is laid out as the optimizer's ``init`` makes it there, read
  from its explicit sharding type: the states' parameter-shaped arrays (the
  moments, decentralized SGD's replicas) as the parameters, their
  per-device arrays (residuals, the 1-bit exchange's errors, PowerSGD's
  errors) and PowerSGD's ``Q`` and ``P`` along the axes of the shards they
  belong to, after ``axis_name`` along the first dimension.
  :func:`~qsgd_jax.data_parallel`'s ``abstract_state`` gives the whole
  layout, a ``NamedSharding`` an array.

  The states are recognized as Flax NNX holds them too: in an
  ``nnx.Optimizer`` (its ``opt_state``, or the optimizer itself), whose
  arrays are ``nnx.OptArray`` variables, and in the ``nnx.State`` of
  ``nnx.state(optimizer)``, where each state is a mapping from its field
  names (empty fields dropped). The result has the structure of
  ``opt_state``, variables included, with a ``PartitionSpec`` for each array.

  See :func:`~qsgd_jax.compressed_allreduce` for the pattern, and
  :func:`~qsgd_jax.data_parallel` for a training step that does it all.

  Args:
    opt_state: an optax state, or its ``jax.eval_shape``.
    axis_name: the mesh axis (or axes) the devices are mapped over.
    split_axis: with a :func:`~qsgd_jax.diloco` over ``axis_name`` on a
      two-level mesh, the axes of a worker's devices (its ``split_axis``,
      or the axes its inner optimizer averages over): what each device of a
      worker holds for itself lies along them too, after ``axis_name``.

  Returns:
    A pytree of ``jax.sharding.PartitionSpec`` shaped like ``opt_state``.

  Raises:
    ValueError: an ``optax.MultiStepsState`` accumulates a scalar gradient.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> tx = qsgd_jax.qsgd("batch", error_feedback=True)
    >>> specs = qsgd_jax.state_partition_specs(jax.eval_shape(tx.init, jnp.zeros(8192)), "batch")
    >>> specs.local_error, specs.count
    ((P('batch',),), P())
  """
  replicated, along_axis = PartitionSpec(), PartitionSpec(axis_name)
  parsed = axes.parse(axis_name, "state_partition_specs")
  split_names = () if split_axis is None else axes.parse(split_axis, "state_partition_specs").names
  along_split = PartitionSpec(tuple(dict.fromkeys((*parsed.names, *split_names))))
  # 0/1 Adam's local steps run on each node's average over the inner axes: its per-device
  # momenta and accumulators differ between nodes only.
  along_outer = PartitionSpec(parsed.outer)

  def all_leaves(spec):
    return lambda tree: jax.tree.map(lambda _: spec, tree)

  def per_worker(tree, spec=along_axis):
    return jax.tree.map(lambda leaf: replicated if len(leaf.shape) == 0 else spec, tree)

  def per_node(tree):
    return per_worker(tree, along_outer)

  def per_worker_state(tree):
    # A DiLoCo worker's inner state: what the rules lay out per device over all the axes stays
    # so, and what they replicate is the worker's own.
    names = along_split[0]
    over_devices = state_partition_specs(tree, names if len(names) > 1 else names[0])
    return jax.tree.map(lambda spec: along_axis if spec == replicated else spec, over_devices,
                        is_leaf=lambda node: isinstance(node, PartitionSpec))

  def compressed_by_dgc(tree):
    return jax.tree.map(lambda leaf: along_axis if len(leaf.shape) > 1 else replicated, tree)

  field_specs = {
      AccumulationState: dict(
          mini_step=all_leaves(replicated), accumulated=all_leaves(along_axis),
          inner_state=lambda inner: specs(inner)),
      CompressedAllReduceState: dict(
          key=all_leaves(replicated), count=all_leaves(replicated),
          local_error=all_leaves(along_axis), chunk_error=all_leaves(along_axis),
          stats=all_leaves(replicated)),
      LowPrecisionDecentralizedState: dict(
          inner_state=per_worker, left_replica=per_worker, right_replica=per_worker,
          key=all_leaves(replicated), stats=all_leaves(replicated)),
      ScaleByOneBitAdamState: dict(
          worker_error=all_leaves(along_axis), server_error=all_leaves(along_axis)),
      FSDPOneBitErrorState: dict(worker_error=all_leaves(along_axis)),
      DiLoCoState: dict(inner_state=per_worker_state, fragments=lambda tree: specs(tree)),
      DelayedFragmentState: dict(
          average_state=lambda tree: specs(tree), outer_gradient=all_leaves(along_axis)),
      SplitAverageState: dict(state=all_leaves(along_split)),
      PowerSGDState: dict(
          key=all_leaves(replicated), count=all_leaves(replicated),
          error=all_leaves(along_axis), q_memory=all_leaves(replicated),
          p_memory=all_leaves(replicated), stats=all_leaves(replicated)),
      ScaleByDemoState: dict(momentum=all_leaves(along_axis)),
      ScaleByDGCState: dict(momentum=compressed_by_dgc, velocity=compressed_by_dgc),
      SparseLoCoState: dict(error=all_leaves(along_axis)),
  }

  def per_device_gradients(tree):
    def layout(path, leaf):
      if len(leaf.shape) == 0:
        raise ValueError(
            f"state_partition_specs: optax.MultiStepsState's acc_grads"
            f"{jax.tree_util.keystr(path)} is a scalar, each device's own accumulated "
            f"gradient, which has no dimension to lay along {axis_name!r}. Give that "
            "parameter shape (1,), or accumulate with qsgd_jax.accumulate_gradients, "
            "which keeps each gradient as a vector (and communicates once per k steps).")
      return along_axis
    return jax.tree_util.tree_map_with_path(layout, tree)

  field_specs[optax.MultiStepsState] = dict(
      mini_step=all_leaves(replicated), gradient_step=all_leaves(replicated),
      acc_grads=per_device_gradients, inner_opt_state=lambda inner: specs(inner),
      skip_state=all_leaves(replicated))

  def zero_one_adam_fields(node):
    fields = _fields(node)
    local_steps = bool(jax.tree.leaves(fields.get("accumulator", ())))
    return dict(worker_error=all_leaves(along_axis), server_error=all_leaves(along_axis),
                accumulator=per_node, mu=per_node if local_steps else all_leaves(replicated))

  def spec(node):
    state_type = _state_type(node)
    if state_type is None:
      return jax.tree.map(lambda _: replicated, node)
    functions = (zero_one_adam_fields(node) if state_type is ZeroOneAdamState
                 else field_specs[state_type])
    return _map_fields(node, functions, default=all_leaves(replicated))

  def specs(tree):
    return jax.tree.map(spec, tree, is_leaf=lambda node: _state_type(node) is not None)

  return specs(opt_state)


def _state_type(node) -> type | None:
  """Which of the library's states ``node`` is, as a NamedTuple or as a mapping of fields."""
  if isinstance(node, tuple(_ALWAYS_PRESENT)):
    return type(node)
  if not isinstance(node, Mapping):
    return None
  for state_type, present in _ALWAYS_PRESENT.items():
    if (all(isinstance(name, str) for name in node) and set(node) <= set(state_type._fields)
        and set(present) <= set(node) and ("stats" not in node or stats.is_stats(node["stats"]))):
      return state_type
  return None


def _fields(node) -> dict:
  """The fields of ``node`` (NamedTuple or mapping) by name."""
  return node._asdict() if isinstance(node, tuple) else dict(node)


def _map_fields(node, functions, default=None):
  """``node`` (NamedTuple or mapping) with each field's value passed through its function
  (``default`` for a field ``functions`` does not name)."""
  fields, structure = jax.tree_util.tree_flatten_with_path(
      node, is_leaf=lambda child: child is not node)
  return jax.tree_util.tree_unflatten(
      structure,
      [functions.get(_field_name(path), default)(value) for path, value in fields])


def _field_name(path) -> str:
  (entry,) = path
  return entry.name if isinstance(entry, jax.tree_util.GetAttrKey) else entry.key
