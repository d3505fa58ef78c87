"""Gradient accumulation that runs the wrapped update, and its collectives, once per k steps."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from qsgd_jax._src import axes


class AccumulationState(NamedTuple):
  """State of :func:`accumulate_gradients`.

  Attributes:
    mini_step: ``int32[]``, mini-steps accumulated since ``inner`` last ran,
      in ``[0, every_k_steps)``; the same on every device.
    accumulated: per device, a tuple with one ``float32[leaf.size]`` a
      gradient leaf: the running mean of this device's gradients over those
      mini-steps (zeros right after ``inner`` runs).
    inner_state: the state of the wrapped transformation, changed only on the
      mini-steps where it runs.

  Examples:
    >>> import jax.numpy as jnp, optax, qsgd_jax
    >>> tx = qsgd_jax.accumulate_gradients(optax.sgd(0.1), every_k_steps=4)
    >>> state = tx.init(jnp.zeros(3))
    >>> int(state.mini_step), [x.shape for x in state.accumulated]
    (0, [(3,)])
  """

  mini_step: jax.Array
  accumulated: tuple[jax.Array, ...]
  inner_state: optax.OptState


def accumulate_gradients(
    inner: optax.GradientTransformation,
    every_k_steps: int,
) -> optax.GradientTransformationExtraArgs:
  r"""Averages gradients over ``every_k_steps`` mini-steps, then runs ``inner`` once.

  On mini-steps :math:`m = 1, \dots, k - 1` of each group of
  :math:`k` = ``every_k_steps``, each device adds its gradient :math:`g_m` to
  a running mean,

  .. math::

    \bar g_m = \bar g_{m-1} + (g_m - \bar g_{m-1}) / m, \qquad \bar g_0 = 0,

  returns zero updates and calls nothing else. On mini-step :math:`k` it
  passes :math:`\bar g_k = \frac{1}{k} \sum_{m=1}^{k} g_m` (in float32, cast
  back to the gradients' dtypes) to ``inner.update``, returns what that
  returns, and starts a new group. The recurrence is the one
  ``optax.MultiSteps(inner, k)`` uses (``use_grad_mean=True``), so both give
  the same updates, bit for bit. A ``float0`` leaf (the gradient of an
  integer input, from ``jax.grad(..., allow_int=True)``) holds no values: it
  reaches ``inner`` as it is, as ``optax.apply_updates`` passes it by.

  The two cases are the branches of a ``jax.lax.cond`` on the mini-step
  counter, so a collective inside ``inner``, such as the quantized all-reduce
  of :func:`~qsgd_jax.compressed_allreduce`, runs, and sends its bytes, once
  per :math:`k` mini-steps: :math:`1/k` of the bytes per mini-step of
  averaging every mini-step's gradients. The counter is the same on every
  device, so all devices take the same branch and meet at the collectives
  together. ``inner``'s state (the compressor's key and count, the error
  feedback residuals, the optimizer's moments) changes only when ``inner``
  runs.

  Why not ``optax.MultiSteps``: in optax 0.2.8 it calls ``inner.update`` on
  every mini-step and keeps the result, with ``jnp.where``, only on the
  :math:`k`-th. Its results are right, but a compressed all-reduce inside it
  communicates on every mini-step and sends :math:`k` times the bytes, all
  but one of them thrown away. This wrapper has none of MultiSteps' other
  options: :math:`k` is fixed, and every mini-step counts.

  Under ``jax.shard_map`` the running means differ per device:
  :func:`~qsgd_jax.state_partition_specs` lays them out along the axis and
  ``inner``'s state as it lays out that state alone. Under ``jax.pmap`` the
  state gets pmap's leading axis.

  Args:
    inner: the transformation to run on the mean gradient, e.g.
      ``optax.chain(qsgd_jax.qsgd("batch"), optax.adamw(1e-3))``.
    every_k_steps: mini-steps a group, an int of at least 1.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` passes ``params``
    and extra keyword arguments on to ``inner.update``.

  Raises:
    ValueError: if ``every_k_steps`` is not an int of at least 1.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, qsgd_jax
    >>> n = jax.local_device_count()
    >>> tx = qsgd_jax.accumulate_gradients(
    ...     optax.chain(qsgd_jax.qsgd("batch"), optax.sgd(0.1)), every_k_steps=2)
    >>> state = jax.pmap(tx.init, axis_name="batch")(jnp.zeros((n, 8192)))
    >>> update = jax.pmap(tx.update, axis_name="batch")
    >>> updates, state = update(jnp.full((n, 8192), 3.0), state)  # Sends nothing.
    >>> bool((updates == 0).all())
    True
    >>> updates, state = update(jnp.full((n, 8192), 1.0), state)  # Sends the mean, 2.
    >>> bool(jnp.allclose(updates, -0.2))
    True
  """
  if (not isinstance(every_k_steps, int) or isinstance(every_k_steps, bool)
      or every_k_steps < 1):
    raise ValueError(f"every_k_steps must be an int of at least 1, got {every_k_steps!r}.")
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return AccumulationState(
        mini_step=jnp.zeros((), jnp.int32),
        accumulated=tuple(
            jnp.zeros((jnp.size(leaf),), jnp.float32) for leaf in jax.tree.leaves(params)),
        inner_state=inner.init(params),
    )

  def update_fn(updates, state, params=None, **extra_args):
    leaves, treedef = jax.tree.flatten(updates)
    seen = state.mini_step + 1
    # A float0 leaf (the gradient of an integer input, jax.grad(allow_int=True)) holds no
    # values: it passes through to inner as it is, and its running mean stays zeros.
    accumulated = tuple(
        mean if _is_float0(leaf) else mean + (leaf.reshape(-1) - mean) / seen
        for leaf, mean in zip(leaves, state.accumulated, strict=True))
    mean_updates = jax.tree.unflatten(treedef, [
        leaf if _is_float0(leaf) else mean.reshape(leaf.shape).astype(leaf.dtype)
        for leaf, mean in zip(leaves, accumulated, strict=True)])

    def run_inner():
      return inner.update(mean_updates, state.inner_state, params, **extra_args)

    # The branches must agree on shapes, dtypes and, under shard_map, on the axes each
    # output varies over: each side is cast to the more varying of the two.
    ran = jax.eval_shape(run_inner)

    def run():
      new_updates, inner_state = run_inner()
      return new_updates, axes.varying_like(inner_state, state.inner_state)

    def hold():
      zeros = jax.tree.map(_zeros, ran[0])
      return axes.varying_like((zeros, state.inner_state), ran)

    applies = state.mini_step == every_k_steps - 1
    new_updates, inner_state = jax.lax.cond(applies, run, hold)
    new_state = AccumulationState(
        mini_step=jnp.where(applies, 0, seen).astype(jnp.int32),
        accumulated=tuple(jnp.where(applies, 0.0, mean) for mean in accumulated),
        inner_state=inner_state,
    )
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _is_float0(x) -> bool:
  return jnp.result_type(x) == jax.dtypes.float0


def _zeros(x):
  """Zeros like ``x`` (a ``jax.ShapeDtypeStruct``); float0 zeros, which ``jnp.zeros``
  refuses, as optax makes them, a numpy array."""
  return np.zeros(x.shape, x.dtype) if x.dtype == jax.dtypes.float0 else jnp.zeros(
      x.shape, x.dtype)
