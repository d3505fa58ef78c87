"""When each fragment of DiLoCo takes, sends and merges its outer gradient: as predicates on
the state's step count inside the program, or decided on the host (:func:`diloco_events`)."""

import operator
from typing import NamedTuple

import jax

from qsgd_jax._src.diloco import checks, partition

_OWNER = "qsgd_jax.diloco"


def fires(step, offset: int, sync_every: int, k: int):
  """Whether ``step`` (counted from 1) is a fragment's sync step (``k = 0``) or ``k`` steps
  after one: ``(step - offset) % sync_every == k`` and ``step >= offset + k``.

  ``step`` may be a traced ``int32[]`` (a traced ``bool[]`` comes back) or a
  Python int (a bool); ``offset`` is the fragment's
  (:func:`~qsgd_jax._src.diloco.partition.offsets`).
  """
  return ((step - offset) % sync_every == k) & (step >= offset + k)


class DiLoCoEvents(NamedTuple):
  """What one step of :func:`~qsgd_jax.diloco` does for its fragments, decided on the host.

  Hashable: pass it as a static argument of a ``jax.jit`` step (one program is
  compiled for each distinct value: at most ``1 + 3 P`` of them), as
  ``tx.update(grads, state, params, events=events)``. Build it with
  :func:`diloco_events`.

  Attributes:
    takes: the fragments whose outer gradient this step takes (with
      ``delay=0`` it also exchanges and merges them).
    sends: with ``delay > 0``, the fragments whose held outer gradient this
      step exchanges; empty with ``delay=0``.
    merges: with ``delay > 0``, the fragments this step merges; empty with
      ``delay=0``.
    sync_every: the ``sync_every`` they were computed for.
    fragments: the number of fragments :math:`P` they were computed for.
    delay: the ``delay`` they were computed for. ``update`` checks all three
      against its own.

  Examples:
    >>> import qsgd_jax
    >>> events = qsgd_jax.diloco_events(9, sync_every=10)  # The 10th step syncs.
    >>> events.takes, hash(events) == hash(qsgd_jax.diloco_events(19, sync_every=10))
    ((0,), True)
  """

  takes: tuple[int, ...]
  sends: tuple[int, ...]
  merges: tuple[int, ...]
  sync_every: int
  fragments: int
  delay: int


def diloco_events(count: int, *, sync_every: int, fragments: int = 1,
                  delay: int = 0) -> DiLoCoEvents:
  """The events of the step after ``count`` steps, on the host.

  :func:`~qsgd_jax.diloco` decides inside its program, from its state's
  ``count``, whether a fragment syncs: each decision is a ``jax.lax.cond``.
  Given ``events=diloco_events(count, ...)``, its ``update`` decides in
  Python instead, so that the program of a step holds only what that step
  does: a step between syncs has no sync conditional and no collective, and
  a step that exchanges runs its collective at the program's top level,
  where the backend may run it beside the step's forward and backward passes
  (XLA:CPU with gloo runs a collective beside independent work there, not
  under a conditional; XLA:GPU with its default flags keeps a conditional out
  of the step's CUDA graph, so that the host waits at every step). Pass the
  events as a static argument (``static_argnames`` of ``jax.jit``,
  ``static_broadcasted_argnums`` of ``jax.pmap``): each distinct value
  compiles a program, ``1 + P`` of them with ``delay=0``, at most ``1 + 3P``.

  Args:
    count: the steps taken before this one: the state's ``count``, kept on
      the host (read it once, ``int(state.count)``, after restoring a
      state, and add one a step). Events of another count make the
      transformation sync when that count would: the result is then not
      the schedule's.
    sync_every: ``diloco``'s ``sync_every``.
    fragments: the number of fragments :math:`P`, an int (for a ``fragments``
      function, the number of fragments it makes).
    delay: ``diloco``'s ``delay``.

  Returns:
    A :class:`DiLoCoEvents`.

  Raises:
    TypeError: an argument that is not an integer.
    ValueError: a negative ``count``, or a schedule ``diloco`` refuses.

  Examples:
    Two fragments syncing every 4 steps, in turn, with their exchange one
    step later:

    >>> import qsgd_jax
    >>> [qsgd_jax.diloco_events(c, sync_every=4, fragments=2, delay=1)[:3]
    ...  for c in range(5)]  # doctest: +NORMALIZE_WHITESPACE
    [((), (), ()), ((0,), (), ()), ((), (0,), (0,)), ((1,), (), ()),
     ((), (1,), (1,))]
  """
  values = {}
  for name, value, least in (("count", count, 0), ("sync_every", sync_every, 1),
                             ("fragments", fragments, 1), ("delay", delay, 0)):
    try:
      if isinstance(value, bool):
        raise TypeError
      values[name] = operator.index(value)
    except TypeError:
      raise TypeError(f"qsgd_jax.diloco_events: {name} must be an int, got {value!r}: the "
                      "events are decided on the host, from a count kept there.") from None
    if values[name] < least:
      raise ValueError(f"qsgd_jax.diloco_events: {name} must be at least {least}, got "
                       f"{value!r}.")
  count, sync_every, fragments, delay = values.values()
  checks.check_schedule(sync_every, fragments, delay)
  step = count + 1
  offsets = partition.offsets(sync_every, fragments)

  def at(k):
    return tuple(p for p, offset in enumerate(offsets) if fires(step, offset, sync_every, k))

  return DiLoCoEvents(takes=at(0), sends=at(1) if delay else (),
                      merges=at(delay) if delay else (), sync_every=sync_every,
                      fragments=fragments, delay=delay)


def check_events(events, sync_every: int, fragments: int, delay: int) -> None:
  """Raises unless ``events`` is a :class:`DiLoCoEvents` of this schedule (``fragments`` the
  number of fragments), static."""
  if not isinstance(events, DiLoCoEvents):
    raise TypeError(
        f"{_OWNER}: events must be a qsgd_jax.DiLoCoEvents from qsgd_jax.diloco_events, got "
        f"{type(events).__name__}. Pass events=None to decide from the state's count.")
  if not all(isinstance(x, int) for x in jax.tree.leaves(events)):
    raise TypeError(
        f"{_OWNER}: events hold traced values: pass them to jax.jit as a static argument "
        "(static_argnames, or static_broadcasted_argnums of jax.pmap), as the program depends "
        "on them.")
  given = (events.sync_every, events.fragments, events.delay)
  if given != (sync_every, fragments, delay):
    raise ValueError(
        f"{_OWNER}: events are of sync_every={given[0]}, fragments={given[1]}, delay="
        f"{given[2]}, but this transformation has sync_every={sync_every}, {fragments} "
        f"fragments, delay={delay}: build them with qsgd_jax.diloco_events(count, sync_every="
        f"{sync_every}, fragments={fragments}, delay={delay}).")


def when(events: DiLoCoEvents | None, fragment: int, offset: int, sync_every: int, step, k: int):
  """Whether ``step`` (counted from 1) is ``k`` steps after ``fragment``'s sync step: decided
  on the host from ``events`` (a Python bool), or in the program (:func:`fires`)."""
  if events is None:
    return fires(step, offset, sync_every, k)
  return fragment in (events.takes if k == 0 else events.sends if k == 1 else events.merges)
