"""optax transformations that average gradients with a quantized all-reduce."""

import math
import warnings
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from qsgd_jax._src import axes, base, stats, wire
from qsgd_jax._src.collectives import plan, reduction
from qsgd_jax._src.compressors.onebit import OneBit
from qsgd_jax._src.compressors.qsgd import QSGD

ErrorFeedback = bool | Literal["worker", "owner", "both"]
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
  given_axis_sizes = _given_axis_sizes(axis_name, axis_size)
  if owner_feedback and method != "two_phase":
    raise ValueError(
        f"owner error feedback needs method='two_phase': {method!r} has no piece owners.")
  if not isinstance(track_elias, int) or track_elias < 0:
    raise ValueError(
        f"track_elias must be False, True, or a positive int (every so many steps), "
        f"got {track_elias!r}.")
  elias_every = int(track_elias) if isinstance(compressor, QSGD) and method != "psum" else 0

  def make_plan(tree, axis_sizes=None):
    return plan.make_plan(tree, axis_name, compressor, method=method,
                          min_compressed_size=min_compressed_size, axis_sizes=axis_sizes,
                          owner="compressed_allreduce", exact_own_piece=exact_own_piece)

  # Fails at construction, not at the first step, for a bad compressor, method or axis.
  make_plan((), axis_sizes={})

  def init_fn(params):
    reduction_plan = make_plan(params, _axis_sizes(axis_name, given_axis_sizes))
    return CompressedAllReduceState(
        key=base.as_key(key),
        count=jnp.zeros((), jnp.int32),
        local_error=_zeros(reduction_plan.local_error_shapes()) if worker_feedback else (),
        chunk_error=_zeros(reduction_plan.owner_error_shapes()) if owner_feedback else (),
        stats=stats.empty(),
    )

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    if axis_name is not None:
      axes.check_not_in_apply_if_finite("qsgd_jax.compressed_allreduce", axis_name,
                                        _APPLY_IF_FINITE_AFTER)
    reduction_plan = make_plan(updates)
    _check_residual_shapes(reduction_plan, state, axis_size)
    _warn_if_little_is_compressed(reduction_plan)
    next_key, step_key = jax.random.split(state.key)
    local = reduction_plan.axes.is_local
    n, m = reduction_plan.outer_size, reduction_plan.inner_size
    float32_bits = wire.float32_allreduce_bits(reduction_plan.num_elements, n * m)
    outer_float32_bits = wire.float32_allreduce_bits(reduction_plan.num_elements / m, n)
    # A scalar all-reduce over every axis: the non-finite flag, and the Elias mean.
    scalar_bits = 0.0 if local else wire.float32_allreduce_bits(1, n * m)

    def elias_bits_of(out):
      # Each device's first-phase payloads are its own: one scalar pmean.
      bits = reduction.elias_wire_bits(reduction_plan, out)
      return bits if local else jax.lax.pmean(bits, axis_name)

    def compressed(_):
      out = reduction.reduce(
          reduction_plan, updates, step_key, mean=True,
          local_error=state.local_error if worker_feedback else None,
          owner_error=state.chunk_error if owner_feedback else None,
      )
      # A NaN or inf on one device must reach every device, as through lax.pmean.
      nonfinite = jnp.logical_not(_updates_finite(reduction_plan, updates, out))
      nonfinite = nonfinite.astype(jnp.float32)
      finite = (nonfinite if local else jax.lax.psum(nonfinite, axis_name)) == 0
      mean = jax.tree.map(lambda x: jnp.where(finite, x, jnp.nan).astype(x.dtype)
                          if _is_float(x) else x, out.tree)
      wire_bits = reduction_plan.wire_bits + scalar_bits
      outer_bits = reduction_plan.outer_wire_bits + scalar_bits / m
      elias_bits = state.stats.elias_bits
      if elias_every:
        measured = state.count % elias_every == 0
        elias_bits = jax.lax.cond(measured, lambda: elias_bits_of(out) + 2 * scalar_bits,
                                  lambda: elias_bits)
        wire_bits += jnp.where(measured, scalar_bits, 0.0)
        outer_bits += jnp.where(measured, scalar_bits / m, 0.0)
      # A skipped step (optax.apply_if_finite after this transform) leaves the residuals.
      local_error = _where(finite, out.local_error, state.local_error) if worker_feedback else ()
      chunk_error = _where(finite, out.owner_error, state.chunk_error) if owner_feedback else ()
      return (mean, axes.as_varying(local_error, axis_name),
              axes.as_varying(chunk_error, axis_name),
              stats.make(wire_bits, float32_bits, elias_bits, outer_bits, outer_float32_bits))

    def full_precision(_):
      # As the reduction does: integer leaves in their dtype, float0 ones left alone.
      mean = (jax.tree.map(lambda x: _full_precision_mean(x, axis_name), updates)
              if not local else updates)
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


def qsgd(
    axis_name: axes.AxisName,
    bits: int = 4,
    bucket_size: int | None = 512,
    norm: Literal["max", "l2"] = "max",
    key: jax.Array | int = 0,
    *,
    error_feedback: ErrorFeedback = False,
    warmup_steps: int = 0,
    method: plan.Method = "two_phase",
    min_compressed_size: int = plan.DEFAULT_MIN_COMPRESSED_SIZE,
    axis_size: int | dict[str, int] | None = None,
    track_elias: bool | int = False,
    exact_own_piece: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """QSGD (Alistarh et al. 2017): gradients averaged with the QSGD quantizer.

  ``compressed_allreduce(QSGD(bits, bucket_size, norm), axis_name, key=key)``:
  each coordinate travels as a ``bits``-bit stochastic level of its bucket's
  norm, unbiased, with the variance bound of Lemma 3.1.

  Args:
    axis_name: the mapped axis to average over.
    bits: bits a coordinate; ``2**(bits - 1) - 1`` levels.
    bucket_size: coordinates sharing one scale; ``None`` for one per piece.
    norm: ``"max"`` or ``"l2"``.
    key: PRNG key or integer seed.
    error_feedback, warmup_steps, method: as in :func:`compressed_allreduce`.
    axis_size, track_elias, exact_own_piece: as in :func:`compressed_allreduce`.
    min_compressed_size: leaves with fewer elements (4096 by default: biases
      and norm scales) go in float32.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Under ``optax.inject_hyperparams`` only ``key`` may be traced: name the
  other numeric options in ``static_args``,
  ``static_args=("bits", "bucket_size", "warmup_steps", "min_compressed_size")``
  (and ``"axis_size"``, ``"track_elias"`` if given); the error says so too.

  Examples:
    >>> import optax, qsgd_jax
    >>> tx = optax.chain(qsgd_jax.qsgd("batch"), optax.adamw(1e-3))

  References:
    Alistarh et al., `QSGD: Communication-Efficient SGD via Gradient
    Quantization and Encoding <https://arxiv.org/abs/1610.02132>`_, 2017.
  """
  base.check_static_options(
      "qsgd_jax.qsgd", bits=bits, bucket_size=bucket_size, warmup_steps=warmup_steps,
      min_compressed_size=min_compressed_size, axis_size=axis_size, track_elias=track_elias)
  compressor = QSGD(bits=bits, bucket_size=bucket_size, norm=norm)
  return compressed_allreduce(
      compressor, axis_name, key=key, error_feedback=error_feedback,
      warmup_steps=warmup_steps, method=method, min_compressed_size=min_compressed_size,
      axis_size=axis_size, track_elias=track_elias, exact_own_piece=exact_own_piece)


def onebit_sgd(
    axis_name: axes.AxisName,
    key: jax.Array | int = 0,
    *,
    bucket_size: int | None = 512,
    error_feedback: ErrorFeedback = "worker",
    warmup_steps: int = 0,
    method: plan.Method = "two_phase",
    min_compressed_size: int = plan.DEFAULT_MIN_COMPRESSED_SIZE,
    axis_size: int | dict[str, int] | None = None,
    track_elias: bool | int = False,
    exact_own_piece: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """1-bit SGD (Seide et al. 2014): sign bits, bucket means, error feedback.

  ``compressed_allreduce(OneBit(bucket_size), axis_name, error_feedback=...)``.

  CNTK's ``AllReduceDistGradAggregator`` quantizes each column of a gradient
  matrix on its own (a row here: ``bucket_size=None``), keeps a residual on
  every worker *and* on every stripe owner's re-quantized sum, and quantizes
  the owner's own stripe too: ``onebit_sgd(axis_name, bucket_size=None,
  error_feedback="both", exact_own_piece=False)`` reproduces it to float
  rounding (``tests/fidelity_test.py``).

  The defaults come from ``benchmarks/error_feedback.py`` (digits, an MLP on
  8 devices, 5 seeds x 300 SGD steps; test accuracy): float32 97.00 +- 0.41;
  worker residuals 96.44 +- 0.60 with buckets of 512, 96.78 +- 0.50 with
  rows; both residuals 95.56 +- 1.87 (buckets) and 96.33 +- 0.99 (rows);
  CNTK's settings 96.44 +- 0.84; owner residuals alone 76.6 +- 9.8; none
  94.94 +- 0.36. Worker residuals alone do as well as CNTK's two, with no
  state on the owners; buckets of 512 and rows are within the seeds' spread,
  and a fixed bucket size keeps the scales' share of the bytes fixed whatever
  the leaves' row lengths.

  Args:
    axis_name: the mapped axis to average over.
    key: PRNG key or int seed (1-bit quantization is deterministic; the key
      is kept for a uniform interface).
    bucket_size: elements sharing the two reconstruction values; ``None``
      for one bucket a row of each leaf's last axis, as CNTK.
    error_feedback: as in :func:`compressed_allreduce`; ``"worker"`` by
      default.
    warmup_steps, method, min_compressed_size: as in :func:`compressed_allreduce`.
    axis_size, track_elias, exact_own_piece: as in :func:`compressed_allreduce`.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Examples:
    >>> import optax, qsgd_jax
    >>> tx = optax.chain(qsgd_jax.onebit_sgd("batch"), optax.sgd(0.1, momentum=0.9))

  References:
    Seide et al., `1-Bit Stochastic Gradient Descent and its Application to
    Data-Parallel Distributed Training of Speech DNNs`, Interspeech 2014.
  """
  base.check_static_options(
      "qsgd_jax.onebit_sgd", bucket_size=bucket_size, warmup_steps=warmup_steps,
      min_compressed_size=min_compressed_size, axis_size=axis_size, track_elias=track_elias)
  return compressed_allreduce(
      OneBit(bucket_size=bucket_size), axis_name, key=key, error_feedback=error_feedback,
      warmup_steps=warmup_steps, method=method, min_compressed_size=min_compressed_size,
      axis_size=axis_size, track_elias=track_elias, exact_own_piece=exact_own_piece,
  )


def _given_axis_sizes(axis_name, axis_size) -> dict[str, int]:
  """``axis_size`` by axis name, checked: ``None``, a positive int (one axis) or a dict of them."""
  names = axes.parse(axis_name, "compressed_allreduce").names
  if axis_size is None:
    return {}
  if isinstance(axis_size, dict):
    given = dict(axis_size)
  elif len(names) == 1:
    given = {names[0]: axis_size}
  else:
    raise ValueError(
        f"compressed_allreduce: axis_size must be a dict naming each of {names}, "
        f"got {axis_size!r}.")
  for name, size in given.items():
    if name not in names:
      raise ValueError(
          f"compressed_allreduce: axis_size names axis {name!r}, not one of {names}.")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
      raise ValueError(
          f"compressed_allreduce: axis_size must be a positive int (or a dict of them by "
          f"axis name), got {axis_size!r}.")
  return given


def _check_residual_shapes(reduction_plan: plan.ReductionPlan, state, axis_size) -> None:
  """Raises where the state's residuals are not the shapes this step's plan holds."""
  for field, shapes in (("local_error", reduction_plan.local_error_shapes),
                        ("chunk_error", reduction_plan.owner_error_shapes)):
    held = getattr(state, field)
    if not held:
      continue
    expected = shapes()
    if tuple(e.shape for e in held) != tuple(e.shape for e in expected):
      raise ValueError(
          f"compressed_allreduce: the state's {field} has shapes "
          f"{[e.shape for e in held]}, this step needs {[e.shape for e in expected]}: init "
          f"saw another axis size (axis_size={axis_size!r}) or another tree than update. "
          "Pass the mapped axis's true size as axis_size, or call init inside the mapped "
          "function.")


def _axis_sizes(axis_name, given: dict[str, int]) -> dict[str, int | None]:
  """Each axis's size: as given, else as bound here, else ``None`` (unknown)."""
  sizes = {}
  for name in axes.parse(axis_name, "compressed_allreduce").names:
    try:
      sizes[name] = given[name] if name in given else jax.lax.axis_size(name)
    except NameError:
      sizes[name] = None
  return sizes


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


# Plans already warned about, so that each tree is warned about once.
_WARNED: set[plan.ReductionPlan] = set()


def _warn_if_little_is_compressed(reduction_plan: plan.ReductionPlan) -> None:
  """Warns, once a tree, when under half of its elements would travel compressed."""
  compressed = sum(math.prod(reduction_plan.leaf_shapes[i]) for i in reduction_plan.compressed)
  total = reduction_plan.num_elements
  if reduction_plan in _WARNED or not total or 2 * compressed >= total:
    return
  _WARNED.add(reduction_plan)
  largest = max(math.prod(shape) for shape in reduction_plan.leaf_shapes)
  warnings.warn(
      f"compressed_allreduce: only {compressed} of the {total} elements of the updates are "
      f"in leaves of min_compressed_size={reduction_plan.min_compressed_size} or more, so "
      f"{100 * (1 - compressed / total):.0f}% travel in float32 and the step saves little "
      f"(the largest leaf has {largest} elements). Lower min_compressed_size to quantize "
      "smaller leaves.", stacklevel=3)
