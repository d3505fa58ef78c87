"""optax transformations that average gradients with a quantized all-reduce."""

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from qsgd_jax._src import axes, base, plan, reduction, stats, wire
from qsgd_jax._src.onebit import OneBit
from qsgd_jax._src.qsgd import QSGD

ErrorFeedback = bool | Literal["worker", "owner", "both"]


class CompressedAllReduceState(NamedTuple):
  """State of :func:`compressed_allreduce`.

  Attributes:
    key: typed PRNG key ``key<impl>[]``, split every step; the same on every
      device (each device folds in its axis index).
    count: ``int32[]``, steps taken (for the warm-up).
    local_error: per device, one ``float32[length]`` a leaf sent compressed,
      ``length`` the elements the device quantizes of it (the leaf's size, or
      its share after the full-precision reduce-scatter over inner axes): the
      residual of the device's own compressed gradient (empty tuple without
      worker error feedback).
    chunk_error: per device, one ``float32[batch, width]`` a block of the
      reduction plan (all leaves side by side for a compressor with a fixed
      bucket size, else one block a leaf shape): the residual of re-quantizing
      the sums the device owns (empty tuple without owner error feedback).
    stats: the last step's :class:`CompressionStats`.
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
    method: plan.Method = "two_phase",
    min_compressed_size: int = plan.DEFAULT_MIN_COMPRESSED_SIZE,
    axis_size: int | dict[str, int] | None = None,
    track_elias: bool = True,
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

  A NaN or inf in any device's updates makes the mean NaN on every device (as
  ``jax.lax.pmean`` would) and leaves the residuals as they were, so
  ``optax.apply_if_finite`` placed after this transform in the chain skips
  the step on every device. Do not wrap this transform in ``apply_if_finite``:
  each device would test its own updates, and devices that disagree take
  different branches around the collectives and hang.

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
      :func:`~qsgd_jax.quantized_psum`.
    min_compressed_size: leaves with fewer elements go in full precision.
    axis_size: the size of ``axis_name`` (an int, or a dict for several
      axes). Only the residuals' shapes need it (owner error feedback, and
      worker error feedback over several axes), and only when ``init`` runs
      outside the mapped function, where the size cannot be read.
    track_elias: for QSGD with a method that sends payloads (``"two_phase"``,
      ``"all_gather"``), compute :attr:`CompressionStats.elias_bits` every
      step from the payloads the step sent (one extra pass over them).

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
      min_compressed_size=min_compressed_size, axis_size=axis_size)
  if not (isinstance(error_feedback, bool)
          or (isinstance(error_feedback, str) and error_feedback in ("worker", "owner", "both"))):
    raise ValueError(
        "error_feedback must be False, True, 'worker', 'owner' or 'both', "
        f"got {error_feedback!r}."
    )
  if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
    raise ValueError(f"warmup_steps must be a non-negative int, got {warmup_steps!r}.")
  worker_feedback = error_feedback in (True, "worker", "both")
  owner_feedback = error_feedback in ("owner", "both")
  if owner_feedback and method != "two_phase":
    raise ValueError(
        f"owner error feedback needs method='two_phase': {method!r} has no piece owners.")
  track_elias = track_elias and isinstance(compressor, QSGD) and method != "psum"

  def make_plan(tree, axis_sizes=None):
    return plan.make_plan(tree, axis_name, compressor, method=method,
                          min_compressed_size=min_compressed_size, axis_sizes=axis_sizes,
                          owner="compressed_allreduce")

  # Fails at construction, not at the first step, for a bad compressor, method or axis.
  make_plan((), axis_sizes={})

  def init_fn(params):
    reduction_plan = make_plan(params, _axis_sizes(axis_name, axis_size))
    nan = jnp.full((), jnp.nan, jnp.float32)
    return CompressedAllReduceState(
        key=base.as_key(key),
        count=jnp.zeros((), jnp.int32),
        local_error=_zeros(reduction_plan.local_error_shapes()) if worker_feedback else (),
        chunk_error=_zeros(reduction_plan.owner_error_shapes()) if owner_feedback else (),
        stats=stats.CompressionStats(nan, nan, nan, nan),
    )

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    reduction_plan = make_plan(updates)
    next_key, step_key = jax.random.split(state.key)
    devices = reduction_plan.num_devices
    float32_bits = wire.float32_allreduce_bits(reduction_plan.num_elements, devices)
    flag_bits = wire.float32_allreduce_bits(1, devices)

    def compressed(_):
      out = reduction.reduce(
          reduction_plan, updates, step_key, mean=True,
          local_error=state.local_error if worker_feedback else None,
          owner_error=state.chunk_error if owner_feedback else None,
      )
      # A NaN or inf on one device must reach every device, as through lax.pmean; the
      # quantizers' scales need not carry it (XLA's row reductions may drop a NaN).
      nonfinite_devices = jax.lax.psum(
          jnp.logical_not(_all_finite(updates)).astype(jnp.float32), axis_name)
      finite = nonfinite_devices == 0
      mean = jax.tree.map(lambda x: jnp.where(finite, x, jnp.nan).astype(x.dtype), out.tree)
      wire_bits = reduction_plan.wire_bits + flag_bits
      elias_bits = jnp.full((), jnp.nan, jnp.float32)
      if track_elias:
        # Each device's first-phase payloads are its own: one scalar pmean, counted too.
        wire_bits += flag_bits
        elias_bits = jax.lax.pmean(stats.elias_wire_bits(reduction_plan, out), axis_name)
        elias_bits += 2 * flag_bits
      # A skipped step (optax.apply_if_finite after this transform) leaves the residuals.
      local_error = _where(finite, out.local_error, state.local_error) if worker_feedback else ()
      chunk_error = _where(finite, out.owner_error, state.chunk_error) if owner_feedback else ()
      return (mean, axes.as_varying(local_error, axis_name),
              axes.as_varying(chunk_error, axis_name),
              stats.make(wire_bits, float32_bits, elias_bits))

    def full_precision(_):
      mean = jax.lax.pmean(updates, axis_name)
      nan = jnp.full((), jnp.nan, jnp.float32)
      return (mean, axes.as_varying(state.local_error, axis_name),
              axes.as_varying(state.chunk_error, axis_name),
              stats.make(float32_bits, float32_bits, nan))

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
    track_elias: bool = True,
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
    error_feedback: as in :func:`compressed_allreduce`.
    warmup_steps: as in :func:`compressed_allreduce`.
    method: as in :func:`compressed_allreduce`.
    min_compressed_size: as in :func:`compressed_allreduce`.
    axis_size: as in :func:`compressed_allreduce`.
    track_elias: as in :func:`compressed_allreduce`.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Under ``optax.inject_hyperparams`` only ``key`` may be traced: name the
  other numeric options in ``static_args``,
  ``static_args=("bits", "bucket_size", "warmup_steps", "min_compressed_size")``
  (and ``"axis_size"`` if given); the error says so too.

  Examples:
    >>> import optax, qsgd_jax
    >>> tx = optax.chain(qsgd_jax.qsgd("batch"), optax.adamw(1e-3))

  References:
    Alistarh et al., `QSGD: Communication-Efficient SGD via Gradient
    Quantization and Encoding <https://arxiv.org/abs/1610.02132>`_, 2017.
  """
  base.check_static_options(
      "qsgd_jax.qsgd", bits=bits, bucket_size=bucket_size, warmup_steps=warmup_steps,
      min_compressed_size=min_compressed_size, axis_size=axis_size)
  compressor = QSGD(bits=bits, bucket_size=bucket_size, norm=norm)
  return compressed_allreduce(
      compressor, axis_name, key=key, error_feedback=error_feedback,
      warmup_steps=warmup_steps, method=method, min_compressed_size=min_compressed_size,
      axis_size=axis_size, track_elias=track_elias)


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
    track_elias: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """1-bit SGD (Seide et al. 2014): sign bits, bucket means, error feedback.

  ``compressed_allreduce(OneBit(bucket_size), axis_name, error_feedback=...)``.
  The default keeps each worker's residual, CNTK's scheme; the comparison of
  ``"worker"``, ``"owner"`` and ``"both"`` on digits is in
  ``benchmarks/error_feedback.py``.

  Args:
    axis_name: the mapped axis to average over.
    key: PRNG key or int seed (1-bit quantization is deterministic; the key
      is kept for a uniform interface).
    bucket_size: elements sharing the two reconstruction values.
    error_feedback: as in :func:`compressed_allreduce`.
    warmup_steps: as in :func:`compressed_allreduce`.
    method: as in :func:`compressed_allreduce`.
    min_compressed_size: as in :func:`compressed_allreduce`.
    axis_size: as in :func:`compressed_allreduce`.
    track_elias: as in :func:`compressed_allreduce`.

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
      min_compressed_size=min_compressed_size, axis_size=axis_size)
  return compressed_allreduce(
      OneBit(bucket_size=bucket_size), axis_name, key=key, error_feedback=error_feedback,
      warmup_steps=warmup_steps, method=method, min_compressed_size=min_compressed_size,
      axis_size=axis_size, track_elias=track_elias,
  )


def _axis_sizes(axis_name, axis_size) -> dict[str, int | None]:
  """Each axis's size: as given, else as bound here, else ``None`` (unknown)."""
  names = axes.parse(axis_name, "compressed_allreduce").names
  if axis_size is None:
    given = {}
  elif isinstance(axis_size, int):
    if len(names) != 1:
      raise ValueError(f"axis_size must be a dict naming each of {names}, got {axis_size}.")
    given = {names[0]: axis_size}
  else:
    given = dict(axis_size)
  sizes = {}
  for name in names:
    try:
      sizes[name] = given[name] if name in given else jax.lax.axis_size(name)
    except NameError:
      sizes[name] = None
  return sizes


def _zeros(shapes) -> tuple[jax.Array, ...]:
  return tuple(jnp.zeros(shape.shape, shape.dtype) for shape in shapes)


def _where(condition, new: tuple[jax.Array, ...], old: tuple[jax.Array, ...]):
  return tuple(jnp.where(condition, n, o) for n, o in zip(new, old, strict=True))


def _all_finite(tree) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)]))
