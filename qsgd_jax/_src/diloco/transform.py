"""Local-update training with a compressed outer exchange: DiLoCo and Streaming DiLoCo."""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from qsgd_jax._src import axes, base, stats, wire
from qsgd_jax._src.diloco import checks, exchange, fragment, inner_step, partition, schedule

_OWNER = "qsgd_jax.diloco"


class DiLoCoState(NamedTuple):
  """State of :func:`diloco` on one device.

  Every field is a pytree of arrays.

  Attributes:
    count: ``int32[]``, steps taken; the same on every device, it decides
      which fragment syncs when.
    stats: :class:`~qsgd_jax.CompressionStats` of the last step's outer
      exchange, per device: zero bits on a step that sent nothing (NaN
      before the first step).
    skipped_workers: ``int32[]``, the workers whose outer gradient was not
      finite and was left out of the last step's exchanges (summed over the
      fragments it exchanged; zero on a step that exchanged nothing); the
      same on every device.
    global_params: the global parameters (the outer optimizer's), a pytree
      like the params, the same on every device: the model to evaluate.
    inner_state: the inner optimizer's state, this device's own, each leaf
      with a leading axis of length 1 (``[1, *shape]``), so that under
      ``jax.shard_map`` every leaf, scalar step counts included (a device
      that skips a non-finite step keeps its own), lies along the axis.
    fragments: a tuple of one record a fragment: a
      :class:`~qsgd_jax.FragmentState` each, or with ``delay > 0`` a
      :class:`~qsgd_jax.DelayedFragmentState` each.

  Examples:
    >>> import jax.numpy as jnp, optax, qsgd_jax
    >>> tx = qsgd_jax.diloco(optax.sgd(0.1), None, sync_every=4)
    >>> state = tx.init({"w": jnp.zeros(3)})
    >>> int(state.count), state.global_params["w"].shape, len(state.fragments)
    (0, (3,), 1)
  """

  count: jax.Array
  stats: stats.CompressionStats
  skipped_workers: jax.Array
  global_params: optax.Params
  inner_state: optax.OptState
  fragments: tuple


def diloco(
    inner: optax.GradientTransformation,
    axis_name: axes.AxisName,
    *,
    sync_every: int,
    outer_optimizer: optax.GradientTransformation | None = None,
    average: optax.GradientTransformation | None = None,
    fragments: partition.Fragments = 1,
    delay: int = 0,
    alpha: float = 0.0,
    split_axis: axes.AxisName | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""DiLoCo and Streaming DiLoCo: local inner steps, a compressed outer exchange.

  Each device (a *worker*) trains its own copy :math:`\theta_m` of the
  parameters with ``inner`` on its own gradients, sending nothing; every
  ``sync_every`` (:math:`H`) steps the workers average how far they moved
  from the global parameters :math:`\theta` and an outer optimizer moves
  :math:`\theta` by that average. With the parameters split into fragments
  :math:`p = 0, \dots, P - 1` (Streaming DiLoCo), each fragment syncs on
  its own schedule. At the sync step :math:`s` of fragment :math:`p`, with
  :math:`\theta_{m,p}` this device's fragment after the step's inner update:

  .. math::

    \Delta_p &= \mathrm{average}_m\,(\theta_p - \theta_{m,p})
      \qquad \text{(the outer gradient, over } \texttt{axis\_name)} \\
    \theta_p &\leftarrow \theta_p + \mathrm{OuterOpt}(\Delta_p) \\
    \theta_{m,p} &\leftarrow \alpha\, \theta_{m,p} + (1 - \alpha)\, \theta_p
      \qquad \text{(the merge)}

  The outer gradient points from the new local parameters back to the old
  global ones, so that an outer ``optax.sgd(1.0)`` without momentum takes
  :math:`\theta` to the workers' mean (DiLoCo, Algorithm 1; torchft takes
  ``original_parameters - local_param``). The merge is torchft's
  ``fragment_update_alpha``: :math:`\alpha = 0` takes the global
  parameters. The average is ``average``'s (a float32 ``jax.lax.pmean`` by
  default), called only on exchange steps, so its error feedback and key
  carry from one round to the next.

  **Schedule.** Fragment :math:`p` has offset :math:`o_p = \lfloor (p + 1)
  H / P \rfloor` and syncs at the steps :math:`s` (counted from 0) where
  :math:`(s + 1 - o_p) \bmod H = 0`: the last fragment every :math:`H`-th
  step, so one fragment is DiLoCo, successive fragments :math:`H / P` steps
  apart, as in torchft. A fragment's life is three phases over its record
  (:class:`~qsgd_jax.FragmentState`): *take* its outer gradient at step
  :math:`s`, *send* it (the exchange) and *merge* (the outer step, then the
  merge). With ``delay`` :math:`\tau = 0` all three run in step :math:`s`.
  With :math:`\tau \ge 1` (Streaming DiLoCo's overlap; a
  :class:`~qsgd_jax.DelayedFragmentState`) the take stores the outer
  gradient; step :math:`s + 1` sends it, reading it from the record, so
  that the collective waits for nothing that step computes and the backend
  may run it beside the forward and backward passes; step :math:`s + \tau`
  merges, with :math:`\theta_{m,p}` as it is then, as torchft merges at
  ``perform_sync`` (torchft counts the offset at the merge, here at the
  take, as Streaming DiLoCo's Algorithm 2 does). Every fragment has merged
  :math:`\tau` steps after its last sync: end a run, or evaluate, there
  (:func:`~qsgd_jax.diloco_events` says which fragments a step merges).

  **Bytes.** ``qsgd_jax.compression_stats(state).wire_bits`` is what the
  step's exchanges sent (zero between them); ``float32_bits`` is what
  synchronous data parallel sends every step: a float32 all-reduce of the
  gradients over every device that computes its own (the workers', those of
  ``split_axis``, and under ``jax.shard_map`` any other axis the gradients
  differ over, a worker's devices), the library's one baseline
  (:class:`~qsgd_jax.CompressionStats`). :func:`~qsgd_jax.accumulate_stats`
  sums a run's steps; its ``compression_ratio`` is the run's saving.

  **Non-finite values.** A device whose inner update is not finite, or would
  take a parameter past its dtype's range, skips its step: a zero update,
  its inner state kept. A worker whose outer gradient is not finite is left
  out of the round's average (taken over the others, as torchft's quorum
  leaves out a failed replica) and takes the global parameters back at the
  merge; ``state.skipped_workers`` counts such workers. A device whose inner
  state holds a non-finite float starts afresh at its next merge from
  ``inner.init`` of its merged parameters. A non-finite average (no worker
  finite, or the sum overflowed) skips the round on every device: the
  global parameters and the outer and average states are kept, and every
  device takes the fragment back to the global parameters.

  **Deciding on the host.** By default each phase is a ``jax.lax.cond`` on
  the state's ``count``, so one compiled step serves every step. Given
  ``update(..., events=qsgd_jax.diloco_events(count, ...))``, static under
  ``jax.jit``, Python decides, and each kind of step is a program of its
  own: a step between syncs holds no conditional and no collective, an
  exchange sits at the program's top level. The merge's outer step is a
  conditional in both (on the average being finite), so it starts from the
  average as the exchange rounded it. On the CPU, where the non-finite
  guard of the inner step is a conditional too, the two give the same bits
  (the tests check it); where the guard is a select (other backends), XLA
  may fuse an inner update's last product into its sum with the parameters
  in a program chosen on the host, rounding them once, where the in-program
  step rounds the update at a conditional's boundary first: the two may then
  differ in the last bit. ``docs/results.md`` measures both on CPUs and
  GPUs.

  **Layouts.** Between syncs the workers hold different parameters. Under
  ``jax.pmap`` nothing is needed. Under ``jax.shard_map``, lay the
  parameters out along ``axis_name`` (each worker's copy stacked along a
  first dimension, ``in_specs=P(axis_name)``; replicated over the workers'
  outer axis they raise a ``ValueError``) and the state by
  ``qsgd_jax.state_partition_specs(state, axis_name)``. On a two-level mesh
  DiLoCo runs over the slow outer axis and ``inner`` averages over the
  fast one (``optax.chain(qsgd_jax.compressed_allreduce(qsgd_jax.Identity(),
  "inner"), optax.adamw(...))``): the parameters lie along the outer axis
  only, replicated over a worker's devices, and the state by
  ``state_partition_specs(state, "outer", split_axis="inner")``, which lays
  what each device of a worker holds for itself (the residuals of an inner
  average, a split exchange's parts) along both axes.
  :func:`~qsgd_jax.data_parallel` does both by itself (the two-level guide
  shows both ways, with the same bits). At a merge (with
  ``alpha=0``) a device's update is the new global parameters minus its own,
  so that after ``optax.apply_updates`` its parameters are the global ones
  up to the rounding of that sum; ``global_params`` is the same on every
  device, bit for bit.

  **Dtypes.** The updates of a merge are in the dtype ``optax.apply_updates``
  adds the inner updates to the parameters in (``jnp.result_type`` of the
  two: float32 for bfloat16 parameters and an inner optimizer whose updates
  are float32), and so are those between merges; the outer gradients and
  their average are float32.

  Args:
    inner: the inner optimizer (``optax.adamw`` in the papers), or a chain
      that averages over a faster axis first; its state is kept per device
      across rounds. It is given this device's params and extra arguments.
    axis_name: the mapped axis (or axes) along which the workers lie, or
      ``None`` for one worker alone (no collective: ``optax.lookahead``
      with an outer optimizer).
    sync_every: :math:`H`, the steps between two syncs of a fragment.
    outer_optimizer: updates the global parameters with the averaged outer
      gradient; ``optax.sgd(0.7, momentum=0.9, nesterov=True)`` by default
      (DiLoCo's, tuned for H = 500 after long synchronous pretraining; for
      a few dozen rounds the local-updates guide finds ``optax.sgd(1.0)``
      better). Each fragment has its own state.
    average: how the outer gradient is averaged over ``axis_name``: ``None``
      for a float32 ``jax.lax.pmean``, or an averaging transform of this
      library bound to the same axis, e.g. ``qsgd_jax.qsgd(axis_name,
      bits=4, error_feedback=True)``, ``qsgd_jax.onebit_sgd(axis_name)`` or
      ``qsgd_jax.compressed_allreduce(qsgd_jax.Cast(jnp.bfloat16),
      axis_name)``. Under ``jax.shard_map`` an average over another axis is
      caught by its result still differing across ``axis_name``.
    fragments: :math:`P`, an int: the default partition strides the model's
      layers over the fragments (for a Flax ``{'params': {'Block_0': ...,
      'Block_1': ..., 'Embed_0': ...}}``, ``Block_0`` to fragment 0,
      ``Block_1`` to 1, ...; in natural order) and puts each other top-level
      module, the largest first, where the fewest coordinates are so far, so
      that each fragment is about :math:`1/P` of the model (by leaf where
      there are fewer modules than fragments); or a function from the params
      to a pytree of ints, each leaf's fragment.
    delay: :math:`\tau`, the steps between a fragment's sync and its merge;
      below ``sync_every // P``, as torchft requires, so that at most one
      fragment is in flight.
    alpha: the merge's weight of the local parameters, in :math:`[0, 1]`.
    split_axis: on a two-level mesh, the fast axis (or axes) of a worker's
      devices, over which ``inner`` averages every step so that they all
      hold the same parameters; or ``None``. With it, each of the ``k``
      devices exchanges a ``1 / k`` part of each fragment's outer gradient,
      flattened into one vector, across the workers, with random draws of
      its own, and the worker's devices all-gather the averaged parts: with
      a float32 average ``k`` times fewer bytes cross between workers; a
      compressed ``average`` quantizes the one vector, its buckets across
      leaves and no leaf spared by ``min_compressed_size``. ``average``'s
      state is then each device's part, a
      :class:`~qsgd_jax.SplitAverageState`: ``init`` needs the axis's size,
      inside the mapped function or under ``jax.set_mesh``.

  Returns:
    An ``optax.GradientTransformationExtraArgs``. ``init(params)`` assumes
    every device starts from the same params (under ``jax.shard_map`` the
    global copy is broadcast from the first device). ``update(grads, state,
    params, events=None)`` needs ``params`` and runs inside ``jax.pmap`` or
    ``jax.shard_map`` over ``axis_name``; apply its updates unchanged.
    ``events``, a :class:`~qsgd_jax.DiLoCoEvents` of
    :func:`~qsgd_jax.diloco_events` for the state's ``count``, decides on the
    host what the step does; ``None`` decides in the program.

  Raises:
    ValueError: a bad ``sync_every``, ``delay``, ``alpha`` or
      ``fragments``; an ``update`` without params, with params replicated
      over the workers' axis, with an ``average`` over another axis or an
      average that differs across a worker's devices, with a state from
      another configuration or number of workers, or with ``events`` of
      another schedule.
    TypeError: ``events`` that are not a :class:`~qsgd_jax.DiLoCoEvents`.

  Examples:
    Eight workers (``jax.vmap`` here; ``jax.pmap`` or ``jax.shard_map`` on
    devices), each pulled to its own target, sync every 5 steps; the global
    parameters find the targets' mean, 3.5:

    >>> import jax, jax.numpy as jnp, optax, qsgd_jax
    >>> tx = qsgd_jax.diloco(optax.sgd(0.1), "workers", sync_every=5,
    ...                      outer_optimizer=optax.sgd(1.0))
    >>> def train(target):
    ...   def step(carry, _):
    ...     params, state = carry
    ...     updates, state = tx.update(params - target, state, params)
    ...     return (optax.apply_updates(params, updates), state), None
    ...   params = jnp.zeros(2)
    ...   (params, state), _ = jax.lax.scan(step, (params, tx.init(params)), length=100)
    ...   return state.global_params
    >>> global_params = jax.vmap(train, axis_name="workers")(jnp.arange(8.0)[:, None])
    >>> bool(jnp.allclose(global_params, 3.5, atol=1e-3))
    True

  References:
    Douillard et al., `DiLoCo: Distributed Low-Communication Training of
    Language Models <https://arxiv.org/abs/2311.08105>`_, 2023 (Algorithm
    1); Douillard et al., `Streaming DiLoCo with overlapping communication
    <https://arxiv.org/abs/2501.18512>`_, 2025 (Algorithm 2); torchft's
    ``DiLoCo`` (pytorch/torchft, ``torchft/local_sgd.py``).
  """
  options = _checked_options(inner, axis_name, sync_every, outer_optimizer, average,
                             fragments, delay, alpha, split_axis)

  def init_fn(params):
    base.check_float_leaves(params, _OWNER)
    return _make_state(options, params, checks.from_first_device(params, options.parsed))

  def update_fn(updates, state, params=None, *, events=None, **extra_args):
    members, offsets, size = _checked_update(options, state, params, events)
    parsed, split, delay = options.parsed, options.split, options.delay
    steps, inner_state = inner_step.step(options.inner, updates, state.inner_state, params,
                                         extra_args)
    checks.check_inner_updates(steps, params, parsed)
    leaves, treedef = jax.tree.flatten(params)
    steps = treedef.flatten_up_to(steps)
    global_leaves = treedef.flatten_up_to(state.global_params)
    out, new_global, records, sent, merges = list(steps), list(global_leaves), [], [], []
    settings = fragment.Settings(options.outer_optimizer, options.alpha, delay, functools.partial(
        exchange.exchange, average=options.average, parsed=parsed, size=size, split=split))
    for p, (member, offset, record) in enumerate(zip(members, offsets, state.fragments,
                                                     strict=True)):
      when = functools.partial(schedule.when, events, p, offset, options.sync_every,
                               state.count + 1)
      local = fragment.Local(*(tuple(x[i] for i in member) for x in (global_leaves, leaves,
                                                                       steps)))
      record, fragment_updates, fragment_global, fragment_sent = fragment.advance(
          record, local, when, settings)
      for i, u, g in zip(member, fragment_updates, fragment_global, strict=True):
        out[i], new_global[i] = u, g
      records.append(record)
      sent.append(fragment_sent)
      merges.append(when(delay))
    inner_state = inner_step.restored_at_merge(options.inner, inner_state, params,
                                               treedef.unflatten(out), merges, parsed)
    new_state = DiLoCoState(
        count=optax.safe_increment(state.count),
        stats=_stats(sent, updates, leaves, parsed, split),
        skipped_workers=sum(s.skipped_workers for s in sent),
        global_params=treedef.unflatten(new_global),
        inner_state=jax.tree.map(lambda x: x[None], inner_state),
        fragments=tuple(records),
    )
    return treedef.unflatten(out), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class _Options(NamedTuple):
  """:func:`diloco`'s options once checked: its arguments, ``inner`` taking extra arguments,
  the outer optimizer's default filled in, the axes parsed."""

  inner: optax.GradientTransformationExtraArgs
  outer_optimizer: optax.GradientTransformation
  average: optax.GradientTransformation | None
  axis_name: axes.AxisName
  parsed: axes.Axes
  split: axes.Axes | None
  sync_every: int
  fragments: partition.Fragments
  delay: int
  alpha: float


def _checked_options(inner, axis_name, sync_every, outer_optimizer, average, fragments, delay,
                     alpha, split_axis) -> _Options:
  """:func:`diloco`'s options, or a ``ValueError`` naming the first that is bad."""
  if not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
    raise ValueError(f"{_OWNER}: sync_every must be a positive int, got {sync_every!r}.")
  if not isinstance(delay, int) or isinstance(delay, bool) or delay < 0:
    raise ValueError(f"{_OWNER}: delay must be a non-negative int, got {delay!r}.")
  if not isinstance(alpha, int | float) or not 0.0 <= alpha <= 1.0:
    raise ValueError(
        f"{_OWNER}: alpha must be in [0, 1] (the merge's weight of the local parameters; 0 "
        f"takes the global ones), got {alpha!r}.")
  if isinstance(fragments, int) and not isinstance(fragments, bool):
    partition.assign([0] * max(fragments, 1), fragments)  # Checks P >= 1 now.
    checks.check_schedule(sync_every, fragments, delay)
  parsed = axes.parse(axis_name, _OWNER)
  split = None if split_axis is None else axes.parse(split_axis, _OWNER)
  if split is not None and (parsed.is_local or set(split.names) & set(parsed.names)):
    raise ValueError(
        f"{_OWNER}: split_axis={split_axis!r} must name the axes of a worker's devices, apart "
        f"from the workers' axis_name={axis_name!r} (and there must be workers).")
  if outer_optimizer is None:
    outer_optimizer = optax.sgd(0.7, momentum=0.9, nesterov=True)
  return _Options(optax.with_extra_args_support(inner), outer_optimizer, average, axis_name,
                  parsed, split, sync_every, fragments, delay, alpha)


def _plan(options: _Options, params) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
  """Each fragment's leaves (their indices in ``jax.tree.leaves(params)``) and offset."""
  count, ids = partition.assign(params, options.fragments)
  checks.check_schedule(options.sync_every, count, options.delay)
  members = tuple(tuple(i for i, f in enumerate(ids) if f == p) for p in range(count))
  return members, partition.offsets(options.sync_every, count)


def _make_state(options: _Options, params, global_params) -> DiLoCoState:
  """The state before the first step: this device's inner state, every fragment's record."""
  members, _ = _plan(options, params)
  leaves = jax.tree.leaves(global_params)
  return DiLoCoState(
      count=jnp.zeros((), jnp.int32),
      stats=stats.empty(),
      skipped_workers=jnp.zeros((), jnp.int32),
      global_params=global_params,
      inner_state=jax.tree.map(lambda x: x[None], options.inner.init(params)),
      fragments=tuple(fragment.init(tuple(leaves[i] for i in m), options.outer_optimizer,
                                    options.average, options.split, options.delay)
                      for m in members),
  )


def _checked_update(options: _Options, state, params, events):
  """Each fragment's leaves and offset, and the number of workers, once the checks of an
  update's arguments and layout pass."""
  if params is None:
    raise ValueError(f"{_OWNER}: update needs this device's params: call "
                     "update(grads, state, params).")
  base.check_float_leaves(params, _OWNER)
  members, offsets = _plan(options, params)
  if events is not None:
    schedule.check_events(events, options.sync_every, len(members), options.delay)
  checks.check_state(state, jax.eval_shape(functools.partial(_make_state, options), params,
                                           params), DiLoCoState)
  parsed = options.parsed
  if parsed.is_local:
    return members, offsets, 1
  axes.check_not_in_apply_if_finite(
      _OWNER, options.axis_name, "Wrap the inner optimizer instead: diloco skips a device's "
      "non-finite inner step by itself, and a non-finite outer gradient on every device "
      "together.")
  checks.check_laid_out(params, parsed)
  if options.split is not None:
    checks.check_same_in_worker(params, options.split)
  return members, offsets, math.prod(parsed.sizes(_OWNER))


def _stats(sent: list, grads, leaves: list, parsed: axes.Axes,
           split: axes.Axes | None) -> stats.CompressionStats:
  """The step's :class:`~qsgd_jax.CompressionStats`: what the exchanges sent, against what
  synchronous data parallel sends every step, a float32 all-reduce of the gradients over
  every device that computes its own: the workers', ``split``'s, and any other axis the
  gradients vary over (a worker's devices); across the outer axis, run hierarchically."""
  elements = sum(x.size for x in leaves)
  if parsed.is_local:
    devices = outer = 1
  else:
    names = dict.fromkeys((*parsed.names, *(split.names if split else ()),
                           *(name for g in jax.tree.leaves(grads)
                             for name in axes.varying_axes(g))))
    devices = math.prod(axes.parse(tuple(names), _OWNER).sizes(_OWNER))
    outer = jax.lax.axis_size(parsed.outer)
  return stats.make(
      sum(s.wire_bits for s in sent), wire.float32_allreduce_bits(elements, devices), jnp.nan,
      sum(s.outer_wire_bits for s in sent),
      wire.float32_allreduce_bits(elements * outer / devices, outer))
