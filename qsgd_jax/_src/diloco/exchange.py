"""DiLoCo's outer exchange: a fragment's outer gradient averaged over the workers, whole or
split over a worker's devices."""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from qsgd_jax._src import axes, base, participation, stats, wire
from qsgd_jax._src.diloco import checks

_OWNER = "qsgd_jax.diloco"


class SplitAverageState(NamedTuple):
  """The state of a fragment's average where the exchange is split over a worker's devices.

  Attributes:
    state: the average's state for this device's part of the outer gradient
      (its error feedback, key and count), every leaf with a leading axis of
      length 1 (``[1, *shape]``), as :class:`~qsgd_jax.DiLoCoState`'s inner
      state is: each device's differs, and under ``jax.shard_map`` all of it
      lies along the workers' and the split axes.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, qsgd_jax
    >>> tx = qsgd_jax.diloco(
    ...     optax.sgd(0.1), "outer", sync_every=4, split_axis="inner",
    ...     average=qsgd_jax.qsgd("outer", bits=4, error_feedback=True))
    >>> with jax.set_mesh(jax.make_mesh((1, 1), ("outer", "inner"))):
    ...   state = jax.eval_shape(tx.init, {"w": jnp.zeros(1000)})
    >>> type(state.fragments[0].average_state).__name__
    'SplitAverageState'
    >>> specs = qsgd_jax.state_partition_specs(state, "outer", split_axis="inner")
    >>> specs.fragments[0].average_state.state.count  # Each device's own, along both axes.
    P(('outer', 'inner'),)
  """

  state: optax.OptState


class Sent(NamedTuple):
  """What one fragment's exchange sent, and whom it left out.

  Attributes:
    wire_bits: ``float32[]``, the bits this device sent.
    outer_wire_bits: ``float32[]``, the part of them that crossed between
      workers.
    skipped_workers: ``int32[]``, the workers whose outer gradient was not
      finite and did not enter the average.
  """

  wire_bits: jax.Array
  outer_wire_bits: jax.Array
  skipped_workers: jax.Array


def nothing_sent() -> Sent:
  """What a step without an exchange sent: nothing."""
  return Sent(jnp.float32(0), jnp.float32(0), jnp.int32(0))


def init_average(average, zeros, split: axes.Axes | None):
  """``average``'s state for a fragment of float32 leaves ``zeros``: of the whole fragment,
  or with ``split``, of this device's part (a :class:`SplitAverageState`)."""
  if average is None:
    return optax.EmptyState()
  if split is None:
    return average.init(tuple(zeros))
  part = jnp.zeros(split_length(sum(z.size for z in zeros), split_count(split)), jnp.float32)
  return SplitAverageState(jax.tree.map(lambda x: x[None], average.init((part,))))


def split_length(size: int, count: int) -> int:
  """Elements of a fragment of ``size`` elements each of a worker's ``count`` devices
  exchanges: ``ceil(size / count)``."""
  return -(-size // count)


def split_count(split: axes.Axes) -> int:
  """The number of devices of ``split``: its bound axes' sizes, or outside a mapped function
  (``init`` under ``jax.eval_shape``), those of the mesh ``jax.set_mesh`` set."""
  try:
    return math.prod(split.sizes(_OWNER))
  except NameError as error:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(split.names) <= set(mesh.axis_names):
      raise NameError(
          f"{_OWNER}: split_axis={split.name!r} is not bound, and no mesh set with "
          "jax.set_mesh has it: init inside jax.shard_map or jax.pmap over it, or under "
          "jax.set_mesh(mesh) (e.g. to take the state's shapes with jax.eval_shape).") from error
    return math.prod(mesh.shape[name] for name in split.names)


def exchange(delta, average_state, *, average, parsed: axes.Axes, size: int,
             split: axes.Axes | None):
  """The averaged outer gradient, the average's new state and the bits sent (all, outer).

  Args:
    delta: this device's outer gradient of one fragment, a tuple of float32
      leaves.
    average_state: the fragment's state of ``average``.
    average: the averaging transform over ``parsed``, or ``None`` for a
      float32 ``jax.lax.pmean``.
    parsed: the workers' axes.
    size: the number of workers.
    split: the axes of a worker's devices over which the exchange is split,
      or ``None``. With ``k`` devices, each flattens the fragment into one
      vector of ``n`` elements, zero-padded to ``k * ceil(n / k)``, averages
      its own ``ceil(n / k)`` of them (the ``i``-th part on the device of
      index ``i`` along ``split``) over the workers, with random draws of its
      own (``i`` folded into the average's keys), and the worker's devices
      all-gather the parts back into the whole.

  A worker whose outer gradient is not finite is left out: the average is
  taken over the other workers, as a quorum leaves out a failed replica (the
  number of them comes from one scalar all-reduce). An
  :class:`~qsgd_jax.AverageOverParticipants` is told so and averages over
  those left in itself. Any other ``average`` is handed zeros from such a
  worker and its result scaled by ``n / (n - left out)``; one with error
  feedback still sends the worker's residual, counted as the others'. A
  non-finite average (the same on every device: every worker was left out,
  or the sum overflowed) keeps the average's state, its error feedback, on
  every device, so that a skipped round loses nothing.

  Returns:
    The averaged outer gradient, a tuple like ``delta``; the average's new
    state; and a :class:`Sent`.
  """
  own_finite = base.all_finite(delta)
  delta = tuple(jnp.where(own_finite, d, 0.0) for d in delta)
  told = isinstance(average, participation.AverageOverParticipants)
  participating = own_finite if told else None
  finite_workers = own_finite.astype(jnp.float32)
  count_bits = jnp.float32(0)
  if not parsed.is_local:
    finite_workers = jax.lax.psum(finite_workers, parsed.name)
    count_bits = jnp.float32(wire.float32_allreduce_bits(1, size))
  if split is None:
    averaged, new_state, bits = _average(delta, average_state, average, parsed, size,
                                         participating)
  else:
    flat = jnp.concatenate([d.ravel() for d in delta])
    count = split_count(split)
    length = split_length(flat.size, count)
    flat = jnp.pad(flat, (0, count * length - flat.size))
    part = jax.lax.dynamic_slice_in_dim(flat, jax.lax.axis_index(split.name) * length, length)
    own_state = average_state if average is None else _own_draws(
        jax.tree.map(lambda x: x[0], average_state.state), split)
    (mine,), new_state, (total, outer) = _average((part,), own_state, average, parsed, size,
                                                  participating)
    if average is not None:
      new_state = SplitAverageState(jax.tree.map(lambda x: x[None], new_state))
    whole = axes.all_gather_replicated(mine, split.name).reshape(-1)
    starts = np.cumsum([0] + [d.size for d in delta[:-1]])
    averaged = tuple(whole[start:start + d.size].reshape(d.shape)
                     for start, d in zip(starts, delta, strict=True))
    # The gather runs over the fast links inside the worker: counted in all the bits only.
    gathered = 8 * wire.bytes_sent("all-gather", 4 * count * length, count)
    bits = (total + gathered, outer)
  # size / size is 1 exactly: with every worker finite the average is as it was.
  scale = jnp.where(finite_workers > 0, 1.0 if told else size / finite_workers, jnp.nan)
  averaged = tuple(a * scale for a in averaged)
  checks.check_same_everywhere(averaged, parsed)
  new_state = select(base.all_finite(averaged), new_state, average_state)
  skipped = (size - finite_workers).astype(jnp.int32)
  return averaged, new_state, Sent(bits[0] + count_bits, bits[1] + count_bits, skipped)


def _own_draws(state, split: axes.Axes):
  """``state`` with each PRNG key folded with this device's index along ``split``.

  The average draws its randomness per worker (it folds in the worker's
  index); each of a worker's devices averages a part of its own, and needs
  draws of its own too, or its dither is its neighbours'.
  """
  index = jax.lax.axis_index(split.name)

  def fold(x):
    if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
      return jax.random.fold_in(x, index)
    return x

  return jax.tree.map(fold, state)


def _average(delta, average_state, average, parsed: axes.Axes, size: int, participating):
  """``delta`` averaged over ``parsed``, the average's new state and the bits (all, outer);
  ``participating`` goes to an average that takes it (else ``None``)."""
  if average is None:
    if parsed.is_local:
      return delta, average_state, (jnp.float32(0), jnp.float32(0))
    averaged = tuple(jax.lax.pmean(d, parsed.name) for d in delta)
    bits = jnp.float32(wire.float32_allreduce_bits(sum(d.size for d in delta), size))
    new_state = average_state
  else:
    told = {} if participating is None else {"participating": participating}
    averaged, new_state = average.update(delta, average_state, None, **told)
    averaged = tuple(averaged)
  checks.check_averaged(averaged, parsed)
  sent = None if average is None else stats.compression_stats(new_state)
  if sent is not None:
    bits = sent.wire_bits
  elif average is not None:  # An average of the user's own, which keeps no stats.
    bits = jnp.float32(jnp.nan)
  outer_bits = bits if sent is None else sent.outer_wire_bits
  return averaged, new_state, (bits, outer_bits)


def select(condition, new, old):
  """``new`` where ``condition``, else ``old``, leaf by leaf (PRNG keys by their data)."""

  def choose(n, o):
    if jnp.issubdtype(jnp.result_type(n), jax.dtypes.prng_key):
      data = jnp.where(condition, jax.random.key_data(n), jax.random.key_data(o))
      return jax.random.wrap_key_data(data, impl=jax.random.key_impl(n))
    return jnp.where(condition, n, o)

  return jax.tree.map(choose, new, old)
