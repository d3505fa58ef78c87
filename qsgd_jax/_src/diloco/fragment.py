"""One fragment's life in DiLoCo, over its state record: its outer gradient taken at the sync
step, sent (averaged over the workers), and merged (the outer step, then each worker's merge)."""

from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp
import optax

from qsgd_jax._src import base
from qsgd_jax._src.diloco import conditional, exchange


class FragmentState(NamedTuple):
  """What one fragment of :func:`~qsgd_jax.diloco` keeps from round to round (``delay=0``).

  A fragment's leaves are its leaves of the parameters, in
  ``jax.tree.leaves`` order; each state below is of a tuple of them.

  Attributes:
    outer_state: the outer optimizer's state, initialized on the fragment's
      leaves of the global parameters; the same on every device.
    average_state: the state of ``average`` (an ``optax.EmptyState`` for the
      default float32 mean), initialized on the fragment's leaves in
      float32: its error feedback and key live across rounds. With
      ``split_axis``, a :class:`~qsgd_jax.SplitAverageState`, this device's
      part.

  Examples:
    >>> import jax.numpy as jnp, optax, qsgd_jax
    >>> tx = qsgd_jax.diloco(optax.sgd(0.1), None, sync_every=4, fragments=2,
    ...                      outer_optimizer=optax.sgd(0.7, momentum=0.9))
    >>> state = tx.init({"a": jnp.zeros(3), "b": jnp.zeros(5)})
    >>> # The larger module, "b", goes to fragment 0 (qsgd_jax.diloco's fragments).
    >>> [fragment.outer_state[0].trace[0].shape for fragment in state.fragments]
    [(5,), (3,)]
  """

  outer_state: optax.OptState
  average_state: optax.OptState


class DelayedFragmentState(NamedTuple):
  """What one fragment of :func:`~qsgd_jax.diloco` keeps with ``delay > 0``.

  Its outer gradient, taken at the sync step, waits in the record until the
  exchange one step later; the average waits until the merge, ``delay``
  steps after the sync.

  Attributes:
    outer_state: as :class:`FragmentState`'s.
    average_state: as :class:`FragmentState`'s.
    outer_gradient: a tuple of ``float32[1, *shape]``, one a leaf: this
      device's outer gradient, from the sync step until the exchange (with a
      leading axis of 1, as the inner state: each device's own).
    averaged_gradient: a tuple of ``float32[*shape]``: the averaged outer
      gradient, the same on every device, from the exchange until the merge.

  Examples:
    >>> import jax.numpy as jnp, optax, qsgd_jax
    >>> tx = qsgd_jax.diloco(optax.sgd(0.1), None, sync_every=4, delay=1)
    >>> fragment, = tx.init({"w": jnp.zeros(3)}).fragments
    >>> fragment.outer_gradient[0].shape, fragment.averaged_gradient[0].shape
    ((1, 3), (3,))
  """

  outer_state: optax.OptState
  average_state: optax.OptState
  outer_gradient: tuple
  averaged_gradient: tuple


class Local(NamedTuple):
  """A fragment's leaves this step on this device, each a tuple in ``jax.tree.leaves`` order.

  Attributes:
    global_leaves: the global parameters.
    params: this device's parameters before the step.
    steps: this step's inner updates (zero where the step was skipped).
  """

  global_leaves: tuple
  params: tuple
  steps: tuple


class Settings(NamedTuple):
  """What every fragment's phases share, fixed when the step is traced.

  Attributes:
    outer_optimizer: ``diloco``'s.
    alpha: the merge's weight of the local parameters.
    delay: the steps from a sync to its merge.
    exchange: ``exchange(outer_gradient, average_state) -> (averaged,
      average_state, sent)``, :func:`~qsgd_jax._src.diloco.exchange.exchange`
      bound to the average and the axes.
  """

  outer_optimizer: optax.GradientTransformation
  alpha: float
  delay: int
  exchange: Callable


def init(global_leaves: tuple, outer_optimizer, average, split,
         delay: int) -> FragmentState | DelayedFragmentState:
  """A fragment's record before the first step, for its leaves of the global parameters."""
  zeros = tuple(jnp.zeros_like(x, jnp.float32) for x in global_leaves)  # In their layout.
  outer_state = outer_optimizer.init(global_leaves)
  average_state = exchange.init_average(average, zeros, split)
  if not delay:
    return FragmentState(outer_state, average_state)
  return DelayedFragmentState(outer_state, average_state, tuple(z[None] for z in zeros), zeros)


def take(local: Local) -> tuple:
  """The outer gradient, in float32: the global leaves minus this device's after the step."""
  return tuple(g.astype(jnp.float32) - applied(p, s).astype(jnp.float32)
               for g, p, s in zip(*local, strict=True))


def merge(averaged, outer_state, local: Local, settings: Settings):
  r"""The outer step on the global leaves, and this device's merge.

  The global leaves move by ``outer_optimizer`` given ``averaged`` as their
  gradient; this device's leaves after the step ``x`` go to :math:`g +
  \alpha (x - g)`, ``g`` the new global ones; a device whose leaves are not
  finite (it was left out of the average) takes ``g`` whatever ``alpha``.

  A non-finite ``averaged`` (the same on every device) skips the round: the
  global leaves and the outer state are kept, and every device takes the
  global leaves back. That choice is a ``jax.lax.cond`` also where the
  host decides the schedule: its boundary keeps ``averaged`` as the
  exchange rounded it, where XLA could otherwise fuse the exchange's last
  product into the outer step's first sum (one fused multiply-add, rounded
  once) and the two programs would differ in the last bit.

  Returns:
    ``(updates, global_leaves, outer_state)``: the updates that take this
    device's parameters to the merged ones, each in the dtype its sum with
    the parameter is taken in (``optax.apply_updates``), the new global
    leaves and the outer state.
  """

  def stepped(averaged, outer_state, local):
    old = local.global_leaves
    grads = tuple(a.astype(g.dtype) for a, g in zip(averaged, old, strict=True))
    outer_updates, outer_state = settings.outer_optimizer.update(grads, outer_state, old)
    new_global = optax.apply_updates(old, outer_updates)
    return _merged(new_global, local, settings.alpha), new_global, outer_state

  def skipped(averaged, outer_state, local):
    return _merged(local.global_leaves, local, 0.0), local.global_leaves, outer_state

  return conditional.cond(base.all_finite(averaged), stepped, skipped, averaged, outer_state,
                          local)


def _merged(new_global, local: Local, alpha: float) -> tuple:
  """The updates that take this device's leaves after the step to the merged ones."""
  mine = tuple(map(applied, local.params, local.steps))
  keeps_local = base.all_finite(mine)
  updates = []
  for g, x, theta, step in zip(new_global, mine, local.params, local.steps, strict=True):
    # torchft's merge: p.lerp_(local, alpha), the global value plus alpha of the way to local.
    target = jnp.where(keeps_local, (g + alpha * (x - g)).astype(x.dtype), g) if alpha else g
    dtype = jnp.result_type(theta, step)
    updates.append(target.astype(dtype) - theta.astype(dtype))
  return tuple(updates)


def advance(record, local: Local, when: Callable, settings: Settings):
  """One step of a fragment: ``(record, updates, global_leaves, sent)``.

  Args:
    record: the fragment's :class:`FragmentState` or :class:`DelayedFragmentState`.
    local: its leaves this step.
    when: ``when(k)``, whether this step is ``k`` steps after the fragment's
      sync step (a traced ``bool[]``, or a bool decided on the host).
    settings: what the phases share.

  Returns:
    The new record; the fragment's updates (its inner steps, or at a merge
    the merge's); its global leaves; and the exchange's
    :class:`~qsgd_jax._src.diloco.exchange.Sent`.
  """
  if settings.delay:
    return _advance_delayed(record, local, when, settings)

  def sync(record, local):
    averaged, average_state, sent = settings.exchange(take(local), record.average_state)
    updates, global_leaves, outer_state = merge(averaged, record.outer_state, local, settings)
    return FragmentState(outer_state, average_state), updates, global_leaves, sent

  def wait(record, local):
    return record, local.steps, local.global_leaves, exchange.nothing_sent()

  return conditional.cond(when(0), sync, wait, record, local)


def _advance_delayed(record: DelayedFragmentState, local: Local, when: Callable,
                     settings: Settings):
  """:func:`advance` with ``delay > 0``: take at the sync step, send one step later, merge
  ``delay`` steps after the sync. Each conditional carries only the fields it changes."""

  # The exchange sends the outer gradient the record holds, not this step's take below (a step
  # never both takes and sends: when(0) and when(1) exclude each other, as delay >= 1 needs
  # H >= 2), so the collective waits for nothing the step computes and may run beside it.
  def send(held, average_state, averaged):
    return settings.exchange(tuple(d[0] for d in held), average_state)

  def hold(held, average_state, averaged):
    return averaged, average_state, exchange.nothing_sent()

  def taken(local, held):
    return tuple(d[None] for d in take(local))

  def kept(local, held):
    return held

  averaged, average_state, sent = conditional.cond(
      when(1), send, hold, record.outer_gradient, record.average_state, record.averaged_gradient)
  held = conditional.cond(when(0), taken, kept, local, record.outer_gradient)

  def merged(averaged, outer_state, local):
    return merge(averaged, outer_state, local, settings)

  def unmerged(averaged, outer_state, local):
    return local.steps, local.global_leaves, outer_state

  updates, global_leaves, outer_state = conditional.cond(
      when(settings.delay), merged, unmerged, averaged, record.outer_state, local)
  return (DelayedFragmentState(outer_state, average_state, held, averaged), updates,
          global_leaves, sent)


def applied(param, update):
  """``param`` after ``update``, as ``optax.apply_updates`` takes it: in the param's dtype."""
  return (param + update).astype(jnp.result_type(param))
