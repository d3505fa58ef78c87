"""0/1 Adam (Lu et al. 2022), as DeepSpeed's ``ZeroOneAdam`` runs it, for optax."""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from qsgd_jax._src import axes as axes_lib
from qsgd_jax._src import axis_checks, stats, wire
from qsgd_jax._src.adam import common, shard_exchange, zero_one_step


class ZeroOneAdamState(NamedTuple):
  """State of :func:`zero_one_adam`.

  Attributes:
    count: ``int32[]``, updates taken (a skipped non-finite step does not count).
    mu: the first moment, like the parameters (``mu_dtype``) and laid out as
      they are: per device when local steps are possible
      (``local_step_clipper > 1``), else the same on every device.
    nu: the second moment, like the parameters, the same on every device.
    accumulator: per device, ``float32`` like each compressed leaf and laid
      out as it is: the sum of this device's updates since the last
      synchronization (DeepSpeed's ``momentum_accumulator``); an empty tuple
      without local steps.
    worker_error: one ``float32[n, width]`` a group of compressed leaves,
      this device's worker error of the 1-bit exchange (``()`` when no leaf
      is compressed; the groups as in
      :class:`~qsgd_jax.ScaleByOneBitAdamState`).
    server_error: one ``float32[width]`` a group, this device's server error
      (likewise).
    variance_interval: ``int32[]``, the variance is updated at counts that
      are multiples of it (DeepSpeed's ``var_interval``).
    variance_counter: ``int32[]``, variance updates at this interval.
    variance_updates: ``int32[]``, variance updates so far (its bias
      correction's exponent).
    local_interval: ``int32[]``, once frozen, the devices synchronize at
      counts that are multiples of it (``local_step_interval``).
    local_counter: ``int32[]``, frozen steps at this interval.
    learning_rate_sum: ``float32[]``, the learning rates since the last
      synchronization (``lrs``).
    freeze_count: ``int32[]``, the variance is frozen in the updates taken when
      ``count`` is at least this (``var_freeze_step + 1``; with ``"auto"``,
      the count chosen, ``2**31 - 1`` until then).
    variance_history: ``float32[window, leaves]`` with ``"auto"``, else ``()``.
    stats: the last step's :class:`~qsgd_jax.CompressionStats`.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> n = jax.local_device_count()
    >>> tx = qsgd_jax.zero_one_adam(1e-3, "batch", var_freeze_step=100)
    >>> state = jax.pmap(tx.init, axis_name="batch")(jnp.zeros((n, 8192)))
    >>> int(state.variance_interval[0]), int(state.local_interval[0])
    (1, 1)
  """

  count: jax.Array
  mu: optax.Updates
  nu: optax.Updates
  accumulator: tuple[jax.Array, ...]
  worker_error: tuple[jax.Array, ...]
  server_error: tuple[jax.Array, ...]
  variance_interval: jax.Array
  variance_counter: jax.Array
  variance_updates: jax.Array
  local_interval: jax.Array
  local_counter: jax.Array
  learning_rate_sum: jax.Array
  freeze_count: jax.Array
  variance_history: jax.Array | tuple[()]
  stats: stats.CompressionStats


def zero_one_adam(
    learning_rate: optax.ScalarOrSchedule,
    axis_name: axes_lib.AxisName,
    *,
    var_freeze_step: common.FreezeStep,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    bias_correction: bool = True,
    mask=None,
    mu_dtype=None,
    var_update_scaler: int = 16,
    local_step_scaler: int = 32678,
    local_step_clipper: int = 16,
    min_compressed_size: int = common.DEFAULT_MIN_COMPRESSED_SIZE,
    compression_mask=None,
    axis_size: int | dict[str, int] | None = None,
    auto_freeze_window: int = 8,
    auto_freeze_tolerance: float = 0.025,
) -> optax.GradientTransformationExtraArgs:
  r"""0/1 Adam: AdamW with 1-bit averages, a variance updated ever more rarely, then local steps.

  DeepSpeed's ``ZeroOneAdam`` (``deepspeed/runtime/fp16/onebit/zoadam.py``),
  as that file runs it. Its ``update`` takes each device's **local**
  gradients, inside ``jax.pmap`` or ``jax.shard_map`` over ``axis_name``, and
  returns the parameters' whole update, learning rate and weight decay
  included (the local steps below accumulate learning-rate-scaled updates,
  so neither can be chained after it). At the ``t``-th update
  (:math:`\eta_t` the learning rate):

  * Until the variance freezes: at counts ``t`` that are multiples of the
    variance interval (``1`` at first), the float32 mean gradient
    :math:`\bar g` updates both moments; at the others the devices' gradients
    travel through DeepSpeed's 1-bit exchange (``sign_exchange.py``) and only
    the momentum takes the 1-bit average. After ``var_update_scaler``
    variance updates at an interval, the interval doubles. The update is
    :math:`-\eta_t (\hat m / (\sqrt{\hat v} + \epsilon) + \lambda p)`.
  * After the first ``var_freeze_step + 1`` updates (DeepSpeed freezes after
    the step whose count exceeds ``var_freeze_step``, its first call only
    counting, and zeroes the exchange's errors then) the variance is fixed
    and each device steps on its own momentum of its own gradients, summing
    its updates in an accumulator ``a``; at counts that are multiples of the
    local interval (``1`` at first) the devices synchronize: each undoes its
    local steps, the 1-bit exchange averages :math:`a (\sqrt{\hat v} +
    \epsilon)`, giving :math:`u`, the momentum becomes :math:`-u / \sum
    \eta` and the parameters move by :math:`u / (\sqrt{\hat v} + \epsilon)`
    from the last synchronized point. After ``local_step_scaler`` frozen
    steps at an interval it doubles, up to ``local_step_clipper``.

  Between synchronizations the devices' parameters and momenta differ: with
  ``local_step_clipper > 1`` hold one model per device (``jax.pmap``, or
  ``jax.shard_map`` with parameters laid out along ``axis_name``) and the
  state's ``mu`` is per device. With ``local_step_clipper=1`` every frozen
  step synchronizes, and parameters and momenta stay replicated:
  :func:`~qsgd_jax.data_parallel` then takes it as it is. With DeepSpeed's
  defaults the first local step comes after ``local_step_scaler`` (32,678)
  frozen steps.

  On a mesh whose model is sharded over other axes inside each data group,
  each device exchanges its own shards, as :func:`scale_by_onebit_adam`
  does there: the errors are one array a group of compressed leaves laid
  out over the same mesh axes, the moments and accumulator are laid out as
  the parameters, and the variance's refreshes (a step count) and its
  ``"auto"`` freeze (read from the whole variance) are the same on every
  device of every shard.

  With ``bias_correction=False`` the numbers are DeepSpeed's, which never
  bias-corrects; with ``True`` the moments are read as
  :math:`\hat m = m / (1 - \beta_1^t)` and
  :math:`\hat v = v / (1 - \beta_2^k)`, ``k`` the variance updates so far, and
  the synchronized momentum is stored as :math:`-u (1 - \beta_1^t) / \sum \eta`.
  DeepSpeed's first ``step`` only sets up its buffers and counts a step;
  here the first update learns. Leaves under ``min_compressed_size``
  elements or excluded by ``compression_mask`` are averaged in float32 every
  step and follow plain Adam; leaves that are not float are left unchanged.

  ``var_freeze_step="auto"`` freezes the variance once it has stopped
  moving, by the rule of :func:`scale_by_onebit_adam` read at the variance
  updates (its window counts variance updates); ``freeze_count`` in the
  state reports the count chosen.

  A NaN or inf in any device's gradient skips the step on every device
  together: the updates are zero and the state is kept (every step tells all
  devices, at no extra collective where float32 leaves are averaged anyway).

  Args:
    learning_rate: a float or an optax schedule (of the count).
    axis_name: the mapped axis (or ``(outer, inner, ...)``: inner axes averaged
      in float32 first, only the outer one crossed by 1-bit exchanges).
    var_freeze_step: the variance may change in the first
      ``var_freeze_step + 1`` updates and is frozen from then on (DeepSpeed's
      setting of the same name, whose first call only counts); or ``"auto"``.
    b1, b2, eps: Adam's.
    weight_decay, mask: decoupled weight decay and its mask, as in
      ``optax.adamw``; added to the Adam ratio, as DeepSpeed does.
    bias_correction: whether to correct the moments' initialization bias.
    mu_dtype: the first moment's dtype (``None``: the parameters').
    var_update_scaler: variance updates at an interval before it doubles
      (DeepSpeed's default 16).
    local_step_scaler: frozen steps at a local interval before it doubles
      (DeepSpeed's default 32678).
    local_step_clipper: the largest local interval (DeepSpeed's default 16).
    min_compressed_size, compression_mask, axis_size: as in
      :func:`scale_by_onebit_adam`.
    auto_freeze_window, auto_freeze_tolerance: as in
      :func:`scale_by_onebit_adam`, but the window counts variance updates,
      which come ever more rarely (the 8 of the default window span 8 steps
      at first and 64 once the interval has doubled three times), where
      1-bit Adam's 20 count every step.

  ``var_freeze_step`` is DeepSpeed's ``ZeroOneAdam`` setting, one more update
  than 1-bit Adam's ``freeze_step`` (DeepSpeed's ``OnebitAdam``) for the same
  number: each keeps the meaning its DeepSpeed optimizer gives it, so that a
  DeepSpeed configuration carries over.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` needs ``params``.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> n = jax.local_device_count()
    >>> tx = qsgd_jax.zero_one_adam(1e-3, "batch", var_freeze_step=4,
    ...                             min_compressed_size=0, local_step_clipper=1)
    >>> params = jnp.zeros((n, 64))
    >>> state = jax.pmap(tx.init, axis_name="batch")(params)
    >>> updates, state = jax.pmap(tx.update, axis_name="batch")(
    ...     jnp.ones((n, 64)), state, params)
    >>> bool(jnp.allclose(updates, -1e-3))
    True

  References:
    Lu et al., `Maximizing Communication Efficiency for Large-scale Training
    via 0/1 Adam <https://arxiv.org/abs/2202.06009>`_, ICLR 2023.
  """
  owner = "qsgd_jax.zero_one_adam"
  common.check_options(owner, b1=b1, b2=b2, eps=eps, min_compressed_size=min_compressed_size)
  common.check_freeze_step(owner, "var_freeze_step", var_freeze_step)
  for name, value in (("var_update_scaler", var_update_scaler),
                      ("local_step_scaler", local_step_scaler),
                      ("local_step_clipper", local_step_clipper)):
    common.check_positive_int(owner, name, value)
  common.check_axis_size(owner, axis_size)
  axes = axes_lib.parse(axis_name, owner)
  auto = common.auto_freeze(owner, var_freeze_step, auto_freeze_window,
                            auto_freeze_tolerance)
  settings = zero_one_step.Settings(
      axes=axes, schedule=common.as_callable_schedule(learning_rate), b1=b1, b2=b2, eps=eps,
      weight_decay=weight_decay, bias_correction=bias_correction,
      var_update_scaler=var_update_scaler, local_step_scaler=local_step_scaler,
      local_step_clipper=local_step_clipper)

  def init_fn(params):
    axis_checks.check_mesh_axes(params, axes, owner)
    leaves = common.leaves_of(params, min_compressed_size, compression_mask)
    compressed, worker_error, server_error = shard_exchange.initial_errors(
        params, leaves, axes, axis_size, owner)
    one = jnp.ones((), jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    return ZeroOneAdamState(
        count=zero,
        mu=optax.tree.zeros_like(params, dtype=mu_dtype),
        nu=common.variance_zeros(params),
        accumulator=tuple(common.zeros_laid_out_as(x, jnp.float32)
                          for x in compressed) if settings.local_steps else (),
        worker_error=worker_error,
        server_error=server_error,
        variance_interval=one, variance_counter=zero, variance_updates=zero,
        local_interval=one, local_counter=zero,
        learning_rate_sum=jnp.zeros((), jnp.float32),
        freeze_count=(common.initial_freeze_count(var_freeze_step) + 1
                      if var_freeze_step != "auto" else common.initial_freeze_count("auto")),
        variance_history=auto.initial(len(leaves.compressed)) if auto else (),
        stats=stats.empty(),
    )

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    axes_lib.check_not_in_apply_if_finite(
        owner, axis_name,
        "It skips a non-finite step on every device together by itself: use it unwrapped.")
    if not isinstance(state, ZeroOneAdamState):
      raise TypeError(
          f"{owner}: the state is a {type(state).__name__}, not a ZeroOneAdamState: pass the "
          "state this optimizer's init returned.")
    if params is None:
      raise ValueError(f"{owner}: update needs params (for the weight decay and local steps).")
    common.check_tree(owner, updates, params, state.mu)
    axis_checks.check_mesh_axes(updates, axes, owner)
    leaves = common.leaves_of(updates, min_compressed_size, compression_mask)
    sizes = axes.sizes(owner)
    axes_lib.check_varying(updates, axes, owner)
    if settings.local_steps:
      _check_params_per_device(params, axes, local_step_clipper)
    grads, treedef = jax.tree.flatten(updates)
    exchange_plan = shard_exchange.make_plan([grads[i] for i in leaves.compressed], sizes,
                                             owner)
    shard_exchange.check_error_shapes(owner, state.worker_error, exchange_plan)
    step = zero_one_step.Step(settings, state, grads, jax.tree.leaves(params),
                              _decayed(mask, params, len(grads)), leaves, exchange_plan,
                              sizes).run()
    # A non-finite step leaves the state as it was (the moments, accumulator, errors and
    # counters already chosen inside the step's branch), on every device together.
    finite, compressed = step.finite, leaves.compressed
    count = jnp.where(finite, optax.safe_increment(state.count), state.count)
    frozen = state.count >= state.freeze_count
    freeze_count, history = state.freeze_count, state.variance_history
    if auto:
      history, freeze_count = auto.update(
          history, freeze_count, variances=[step.nu[i] for i in compressed],
          updates_seen=step.variance_updates, recorded=step.variance_updated & finite,
          count=count, b2=b2, bias_correction=bias_correction)
      freeze_count = jnp.where(finite, freeze_count, state.freeze_count)
      history = common.tree_select(finite, history, state.variance_history)
    # zoadam.py 310-317: the errors start afresh when the variance freezes.
    freezing = finite & jnp.logical_not(frozen) & (count >= freeze_count)
    worker_error, server_error = jax.tree.map(lambda e: jnp.where(freezing, 0.0, e),
                                              (step.worker_error, step.server_error))
    new_state = ZeroOneAdamState(
        count=count,
        mu=jax.tree.unflatten(treedef, step.mu),
        nu=jax.tree.unflatten(treedef, step.nu),
        accumulator=step.accumulator,
        worker_error=worker_error,
        server_error=server_error,
        variance_interval=step.variance_interval,
        variance_counter=step.variance_counter,
        variance_updates=step.variance_updates,
        local_interval=step.local_interval,
        local_counter=step.local_counter,
        learning_rate_sum=step.learning_rate_sum,
        freeze_count=freeze_count,
        variance_history=history,
        stats=_stats(step.sent, leaves, exchange_plan, sizes),
    )
    out = [common.zero_update(g) if d is None
           else jnp.where(finite, d, jnp.zeros((), jnp.float32)).astype(jnp.result_type(g))
           for g, d in zip(grads, step.deltas, strict=True)]
    return jax.tree.unflatten(treedef, out), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _decayed(mask, params, count: int) -> list[bool]:
  """Whether weight decay applies to each leaf, from an ``optax.adamw``-style mask."""
  if mask is None:
    return [True] * count
  given = mask(params) if callable(mask) else mask
  flags = jax.tree.leaves(given)
  if len(flags) != count:
    raise ValueError(
        f"qsgd_jax.zero_one_adam: mask has {len(flags)} leaves and the parameters {count}: "
        "give one bool a leaf, in the parameters' structure (or a callable returning it).")
  return [bool(flag) for flag in flags]


def _check_params_per_device(params, axes: axes_lib.Axes, local_step_clipper: int) -> None:
  """Raises where ``jax.shard_map`` holds the parameters replicated over the outer axis, which
  local steps would make differ between devices."""
  found = axes_lib.first_replicated(params, (axes.outer,))
  if found is not None:
    path = found[0] if found[0] != "<root>" else ""
    raise ValueError(
        f"qsgd_jax.zero_one_adam: params{path} is replicated over axis "
        f"{axes.outer!r}, but with local_step_clipper={local_step_clipper} the devices take "
        "local steps after the freeze, and each device's parameters and momentum then differ. "
        "Either pass local_step_clipper=1 (every frozen step synchronizes, parameters stay "
        "replicated: what qsgd_jax.data_parallel needs), or hold one copy of the parameters "
        f"a device: jax.pmap, or jax.shard_map with params laid out along {axes.outer!r} "
        "(a leading axis of the device count, in_specs and out_specs P(axis)), and the "
        "state laid out by qsgd_jax.state_partition_specs.")


def _stats(sent: jax.Array, leaves: common.Leaves, exchange_plan: shard_exchange.ExchangePlan,
           sizes: tuple[int, ...]) -> stats.CompressionStats:
  """What the step sent: the float32 leaves (with the finiteness flag) every step, and all the
  others in float32 (a variance update, a synchronization with a zero learning rate) or by
  the 1-bit exchange (its other steps before the freeze, a synchronization after)."""
  if not sizes:
    return stats.make(0.0, 0.0, jnp.nan)
  n, m = sizes[0], math.prod(sizes[1:])
  num_float = leaves.elements("compressed") + leaves.elements("float32")
  float32_bits = wire.float32_allreduce_bits(num_float, n * m)
  small = wire.float32_allreduce_bits(leaves.elements("float32") + 1, n * m)
  inner = wire.float32_allreduce_bits(leaves.elements("compressed"), m)
  onebit = exchange_plan.wire_bits() + inner + small
  bits = jnp.select([sent == zero_one_step.SENT_FLOAT32, sent == zero_one_step.SENT_ONEBIT],
                    [float32_bits, onebit], small)
  return stats.make(bits, float32_bits, jnp.nan)
