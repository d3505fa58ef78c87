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
from qsgd_jax._src.training import model_axes, state_layout


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
    batch_axes: str | tuple[str, ...] = (),
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
  average inside, a copy a device; on a mesh whose model is sharded, a copy
  a data group, laid out over the model axes as the parameters.
  ``step(..., events=...)`` passes a :func:`~qsgd_jax.diloco_events` to its
  update, a static argument: each kind of step compiles a program of its
  own. Evaluate the global parameters, the :class:`~qsgd_jax.DiLoCoState`'s
  ``global_params`` (``opt_state.global_params`` when ``diloco`` is the
  whole optimizer).

  On a mesh whose model is sharded too (Flax ``lm1b``'s ``('data', 'fsdp',
  'tensor')``, MaxText's ``dcn_data_parallelism`` with ``ici_fsdp_parallelism``),
  pass the slow axis as ``axis_name`` and lay the parameters out over the
  others, as Flax linen's ``nn.logical_to_mesh_sharding`` or NNX's
  ``nnx.get_named_sharding`` give them. ``step`` keeps that layout for the
  parameters and for the state, runs ``loss_fn`` with the compiler sharding
  the model over those *model axes* (they are made automatic for it if the
  mesh makes them explicit), and calls the optimizer with them explicit
  (``jax.sharding.explicit_axes``), so that each average of this library
  compresses each device's own shard and sends it over ``axis_name`` alone:
  no bucket spans two shards and no leaf is gathered whole. What the
  optimizer adds is laid out as its ``init`` makes it there: Adam's moments
  as the parameters, a compressed average's residuals along ``axis_name``
  and the axes of the shards they belong to. The batch splits over
  ``axis_name`` and, within each data group, over ``batch_axes``.

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
      default every axis of ``mesh``, in its order. The mesh's other axes,
      if any, are the model's (above).
    batch_axes: model axes (or one) the batch also splits over within each
      data group, its first dimension then split over ``axis_name`` and
      them (MaxText splits it over ``('data', 'fsdp')``); none by default.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    donate: whether ``step`` donates ``params`` and ``opt_state`` (reusing
      their memory for the new ones; the arrays passed in are deleted).

  Returns:
    A :class:`DataParallel`: ``init``, ``step`` and ``abstract_state``.

  Raises:
    ValueError: ``axis_name`` is not an axis of ``mesh``, or ``batch_axes``
      one of the model axes; a params leaf laid out over ``axis_name`` (that
      is FSDP: :func:`~qsgd_jax.fsdp_gather`); a batch leaf whose first
      dimension does not split over the data groups; at trace time, the
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
  model = model_axes.model_axes(mesh, names)

  def check_data_devices():
    # Raised when a program is made, not here: abstract_state serves resize_state on such a
    # mesh, to resume a run's state on one data group.
    if model and math.prod(mesh.shape[name] for name in names) == 1:
      raise ValueError(
          f"data_parallel: the data axes {names} have one device, so there is nothing to "
          f"average over them, and XLA's partitioner refuses a collective over a manual axis "
          f"of one device beside the model axes {model}. Train without data parallel (a plain "
          "jax.jit step over the mesh), or give the data axes more devices.")

  batch_axes = _check_batch_axes(batch_axes, model)
  axis = names if len(names) > 1 else names[0]
  split = P(axis)
  layout = state_layout.StateLayout(optimizer, mesh, names, model)

  def init_program(params, param_specs):
    data_specs, model_specs, _ = layout.specs(params, param_specs)
    init_fn = model_axes.with_model_axes(optimizer.init, model, (param_specs,))
    full = model_axes.full_specs(data_specs, model_specs)
    return jax.jit(_mapped(init_fn, mesh, names, model, P(), data_specs, full),
                   out_shardings=_named(mesh, full))

  def make_step(params, param_specs, copies: int, local_update: bool, events):
    check_data_devices()
    data_specs, model_specs, param_axes = layout.specs(params, param_specs)
    # A local-update optimizer's workers lie along param_axes: its params a copy a worker,
    # stacked along a new first dimension there, each copy laid out as the params.
    along = P(state_layout.axis_name(param_axes)) if local_update else P()
    if copies:
      _check_copies(copies, math.prod(mesh.shape[name] for name in param_axes), params)
    extra = {} if events is None else {"events": events}

    def update(grads, opt_state, params):
      updates, opt_state = optimizer.update(grads, opt_state, params, **extra)
      if not local_update:
        _check_averaged(updates, names)
      return optax.apply_updates(params, updates), opt_state

    # With the model axes explicit, the new params and state keep their layout there.
    update = model_axes.with_model_axes(update, model, (param_specs, model_specs, param_specs))

    def device_step(params, opt_state, batch, *args):
      if copies:
        params = jax.tree.map(lambda x: x[0], params)  # This worker's own copy.
      local = axes.as_varying(params, axis)
      value, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(local, batch, *args)
      # The parameters updated: a worker's own with a local-update optimizer, else the
      # replicated ones, which the averaged updates keep replicated.
      updated = axes.as_varying(params, param_axes) if local_update else params
      new_params, opt_state = update(grads, opt_state, updated)
      if local_update:
        new_params = jax.tree.map(lambda x: x[None], new_params)
      return new_params, opt_state, _device_mean(value, names)

    copy_specs = jax.tree.map(lambda spec: P(*along, *spec), param_specs,
                              is_leaf=lambda x: isinstance(x, P))
    full = (copy_specs if local_update else param_specs,
            model_axes.full_specs(data_specs, model_specs), P())

    def step(params, opt_state, batch, *args):
      if copies:  # Copies from the host (a checkpoint) are laid out as step returns them.
        params = jax.tree.map(lambda x: _split(x, mesh, along), params)
      _check_batch(batch, mesh, (*names, *batch_axes))
      batch = jax.tree.map(lambda x: _split(x, mesh, P((*names, *batch_axes))), batch)
      # A scalar has no dimension to split: every device gets it whole.
      batch_specs = jax.tree.map(lambda x: P() if jnp.ndim(x) == 0 else split, batch)
      return _mapped(device_step, mesh, names, model,
                     (along if copies else P(), data_specs, batch_specs, *(P() for _ in args)),
                     (along, data_specs, P()), full)(params, opt_state, batch, *args)

    # Over model axes the outputs keep the inputs' layout, which the compiler would choose
    # otherwise.
    return jax.jit(step, donate_argnums=(0, 1) if donate else (),
                   out_shardings=_named(mesh, full) if model else None)

  def specs_of(params, opt_state=None, events=None):
    """The static layout a program is made for: one copy of the params, abstract (a
    local-update optimizer's global copy), their specs over the model axes and, for a
    step, the number of copies stacked in ``params`` (0 for one copy), whether the
    optimizer is a local-update one, and its ``events``."""
    global_params = None if opt_state is None else _global_params(opt_state)
    one = params if global_params is None else global_params
    one_copy = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
                            one)
    param_specs = (model_axes.param_specs(one, mesh, names, "data_parallel")
                   if model else jax.tree.map(lambda _: P(), one))
    copies = 0 if global_params is None else _copies(params, global_params)
    return one_copy, param_specs, copies, global_params is not None, events

  def abstract_state(params):
    one_copy, param_specs, *_ = specs_of(params)
    data_specs, model_specs, _ = layout.specs(one_copy, param_specs)
    full = model_axes.full_specs(data_specs, model_specs)
    return jax.tree.map(
        lambda shape, spec: jax.ShapeDtypeStruct(
            shape.shape, shape.dtype, sharding=NamedSharding(mesh, spec)),
        jax.eval_shape(init_program(one_copy, param_specs), params), full)

  def make_init(params, param_specs):
    check_data_devices()
    return init_program(params, param_specs)

  init = _Programs(make_init, lambda params: specs_of(params)[:2])
  step = _Programs(make_step, specs_of)
  return DataParallel(init=init, step=step, abstract_state=abstract_state)


class _Programs:
  """A jitted function for each static layout of its arguments, called or lowered alike.

  ``make(*layout)`` builds the program for a layout; ``layout_of(*args,
  **static)`` reads the layout from the first arguments (shapes and shardings,
  not values) and the static keyword arguments (DiLoCo's ``events``).
  """

  def __init__(self, make, layout_of):
    self._make, self._layout_of, self._programs = make, layout_of, {}

  def _program(self, args, kwargs):
    layout = self._layout_of(*args[:2], **kwargs)
    key = tuple((tuple(leaves), treedef) for leaves, treedef in (
        jax.tree.flatten(part, is_leaf=lambda x: isinstance(x, P)) for part in layout))
    # The params' shapes are part of the key (one copy, abstract): a program is traced for
    # them, and the state laid out for them.
    if key not in self._programs:
      self._programs[key] = self._make(*layout)
    return self._programs[key]

  def __call__(self, *args, **static):
    return self._program(args, static)(*args)

  def trace(self, *args, **static):
    """The program's ``jax.jit(...).trace(*args)``, for its jaxpr."""
    return self._program(args, static).trace(*args)

  def lower(self, *args, **static):
    """The program's ``jax.jit(...).lower(*args)``, for its compiled HLO."""
    return self._program(args, static).lower(*args)


def _mapped(fn, mesh: jax.sharding.Mesh, names, model, in_specs, out_specs, full_out_specs):
  """``fn`` under ``jax.shard_map`` manual over the data axes ``names``.

  Over model axes the compiler lays out what ``fn`` computes, and the mesh's
  explicit ones are made automatic for it (their leaves' layouts kept).
  """
  if not model:
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
  mapped = jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names=set(names))
  run = model_axes.auto_model_axes(mapped, mesh, model, full_out_specs)

  def in_mesh(*args):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return run(*args)

  return in_mesh


def _named(mesh: jax.sharding.Mesh, specs):
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                      is_leaf=lambda x: isinstance(x, P))


def _check_batch_axes(batch_axes, model: tuple[str, ...]) -> tuple[str, ...]:
  batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
  for name in batch_axes:
    if name not in model:
      raise ValueError(
          f"data_parallel: batch_axes names {name!r}, which is not one of the mesh's axes "
          f"beyond axis_name, {model}: the batch splits over axis_name and, within each data "
          "group, over any of those (MaxText splits it over ('data', 'fsdp')).")
  return batch_axes


def _check_batch(batch, mesh: jax.sharding.Mesh, split_axes: tuple[str, ...]) -> None:
  """Raises where a batch leaf's first dimension does not split over ``split_axes``."""
  groups = math.prod(mesh.shape[name] for name in split_axes)
  for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
    if jnp.ndim(leaf) and jnp.shape(leaf)[0] % groups:
      raise ValueError(
          f"data_parallel: batch leaf {jax.tree_util.keystr(path) or '<root>'} has "
          f"{jnp.shape(leaf)[0]} rows along its first dimension, which do not split over "
          f"the {groups} devices of the axes {split_axes}: give a batch whose first "
          f"dimension is a multiple of {groups}.")


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


def _copies(params, global_params) -> int:
  """How many copies ``params`` hold along a first dimension (``step``'s own output with a
  local-update optimizer), or 0 for one copy (``init``'s input).

  Raises:
    ValueError: a leaf is neither, or the leaves hold different numbers of copies.
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
    if shape == tuple(model.shape) or shape[1:] == tuple(model.shape):
      kinds.add(0 if shape == tuple(model.shape) else shape[0])
      if len(kinds) == 1:
        continue
    raise ValueError(
        f"data_parallel: params leaf {jax.tree_util.keystr(path) or '<root>'} has shape "
        f"{shape}. With qsgd_jax.diloco every worker keeps parameters of its own between "
        f"syncs: step takes either one copy, shaped as init's params ({model.shape} here), or "
        f"the copies step returned, one a worker stacked along a first dimension, for every "
        "leaf alike.")
  return kinds.pop()


def _check_copies(copies: int, workers: int, params) -> None:
  """Raises unless the step's params hold one copy a worker (``params``: one copy)."""
  if copies != workers:
    path, first = jax.tree_util.tree_leaves_with_path(params)[0]
    shape = tuple(first.shape)
    raise ValueError(
        f"data_parallel: params leaf {jax.tree_util.keystr(path) or '<root>'} has shape "
        f"{(copies, *shape)}. With qsgd_jax.diloco every worker keeps parameters of its own "
        f"between syncs: step takes either one copy, shaped as init's params ({shape} here), "
        f"or the {workers} copies step returned, one a worker stacked along a first dimension "
        f"({(workers, *shape)}), for every leaf alike.")


def _device_mean(tree, names: tuple[str, ...]):
  """Each leaf averaged with ``lax.pmean`` over the axes it differs along; others as they are."""

  def mean(x):
    varying = state_layout.varying_over(x, names)
    return jax.lax.pmean(x, varying) if varying else x

  return jax.tree.map(mean, tree)


def _check_averaged(updates, names: tuple[str, ...]) -> None:
  for path, leaf in jax.tree_util.tree_leaves_with_path(updates):
    varying = state_layout.varying_over(leaf, names)
    if varying:
      raise ValueError(
          f"data_parallel: the optimizer's update of {jax.tree_util.keystr(path) or 'params'} "
          f"differs per device over {varying}: the optimizer must average the gradients. Put "
          f"qsgd_jax.qsgd({names if len(names) > 1 else names[0]!r}), "
          "qsgd_jax.compressed_allreduce(...) or another averaging transform first in its "
          "chain, or use an optimizer that averages for itself (qsgd_jax.onebit_adam; "
          "qsgd_jax.zero_one_adam with local_step_clipper=1, since its local steps keep one "
          "model per device).")
