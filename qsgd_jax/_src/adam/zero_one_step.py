"""One update of 0/1 Adam: its phases, each a method of :class:`Step`.

:func:`~qsgd_jax.zero_one_adam` checks its input and assembles its state;
this module computes what an update changes. Before the variance freezes a
step either updates both moments from the float32 mean gradient (a
*variance step*) or only the momentum from the 1-bit average of the
gradients (a *1-bit step*); after it, each device steps on its own momentum
and, at synchronizations, the devices average how far they moved. Every
kind of step returns an :class:`Outcome` of the same types, as the
``jax.lax.switch`` that chooses it needs: the moments in the state's dtypes,
the updates in float32.
"""

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from qsgd_jax._src import axes as axes_lib
from qsgd_jax._src import base
from qsgd_jax._src.adam import common, shard_exchange

# What a step sends besides the float32 leaves: every float leaf in float32, the compressed
# ones by the 1-bit exchange, or nothing more.
SENT_FLOAT32, SENT_ONEBIT, SENT_SMALL = np.int32(0), np.int32(1), np.int32(2)


@dataclasses.dataclass(frozen=True)
class Settings:
  """The options of one :func:`~qsgd_jax.zero_one_adam`, fixed at construction."""

  axes: axes_lib.Axes
  schedule: Callable[[jax.Array], jax.Array]
  b1: float
  b2: float
  eps: float
  weight_decay: float
  bias_correction: bool
  var_update_scaler: int
  local_step_scaler: int
  local_step_clipper: int

  @property
  def local_steps(self) -> bool:
    """Whether devices may step on their own between synchronizations."""
    return self.local_step_clipper > 1

  def per_device(self, tree):
    """``tree`` typed as varying over the axes where local steps can make devices differ."""
    if not self.local_steps or self.axes.is_local:
      return tree
    return jax.tree.map(lambda x: axes_lib.as_varying(x, self.axes.name), tree)


class Moments(NamedTuple):
  """What a step before the freeze computes, in either of its branches."""

  mu: list[jax.Array]  # In the state's dtypes.
  nu: list[jax.Array]
  worker_error: tuple[jax.Array, ...]  # One a group of compressed leaves.
  server_error: tuple[jax.Array, ...]
  finite: jax.Array  # bool[]: the same on every device.
  variance_updates: jax.Array  # int32[]


class Local(NamedTuple):
  """A frozen step's own part, before any synchronization."""

  deltas: list  # float32 updates, None for a leaf that is not optimized.
  mu: list[jax.Array]  # This device's momentum, in the state's dtypes.
  nu: list[jax.Array]
  denominators: dict[int, jax.Array]  # sqrt(v_hat) + eps of each compressed leaf.
  accumulator: tuple[jax.Array, ...]  # Its updates since the last synchronization, this one in.
  learning_rate_sum: jax.Array
  finite: jax.Array


class Synchronized(NamedTuple):
  """What a step after the freeze computes, synchronizing or stepping locally."""

  deltas: list
  mu: list[jax.Array]
  accumulator: tuple[jax.Array, ...]
  worker_error: tuple[jax.Array, ...]  # One a group of compressed leaves.
  server_error: tuple[jax.Array, ...]
  finite: jax.Array
  learning_rate_sum: jax.Array
  sent: jax.Array  # int32[], one of SENT_*.


class Outcome(NamedTuple):
  """A step's new state and updates, the same fields and dtypes before and after the freeze."""

  deltas: list
  mu: list[jax.Array]
  nu: list[jax.Array]
  accumulator: tuple[jax.Array, ...]
  worker_error: tuple[jax.Array, ...]  # One a group of compressed leaves.
  server_error: tuple[jax.Array, ...]
  finite: jax.Array
  variance_interval: jax.Array
  variance_counter: jax.Array
  variance_updates: jax.Array
  local_interval: jax.Array
  local_counter: jax.Array
  learning_rate_sum: jax.Array
  variance_updated: jax.Array
  sent: jax.Array


class Step:
  """One update's inputs, and its phases.

  Args:
    settings: the optimizer's :class:`Settings`.
    state: its :class:`~qsgd_jax.ZeroOneAdamState` before the update.
    grads: this device's gradients, flattened.
    params: the parameters, flattened.
    decayed: whether weight decay applies to each leaf.
    leaves: how each leaf travels.
    exchange_plan: the compressed leaves' groups for the 1-bit exchange.
    sizes: the mapped axes' sizes, outer first.
  """

  def __init__(self, settings: Settings, state, grads: list[jax.Array], params: list[jax.Array],
               decayed: list[bool], leaves: common.Leaves,
               exchange_plan: shard_exchange.ExchangePlan, sizes: tuple[int, ...]):
    self.settings, self.state, self.grads, self.params = settings, state, grads, params
    self.decayed, self.leaves, self.sizes = decayed, leaves, sizes
    self.exchange_plan = exchange_plan
    self.mu, self.nu = jax.tree.leaves(state.mu), jax.tree.leaves(state.nu)
    self.count = optax.safe_increment(state.count)
    self.learning_rate = jnp.asarray(settings.schedule(state.count), jnp.float32)
    # The learning rates' sum since the last synchronization, this step's included.
    self.learning_rate_sum = state.learning_rate_sum + self.learning_rate
    self.momentum_correction = 1 - settings.b1 ** self.count if settings.bias_correction else 1.0

  def run(self) -> Outcome:
    """The update's :class:`Outcome`, from one of its kinds of step, chosen by one
    ``jax.lax.switch``: before the freeze a variance step or a 1-bit step; after it a
    synchronization by the 1-bit exchange, one by the float32 momentum average (after
    learning rates of zero only), or a local step.

    One conditional, not one nested in another for each choice: XLA:GPU runs a conditional
    by reading its predicate back to the host (unless a CUDA graph holds it), and the step
    that nested three lasted 7.6 ms longer than its kernels on an H100, AdamW's 3.6
    (``benchmarks/step_profile.py``)."""
    s, state = self.settings, self.state
    is_variance_step = self.count % state.variance_interval == 0
    kinds = [lambda: self.warm(self.variance_step(), is_variance_step),
             lambda: self.warm(self.onebit_step(), is_variance_step),
             lambda: self.frozen(self.onebit_sync),
             lambda: self.frozen(self.momentum_sync)]
    if s.local_steps:
      kinds.append(lambda: self.frozen(self.local_only))
      synchronizing = self.count % state.local_interval == 0
    else:
      synchronizing = jnp.bool_(True)
    moved = self.learning_rate_sum > 0  # Else a synchronization has no movement to read.
    kind = jnp.where(state.count >= state.freeze_count,
                     jnp.where(synchronizing, jnp.where(moved, 2, 3), 4),
                     jnp.where(is_variance_step, 0, 1))
    return jax.lax.switch(kind, [lambda _, step=step: self.kept(step()) for step in kinds], None)

  def kept(self, outcome: Outcome) -> Outcome:
    """``outcome`` whose fields of the state (moments, accumulator, errors, counters) are the
    state's if the step is not finite: chosen inside each branch, where XLA fuses the choice
    into what computes them."""
    old = self.state._replace(mu=self.mu, nu=self.nu)  # The moments as flat lists.
    names = [name for name in Outcome._fields if name in old._fields]
    chosen = common.tree_select(outcome.finite, [getattr(outcome, name) for name in names],
                                [getattr(old, name) for name in names])
    return outcome._replace(**dict(zip(names, chosen, strict=True)))

  # The arithmetic every phase shares.

  def denominator(self, v: jax.Array, updates_count) -> jax.Array:
    """:math:`\\sqrt{\\hat v} + \\epsilon`, in float32 at least."""
    s = self.settings
    v_hat = optax.tree.bias_correction(v, s.b2, updates_count) if s.bias_correction else v
    return jnp.sqrt(v_hat) + s.eps

  def delta(self, i: int, m: jax.Array, denominator: jax.Array) -> jax.Array:
    """Leaf ``i``'s update from momentum ``m``: :math:`-\\eta (\\hat m / d + \\lambda p)`."""
    s = self.settings
    update = (m / self.momentum_correction if s.bias_correction else m) / denominator
    if self.decayed[i]:
      update = update + s.weight_decay * self.params[i]
    return (-self.learning_rate * update).astype(jnp.float32)

  def stored(self, mu: list, nu: list) -> tuple[list, list]:
    """The moments in the state's dtypes: every branch returns them so."""
    return common.cast_like(mu, self.mu), common.cast_like(nu, self.nu)

  def small_leaves(self, mu: list, nu: list, flag: jax.Array):
    """The float32 leaves' plain Adam step; ``flag`` (this device's) travels with them."""
    s, small = self.settings, self.leaves.float32
    means = common.pmean_float32([self.grads[i] for i in small] + [flag.astype(jnp.float32)],
                                 s.axes)
    flag = means.pop()
    for i, mean in zip(small, means, strict=True):
      mu[i] = optax.tree.update_moment(mean, self.mu[i], s.b1, 1)
      nu[i] = optax.tree.update_moment_per_elem_norm(mean, self.nu[i], s.b2, 2)
    return mu, nu, (flag == 0) & base.all_finite(means)

  # Before the freeze.

  def variance_step(self) -> Moments:
    """Both moments from the float32 mean gradient."""
    s, state = self.settings, self.state
    indices = tuple(sorted(self.leaves.compressed + self.leaves.float32))
    means = common.pmean_float32([self.grads[i] for i in indices], s.axes)
    mu, nu = list(self.mu), list(self.nu)
    for i, mean in zip(indices, means, strict=True):
      mu[i] = optax.tree.update_moment(mean, self.mu[i], s.b1, 1)
      nu[i] = optax.tree.update_moment_per_elem_norm(mean, self.nu[i], s.b2, 2)
    return Moments(*self.stored(mu, nu), state.worker_error, state.server_error,
                   base.all_finite(means), state.variance_updates + 1)

  def onebit_step(self) -> Moments:
    """The compressed leaves' momentum from the 1-bit average of the gradients."""
    s, state, compressed = self.settings, self.state, self.leaves.compressed
    out = shard_exchange.exchange(self.exchange_plan, [self.grads[i] for i in compressed],
                                  state.worker_error, state.server_error, s.axes, self.sizes)
    mu = list(self.mu)
    for i, vector in zip(compressed, out.vectors, strict=True):
      mu[i] = common.unseen_masked(optax.tree.update_moment(vector, self.mu[i], s.b1, 1),
                                   self.nu[i])
    mu, nu, finite = self.small_leaves(mu, list(self.nu), jnp.bool_(False))
    return Moments(*self.stored(mu, nu), out.worker_error, out.server_error,
                   out.all_finite & finite, state.variance_updates)

  def warm(self, moments: Moments, is_variance_step: jax.Array) -> Outcome:
    """A step before the freeze from its ``moments``: a variance step's at multiples of the
    interval, else a 1-bit step's."""
    s, state, kinds = self.settings, self.state, self.leaves.kinds
    deltas = [None if kind == "other" else self.delta(i, moments.mu[i], self.denominator(
        moments.nu[i], moments.variance_updates if kind == "compressed" else self.count))
              for i, kind in enumerate(kinds)]
    counter = state.variance_counter + is_variance_step.astype(jnp.int32)
    doubled = counter == s.var_update_scaler
    return Outcome(
        deltas=s.per_device(deltas), mu=moments.mu, nu=moments.nu,
        accumulator=state.accumulator, worker_error=moments.worker_error,
        server_error=moments.server_error, finite=moments.finite,
        variance_interval=jnp.where(doubled, 2 * state.variance_interval,
                                    state.variance_interval),
        variance_counter=jnp.where(doubled, 0, counter),
        variance_updates=moments.variance_updates, local_interval=state.local_interval,
        local_counter=state.local_counter, learning_rate_sum=state.learning_rate_sum,
        variance_updated=is_variance_step,
        sent=jnp.where(is_variance_step, SENT_FLOAT32, SENT_ONEBIT))

  # After the freeze.

  def local(self) -> Local:
    """This device's step on its own momentum of its own gradients (the inner axes' mean)."""
    s, state, compressed = self.settings, self.state, self.leaves.compressed
    grads = common.inner_mean([self.grads[i] for i in compressed], s.axes)
    flag = jnp.logical_not(base.all_finite([self.grads[i] for i in compressed]))
    mu, nu, finite = self.small_leaves(list(self.mu), list(self.nu), flag)
    deltas = [None] * len(self.grads)
    denominators = {}
    for k, i in enumerate(compressed):
      mu[i] = common.unseen_masked(optax.tree.update_moment(grads[k], self.mu[i], s.b1, 1),
                                   self.nu[i])
      denominators[i] = self.denominator(self.nu[i], state.variance_updates)
      deltas[i] = self.delta(i, mu[i], denominators[i])
    for i in self.leaves.float32:
      deltas[i] = self.delta(i, mu[i], self.denominator(nu[i], self.count))
    if s.local_steps:
      accumulator = tuple(a + deltas[i] for a, i in zip(state.accumulator, compressed,
                                                        strict=True))
    else:
      accumulator = tuple(deltas[i] for i in compressed)
    return Local(deltas, *self.stored(mu, nu), denominators, accumulator,
                 self.learning_rate_sum, finite)

  def synchronized(self, local: Local, average: list, moved: list):
    """The updates, momentum and accumulator of a synchronization: the compressed leaves'
    momentum ``average`` and the parameters ``moved`` from the last synchronized point."""
    s = self.settings
    mu, deltas = list(local.mu), list(local.deltas)
    for k, i in enumerate(self.leaves.compressed):
      mu[i] = common.unseen_masked(average[k], self.nu[i])
      deltas[i] = (moved[k] - self.state.accumulator[k] if s.local_steps
                   else moved[k]).astype(jnp.float32)
    zeros = tuple(jnp.zeros_like(a) for a in local.accumulator) if s.local_steps else ()
    return (s.per_device(deltas), s.per_device(common.cast_like(mu, self.mu)),
            s.per_device(zeros))

  def onebit_sync(self, local: Local) -> Synchronized:
    """The devices average how far they moved, times the denominator, by the 1-bit exchange:
    the momentum is that over the sum of the learning rates."""
    state, compressed = self.state, self.leaves.compressed
    scaled = [a * local.denominators[i]
              for a, i in zip(local.accumulator, compressed, strict=True)]
    out = shard_exchange.exchange(self.exchange_plan, scaled, state.worker_error,
                                  state.server_error, self.settings.axes, self.sizes)
    average = [-(u / local.learning_rate_sum) * self.momentum_correction for u in out.vectors]
    moved = [common.unseen_masked(u / local.denominators[i], self.nu[i])
             for u, i in zip(out.vectors, compressed, strict=True)]
    return Synchronized(*self.synchronized(local, average, moved), out.worker_error,
                        out.server_error, out.all_finite & base.all_finite(average),
                        jnp.float32(0), SENT_ONEBIT)

  def momentum_sync(self, local: Local) -> Synchronized:
    """A synchronization after learning rates of zero only (a warm restart, a schedule decayed
    to zero): nothing moved, and the momentum cannot be read back from the movement (0 / 0).
    The devices average their momenta in float32 instead, as AdamW's would be, the
    parameters stay, and the exchange's errors are untouched."""
    compressed = self.leaves.compressed
    average = common.pmean_float32([local.mu[i] for i in compressed], self.settings.axes)
    moved = [common.zeros_laid_out_as(a, a.dtype) for a in local.accumulator]
    return Synchronized(*self.synchronized(local, average, moved), self.state.worker_error,
                        self.state.server_error, base.all_finite(average), jnp.float32(0),
                        SENT_FLOAT32)

  def local_only(self, local: Local) -> Synchronized:
    s = self.settings
    return Synchronized(s.per_device(local.deltas), s.per_device(local.mu), local.accumulator,
                        self.state.worker_error, self.state.server_error, jnp.bool_(True),
                        local.learning_rate_sum, SENT_SMALL)

  def frozen(self, sync) -> Outcome:
    """A step after the freeze: this device's local step, then ``sync`` of it (a
    synchronization, or the local step alone)."""
    s, state = self.settings, self.state
    local = self.local()
    sync = sync(local)
    counter = state.local_counter + 1
    doubled = counter == s.local_step_scaler
    return Outcome(
        deltas=s.per_device(sync.deltas), mu=sync.mu, nu=local.nu,
        accumulator=sync.accumulator, worker_error=sync.worker_error,
        server_error=sync.server_error, finite=local.finite & sync.finite,
        variance_interval=state.variance_interval, variance_counter=state.variance_counter,
        variance_updates=state.variance_updates,
        local_interval=jnp.where(
            doubled, jnp.minimum(s.local_step_clipper, 2 * state.local_interval),
            state.local_interval),
        local_counter=jnp.where(doubled, 0, counter),
        learning_rate_sum=sync.learning_rate_sum, variance_updated=jnp.bool_(False),
        sent=sync.sent)
