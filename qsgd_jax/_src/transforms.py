"""optax transformations that average gradients with a quantized all-reduce."""

import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from qsgd_jax._src import base, collectives, grouping, stats
from qsgd_jax._src.onebit import OneBit
from qsgd_jax._src.qsgd import QSGD

ErrorFeedback = bool | Literal["worker", "owner", "both"]


class CompressedAllReduceState(NamedTuple):
  """State of :func:`compressed_allreduce`.

  Attributes:
    key: typed PRNG key ``key<impl>[]``, split every step; the same on every
      device (each device folds in its axis index).
    count: ``int32[]``, steps taken (for the warm-up).
    local_error: per device, a tuple with one ``float32[leaf.size]`` a
      gradient leaf: the residual of the device's own compressed gradient
      (empty tuple without worker error feedback).
    chunk_error: per device, a tuple with one ``float32[piece]`` a leaf sent
      compressed (leaves sent in full precision have none): the residual of
      re-quantizing the chunk the device owns (empty tuple without owner
      error feedback).
    stats: the last step's :class:`CompressionStats`.
  """

  key: jax.Array
  count: jax.Array
  local_error: tuple[jax.Array, ...]
  chunk_error: tuple[jax.Array, ...]
  stats: stats.CompressionStats


def compressed_allreduce(
    compressor: base.Compressor,
    axis_name: collectives.AxisName,
    *,
    key: jax.Array | int = 0,
    error_feedback: ErrorFeedback = False,
    warmup_steps: int = 0,
    method: Literal["two_phase", "psum"] = "two_phase",
    min_compressed_size: int = collectives.DEFAULT_MIN_COMPRESSED_SIZE,
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
    method: ``"two_phase"`` or ``"psum"``, see :func:`~qsgd_jax.quantized_psum`.
    min_compressed_size: leaves with fewer elements go in full precision.
    axis_size: the size of ``axis_name`` (an int, or a dict for several
      axes). Only owner error feedback needs it, and only when ``init`` runs
      outside the mapped function, where the size cannot be read.
    track_elias: for QSGD, compute :attr:`CompressionStats.elias_bits` every
      step (one extra pass over the payloads).

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
  if not isinstance(compressor, base.Compressor):
    raise TypeError(
        f"compressor must be a qsgd_jax.Compressor, got {type(compressor).__name__}: "
        f"{compressor!r}."
    )
  if not (isinstance(error_feedback, bool)
          or (isinstance(error_feedback, str) and error_feedback in ("worker", "owner", "both"))):
    raise ValueError(
        "error_feedback must be False, True, 'worker', 'owner' or 'both', "
        f"got {error_feedback!r}."
    )
  if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
    raise ValueError(f"warmup_steps must be a non-negative int, got {warmup_steps!r}.")
  if method not in ("two_phase", "psum"):
    raise ValueError(f"method must be 'two_phase' or 'psum', got {method!r}.")
  worker_feedback = error_feedback in (True, "worker", "both")
  owner_feedback = error_feedback in ("owner", "both")
  if owner_feedback and method == "psum":
    raise ValueError("owner error feedback needs method='two_phase': 'psum' has no owners.")
  elias_compressor = compressor if track_elias and isinstance(compressor, QSGD) else None
  reduce_options = dict(method=method, min_compressed_size=min_compressed_size)

  def init_fn(params):
    leaves = jax.tree.leaves(params)
    local_error = tuple(jnp.zeros((leaf.size,), jnp.float32) for leaf in leaves) if (
        worker_feedback) else ()
    chunk_error = ()
    if owner_feedback:
      shapes = collectives.chunk_error_shapes(
          params, axis_name, compressor, min_compressed_size=min_compressed_size,
          axis_sizes=_axis_sizes(axis_name, axis_size),
      )
      # Leaves sent in full precision have empty residuals; orbax cannot save empty arrays.
      chunk_error = tuple(
          jnp.zeros(s.shape, s.dtype) for s in jax.tree.leaves(shapes) if s.shape != (0,))
    nan = jnp.full((), jnp.nan, jnp.float32)
    return CompressedAllReduceState(
        key=base.as_key(key),
        count=jnp.zeros((), jnp.int32),
        local_error=local_error,
        chunk_error=chunk_error,
        stats=stats.CompressionStats(nan, nan, nan, nan),
    )

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    base.bound_axis_size(axis_name, "compressed_allreduce")
    next_key, step_key = jax.random.split(state.key)
    treedef = jax.tree.structure(updates)
    is_compressed = [math.prod(jnp.shape(leaf)) >= min_compressed_size
                     for leaf in jax.tree.leaves(updates)]
    full_bits = collectives.float32_allreduce_bits(updates, axis_name)

    def compressed(_):
      out = collectives.reduce_compressed(
          updates, axis_name, compressor, step_key, mean=True,
          local_error=(jax.tree.unflatten(treedef, state.local_error)
                       if worker_feedback else None),
          chunk_error=(_with_empty(state.chunk_error, is_compressed)
                       if owner_feedback else None),
          **reduce_options,
      )
      # A NaN or inf on one device must reach every device, as through lax.pmean; the
      # quantizers' scales need not carry it (XLA's row reductions may drop a NaN).
      nonfinite_devices = jax.lax.psum(
          jnp.logical_not(_all_finite(updates)).astype(jnp.float32), axis_name)
      finite = nonfinite_devices == 0
      mean = jax.tree.map(lambda x: jnp.where(finite, x, jnp.nan).astype(x.dtype), out.tree)
      wire_bits = collectives.wire_bits(updates, axis_name, compressor, **reduce_options)
      wire_bits += _scalar_allreduce_bits(axis_name)
      elias_bits = jnp.full((), jnp.nan, jnp.float32)
      if elias_compressor is not None:
        # Each device estimates from its own payloads; the mean is the same everywhere.
        elias_bits = jax.lax.pmean(
            _elias_wire_bits(updates, elias_compressor, step_key, wire_bits,
                             min_compressed_size),
            axis_name)
        wire_bits += _scalar_allreduce_bits(axis_name)
      # A skipped step (optax.apply_if_finite after this transform) leaves the residuals.
      local_error = tuple(
          jnp.where(finite, new.reshape(-1), old)
          for new, old in zip(jax.tree.leaves(out.local_error), state.local_error, strict=True)
      ) if worker_feedback else ()
      chunk_error = tuple(
          jnp.where(finite, new, old) for new, old in zip(
              [e for e, kept in zip(out.chunk_error, is_compressed, strict=True) if kept],
              state.chunk_error, strict=True)
      ) if owner_feedback else ()
      return (mean, _per_device(local_error, axis_name), _per_device(chunk_error, axis_name),
              stats.make(wire_bits, full_bits, elias_bits))

    def full_precision(_):
      mean = jax.lax.pmean(updates, axis_name)
      nan = jnp.full((), jnp.nan, jnp.float32)
      return (mean, _per_device(state.local_error, axis_name),
              _per_device(state.chunk_error, axis_name), stats.make(full_bits, full_bits, nan))

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
    axis_name: collectives.AxisName,
    bits: int = 4,
    bucket_size: int | None = 512,
    norm: Literal["max", "l2"] = "max",
    key: jax.Array | int = 0,
    **kwargs: Any,
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
    key: PRNG key or int seed.
    **kwargs: more options of :func:`compressed_allreduce`.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Examples:
    >>> import optax, qsgd_jax
    >>> tx = optax.chain(qsgd_jax.qsgd("batch"), optax.adamw(1e-3))

  References:
    Alistarh et al., `QSGD: Communication-Efficient SGD via Gradient
    Quantization and Encoding <https://arxiv.org/abs/1610.02132>`_, 2017.
  """
  compressor = QSGD(bits=bits, bucket_size=bucket_size, norm=norm)
  return compressed_allreduce(compressor, axis_name, key=key, **kwargs)


def onebit_sgd(
    axis_name: collectives.AxisName,
    key: jax.Array | int = 0,
    *,
    bucket_size: int | None = 512,
    error_feedback: ErrorFeedback = "worker",
    **kwargs: Any,
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
    **kwargs: more options of :func:`compressed_allreduce`.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Examples:
    >>> import optax, qsgd_jax
    >>> tx = optax.chain(qsgd_jax.onebit_sgd("batch"), optax.sgd(0.1, momentum=0.9))

  References:
    Seide et al., `1-Bit Stochastic Gradient Descent and its Application to
    Data-Parallel Distributed Training of Speech DNNs`, Interspeech 2014.
  """
  return compressed_allreduce(
      OneBit(bucket_size=bucket_size), axis_name, key=key,
      error_feedback=error_feedback, **kwargs,
  )


def _axis_sizes(axis_name, axis_size) -> dict[str, int] | None:
  names = axis_name if isinstance(axis_name, tuple | list) else (axis_name,)
  if axis_size is None:
    try:
      return {name: jax.lax.axis_size(name) for name in names}
    except NameError as error:
      raise ValueError(
          f"Owner error feedback sizes its residuals by the size of axis {axis_name!r}, "
          "which is not bound where init runs: pass axis_size=... to "
          "compressed_allreduce, or call init inside the mapped function."
      ) from error
  if isinstance(axis_size, int):
    if len(names) != 1:
      raise ValueError(f"axis_size must be a dict naming each of {names}, got {axis_size}.")
    return {names[0]: axis_size}
  return dict(axis_size)


def _per_device(residuals: tuple[jax.Array, ...], axis_name) -> tuple[jax.Array, ...]:
  """Residuals typed as varying over ``axis_name`` under ``shard_map``.

  A residual of a leaf sent in full precision is a constant zero, which
  shard_map types as replicated; both branches of the warm-up ``cond`` and a
  ``scan`` carrying the state need every residual typed alike.
  """
  axes = tuple(axis_name) if isinstance(axis_name, tuple | list) else axis_name
  return tuple(collectives._as_varying(e, axes) for e in residuals)


def _with_empty(chunk_error: tuple[jax.Array, ...], is_compressed: list[bool]):
  """One residual a leaf, as :func:`collectives.reduce_compressed` takes them."""
  stored = iter(chunk_error)
  return tuple(next(stored) if kept else jnp.zeros((0,), jnp.float32) for kept in is_compressed)


def _all_finite(tree) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)]))


def _scalar_allreduce_bits(axis_name) -> float:
  """Bits one device sends in an all-reduce of one float32 over ``axis_name``."""
  return collectives.float32_allreduce_bits(jnp.zeros(()), axis_name)


def _elias_wire_bits(updates, compressor, key, wire_bits, min_compressed_size):
  """``wire_bits`` scaled by Elias size / packed size of this device's payloads.

  The device's large gradient leaves are encoded once more with the step's
  key (batched as the reduction batches them), and their levels Elias-coded (the smaller variant per
  bucket): the fraction of the fixed-width payload that Elias coding would
  take.
  """
  vectors = [leaf.astype(jnp.float32).reshape(-1) for leaf in jax.tree.leaves(updates)
             if leaf.size >= min_compressed_size]
  if not vectors:
    return jnp.asarray(wire_bits, jnp.float32)
  layout = grouping.layout(compressor, vectors)
  payloads = grouping.encode_blocks(compressor, key, layout.join(vectors))
  packed_bits = sum(batch * compressor.wire_bits((length,))
                    for batch, length in layout.block_sizes())
  elias_total = sum(jnp.sum(jax.vmap(compressor.elias_bits)(p).smaller.astype(jnp.float32))
                    for p in payloads)
  return wire_bits * elias_total / packed_bits
