"""PowerSGD (Vogels et al. 2019) as an optax transform, faithful to PyTorch's ``powerSGD_hook``."""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from qsgd_jax._src import axes, axis_checks, base, stats, wire
from qsgd_jax._src.powersgd import checks, low_rank, shard_step

_OWNER = "powersgd"


class PowerSGDState(NamedTuple):
  """State of :func:`powersgd`; one array a group of compressed leaves of one matrix shape
  (on a mesh whose model is sharded, of one matrix shape and one layout over the mesh, the
  arrays of a group's devices end to end along the first dimension).

  Attributes:
    key: typed PRNG key ``key<impl>[]``, the same on every device, split
      every step; without warm start a step draws its Q from its half.
    count: ``int32[]``, steps taken (the first ``start_iter`` are exact means).
    error: per device, one ``float32[count, n, m]`` a group: the gradient
      plus the previous error, less the step's output (empty tuple without
      error feedback; zeros until the first compressed step).
    q_memory: one ``float32[count, m, r]`` a group, the same on every device
      of the averaged axes:
      the last compressed step's Q (all-reduced, over the number of
      devices), where the next step starts with warm start. Until the first
      compressed step, with warm start, the standard normal draw it starts
      from; without, zeros.
    p_memory: one ``float32[count, n, r]`` a group, the same on every device
      of the averaged axes:
      the last compressed step's orthonormal P, so that ``p_memory @
      q_memory.T`` is what the step returned (zeros before).
    stats: the last step's :class:`~qsgd_jax.CompressionStats`.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> n = jax.local_device_count()
    >>> tx = qsgd_jax.powersgd("batch", rank=2)
    >>> state = jax.pmap(tx.init, axis_name="batch")(jnp.zeros((n, 256, 128)))
    >>> [q.shape[1:] for q in state.q_memory]  # Kernels of one shape, their Q: (in, rank).
    [(1, 128, 2)]
  """

  key: jax.Array
  count: jax.Array
  error: tuple[jax.Array, ...]
  q_memory: tuple[jax.Array, ...]
  p_memory: tuple[jax.Array, ...]
  stats: stats.CompressionStats


def powersgd(
    axis_name: axes.AxisName,
    *,
    rank: int = 1,
    start_iter: int = 1000,
    min_compression_rate: float = 2.0,
    use_error_feedback: bool = True,
    warm_start: bool = True,
    orthogonalization_epsilon: float = 0.0,
    seed: jax.Array | int = 0,
    matrix_view: low_rank.MatrixView | None = None,
    total_steps: int | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Averages updates over ``axis_name`` with PowerSGD's rank-``r`` factorization.

  PyTorch's ``powerSGD_hook`` (``PowerSGDState`` with its defaults) as the
  first transform of an optax chain, in place of ``jax.lax.pmean(grads)``:

  * the first ``start_iter`` steps return the exact float32 mean and leave
    the state alone;
  * then each compressed leaf's matrix ``M`` (its gradient plus its error) is
    sent as two factors: ``P = M Q`` is summed over the devices and
    orthonormalized (Gram-Schmidt for ``rank <= 2``; above, QR on the CPU and
    Gram-Schmidt twice elsewhere, both to float32 precision), ``Q = M^T P``
    is averaged, and the step returns ``P Q^T`` - the orthogonal projection
    of the devices' mean matrix onto the span of ``P``, of rank at most
    ``r``. A device sends :math:`(n + m) r` numbers for an :math:`n \times m`
    matrix instead of :math:`n m`;
  * with error feedback, each device keeps ``M - P Q^T`` and adds it to its
    next gradient; with warm start, the next step starts from this ``Q``
    (one step of subspace iteration a training step), else from a new
    standard normal draw.

  **The first steps are not compressed.** ``start_iter`` defaults to
  PyTorch's 1000: a run of fewer steps sends float32 throughout, and
  :func:`~qsgd_jax.compression_stats` reads ``compression_ratio == 1`` on
  every step until PowerSGD starts. Declare the run's length with
  ``total_steps`` to have a ``start_iter`` that leaves nothing to compress
  refused; PyTorch's documentation suggests starting with ``start_iter`` at
  10% of the run's steps.

  A leaf is compressed when it is floating, has two or more dimensions, and
  ``(n + m) r * min_compression_rate < n m`` (strictly; ``r = min(n, m,
  rank)``), its ``n x m`` matrix being what ``matrix_view`` says: by default
  (:func:`~qsgd_jax.attention_matrix_view`) its layer's input-to-output
  map, a Flax kernel's output features being its columns:
  ``(prod(shape[:-1]), shape[-1])``, except Flax attention's query, key and
  value kernels ``(in, heads, head_dim)``, which are ``(in, heads *
  head_dim)`` (their ``out`` kernel ``(heads, head_dim, out)`` is ``(heads *
  head_dim, out)``). PyTorch views a weight of shape ``(out, in, kh, kw)`` as
  ``(out, in * kh * kw)``, the transpose of the same layer's matrix here
  (its rows in another order for a convolution). The compression test, the
  bytes and the limit of warm-started iterations (the best rank-``r``
  approximation) are the same either way; one step's numbers are not: this
  is PyTorch's hook applied to the transposed weight.
  Every other leaf is averaged exactly, in one all-reduce; integer leaves to
  floats, as ``jax.lax.pmean`` does, and ``float0`` leaves pass through.

  The step sends three all-reduces, as the hook does: the exact leaves, every
  P and every Q (XLA may combine the first two, which are independent);
  leaves of one matrix shape are batched into one matmul (the hook's
  ``batch_tensors_with_same_shape``; the numbers are the same without).
  bfloat16 and float16 leaves are computed in float32, their error too, and
  cast back; the error holds what the cast dropped as well.

  Where this differs from PyTorch:

  * Q's draws come from ``seed``, a JAX key, not from PyTorch's generator:
    the same distribution, other numbers.
  * A column of zero norm with ``orthogonalization_epsilon == 0`` (an
    all-zero gradient matrix) gives zeros, not PyTorch's NaN.
  * PyTorch also keeps an error for the leaves it does not compress, each
    device's deviation from the mean; those cancel in the next mean, so none
    is kept here (the means agree to float rounding).
  * ``start_iter <= 1`` with error feedback or warm start is refused, as
    PyTorch refuses it: there DDP rebuilds its gradient buckets after the
    first step, which would invalidate memories made before. Here nothing is
    rebuilt, but a configuration that PyTorch would not run is not one to
    compare with.
  * A NaN or inf in any device's updates makes the whole output NaN on every
    device and keeps ``error``, ``q_memory`` and ``p_memory`` as they were,
    so that ``optax.apply_if_finite`` after this transform skips the step
    on every device together. The test reads the all-reduced P factors and
    exact means, which hold a NaN or inf wherever any device's updates do:
    no extra collective (but one scalar all-reduce a group on a mesh whose
    model is sharded, below). PyTorch has no such test.

  With ``axis_name=(outer, inner, ...)``, P and Q are summed over every axis
  at once: as P and Q are linear in the gradients, that gives the factors of
  the mean over every device, the same as averaging the inner axes in
  float32 first and compressing only over ``outer`` (with each node's error
  the sum of its devices'), but without sending the whole gradient in
  float32 over the inner links. :attr:`CompressionStats.outer_wire_bits`
  counts ``1 / inner_size`` of these all-reduces.

  Under ``jax.shard_map``, lay the state out with
  :func:`~qsgd_jax.state_partition_specs` (``error`` along the axis, the rest
  replicated) and differentiate with respect to
  :func:`~qsgd_jax.as_varying` parameters, as for
  :func:`~qsgd_jax.compressed_allreduce`; :func:`~qsgd_jax.data_parallel`
  does both. Under ``jax.pmap`` the state gets pmap's leading axis.

  On a mesh whose model is sharded over other axes (``fsdp``, ``tensor``)
  inside each data group, run it as :func:`~qsgd_jax.compressed_allreduce`
  runs there (through :func:`~qsgd_jax.data_parallel`, or under a
  ``jax.shard_map`` manual over ``axis_name`` alone with the other axes
  explicit). The leaves laid out over the same mesh axes form a group, run
  on each device's own shards in a ``jax.shard_map`` manual over those axes
  too, and **each device's block of a matrix is compressed as a matrix of
  its own**: the block (the shard, seen through ``matrix_view``, which is
  given the shard's shape) has its own ``P``, ``Q`` and error, and the
  compression test is the block's. Factoring the whole matrix would sum
  ``P = M Q`` over the blocks of a row, a collective over the model axes
  every step; the blocks need none, and a device sends :math:`(n / a + m /
  b) r` numbers for its :math:`n / a \times m / b` block. The blocks'
  approximations have rank up to :math:`a b r` together. The memories of a
  group hold the devices' of its axes end to end along their first
  dimension: ``error`` along ``axis_name`` and the group's axes, ``Q`` and
  ``P`` along the group's axes (the same on every data group). Each block
  draws its own ``Q`` (the key folded with its index over the group's axes);
  one scalar all-reduce a group, over its axes, tells every shard of a
  non-finite value, so that every device skips together.

  PowerSGD is a biased compressor: keep ``use_error_feedback``. Vogels et al.
  train with SGD and momentum; with Adam, whose second moment is computed
  from the compressed gradients, it is known to need care: compare with
  float32 on the model before relying on it.

  Args:
    axis_name: the mapped axis to average over, a tuple of axes (outer
      first), or ``None`` for one device alone (the factorization applied
      locally, nothing sent).
    rank: ``r``, the rank of the factors (PyTorch's
      ``matrix_approximation_rank``).
    start_iter: steps of exact float32 averaging before PowerSGD starts
      (``start_powerSGD_iter``).
    min_compression_rate: a leaf is compressed only if its matrix shrinks by
      more than this factor.
    use_error_feedback: keep each device's error and add it back.
    warm_start: start each step's power iteration from the last step's Q.
    orthogonalization_epsilon: added to each column's norm in Gram-Schmidt,
      so that an all-zero matrix gives zeros (see above for 0).
    seed: PRNG key or int seed for Q's draws, the same on every device.
    matrix_view: ``(path, shape) -> (rows, columns)``, the matrix of each
      floating leaf of two or more dimensions: ``path`` is the leaf's path,
      one ``str`` an entry (dict keys, attribute names, sequence indices),
      ``rows`` the product of the leading dimensions that are the layer's
      inputs and ``columns`` that of the rest; ``None`` for
      :func:`~qsgd_jax.attention_matrix_view`. For a ``DenseGeneral`` of
      other names, say which of its axes are inputs; for the view of
      releases before this option, ``lambda path, shape:
      (math.prod(shape[:-1]), shape[-1])``. On a mesh whose model is
      sharded, ``shape`` is a device's shard's.
    total_steps: the steps the run will take, if known: a ``start_iter``
      at or past it, under which PowerSGD would never compress, is refused.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` ignores
    ``params`` and extra arguments.

  Raises:
    ValueError: a bad option, naming it; ``start_iter >= total_steps``; at
      trace time, an update tree whose compressed leaves differ from those
      the state was made for, a ``matrix_view`` that does not give a
      matrix view of a leaf (naming it), an ``axis_name`` the mesh lacks, or
      a leaf laid out over ``axis_name`` (naming it: FSDP's layout, see
      :func:`~qsgd_jax.fsdp_gather`).
    NameError: at trace time, ``axis_name`` is not bound.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, qsgd_jax
    >>> n = jax.local_device_count()
    >>> tx = optax.chain(qsgd_jax.powersgd("batch", start_iter=2), optax.sgd(0.1))
    >>> state = jax.pmap(tx.init, axis_name="batch")(jnp.zeros((n, 256, 64)))
    >>> step = jax.pmap(tx.update, axis_name="batch")
    >>> grads = jnp.ones((n, 256, 64))  # Of rank one: sent exactly, in 256 + 64 numbers.
    >>> for _ in range(3):
    ...   updates, state = jax.block_until_ready(step(grads, state))
    >>> bool(jnp.allclose(updates, -0.1))
    True
    >>> float(qsgd_jax.compression_stats(state).compression_ratio[0]) > 50
    True

  References:
    Vogels, Karimireddy and Jaggi, `PowerSGD: Practical Low-Rank Gradient
    Compression for Distributed Optimization
    <https://arxiv.org/abs/1905.13727>`_, NeurIPS 2019; PyTorch's
    ``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``.
  """
  base.check_static_options(
      f"qsgd_jax.{_OWNER}", rank=rank, start_iter=start_iter,
      min_compression_rate=min_compression_rate,
      orthogonalization_epsilon=orthogonalization_epsilon)
  checks.check_options(rank, start_iter, min_compression_rate, use_error_feedback, warm_start,
                 orthogonalization_epsilon)
  checks.check_run_length(start_iter, total_steps)
  if matrix_view is not None and not callable(matrix_view):
    raise ValueError(f"{_OWNER}: matrix_view must be a function (path, shape) -> (rows, "
                     f"columns) or None, got {matrix_view!r}.")
  view = low_rank.attention_matrix_view if matrix_view is None else matrix_view
  reduction_axes = axes.parse(axis_name, _OWNER)
  first_key = base.as_key(seed)

  def make_plans(tree) -> tuple[shard_step.ShardPlan, ...]:
    return shard_step.make_shard_plans(tree, rank, min_compression_rate, view,
                                       f"qsgd_jax.{_OWNER}")

  def init_fn(params):
    axis_checks.check_mesh_axes(params, reduction_axes, f"qsgd_jax.{_OWNER}")
    plans = make_plans(params)
    key, draw_key = jax.random.split(first_key)
    error, q_memory, p_memory = shard_step.initial_memories(
        plans, jax.tree.leaves(params), draw_key, warm_start=warm_start,
        use_error_feedback=use_error_feedback)
    return PowerSGDState(key=key, count=jnp.zeros((), jnp.int32), error=error,
                         q_memory=q_memory, p_memory=p_memory, stats=stats.empty())

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    axes.check_not_in_apply_if_finite(
        "qsgd_jax.powersgd", axis_name, "Put it after this transform in the chain instead: a "
        "non-finite value on any device makes every device's output non-finite, so all skip "
        "together.")
    axis_checks.check_mesh_axes(updates, reduction_axes, f"qsgd_jax.{_OWNER}")
    plans = make_plans(updates)
    checks.check_state(plans, state, use_error_feedback)
    sizes = reduction_axes.sizes(_OWNER)
    axes.check_varying(updates, reduction_axes, _OWNER)
    world, inner = math.prod(sizes), math.prod(sizes[1:])
    name = reduction_axes.name
    leaves, treedef = jax.tree.flatten(updates)
    next_key, step_key = jax.random.split(state.key)

    def pmean(values):
      return jax.lax.pmean(values, name) if values and sizes else values

    # What one device sends of its own shards.
    num_elements = sum(shard_plan.plan.num_elements for shard_plan in plans)
    float32_bits = wire.float32_allreduce_bits(num_elements, world)
    outer_float32_bits = wire.float32_allreduce_bits(num_elements / inner, world // inner)
    sent_bits = sum(wire.float32_allreduce_bits(
        sum(getattr(shard_plan.plan, elements) for shard_plan in plans), world)
        for elements in ("exact_elements", "p_elements", "q_elements"))
    options = shard_step.StepOptions(name, world, warm_start, use_error_feedback,
                                     orthogonalization_epsilon)

    def exact_step(_):
      averaged = list(leaves)
      indices = [i for i, x in enumerate(leaves) if jnp.result_type(x) != jax.dtypes.float0]
      for i, mean in zip(indices, pmean(tuple(leaves[i] for i in indices)), strict=True):
        averaged[i] = mean
      return (averaged, axes.as_varying(state.error, name), state.q_memory, state.p_memory,
              stats.make(float32_bits, float32_bits, jnp.nan, outer_float32_bits,
                         outer_float32_bits))

    def compressed_step(_):
      averaged, (error, q, p), finite = shard_step.compressed(
          plans, leaves, (state.error, state.q_memory), step_key, options)
      averaged = [jnp.where(finite, x, jnp.nan).astype(x.dtype)
                  if jnp.issubdtype(x.dtype, jnp.floating) else x for x in averaged]

      def keep(new, old):
        return tuple(jnp.where(finite, n, o) for n, o in zip(new, old, strict=True))

      return (averaged, axes.as_varying(keep(error, state.error), name),
              keep(q, state.q_memory), keep(p, state.p_memory),
              stats.make(sent_bits, float32_bits, jnp.nan, sent_bits / inner,
                         outer_float32_bits))

    if start_iter:
      averaged, error, q_memory, p_memory, step_stats = jax.lax.cond(
          state.count < start_iter, exact_step, compressed_step, None)
    else:
      averaged, error, q_memory, p_memory, step_stats = compressed_step(None)
    new_state = PowerSGDState(
        key=next_key, count=optax.safe_increment(state.count), error=error,
        q_memory=q_memory, p_memory=p_memory, stats=step_stats)
    return jax.tree.unflatten(treedef, averaged), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
