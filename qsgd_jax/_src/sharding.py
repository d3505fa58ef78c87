"""``PartitionSpec`` trees of the library's optax states, for ``jax.shard_map``."""

import jax
from jax.sharding import PartitionSpec

from qsgd_jax._src import axes
from qsgd_jax._src.accumulation import AccumulationState
from qsgd_jax._src.decentralized import LowPrecisionDecentralizedState
from qsgd_jax._src.stats import CompressionStats
from qsgd_jax._src.transforms import CompressedAllReduceState

_STATES = (AccumulationState, CompressedAllReduceState, LowPrecisionDecentralizedState)


def state_partition_specs(opt_state, axis_name: axes.AxisName):
  """``PartitionSpec`` tree of an optax state for ``jax.shard_map``.

  * In a :class:`~qsgd_jax.CompressedAllReduceState` the residuals differ per
    device and lie along ``axis_name`` (each device holds its own vectors);
    the key, the count and the stats are replicated.
  * In a :class:`~qsgd_jax.LowPrecisionDecentralizedState` every worker has
    its own model, so the replicas and the inner optimizer's arrays lie along
    ``axis_name`` (with the parameters' layout); the key, the stats and the
    scalars (step counts) are replicated.
  * In an :class:`~qsgd_jax.AccumulationState` each device's running mean of
    its gradients lies along ``axis_name`` and the mini-step counter is
    replicated; the wrapped state inside is laid out by these same rules.
  * Every other leaf is replicated (``P()``).

  See :func:`~qsgd_jax.compressed_allreduce` for the pattern.

  Args:
    opt_state: an optax state, or its ``jax.eval_shape``.
    axis_name: the mesh axis (or axes) the devices are mapped over.

  Returns:
    A pytree of ``jax.sharding.PartitionSpec`` shaped like ``opt_state``.
  """
  replicated, along_axis = PartitionSpec(), PartitionSpec(axis_name)

  def per_worker(leaf):
    return replicated if len(leaf.shape) == 0 else along_axis

  def spec(node):
    if isinstance(node, AccumulationState):
      return node._replace(
          mini_step=replicated,
          accumulated=tuple(along_axis for _ in node.accumulated),
          inner_state=specs(node.inner_state),
      )
    if isinstance(node, CompressedAllReduceState):
      return node._replace(
          key=replicated,
          count=replicated,
          local_error=tuple(along_axis for _ in node.local_error),
          chunk_error=tuple(along_axis for _ in node.chunk_error),
          stats=CompressionStats(*(replicated for _ in node.stats)),
      )
    if isinstance(node, LowPrecisionDecentralizedState):
      return node._replace(
          inner_state=jax.tree.map(per_worker, node.inner_state),
          left_replica=jax.tree.map(per_worker, node.left_replica),
          right_replica=jax.tree.map(per_worker, node.right_replica),
          key=replicated,
          stats=CompressionStats(*(replicated for _ in node.stats)),
      )
    return jax.tree.map(lambda _: replicated, node)

  def specs(tree):
    return jax.tree.map(spec, tree, is_leaf=lambda node: isinstance(node, _STATES))

  return specs(opt_state)
