"""1-bit Adam (Tang et al. 2021), as DeepSpeed's ``OnebitAdam`` runs it, for optax: its core."""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from qsgd_jax._src import axes as axes_lib
from qsgd_jax._src import axis_checks, base, stats, wire
from qsgd_jax._src.adam import common, shard_exchange


class ScaleByOneBitAdamState(NamedTuple):
  """State of :func:`scale_by_onebit_adam`.

  Attributes:
    count: ``int32[]``, updates taken (a skipped non-finite step does not count).
    mu: the first moment, like the parameters (``mu_dtype``) and laid out as
      they are; the same on every device of the averaged axes.
    nu: the second moment, like the parameters; the same on every device of
      the averaged axes, and no longer updated for the compressed leaves once
      the variance is frozen.
    worker_error: one ``float32[n, width]`` a group of compressed leaves,
      this device's worker error of the 1-bit exchange (``n`` devices on the
      compressed axis; ``width`` one chunk of every leaf of the group, see
      ``qsgd_jax/_src/adam/sign_exchange.py``); ``()`` when no leaf is
      compressed. Under ``jax.pmap`` or plain data parallel there is one
      group; on a mesh whose model is sharded over other axes, one a set of
      mesh axes that leaves are laid out over, each device's error that of
      its own shards (see ``qsgd_jax/_src/adam/shard_exchange.py``).
    server_error: one ``float32[width]`` a group, this device's server error
      (likewise).
    freeze_count: ``int32[]``, the count from which the variance is frozen:
      ``freeze_step``, or with ``"auto"`` the count it chose (``2**31 - 1``
      until then).
    variance_history: ``float32[window, leaves]`` with ``"auto"``: the last
      ``||v_i||_1`` of each compressed leaf, which the rule reads (``()``
      otherwise).
    stats: the last step's :class:`~qsgd_jax.CompressionStats`.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> n = jax.local_device_count()
    >>> tx = qsgd_jax.scale_by_onebit_adam("batch", freeze_step=100)
    >>> state = jax.pmap(tx.init, axis_name="batch")(jnp.zeros((n, 8192)))
    >>> int(state.count[0]), int(state.freeze_count[0]), len(state.worker_error)
    (0, 100, 1)
  """

  count: jax.Array
  mu: optax.Updates
  nu: optax.Updates
  worker_error: tuple[jax.Array, ...]
  server_error: tuple[jax.Array, ...]
  freeze_count: jax.Array
  variance_history: jax.Array | tuple[()]
  stats: stats.CompressionStats


def scale_by_onebit_adam(
    axis_name: axes_lib.AxisName,
    *,
    freeze_step: common.FreezeStep,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    bias_correction: bool = True,
    mu_dtype=None,
    min_compressed_size: int = common.DEFAULT_MIN_COMPRESSED_SIZE,
    compression_mask=None,
    axis_size: int | dict[str, int] | None = None,
    auto_freeze_window: int = 20,
    auto_freeze_tolerance: float = 0.025,
) -> optax.GradientTransformationExtraArgs:
  r"""Adam's scaling of each device's local gradients, averaged as DeepSpeed's 1-bit Adam does.

  The core of :func:`onebit_adam`: it takes each device's own gradients and
  returns the Adam direction :math:`\hat m / (\sqrt{\hat v} + \epsilon)`, the
  same on every device, doing the communication itself. Two stages, switched
  by ``jax.lax.cond`` on the step count (the same on every device, so one
  compiled step serves both):

  * **Warm-up**, the first ``freeze_step`` updates: Adam on the float32 mean
    gradient :math:`\bar g` (one ``jax.lax.pmean``):
    :math:`m \leftarrow \beta_1 m + (1 - \beta_1) \bar g`,
    :math:`v \leftarrow \beta_2 v + (1 - \beta_2) \bar g^2`.
  * **Compression**: the variance of the compressed leaves is frozen; each
    device folds its own gradient into the momentum,
    :math:`m_k = \beta_1 m + (1 - \beta_1) g_k`, and the devices average the
    :math:`m_k` by DeepSpeed's two-round 1-bit exchange with worker and server
    error feedback (one scale :math:`\|x\|_2 / \sqrt{d}` a tensor and one
    sign bit an element each way, about 32x fewer bytes than float32; see
    ``sign_exchange.py``): :math:`m \leftarrow \mathrm{exchange}(m_k)`.

  Compression error dominates a variance estimated from compressed gradients,
  which is why 1-bit SGD chained before Adam fails; a variance frozen after a
  float32 warm-up is a fixed preconditioner, and the momentum, which is linear
  in the gradients, takes the error feedback well (Tang et al. 2021).

  After the freeze, a coordinate of a compressed leaf whose frozen variance
  is exactly zero (its mean gradient was zero through the whole warm-up: an
  embedding row whose token never came, padding, a dead unit) keeps a zero
  momentum, and so a zero Adam direction, as AdamW gives it: the 1-bit
  exchange cannot send a zero, and :math:`m / \epsilon` would move it by
  about :math:`10^8` times its tensor's scale a step. DeepSpeed leaves that
  to a mask the user gives (``exp_avg_mask``); here it is read from the
  variance. Such a coordinate stays where the warm-up left it, even if its
  gradient appears later: give it a warm-up long enough to see it, or keep
  its leaf on the float32 path with ``compression_mask``.

  Leaves under ``min_compressed_size`` elements, and those
  ``compression_mask`` excludes, are averaged in float32 throughout and keep
  plain Adam, variance included (DeepSpeed's ``non_freeze`` parameter
  groups). Leaves that are not float are not optimized: their update is zero.

  With ``bias_correction=False`` the numbers are DeepSpeed's, which never
  bias-corrects; with ``True`` (the default) the warm-up is exactly
  ``optax.scale_by_adam`` on the mean gradient, and after the freeze
  :math:`\hat m = m / (1 - \beta_1^t)` and
  :math:`\hat v = v / (1 - \beta_2^{t_f})`, :math:`t_f` the freeze count.
  DeepSpeed's first ``step`` only sets up its buffers, discarding that
  gradient, and so warms up ``freeze_step - 1`` updates; here the first
  update learns, and ``freeze_step`` updates warm up.

  ``freeze_step="auto"`` freezes the variance once it has stopped moving:
  after the first update at which, over the last ``auto_freeze_window``
  updates, each compressed leaf's share of the variance,
  :math:`\|v_i\|_1 / \sum_j \|v_j\|_1`, has moved by at most
  ``auto_freeze_tolerance`` in total variation between the older and the
  newer half of the window (shares: unmoved by gradient clipping or the
  learning rate's schedule, which hold the variance's norm still early on;
  with one compressed leaf, the relative drift of its norm). Every device
  holds the same variance, so every device decides alike;
  :attr:`ScaleByOneBitAdamState.freeze_count` reports the count chosen.

  A NaN or inf in any device's gradient makes every device's updates NaN
  and leaves the state as it was; :func:`onebit_adam` wraps the rest of its
  chain in ``optax.apply_if_finite``, which then skips the step on every
  device together. Do not wrap this transform in ``optax.apply_if_finite``:
  that tests each device's own gradient before the exchange, devices that
  disagree take different branches around its collectives, and they hang.

  Under ``jax.shard_map`` the error buffers differ per device and the rest is
  replicated: :func:`~qsgd_jax.state_partition_specs` gives the layout, and
  :func:`~qsgd_jax.data_parallel` uses it.

  On a mesh whose model is sharded over other axes (``fsdp``, ``tensor``)
  inside each data group, run it as :func:`~qsgd_jax.compressed_allreduce`
  runs there (through :func:`~qsgd_jax.data_parallel`, or under a
  ``jax.shard_map`` manual over ``axis_name`` alone with the other axes
  explicit): each device exchanges its own shards. The compressed leaves
  laid out over the same mesh axes form a group, whose exchange runs in a
  ``jax.shard_map`` manual over those axes too, so that DeepSpeed's chunks
  are cut from a device's shards and nothing is gathered over them; each
  group keeps its own errors (hence a tuple of them), each device's own,
  laid out along ``axis_name`` and the group's axes. The moments are laid
  out as the parameters. ``min_compressed_size`` applies to whole leaves.
  Whether a step is finite, and the ``"auto"`` freeze, are decided from
  values reduced over every shard (a scalar all-reduce over the model axes),
  so every device of every shard takes the same branch.

  Args:
    axis_name: the mapped axis to average over, or ``(outer, inner, ...)``:
      the inner axes (fast links) are averaged in float32 first, and only the
      outer axis is crossed by the 1-bit exchange.
    freeze_step: float32 warm-up updates before the variance is frozen, or
      ``"auto"``. DeepSpeed's tutorial suggests 15-25% of training.
    b1, b2, eps: Adam's, as in ``optax.scale_by_adam``.
    bias_correction: whether to correct the moments' initialization bias.
    mu_dtype: the first moment's dtype (``None``: the parameters').
    min_compressed_size: float leaves with fewer elements take the float32
      path; ``0`` compresses every float leaf, as DeepSpeed does.
    compression_mask: a pytree of bools like the parameters (or a callable
      returning one): ``False`` leaves take the float32 path.
    axis_size: the outer axis's size, for an ``init`` outside the mapped
      function (the error buffers' shapes depend on it).
    auto_freeze_window, auto_freeze_tolerance: the ``"auto"`` rule's window
      (updates, at least 2) and the drift of the shares it accepts.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, qsgd_jax
    >>> n = jax.local_device_count()
    >>> tx = optax.chain(qsgd_jax.scale_by_onebit_adam("batch", freeze_step=100),
    ...                  optax.scale_by_learning_rate(1e-3))
    >>> state = jax.pmap(tx.init, axis_name="batch")(jnp.zeros((n, 8192)))
    >>> updates, state = jax.pmap(tx.update, axis_name="batch")(jnp.ones((n, 8192)), state)
    >>> bool(jnp.allclose(updates, -1e-3))
    True

  References:
    Tang et al., `1-bit Adam: Communication Efficient Large-Scale Training
    with Adam's Convergence Speed <https://arxiv.org/abs/2102.02888>`_, ICML
    2021.
  """
  owner = "qsgd_jax.scale_by_onebit_adam"
  common.check_options(owner, b1=b1, b2=b2, eps=eps, min_compressed_size=min_compressed_size)
  common.check_freeze_step(owner, "freeze_step", freeze_step)
  common.check_axis_size(owner, axis_size)
  axes = axes_lib.parse(axis_name, owner)
  auto = common.auto_freeze(owner, freeze_step, auto_freeze_window, auto_freeze_tolerance)

  def init_fn(params):
    axis_checks.check_mesh_axes(params, axes, owner)
    leaves = common.leaves_of(params, min_compressed_size, compression_mask)
    _, worker_error, server_error = shard_exchange.initial_errors(params, leaves, axes,
                                                                  axis_size, owner)
    return ScaleByOneBitAdamState(
        count=jnp.zeros((), jnp.int32),
        mu=optax.tree.zeros_like(params, dtype=mu_dtype),
        nu=common.variance_zeros(params),
        worker_error=worker_error,
        server_error=server_error,
        freeze_count=common.initial_freeze_count(freeze_step),
        variance_history=auto.initial(len(leaves.compressed)) if auto else (),
        stats=stats.empty(),
    )

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    axes_lib.check_not_in_apply_if_finite(
        owner, axis_name, "qsgd_jax.onebit_adam already skips a non-finite step on every "
        "device together; around this core, put optax.apply_if_finite after it in the chain, "
        "as onebit_adam does.")
    if not isinstance(state, ScaleByOneBitAdamState):
      raise TypeError(
          f"{owner}: the state is a {type(state).__name__}, not a ScaleByOneBitAdamState: "
          "pass the state this optimizer's init returned.")
    common.check_tree(owner, updates, params, state.mu)
    axis_checks.check_mesh_axes(updates, axes, owner)
    leaves = common.leaves_of(updates, min_compressed_size, compression_mask)
    sizes = axes.sizes(owner)
    axes_lib.check_varying(updates, axes, owner)
    grads, treedef = jax.tree.flatten(updates)
    exchange_plan = shard_exchange.make_plan([grads[i] for i in leaves.compressed], sizes,
                                             owner)
    shard_exchange.check_error_shapes(owner, state.worker_error, exchange_plan)
    mu, nu = jax.tree.leaves(state.mu), jax.tree.leaves(state.nu)
    count = optax.safe_increment(state.count)
    frozen = state.count >= state.freeze_count

    def moments(indices, means, mu, nu):
      for i, mean in zip(indices, means, strict=True):
        mu[i] = optax.tree.update_moment(mean, mu[i], b1, 1)
        nu[i] = optax.tree.update_moment_per_elem_norm(mean, nu[i], b2, 2)
      return mu, nu

    def warm_up(_):
      indices = tuple(sorted(leaves.compressed + leaves.float32))
      means = common.pmean_float32([grads[i] for i in indices], axes)
      new_mu, new_nu = moments(indices, means, list(mu), list(nu))
      return new_mu, new_nu, state.worker_error, state.server_error, base.all_finite(means)

    def compressed(_):
      local_mu = [optax.tree.update_moment(grads[i].astype(jnp.float32), mu[i], b1, 1)
                  for i in leaves.compressed]
      out = shard_exchange.exchange(exchange_plan, local_mu, state.worker_error,
                                    state.server_error, axes, sizes)
      new_mu = list(mu)
      for i, vector in zip(leaves.compressed, out.vectors, strict=True):
        new_mu[i] = common.unseen_masked(vector, nu[i])
      means = common.pmean_float32([grads[i] for i in leaves.float32], axes)
      new_mu, new_nu = moments(leaves.float32, means, new_mu, list(nu))
      return new_mu, new_nu, out.worker_error, out.server_error, out.all_finite & base.all_finite(
          means)

    def stored(new_mu, new_nu, worker_error, server_error, finite):
      # A non-finite step keeps the moments and errors as they were, on every device
      # together; chosen here, where XLA fuses the choice into what computes them.
      new_mu = [m.astype(old.dtype) for m, old in zip(new_mu, mu, strict=True)]
      new_nu = [v.astype(old.dtype) for v, old in zip(new_nu, nu, strict=True)]
      kept = common.tree_select(finite, (new_mu, new_nu, worker_error, server_error),
                                (mu, nu, state.worker_error, state.server_error))
      return *kept, finite

    new_mu, new_nu, worker_error, server_error, finite = jax.lax.cond(
        frozen, lambda _: stored(*compressed(_)), lambda _: stored(*warm_up(_)), None)
    out = _directions(grads, new_mu, new_nu, leaves, count, state.freeze_count, finite, b1=b1,
                      b2=b2, eps=eps, bias_correction=bias_correction)
    freeze_count, history = state.freeze_count, state.variance_history
    if auto:
      history, freeze_count = auto.update(
          history, freeze_count, variances=[new_nu[i] for i in leaves.compressed],
          updates_seen=count, recorded=jnp.logical_not(frozen) & finite, count=count, b2=b2,
          bias_correction=bias_correction)

    num_float = leaves.elements("compressed") + leaves.elements("float32")
    step_stats = _stats(frozen, leaves, exchange_plan, num_float, sizes)
    # A non-finite step leaves the state as it was (the moments and errors already
    # chosen above), on every device together.
    new_state = ScaleByOneBitAdamState(
        count=jnp.where(finite, count, state.count),
        mu=jax.tree.unflatten(treedef, new_mu),
        nu=jax.tree.unflatten(treedef, new_nu),
        worker_error=worker_error,
        server_error=server_error,
        freeze_count=jnp.where(finite, freeze_count, state.freeze_count),
        variance_history=common.tree_select(finite, history, state.variance_history),
        stats=step_stats,
    )
    return jax.tree.unflatten(treedef, out), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _directions(grads, mu, nu, leaves: common.Leaves, count, freeze_count, finite, *, b1, b2,
                eps, bias_correction) -> list[jax.Array]:
  """Each leaf's Adam direction :math:`\\hat m / (\\sqrt{\\hat v} + \\epsilon)`, NaN
  everywhere on a non-finite step, zero for a leaf that is not float. A compressed leaf's
  variance is corrected for the updates up to its freeze."""
  out = []
  for i, g in enumerate(grads):
    if leaves.kinds[i] == "other":
      out.append(common.zero_update(g))
      continue
    frozen_variance = leaves.kinds[i] == "compressed"
    variance_count = jnp.minimum(count, freeze_count) if frozen_variance else count
    m_hat, v_hat = mu[i], nu[i]
    if bias_correction:
      m_hat = optax.tree.bias_correction(m_hat, b1, count)
      v_hat = optax.tree.bias_correction(v_hat, b2, variance_count)
    direction = m_hat / (jnp.sqrt(v_hat) + eps)
    out.append(jnp.where(finite, direction, jnp.nan).astype(jnp.result_type(g)))
  return out


def _stats(frozen: jax.Array, leaves: common.Leaves, exchange_plan: shard_exchange.ExchangePlan,
           num_float: int, sizes: tuple[int, ...]) -> stats.CompressionStats:
  """What one device sent this step (of its own shards, on a mesh whose model is sharded): a
  float32 all-reduce while warming up, the 1-bit exchange after."""
  n = sizes[0] if sizes else 1
  m = math.prod(sizes[1:])
  if not sizes:
    return stats.make(0.0, 0.0, jnp.nan)
  float32_bits = wire.float32_allreduce_bits(num_float, n * m)
  outer_float32_bits = wire.float32_allreduce_bits(num_float / m, n)
  small = leaves.elements("float32")
  inner_bits = wire.float32_allreduce_bits(leaves.elements("compressed"), m)
  compressed_bits = (exchange_plan.wire_bits() + inner_bits
                     + wire.float32_allreduce_bits(small, n * m))
  outer_compressed_bits = exchange_plan.wire_bits() + wire.float32_allreduce_bits(small / m, n)
  return stats.make(jnp.where(frozen, compressed_bits, float32_bits), float32_bits, jnp.nan,
                    jnp.where(frozen, outer_compressed_bits, outer_float32_bits),
                    outer_float32_bits)
