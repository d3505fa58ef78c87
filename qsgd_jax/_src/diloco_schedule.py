"""When each fragment of DiLoCo takes, sends and merges its outer gradient: as predicates on
the state's step count inside the program, or decided on the host (:func:`diloco_events`)."""

from typing import NamedTuple

from qsgd_jax._src import diloco_checks, diloco_fragments

_OWNER = "qsgd_jax.diloco"


def fires(step, offset: int, sync_every: int, k: int):
  """Whether ``step`` (counted from 1) is a fragment's sync step (``k = 0``) or ``k`` steps
  after one: ``(step - offset) % sync_every == k`` and ``step >= offset + k``.

  ``step`` may be a traced ``int32[]`` (a traced ``bool[]`` comes back) or a
  Python int (a bool); ``offset`` is the fragment's
  (:func:`~qsgd_jax._src.diloco_fragments.offsets`).
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
  does: a step between syncs neither branches nor communicates, and a step
  that exchanges runs its collective at the program's top level, where the
  backend may overlap it with the step's forward and backward passes (XLA:CPU
  with gloo does; XLA:GPU with its default flags keeps a conditional out of
  the step's CUDA graph, so that the host waits at every step).

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
  for name, value, least in (("count", count, 0), ("sync_every", sync_every, 1),
                             ("fragments", fragments, 1), ("delay", delay, 0)):
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
      raise ValueError(f"qsgd_jax.diloco_events: {name} must be an int of at least {least}, "
                       f"got {value!r}.")
  diloco_checks.check_schedule(sync_every, fragments, delay)
  step = count + 1
  offsets = diloco_fragments.offsets(sync_every, fragments)

  def at(k):
    return tuple(p for p, offset in enumerate(offsets) if fires(step, offset, sync_every, k))

  return DiLoCoEvents(takes=at(0), sends=at(1) if delay else (),
                      merges=at(delay) if delay else (), sync_every=sync_every,
                      fragments=fragments, delay=delay)


def check_events(events, sync_every: int, count: int, delay: int) -> None:
  """Raises unless ``events`` is a :class:`DiLoCoEvents` of this schedule."""
  if not isinstance(events, DiLoCoEvents):
    raise TypeError(
        f"{_OWNER}: events must be a qsgd_jax.DiLoCoEvents from qsgd_jax.diloco_events, got "
        f"{type(events).__name__}. Pass events=None to decide from the state's count.")
  given = (events.sync_every, events.fragments, events.delay)
  if given != (sync_every, count, delay):
    raise ValueError(
        f"{_OWNER}: events are of sync_every={given[0]}, fragments={given[1]}, delay="
        f"{given[2]}, but this transformation has sync_every={sync_every}, {count} fragments, "
        f"delay={delay}: build them with qsgd_jax.diloco_events(count, sync_every="
        f"{sync_every}, fragments={count}, delay={delay}).")
