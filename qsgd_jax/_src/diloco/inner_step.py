"""A DiLoCo worker's own step: the inner optimizer's update, skipped where it is not finite, and
the inner state begun afresh at a merge where it went non-finite."""

import functools
import operator

import jax
import jax.numpy as jnp

from qsgd_jax._src import axes, base, stats
from qsgd_jax._src.diloco import conditional, exchange, fragment


def step(inner, grads, stacked_state, params, extra_args: dict):
  """``(updates, inner_state)`` of the inner step on this device.

  ``stacked_state`` is the inner state with a leading axis of 1 a leaf (as
  :class:`~qsgd_jax.DiLoCoState` holds it); the state returned has none. A
  device whose update is not finite, or would take a parameter past its
  dtype's range (no later update could bring it back), skips the step: its
  update is zero and its state kept.
  """
  state = jax.tree.map(lambda x: x[0], stacked_state)
  updates, new_state = inner.update(grads, state, params, **extra_args)
  finite = base.all_finite(updates) & base.all_finite(
      jax.tree.map(fragment.applied, params, updates))
  stepped, kept = (updates, new_state), (jax.tree.map(jnp.zeros_like, updates), state)
  stepped, kept = (conditional.alike(x, stepped, kept, finite) for x in (stepped, kept))
  return finite_or_kept(finite, stepped, kept)


def finite_or_kept(finite, stepped, kept):
  """``stepped`` where ``finite``, else ``kept``, as each backend runs it faster.

  On the CPU a conditional (:func:`kept_by_conditional`): it costs less
  there than an element-wise select of the updates and the whole inner
  state. Elsewhere a select (:func:`~qsgd_jax._src.diloco.exchange.select`):
  XLA:GPU copies a conditional's predicate to the host, which waits for it
  before it dispatches more. ``docs/results.md`` has the figures.
  """
  return jax.lax.platform_dependent(finite, stepped, kept, cpu=kept_by_conditional,
                                    default=exchange.select)


def kept_by_conditional(finite, stepped, kept):
  """``stepped`` if ``finite`` else ``kept``, by ``jax.lax.cond``."""
  return jax.lax.cond(finite, lambda: stepped, lambda: kept)


def restored_at_merge(inner, inner_state, params, updates, merges: list, parsed: axes.Axes):
  """``inner_state``, or at a step that merges a fragment, where a float leaf of it (its
  :class:`~qsgd_jax.CompressionStats` aside) is not finite, a fresh one: ``inner.init`` of the
  parameters after ``updates``, on every device of the worker."""

  def restored(inner_state, params, updates):
    checked = jax.tree.map(lambda node: None if stats.is_stats(node) else node, inner_state,
                           is_leaf=stats.is_stats)
    finite = base.all_finite(checked)
    # One decision for all of a worker's devices (the residual of an average over them is each
    # device's own), so that they go on holding the same state.
    within = tuple(name for name in axes.varying_axes(finite) if name not in parsed.names)
    if within:
      finite = jax.lax.pmin(finite.astype(jnp.int32), within) > 0
    fresh = inner.init(jax.tree.map(fragment.applied, params, updates))
    fresh, kept = (conditional.alike(x, fresh, inner_state, finite) for x in (fresh, inner_state))
    return exchange.select(finite, kept, fresh)

  return conditional.cond(functools.reduce(operator.or_, merges), restored,
                          lambda inner_state, params, updates: inner_state,
                          inner_state, params, updates)
