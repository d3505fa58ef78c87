"""optax transformations that average gradients with a quantized all-reduce."""

import functools
import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from qsgd_jax._src import axes, base, shards, stats, wire
from qsgd_jax._src.averaging import allreduce_checks
from qsgd_jax._src.collectives import plan, reduction
from qsgd_jax._src.compressors.qsgd import QSGD

ErrorFeedback = bool | Literal["worker", "owner", "both"]
_OWNER = "qsgd_jax.compressed_allreduce"
_APPLY_IF_FINITE_AFTER = (
    "Put it after this transform in the chain instead, e.g. optax.chain(qsgd_jax.qsgd(...), "
    "optax.apply_if_finite(optax.sgd(...), max_consecutive_errors)): a non-finite value on any "
    "device makes the mean non-finite on every device, so all skip the step together.")


class CompressedAllReduceState(NamedTuple):
  """State of :func:`compressed_allreduce`.

  Attributes:
    key: typed PRNG key ``key<impl>[]``, split every step; the same on every
      device (each device folds in its axis index).
    count: ``int32[]``, steps taken (for the warm-up).
    local_error: per device, one ``float32[length]`` a segment of the
      reduction plan (compressed leaves laid end to end, each padded to whole
      buckets or rows; ``length`` the elements the device quantizes, after the
      full-precision reduce-scatter over inner axes if any): the residual of
      the device's own compressed gradient (empty tuple without worker error
      feedback).
    chunk_error: per device, one ``float32[batch, *element_shape]`` a block of
      the plan (segments encoded together; ``element_shape`` is ``(width //
      run, run)`` for a segment of buckets or rows, else ``(width,)``): the
      residual of re-quantizing the sums of the pieces the device owns (empty
      tuple without owner error feedback).
    stats: the last step's :class:`CompressionStats`.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> n = jax.local_device_count()
    >>> tx = qsgd_jax.qsgd("batch", error_feedback=True)
    >>> state = jax.pmap(tx.init, axis_name="batch")(jnp.zeros((n, 8192)))
    >>> int(state.count[0]), [e.shape for e in state.local_error] == [(n, 8192)]
    (0, True)
  """

  key: jax.Array
  count: jax.Array
  local_error: tuple[jax.Array, ...]
  chunk_error: tuple[jax.Array, ...]
  stats: stats.CompressionStats


def compressed_allreduce(
    compressor: base.Compressor,
    axis_name: axes.AxisName,
    *,
    key: jax.Array | int = 0,
    error_feedback: ErrorFeedback = False,
    warmup_steps: int = 0,
    method: plan.Method | None = None,
    min_compressed_size: int = plan.DEFAULT_MIN_COMPRESSED_SIZE,
    axis_size: int | dict[str, int] | None = None,
    track_elias: bool | int = False,
    exact_own_piece: bool = True,
) -> optax.GradientTransformationExtraArgs:
  r"""Averages updates over ``axis_name`` with a quantized all-reduce.

  It replaces the ``grads = jax.lax.pmean(grads, axis_name)`` line of a
  data-parallel training step: put it first in an ``optax.chain``. The
  result is bit-identical on every device, so replicas never drift.

  Error feedback (Seide et al. 2014; Karimireddy et al. 2019) keeps what
  compression dropped and adds it back the next step, so that nothing is lost
  over time and biased compressors such as :class:`~qsgd_jax.OneBit` converge:

  * ``"worker"`` (or ``True``): each device's residual of its own gradient,
    :math:`e \leftarrow (g + e) - \hat{(g + e)}`;
  * ``"owner"``: each chunk owner's residual of the re-quantized average;
  * ``"both"``: the two together.

  Under ``shard_map`` the residuals differ per device while everything else
  is replicated; :func:`~qsgd_jax.state_partition_specs` gives the
  ``PartitionSpec`` tree. The pattern::

    shapes = jax.eval_shape(tx.init, params)
    specs = qsgd_jax.state_partition_specs(shapes, "batch")
    init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)
    opt_state = jax.jit(init)(params)
    step = jax.shard_map(train_step, mesh=mesh,
                         in_specs=(P(), specs, P("batch")),
                         out_specs=(P(), specs))

  Under ``shard_map``, take the gradients with respect to parameters made
  device-varying, ``jax.lax.pcast(params, "batch", to="varying")``: the
  gradient of replicated parameters is already summed over the axis, in full
  precision, by autodiff. Under ``jax.pmap`` nothing is needed: the state gets
  pmap's leading axis.

  Non-finite updates: a NaN or inf in any device's updates makes the mean NaN
  on every device (as ``jax.lax.pmean`` would) and leaves the residuals as
  they were, so ``optax.apply_if_finite`` placed *after* this transform in the
  chain skips the step on every device together::

    optax.chain(qsgd_jax.qsgd("batch"),
                optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=5))

  Wrapping this transform *in* ``apply_if_finite`` is refused at trace time
  (a ``ValueError``): each device would test its own updates, and devices
  that disagree would take different branches around the collectives and
  hang. For QSGD and MinMax with the ``"two_phase"`` or ``"all_gather"``
  method the test costs next to nothing: it reads the scales the step sends,
  NaN or inf exactly where a bucket holds such a value, and reads the updates
  again only then.

  Leaves that are not floating point keep their dtype: integer leaves come
  back as ``jax.lax.pmean(x).astype(x.dtype)`` (the mean rounded toward
  zero), bool leaves ``True`` where any device's is, ``float0`` leaves (from
  ``jax.grad(..., allow_int=True)``) as they are.

  On a mesh whose model is sharded over other axes (``fsdp``, ``tensor``)
  inside each data group, this transform, under a ``jax.shard_map`` manual
  over ``axis_name`` alone, reads each leaf's layout over the mesh's
  *explicit* axes from its type (``jax.typeof(leaf).sharding``) and
  compresses each device's own shard: the leaves laid out over the same
  axes form a group, quantized on their shards in a ``jax.shard_map`` manual
  over those axes too, so that no bucket spans two shards and nothing is
  gathered over them. A float leaf whole over some of those axes (a
  LayerNorm scale, a bias) is first laid out over them along a dimension
  they divide, so that each device sends its part of it, not all of it, and
  its mean is all-gathered back over them (the fast links).
  ``min_compressed_size`` applies to whole leaves; the
  residuals are each device's own, along ``axis_name`` and the group's
  axes; each shard draws its own rounding; one scalar all-reduce a group,
  over every axis, tells every device of any non-finite value. Under
  automatic model axes (the compiler's layout, unknown here) run ``update``
  in ``jax.sharding.explicit_axes`` with the leaves' specs, as
  :func:`~qsgd_jax.data_parallel` does.

  To accumulate gradients over ``k`` mini-steps, wrap the chain in
  :func:`~qsgd_jax.accumulate_gradients`: each device averages its own
  gradients and this transform all-reduces their mean once, on the
  ``k``-th mini-step. ``optax.MultiSteps`` gives the same updates but runs the
  all-reduce on every mini-step, sending ``k`` times the bytes.

  Args:
    compressor: a :class:`~qsgd_jax.Compressor`.
    axis_name: the mapped axis to average over, or ``(outer, inner, ...)`` to
      average over the inner axes in full precision and quantize only over
      ``outer`` (see :func:`~qsgd_jax.quantized_psum`).
    key: PRNG key or int seed for the stochastic rounding.
    error_feedback: ``False``, ``True``/``"worker"``, ``"owner"`` or ``"both"``.
    warmup_steps: the first steps all-reduce in full precision (as CNTK,
      DeepSpeed's 1-bit Adam and Bagua's QAdam do).
    method: ``"two_phase"``, ``"psum"`` or ``"all_gather"``, see
      :func:`~qsgd_jax.quantized_psum`; ``None`` (the default) is
      ``"two_phase"``, or ``"all_gather"`` for a compressor whose payloads
      cannot be summed (``gather_only``: :class:`~qsgd_jax.TopK`).
    min_compressed_size: leaves with fewer elements go in full precision.
    axis_size: the size of ``axis_name`` (an int, or a dict for several
      axes). Only the residuals' shapes need it (owner error feedback, and
      worker error feedback over several axes), and only when ``init`` runs
      outside the mapped function, where the size cannot be read.
    track_elias: for QSGD with a method that sends payloads (``"two_phase"``,
      ``"all_gather"``), measure :attr:`CompressionStats.elias_bits` from the
      payloads the step sent: ``True`` every step, an int ``k`` every ``k``
      steps (held in between). Off by default: it is one more pass over the
      payloads plus a scalar all-reduce, which made a step 5x slower in
      ``benchmarks/step_cost.py`` (ResNet-50's tree, 2 CPU devices); every
      100 steps that is about 4% on average.
    exact_own_piece: as in :func:`~qsgd_jax.quantized_psum`: ``False``
      quantizes each device's own piece too, as CNTK's aggregator does.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` ignores
    ``params`` and extra arguments.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, qsgd_jax
    >>> n = jax.local_device_count()
    >>> tx = optax.chain(
    ...     qsgd_jax.compressed_allreduce(qsgd_jax.MinMax(bits=8), "batch"),
    ...     optax.sgd(0.1))
    >>> params = jnp.zeros(8192)
    >>> state = jax.pmap(tx.init, axis_name="batch")(jnp.zeros((n, 8192)))
    >>> grads = jnp.ones((n, 8192))
    >>> updates, state = jax.pmap(tx.update, axis_name="batch")(grads, state)
    >>> bool(jnp.allclose(updates, -0.1))
    True

  References:
    Alistarh et al., QSGD, NeurIPS 2017; Seide et al., 1-Bit SGD,
    Interspeech 2014; Karimireddy et al., `Error Feedback Fixes SignSGD
    <https://arxiv.org/abs/1901.09847>`_, ICML 2019.
  """
  base.check_static_options(
      "qsgd_jax.compressed_allreduce", warmup_steps=warmup_steps,
      min_compressed_size=min_compressed_size, axis_size=axis_size, track_elias=track_elias)
  if not (isinstance(error_feedback, bool)
          or (isinstance(error_feedback, str) and error_feedback in ("worker", "owner", "both"))):
    raise ValueError(
        "error_feedback must be False, True, 'worker', 'owner' or 'both', "
        f"got {error_feedback!r}."
    )
  if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
    raise ValueError(f"warmup_steps must be a non-negative int, got {warmup_steps!r}.")
  if method is None:
    method = "all_gather" if getattr(compressor, "gather_only", False) else "two_phase"
  plan.check_method(method, "compressed_allreduce")
  worker_feedback = error_feedback in (True, "worker", "both")
  owner_feedback = error_feedback in ("owner", "both")
  if owner_feedback and axis_name is None:
    raise ValueError(
        f"compressed_allreduce: error_feedback={error_feedback!r} keeps residuals on the "
        "owners of the reduced pieces, and axis_name=None has none; use "
        "error_feedback='worker'.")
  given_axis_sizes = allreduce_checks.given_axis_sizes(axis_name, axis_size)
  if owner_feedback and method != "two_phase":
    raise ValueError(
        f"owner error feedback needs method='two_phase': {method!r} has no piece owners.")
  if not isinstance(track_elias, int) or track_elias < 0:
    raise ValueError(
        f"track_elias must be False, True, or a positive int (every so many steps), "
        f"got {track_elias!r}.")
  elias_every = int(track_elias) if isinstance(compressor, QSGD) and method != "psum" else 0

  def make_plan(tree, axis_sizes=None, shard_axes=()):
    # A leaf cut into k shards is compressed when the whole leaf has min_compressed_size
    # elements: when each shard has ceil(min_compressed_size / k).
    shards_count = math.prod(
        jax.sharding.get_abstract_mesh().shape[name] for name in shard_axes)
    shard_min = -(-min_compressed_size // shards_count) if shards_count > 1 else None
    return plan.make_plan(tree, axis_name, compressor, method=method,
                          min_compressed_size=shard_min or min_compressed_size,
                          axis_sizes=axis_sizes, owner="compressed_allreduce",
                          exact_own_piece=exact_own_piece)

  # Fails at construction, not at the first step, for a bad compressor, method or axis.
  make_plan((), axis_sizes={})

  def init_fn(params):
    axis_sizes = allreduce_checks.axis_sizes(axis_name, given_axis_sizes)
    leaves, _ = shards.spread(jax.tree.leaves(params))

    def zeros(group_leaves, per_device, shared, shard_axes):
      del per_device, shared
      group_plan = make_plan(group_leaves, axis_sizes, shard_axes)
      return group_leaves, (
          _zeros(group_plan.local_error_shapes()) if worker_feedback else (),
          _zeros(group_plan.owner_error_shapes()) if owner_feedback else ()), ()

    local_error, chunk_error = (), ()
    for group in shards.group(leaves, _OWNER):
      _, (group_local, group_chunk), _ = shards.own_shards(
          functools.partial(zeros, shard_axes=group.axes), group.axes, group.specs,
          [leaves[i] for i in group.members])
      local_error, chunk_error = local_error + group_local, chunk_error + group_chunk
    return CompressedAllReduceState(
        key=base.as_key(key),
        count=jnp.zeros((), jnp.int32),
        local_error=local_error,
        chunk_error=chunk_error,
        stats=stats.empty(),
    )

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    if axis_name is not None:
      axes.check_not_in_apply_if_finite(_OWNER, axis_name, _APPLY_IF_FINITE_AFTER)
    leaves, treedef = jax.tree.flatten(updates)
    leaves, specs = shards.spread(leaves)
    groups = shards.group(leaves, _OWNER)
    plans = [make_plan([jax.ShapeDtypeStruct(shards.local_shape(jnp.shape(leaves[i]), spec),
                                             jnp.result_type(leaves[i]))
                        for i, spec in zip(group.members, group.specs, strict=True)],
                       shard_axes=group.axes)
             for group in groups]
    if plans and not plans[0].axes.is_local:
      # Here, where the leaves' paths are known: each group's reduction checks it again.
      axes.check_varying(updates, plans[0].axes, "compressed_allreduce")
    allreduce_checks.check_residual_shapes(plans, groups, state, axis_size)
    allreduce_checks.warn_if_little_is_compressed(plans)
    allreduce_checks.warn_if_chunks_pad(plans)
    next_key, step_key = jax.random.split(state.key)
    local = plans[0].axes.is_local if plans else True
    n, m = (plans[0].outer_size, plans[0].inner_size) if plans else (1, 1)
    num_elements = sum(group_plan.num_elements for group_plan in plans)
    float32_bits = wire.float32_allreduce_bits(num_elements, n * m)
    outer_float32_bits = wire.float32_allreduce_bits(num_elements / m, n)
    # A scalar all-reduce over every axis a group: the non-finite flag, and the Elias mean.
    scalar_bits = 0.0 if local else len(plans) * wire.float32_allreduce_bits(1, n * m)

    def compressed(_):
      measured = (state.count % elias_every == 0) if elias_every else False
      keys = [step_key] if len(groups) < 2 else list(jax.random.split(step_key, len(groups)))
      out, local_error, chunk_error = list(leaves), [], []
      nonfinite = elias_bits = jnp.float32(0)
      residuals = _residuals_by_group(plans, state)
      for group, group_plan, group_key, (group_local, group_chunk) in zip(
          groups, plans, keys, residuals, strict=True):
        means, (new_local, new_chunk), (group_nonfinite, group_elias) = shards.own_shards(
            functools.partial(_exchange, group_plan, axis_name=axis_name,
                              shard_axes=group.axes, worker_feedback=worker_feedback,
                              owner_feedback=owner_feedback, measure_elias=bool(elias_every)),
            group.axes, group.specs, [leaves[i] for i in group.members],
            (group_local, group_chunk), (group_key, jnp.asarray(measured)))
        for i, mean in zip(group.members, means, strict=True):
          out[i] = mean
        local_error, chunk_error = local_error + list(new_local), chunk_error + list(new_chunk)
        nonfinite, elias_bits = nonfinite + group_nonfinite, elias_bits + group_elias
      out = shards.gather_back(out, specs)
      # A NaN or inf on one device must reach every device, as through lax.pmean.
      finite = nonfinite == 0
      mean = treedef.unflatten([jnp.where(finite, x, jnp.nan).astype(x.dtype)
                                if _is_float(x) else x for x in out])
      wire_bits = sum(group_plan.wire_bits for group_plan in plans) + scalar_bits
      outer_bits = sum(group_plan.outer_wire_bits for group_plan in plans) + scalar_bits / m
      if elias_every:
        elias_bits = jnp.where(measured, elias_bits + 2 * scalar_bits, state.stats.elias_bits)
        wire_bits += jnp.where(measured, scalar_bits, 0.0)
        outer_bits += jnp.where(measured, scalar_bits / m, 0.0)
      else:
        elias_bits = state.stats.elias_bits
      # A skipped step (optax.apply_if_finite after this transform) leaves the residuals.
      local_error = _where(finite, local_error, state.local_error) if worker_feedback else ()
      chunk_error = _where(finite, chunk_error, state.chunk_error) if owner_feedback else ()
      return (mean, axes.as_varying(local_error, axis_name),
              axes.as_varying(chunk_error, axis_name),
              stats.make(wire_bits, float32_bits, elias_bits, outer_bits, outer_float32_bits))

    def full_precision(_):
      # As the reduction does: integer leaves in their dtype, float0 ones left alone.
      mean = updates if local else treedef.unflatten(shards.gather_back(
          [_full_precision_mean(x, axis_name) for x in leaves], specs))
      return (mean, axes.as_varying(state.local_error, axis_name),
              axes.as_varying(state.chunk_error, axis_name),
              stats.make(float32_bits, float32_bits, state.stats.elias_bits,
                         outer_float32_bits, outer_float32_bits))

    if warmup_steps:
      mean, local_error, chunk_error, step_stats = jax.lax.cond(
          state.count < warmup_steps, full_precision, compressed, None
      )
    else:
      mean, local_error, chunk_error, step_stats = compressed(None)
    new_state = CompressedAllReduceState(
        key=next_key,
        count=optax.safe_increment(state.count),
        local_error=local_error,
        chunk_error=chunk_error,
        stats=step_stats,
    )
    return mean, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _exchange(reduction_plan: plan.ReductionPlan, leaves, residuals, shared, *, axis_name,
              shard_axes: tuple[str, ...], worker_feedback: bool, owner_feedback: bool,
              measure_elias: bool):
  """One group's quantized mean, on this device's own shards of its leaves.

  Returns the means (not yet made NaN by another device's non-finite values),
  the new residuals ``(local_error, chunk_error)``, and, the same on every
  device, how many devices' updates were not finite and this device's Elias
  bits (averaged over the devices; zero unless ``measured``).
  """
  local_error, chunk_error = residuals
  key, measured = shared
  if shard_axes:  # Each shard its own draws, as each device of axis_name has.
    key = jax.random.fold_in(key, jax.lax.axis_index(shard_axes))
  out = reduction.reduce(
      reduction_plan, leaves, key, mean=True,
      local_error=local_error if worker_feedback else None,
      owner_error=chunk_error if owner_feedback else None)
  every_axis = () if axis_name is None else axes.parse(axis_name, _OWNER).names
  every_axis += shard_axes
  nonfinite = jnp.logical_not(_updates_finite(reduction_plan, leaves, out)).astype(jnp.float32)
  elias_bits = jnp.float32(0)
  if measure_elias:
    # Each device's first-phase payloads are its own: one scalar pmean.
    elias_bits = jax.lax.cond(measured, lambda: reduction.elias_wire_bits(reduction_plan, out),
                              lambda: axes.varying_like(elias_bits, nonfinite))
  if every_axis:
    nonfinite = jax.lax.psum(nonfinite, every_axis)
    elias_bits = jax.lax.pmean(elias_bits, every_axis)
  return (out.tree, (out.local_error if worker_feedback else (),
                     out.owner_error if owner_feedback else ()), (nonfinite, elias_bits))


def _residuals_by_group(plans, state):
  """The state's residuals ``(local_error, chunk_error)`` cut into each plan's share."""
  found, local_at, chunk_at = [], 0, 0
  for group_plan in plans:
    local_count = len(group_plan.segments) if state.local_error else 0
    chunk_count = len(group_plan.blocks) if state.chunk_error else 0
    found.append((state.local_error[local_at:local_at + local_count],
                  state.chunk_error[chunk_at:chunk_at + chunk_count]))
    local_at, chunk_at = local_at + local_count, chunk_at + chunk_count
  return found


def _zeros(shapes) -> tuple[jax.Array, ...]:
  return tuple(jnp.zeros(shape.shape, shape.dtype) for shape in shapes)


def _where(condition, new: tuple[jax.Array, ...], old: tuple[jax.Array, ...]):
  return tuple(jnp.where(condition, n, o) for n, o in zip(new, old, strict=True))


def _full_precision_mean(x, axis_name):
  if _is_float0(x):
    return x
  if not _is_float(x):
    return reduction.reduce_integer(x, axis_name, mean=True)
  return jax.lax.pmean(x, axis_name)


def _is_float0(x) -> bool:
  return jnp.result_type(x) == jax.dtypes.float0


def _is_float(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _updates_finite(reduction_plan: plan.ReductionPlan, updates,
                    out: reduction.Reduction) -> jax.Array:
  """Whether this device's ``updates`` are all finite, ``bool[]``.

  Where the compressor's payloads tell (:func:`reduction.encoded_all_finite`:
  QSGD's and MinMax's scales), the step reads them and the float32 leaves
  rather than every update again. Payloads holding a NaN or inf almost always
  mean updates that do, but a residual added to finite updates can overflow:
  only then are the updates read, so the answer is always theirs.
  """
  encoded_finite = reduction.encoded_all_finite(reduction_plan, out)
  if encoded_finite is None:
    return base.all_finite(updates)
  leaves = jax.tree.leaves(updates)
  float32_leaves = [leaves[i] for i in reduction_plan.full_precision]
  seen_finite = encoded_finite & base.all_finite(float32_leaves)
  # Both answers typed varying over every axis either one is (under jax.shard_map).
  names = tuple(sorted(set(axes.varying_axes(seen_finite)).union(
      *(axes.varying_axes(leaf) for leaf in leaves if _is_float(leaf)))))
  typed = (lambda x: axes.as_varying(x, names)) if names else (lambda x: x)
  return jax.lax.cond(seen_finite, lambda: typed(seen_finite),
                      lambda: typed(base.all_finite(updates)))
