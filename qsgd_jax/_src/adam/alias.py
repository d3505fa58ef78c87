"""1-bit Adam as an ``optax.adamw``-style alias: DeepSpeed's ``OnebitAdam`` whole."""

import jax
import jax.numpy as jnp
import optax

from qsgd_jax._src import axes as axes_lib
from qsgd_jax._src.adam import common
from qsgd_jax._src.adam.onebit_adam import scale_by_onebit_adam

# Skipped steps never run out: a non-finite step is always skipped, on every device together.
_ALWAYS_SKIP = 2**31 - 1


def onebit_adam(
    learning_rate: optax.ScalarOrSchedule,
    axis_name: axes_lib.AxisName,
    *,
    freeze_step: common.FreezeStep,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    bias_correction: bool = True,
    mask=None,
    mu_dtype=None,
    min_compressed_size: int = common.DEFAULT_MIN_COMPRESSED_SIZE,
    compression_mask=None,
    axis_size: int | dict[str, int] | None = None,
    auto_freeze_window: int = 20,
    auto_freeze_tolerance: float = 0.025,
) -> optax.GradientTransformationExtraArgs:
  r"""1-bit Adam: AdamW whose gradient average is 1-bit after a float32 warm-up.

  The optimizer of DeepSpeed's ``OnebitAdam``
  (``deepspeed/runtime/fp16/onebit/adam.py``), as an ``optax.adamw``-style
  alias: :func:`scale_by_onebit_adam`, then
  ``optax.add_decayed_weights(weight_decay, mask)`` (weight decay added to
  the Adam ratio in both stages, as DeepSpeed adds it), then the learning
  rate, the last two wrapped in ``optax.apply_if_finite`` so that a
  non-finite gradient on any device skips the step on every device together.

  Its ``update`` takes each device's **local** gradients, inside
  ``jax.pmap`` or ``jax.shard_map`` over ``axis_name`` (or through
  :func:`~qsgd_jax.data_parallel`), and does the whole job, communication
  included: do not average the gradients before it. During the warm-up it
  sends what a float32 all-reduce does; after the freeze, about 32x less.

  Unlike DeepSpeed's, its error buffers are part of the optax state: a
  checkpoint keeps them, and a resumed run continues bit for bit (DeepSpeed
  resets them when it loads a checkpoint).

  Args:
    learning_rate: a float or an optax schedule.
    axis_name: the mapped axis to average over (or ``(outer, inner, ...)``,
      see :func:`scale_by_onebit_adam`).
    freeze_step: float32 warm-up updates before the variance is frozen, or
      ``"auto"`` to freeze it once it has stopped moving.
    b1, b2, eps, bias_correction, mu_dtype: see :func:`scale_by_onebit_adam`.
    min_compressed_size, compression_mask, axis_size: see
      :func:`scale_by_onebit_adam`.
    auto_freeze_window, auto_freeze_tolerance: see :func:`scale_by_onebit_adam`.
    weight_decay: decoupled weight decay, as in ``optax.adamw``.
    mask: which leaves are decayed, as in ``optax.adamw``.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> n = jax.local_device_count()
    >>> tx = qsgd_jax.onebit_adam(1e-3, "batch", freeze_step=2, min_compressed_size=0)
    >>> params = jnp.zeros((n, 64))
    >>> state = jax.pmap(tx.init, axis_name="batch")(params)
    >>> step = jax.pmap(tx.update, axis_name="batch")
    >>> for _ in range(3):  # Two float32 warm-up steps, then 1-bit ones.
    ...   updates, state = jax.block_until_ready(step(jnp.ones((n, 64)), state, params))
    >>> bool(jnp.allclose(updates, -1e-3))
    True

  References:
    Tang et al., `1-bit Adam: Communication Efficient Large-Scale Training
    with Adam's Convergence Speed <https://arxiv.org/abs/2102.02888>`_, ICML
    2021; Loshchilov and Hutter, Decoupled Weight Decay Regularization, ICLR
    2019.
  """
  return optax.chain(
      scale_by_onebit_adam(
          axis_name, freeze_step=freeze_step, b1=b1, b2=b2, eps=eps,
          bias_correction=bias_correction, mu_dtype=mu_dtype,
          min_compressed_size=min_compressed_size, compression_mask=compression_mask,
          axis_size=axis_size, auto_freeze_window=auto_freeze_window,
          auto_freeze_tolerance=auto_freeze_tolerance),
      # Leaves that are not float have zero updates, which stay zero and of their dtype.
      optax.masked(
          optax.apply_if_finite(
              optax.chain(optax.add_decayed_weights(weight_decay, mask),
                          optax.scale_by_learning_rate(learning_rate)),
              max_consecutive_errors=_ALWAYS_SKIP),
          _float_leaves),
  )


def _float_leaves(tree):
  return jax.tree.map(lambda x: jnp.issubdtype(jnp.result_type(x), jnp.floating), tree)
