"""Where :func:`~qsgd_jax.data_parallel` puts each array of an optimizer's state.

Over the data axes a leaf is the same on every device (replicated) or each
device's own (laid along the axes); :func:`~qsgd_jax.state_partition_specs`
knows the library's states, and the rest is found by tracing the update. Over
the model axes of a mesh whose model is sharded (``fsdp``, ``tensor``) a leaf
is laid out as the optimizer's ``init`` makes it, read from its explicit
sharding type: Adam's moments as the parameters, a compressed average's
residuals along the axes of the shards they belong to.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from qsgd_jax._src import axes
from qsgd_jax._src.diloco.transform import DiLoCoState
from qsgd_jax._src.training import model_axes
from qsgd_jax._src.training.partition_specs import state_partition_specs


class StateLayout:
  """The layout of ``optimizer``'s state on ``mesh``, for given parameters.

  Args:
    optimizer: the optax transformation.
    mesh: the devices.
    names: the data axes, over which the gradients are averaged.
    model: the model axes, the mesh's others (none for plain data parallel).
  """

  def __init__(self, optimizer, mesh: jax.sharding.Mesh, names: tuple[str, ...],
               model: tuple[str, ...]):
    self._optimizer, self._names, self._model = optimizer, names, model
    self._axis = names if len(names) > 1 else names[0]
    # Abstract passes run with every model axis automatic (explicit_axes makes them explicit
    # again for the optimizer), the data axes manual.
    self._mesh = mesh if not model else jax.sharding.Mesh(
        mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
  def specs(self, params, param_specs):
    """``(data_specs, model_specs, param_axes)`` of the state ``init(params)`` makes
    (``params`` one copy, arrays or ``jax.ShapeDtypeStruct``, laid out by ``param_specs``
    over the model axes): each leaf's ``PartitionSpec`` over the data axes, as
    ``jax.shard_map`` over them takes it, and over the model axes, as its explicit type
    says (``P()`` each without model axes); and for a local-update optimizer the data axes
    its workers lie along (the first, the slow link, and every other its update makes the
    parameters differ over), else ``None``."""
    found = []

    def device_state(params):
      def probe(params):
        state = self._optimizer.init(params)
        found.append(model_axes.explicit_specs(state))
        return state

      state = model_axes.with_model_axes(probe, self._model, (param_specs,))(params)
      return jax.tree.map(lambda x: x[None], axes.as_varying(state, self._axis))

    stacked = jax.eval_shape(self._map(device_state, P(), P(self._axis)), params)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), stacked)
    model_specs = found[0] if self._model else jax.tree.map(lambda _: P(), shapes)
    param_axes = self._names[:1] if _holds_global_params(shapes) else None
    specs = self._known_specs(shapes, param_axes)
    # A state that state_partition_specs does not know may hold per-device arrays: lay out
    # each leaf along the axes the update makes it vary over. Laying one out may make others
    # vary, so until nothing changes (each round only turns replicated leaves per device).
    while True:
      params_varying, state_varying = self._updated_varying(params, param_specs, specs,
                                                            model_specs, param_axes)
      specs, changed = _per_device_specs(shapes, specs, state_varying, self._names)
      if param_axes is not None and not set(params_varying) <= set(param_axes):
        param_axes = tuple(name for name in self._names
                           if name in {*param_axes, *params_varying})
        specs, changed = self._known_specs(shapes, param_axes), True
      if not changed:
        return specs, model_specs, param_axes

  def _known_specs(self, shapes, param_axes):
    """What :func:`~qsgd_jax.state_partition_specs` says: a local-update optimizer's
    workers along ``param_axes``, the other data axes a worker's devices."""
    if param_axes is None:
      return state_partition_specs(shapes, self._axis)
    within = tuple(name for name in self._names if name not in param_axes)
    return state_partition_specs(shapes, axis_name(param_axes),
                                 split_axis=axis_name(within) if within else None)

  def _updated_varying(self, params, param_specs, specs, model_specs, param_axes):
    """The data axes the update makes the parameters vary over, and each leaf of the new
    state."""
    found = []

    def probe(params, opt_state):
      local = axes.as_varying(params, self._axis)
      updated = params if param_axes is None else axes.as_varying(params, param_axes)
      updates, new_state = self._optimizer.update(local, opt_state, updated)
      found.append((tuple(name for leaf in jax.tree.leaves(updates)
                          for name in varying_over(leaf, self._names)),
                    [varying_over(leaf, self._names) for leaf in jax.tree.leaves(new_state)]))
      return jnp.zeros(())

    init = model_axes.with_model_axes(self._optimizer.init, self._model, (param_specs,))
    update = model_axes.with_model_axes(probe, self._model, (param_specs, model_specs))
    global_shapes = jax.eval_shape(self._map(init, P(), specs), params)
    jax.eval_shape(self._map(update, (P(), specs), P()), params, global_shapes)
    return found[0]

  def _map(self, fn, in_specs, out_specs):
    return jax.shard_map(fn, mesh=self._mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=set(self._names))


def axis_name(names: tuple[str, ...]) -> axes.AxisName:
  """What ``PartitionSpec`` and the transforms take for ``names``: one name, or the tuple."""
  return names if len(names) > 1 else names[0]


def varying_over(x, names: Sequence[str]) -> tuple[str, ...]:
  """Those of ``names`` that ``x`` varies over, in their order."""
  varying = axes.varying_axes(x)
  return tuple(name for name in names if name in varying)


def _holds_global_params(state) -> bool:
  """Whether ``state`` holds a local-update optimizer's state (a ``DiLoCoState``)."""
  return any(isinstance(node, DiLoCoState) for node in jax.tree.leaves(
      state, is_leaf=lambda node: isinstance(node, DiLoCoState)))


def _per_device_specs(shapes, specs, varying, names: tuple[str, ...]):
  """``(specs, changed)``: ``specs`` with each leaf that ``specs`` replicates but that
  ``varying`` says varies over some of ``names`` laid out along those axes.

  Raises:
    ValueError: such a leaf is a scalar, which has no dimension to lay out.
  """
  is_spec = lambda node: isinstance(node, P)  # noqa: E731
  spec_leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
  paths_and_shapes = jax.tree_util.tree_leaves_with_path(shapes)
  out, changed = [], False
  for (path, shape), spec, axes_of in zip(paths_and_shapes, spec_leaves, varying, strict=True):
    if spec != P() or not axes_of:
      out.append(spec)
      continue
    state_type = type(_innermost_state(shapes, path)).__name__
    if len(shape.shape) == 0:
      raise ValueError(
          f"data_parallel: the optimizer's state{jax.tree_util.keystr(path)}, a scalar in "
          f"a {state_type}, differs per device over {axes_of} after the update, and a "
          "scalar has no dimension to lay out along the axis (state_partition_specs does "
          f"not know {state_type}). Keep that per-device value in an array of shape (1,), "
          "or make the state the same on every device (average what it holds).")
    out.append(P(axes_of if len(axes_of) > 1 else axes_of[0]))
    changed = True
  return jax.tree.unflatten(treedef, out), changed


def _innermost_state(tree, path):
  """The innermost NamedTuple (an optax state) on ``path`` from ``tree``'s root."""
  owner = node = tree
  for entry in path[:-1]:
    if isinstance(entry, jax.tree_util.GetAttrKey):
      node = getattr(node, entry.name)
    elif isinstance(entry, jax.tree_util.SequenceKey):
      node = node[entry.idx]
    elif isinstance(entry, jax.tree_util.DictKey):
      node = node[entry.key]
    else:  # A custom node's child: the state found so far names it.
      break
    if isinstance(node, tuple) and hasattr(node, "_fields"):
      owner = node
  return owner
