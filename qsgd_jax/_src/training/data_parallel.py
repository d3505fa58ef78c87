"""A ``jax.jit`` training step over a mesh whose gradient average is the optimizer's own."""

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from qsgd_jax._src import axes
from qsgd_jax._src.diloco.transform import DiLoCoState
from qsgd_jax._src.training.partition_specs import state_partition_specs


class DataParallel(NamedTuple):
  """The functions of data-parallel training, from :func:`data_parallel`.

  Attributes:
    init: ``init(params) -> opt_state``, jitted: the optimizer's state, laid
      out by :func:`~qsgd_jax.state_partition_specs` over the mesh.
    step: ``step(params, opt_state, batch, *args, events=None) -> (params,
      opt_state, value)``, jitted: one training step. ``value`` is the loss,
      or ``(loss, aux)`` with ``has_aux``, averaged over the devices. With
      :func:`~qsgd_jax.diloco` the params it returns are a copy a worker,
      stacked along a first dimension; ``events``, static, is passed to its
      update (:func:`~qsgd_jax.diloco_events`).
    abstract_state: ``abstract_state(params)``: a ``jax.ShapeDtypeStruct`` for
      each array of ``init(params)``, its ``sharding`` the concrete
      ``NamedSharding`` that ``init`` and ``step`` give it; computes nothing.
      It is the target an orbax restore takes, e.g. in a fresh process.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, qsgd_jax
    >>> mesh = jax.make_mesh((jax.device_count(),), ("batch",))
    >>> tx = optax.chain(qsgd_jax.qsgd("batch"), optax.sgd(0.1))
    >>> init, step, abstract_state = qsgd_jax.data_parallel(
    ...     lambda params, batch: jnp.mean((batch @ params) ** 2), tx, mesh)
    >>> abstract_state(jnp.zeros((4096, 2)))[0].count.shape
    ()
  """

  init: Callable[..., Any]
  step: Callable[..., Any]
  abstract_state: Callable[..., Any]


def data_parallel(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    axis_name: axes.AxisName | None = None,
    *,
    has_aux: bool = False,
    donate: bool = False,
) -> DataParallel:
  r"""A jitted training step over ``mesh`` whose optimizer averages the gradients.

  It is for the data-parallel loop written with ``jax.jit`` and
  ``NamedSharding``: parameters replicated, ``NamedSharding(mesh, P())``; the
  batch split along its first dimension, ``NamedSharding(mesh,
  P("batch"))``. There the compiler inserts a float32 all-reduce of the
  gradients; here each device computes the gradient of its own share of the
  batch and the optimizer averages them, with
  :func:`~qsgd_jax.compressed_allreduce` (or :func:`~qsgd_jax.qsgd`,
  :func:`~qsgd_jax.onebit_sgd`) first in its chain. A tutorial's loop changes
  in three lines, and its hand-written step goes::

    tx = optax.chain(qsgd_jax.qsgd("batch"), optax.adam(1e-3))  # was optax.adam(1e-3)
    init, train_step, abstract_state = qsgd_jax.data_parallel(loss_fn, tx, mesh)
    opt_state = init(params)  # was tx.init(params)
    for batch in batches:
      batch = jax.device_put(batch, NamedSharding(mesh, P("batch")))
      params, opt_state, loss = train_step(params, opt_state, batch)

  The batch may be numpy arrays, or arrays laid out otherwise: ``step`` splits
  each leaf along its first dimension over the mesh; a scalar leaf (a step
  number, a loss weight) has no dimension to split and reaches every device
  whole, like an extra argument of ``step``. (The whole batch is copied to
  the devices first; for large batches, ``jax.device_put`` it with
  ``NamedSharding(mesh, P("batch"))``, or in several processes
  ``jax.make_array_from_process_local_data``.)

  ``step`` runs, under ``jax.shard_map`` over ``axis_name``:

  .. code-block:: python

    local = qsgd_jax.as_varying(params, axis_name)  # This device's own copy.
    value, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(local, batch, *args)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)  # The replicated params.
    value = <lax.pmean of every leaf of value that differs per device>

  The gradient is taken with respect to a per-device copy because the
  gradient of replicated parameters under ``shard_map`` is already summed over
  the axis by autodiff, in float32: the all-reduce the optimizer replaces.
  The averaged updates are the same on every device, so the parameters stay
  replicated. ``loss_fn`` should return the mean over its share of the batch;
  the shares being equal, the devices' mean is the mean over the batch.
  Integer leaves of ``value`` that differ per device come back as float
  means, as from ``jax.lax.pmean``.

  A local-update optimizer, :func:`~qsgd_jax.diloco`, keeps parameters of
  each worker's own between syncs; ``step`` then returns them stacked, one
  copy a worker along a new first dimension, and takes either such copies
  or one copy (as ``init`` does, on the first step; with ``donate`` its
  buffers cannot hold the copies, and JAX warns that they were not used).
  The workers lie along the first axis of ``axis_name`` and every other
  axis the update makes the parameters differ over: on a two-level mesh
  whose inner axis ``diloco``'s inner optimizer averages over, a copy a
  node, laid out along the outer axis (the state then by
  ``state_partition_specs(state, outer, split_axis=inner)``); with no
  average inside, a copy a device. ``step(..., events=...)`` passes a
  :func:`~qsgd_jax.diloco_events` to its update, a static argument: each
  kind of step compiles a program of its own. Evaluate the global
  parameters, the :class:`~qsgd_jax.DiLoCoState`'s ``global_params``
  (``opt_state.global_params`` when ``diloco`` is the whole optimizer).

  The optimizer's state is laid out by :func:`~qsgd_jax.state_partition_specs`:
  per-device residuals along ``axis_name``, the rest replicated. A state that
  function does not know (a wrapper's, a transform of your own) may hold
  per-device arrays, as ``optax.MultiSteps``' accumulated gradients do: the
  update is traced once, abstractly, and each leaf of such a state that it
  makes differ per device is laid out along the axes it differs over.

  Args:
    loss_fn: ``loss_fn(params, batch, *args)``, the loss of one device's share
      of ``batch``: a float scalar, or ``(loss, aux)`` with ``has_aux``.
      ``args`` are the extra arguments of ``step``, the same on every device
      (fold in ``jax.lax.axis_index(axis_name)`` for a per-device rng).
    optimizer: an optax transformation that averages the gradients over
      ``axis_name`` first, e.g. ``optax.chain(qsgd_jax.qsgd(axis_name), ...)``,
      or one that communicates for itself, e.g.
      ``qsgd_jax.onebit_adam(1e-3, axis_name, freeze_step=1000)``.
    mesh: the devices. A ``jax.make_mesh`` mesh of either axis type works.
    axis_name: the mesh axis the batch is split over, or ``(outer, inner,
      ...)`` for a two-level mesh (the optimizer's ``axis_name`` too); by
      default every axis of ``mesh``, in its order.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    donate: whether ``step`` donates ``params`` and ``opt_state`` (reusing
      their memory for the new ones; the arrays passed in are deleted).

  Returns:
    A :class:`DataParallel`: ``init``, ``step`` and ``abstract_state``.

  Raises:
    ValueError: ``axis_name`` is not an axis of ``mesh``; at trace time, the
      optimizer's updates differ per device (it does not average them, and
      is no :func:`~qsgd_jax.diloco`), its state holds a per-device scalar,
      which cannot be laid out, or, with :func:`~qsgd_jax.diloco`, a params
      leaf is shaped neither as one copy nor as a copy a worker.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, qsgd_jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("batch",))
    >>> def loss_fn(params, batch):
    ...   x, y = batch
    ...   return jnp.mean((x @ params - y) ** 2)
    >>> tx = optax.chain(qsgd_jax.onebit_sgd("batch"), optax.sgd(0.1))
    >>> init, train_step, _ = qsgd_jax.data_parallel(loss_fn, tx, mesh)
    >>> params = jax.device_put(jnp.zeros((4096, 2)), NamedSharding(mesh, P()))
    >>> opt_state = init(params)
    >>> x = jnp.ones((8 * jax.device_count(), 4096))
    >>> y = jnp.ones((8 * jax.device_count(), 2))
    >>> batch = jax.device_put((x, y), NamedSharding(mesh, P("batch")))
    >>> params, opt_state, loss = train_step(params, opt_state, batch)
    >>> float(loss)
    1.0
  """
  names = tuple(mesh.axis_names) if axis_name is None else axes.parse(
      axis_name, "data_parallel").names
  for name in names:
    if name not in mesh.axis_names:
      raise ValueError(
          f"data_parallel: axis_name {name!r} is not an axis of the mesh, whose axes are "
          f"{tuple(mesh.axis_names)}.")
  axis = names if len(names) > 1 else names[0]
  split = P(axis)

  def layout(params):
    """``(specs, param_axes)``: the state's partition specs, and for a local-update
    optimizer the axes its parameters differ over (else ``None``)."""
    # The state's shapes on one device, from init run under the mesh: the residuals'
    # shapes may depend on the axis sizes, which only a mapped function can read.
    def device_state(params):
      return jax.tree.map(lambda x: x[None], axes.as_varying(optimizer.init(params), axis))

    stacked = jax.eval_shape(
        jax.shard_map(device_state, mesh=mesh, in_specs=P(), out_specs=split), params)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), stacked)
    # A local-update optimizer's workers lie along the first axis (the slow link) at least,
    # and along every axis its update makes the parameters differ over.
    param_axes = names[:1] if _global_params(shapes) is not None else None
    specs = _known_specs(shapes, param_axes)
    # A state that state_partition_specs does not know may hold per-device arrays: lay out
    # each leaf along the axes the update makes it vary over. Laying one out may make others
    # vary, so until nothing changes (each round only turns replicated leaves per device).
    while True:
      params_varying, state_varying = _updated_varying(params, specs, param_axes)
      specs, changed = _per_device_specs(shapes, specs, state_varying, names)
      if param_axes is not None and not set(params_varying) <= set(param_axes):
        param_axes = tuple(name for name in names if name in {*param_axes, *params_varying})
        specs, changed = _known_specs(shapes, param_axes), True
      if not changed:
        return specs, param_axes

  def _known_specs(shapes, param_axes):
    if param_axes is None:
      return state_partition_specs(shapes, axis)
    within = tuple(name for name in names if name not in param_axes)
    return state_partition_specs(shapes, _axis_name(param_axes),
                                 split_axis=_axis_name(within) if within else None)

  def _updated_varying(params, specs, param_axes):
    """The axes the update makes the parameters vary over, and each leaf of the new state."""
    found = []

    def probe(params, opt_state):
      local = axes.as_varying(params, axis)
      updated = params if param_axes is None else axes.as_varying(params, param_axes)
      updates, new_state = optimizer.update(local, opt_state, updated)
      found.append((tuple(name for leaf in jax.tree.leaves(updates)
                          for name in _varying_axes(leaf, names)),
                    [_varying_axes(leaf, names) for leaf in jax.tree.leaves(new_state)]))
      return jnp.zeros(())

    global_shapes = jax.eval_shape(
        jax.shard_map(optimizer.init, mesh=mesh, in_specs=P(), out_specs=specs), params)
    jax.eval_shape(jax.shard_map(probe, mesh=mesh, in_specs=(P(), specs), out_specs=P()),
                   params, global_shapes)
    return found[0]

  def init(params):
    specs, _ = layout(params)
    return jax.shard_map(optimizer.init, mesh=mesh, in_specs=P(), out_specs=specs)(params)

  def abstract_state(params):
    return jax.tree.map(
        lambda shape, spec: jax.ShapeDtypeStruct(
            shape.shape, shape.dtype, sharding=NamedSharding(mesh, spec)),
        jax.eval_shape(init, params), layout(params)[0])

  def step(params, opt_state, batch, *args, events=None):
    global_params = _global_params(opt_state)
    local_update = global_params is not None
    specs, param_axes = layout(global_params if local_update else params)
    along = P(_axis_name(param_axes)) if local_update else P()
    stacked = local_update and _is_stacked(
        params, global_params, math.prod(mesh.shape[name] for name in param_axes))
    extra = {} if events is None else {"events": events}

    def device_step(params, opt_state, batch, *args):
      if stacked:
        params = jax.tree.map(lambda x: x[0], params)  # This device's own copy.
      local = axes.as_varying(params, axis)
      value, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(local, batch, *args)
      # The parameters updated: a worker's own with a local-update optimizer, else the
      # replicated ones, which the averaged updates keep replicated.
      updated = axes.as_varying(params, param_axes) if local_update else params
      updates, opt_state = optimizer.update(grads, opt_state, updated, **extra)
      if local_update:
        new_params = jax.tree.map(lambda x: x[None], optax.apply_updates(updated, updates))
      else:
        _check_averaged(updates, names)
        new_params = optax.apply_updates(updated, updates)
      return new_params, opt_state, _device_mean(value, names)

    if stacked:  # Copies from the host (a checkpoint) are laid out as step returns them.
      params = jax.tree.map(lambda x: _split(x, mesh, along), params)
    batch = jax.tree.map(lambda x: _split(x, mesh, split), batch)
    # A scalar has no dimension to split: every device gets it whole.
    batch_specs = jax.tree.map(lambda x: P() if jnp.ndim(x) == 0 else split, batch)
    return jax.shard_map(
        device_step, mesh=mesh,
        in_specs=(along if stacked else P(), specs, batch_specs, *(P() for _ in args)),
        out_specs=(along, specs, P()),
    )(params, opt_state, batch, *args)

  return DataParallel(
      init=jax.jit(init),
      step=jax.jit(step, donate_argnums=(0, 1) if donate else (), static_argnames="events"),
      abstract_state=abstract_state,
  )


def _split(x, mesh: jax.sharding.Mesh, spec: P):
  """``x`` split along its first dimension over the mesh, as ``step`` needs it.

  A numpy batch, or an array laid out otherwise, enters ``jax.jit`` whole;
  over explicit mesh axes the split is then a ``reshard`` (over automatic
  axes the compiler places it where ``shard_map`` asks).
  """
  explicit = any(axis_type == jax.sharding.AxisType.Explicit for axis_type in mesh.axis_types)
  if not explicit or jnp.ndim(x) == 0:
    return x
  sharding = jax.typeof(x).sharding
  if isinstance(sharding, NamedSharding) and sharding.spec[:1] == spec[:1]:
    return x
  return jax.sharding.reshard(x, NamedSharding(mesh, spec))


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


def _global_params(state):
  """The global parameters of a :func:`~qsgd_jax.diloco` state within ``state``, or ``None``
  when the optimizer keeps the parameters the same on every device."""
  is_diloco = lambda node: isinstance(node, DiLoCoState)  # noqa: E731
  found = [node for node in jax.tree.leaves(state, is_leaf=is_diloco) if is_diloco(node)]
  if len(found) > 1:
    raise ValueError(
        f"data_parallel: the optimizer's state holds {len(found)} DiLoCoStates; a step keeps "
        "one model a device, of one qsgd_jax.diloco. Chain the transforms inside one diloco "
        "(its inner optimizer) instead.")
  return found[0].global_params if found else None


def _is_stacked(params, global_params, devices: int) -> bool:
  """Whether ``params`` hold one copy a worker along a first dimension (``step``'s own
  output with a local-update optimizer over ``devices`` workers), rather than one copy
  (``init``'s input).

  Raises:
    ValueError: a leaf is neither, or some leaves are one and some the other.
  """
  if jax.tree.structure(params) != jax.tree.structure(global_params):
    raise ValueError(
        f"data_parallel: the params' tree {jax.tree.structure(params)} is not the one "
        f"qsgd_jax.diloco keeps global parameters of, {jax.tree.structure(global_params)}: "
        "with a local-update optimizer the step takes the whole params tree diloco was "
        "initialized on (diloco under optax.masked or optax.multi_transform is not run here).")
  kinds = set()
  for (path, leaf), model in zip(jax.tree_util.tree_leaves_with_path(params),
                                 jax.tree.leaves(global_params), strict=True):
    shape = tuple(jnp.shape(leaf))
    if shape in (model.shape, (devices, *model.shape)):
      kinds.add(shape != model.shape)
      if len(kinds) == 1:
        continue
    raise ValueError(
        f"data_parallel: params leaf {jax.tree_util.keystr(path) or '<root>'} has shape "
        f"{shape}. With qsgd_jax.diloco every device keeps parameters of its own between "
        f"syncs: step takes either one copy, shaped as init's params ({model.shape} here), or "
        f"the {devices} copies step returned, stacked along a first dimension "
        f"({(devices, *model.shape)}), for every leaf alike.")
  return kinds == {True}


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


def _axis_name(names: tuple[str, ...]) -> axes.AxisName:
  """What ``PartitionSpec`` and the transforms take for ``names``: one name, or the tuple."""
  return names if len(names) > 1 else names[0]


def _varying_axes(x, names: tuple[str, ...]) -> tuple[str, ...]:
  """Those of ``names`` that ``x`` varies over, in their order."""
  varying = axes.varying_axes(x)
  return tuple(name for name in names if name in varying)


def _device_mean(tree, names: tuple[str, ...]):
  """Each leaf averaged with ``lax.pmean`` over the axes it differs along; others as they are."""

  def mean(x):
    varying = _varying_axes(x, names)
    return jax.lax.pmean(x, varying) if varying else x

  return jax.tree.map(mean, tree)


def _check_averaged(updates, names: tuple[str, ...]) -> None:
  for path, leaf in jax.tree_util.tree_leaves_with_path(updates):
    varying = _varying_axes(leaf, names)
    if varying:
      raise ValueError(
          f"data_parallel: the optimizer's update of {jax.tree_util.keystr(path) or 'params'} "
          f"differs per device over {varying}: the optimizer must average the gradients. Put "
          f"qsgd_jax.qsgd({names if len(names) > 1 else names[0]!r}), "
          "qsgd_jax.compressed_allreduce(...) or another averaging transform first in its "
          "chain, or use an optimizer that averages for itself (qsgd_jax.onebit_adam; "
          "qsgd_jax.zero_one_adam with local_step_clipper=1, since its local steps keep one "
          "model per device).")
