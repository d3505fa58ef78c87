"""What 1-bit Adam and 0/1 Adam share: which leaves are compressed, checks, and the auto freeze.

Both optimizers take each device's local gradients and average them
themselves: a leaf travels through DeepSpeed's 1-bit exchange
(``sign_exchange.py``) when it is a float leaf of at least
``min_compressed_size`` elements that ``compression_mask`` does not exclude;
every other float leaf is averaged in float32 by one ``jax.lax.pmean`` and
follows plain Adam; a leaf that is not float (integer, bool, ``float0``) is
not optimized, its update zero.
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from qsgd_jax._src import axes as axes_lib
from qsgd_jax._src import shards

FreezeStep = int | Literal["auto"]
# The float32 path for leaves under this many elements (biases, norm scales), as the
# library's other averages do; 0 compresses every float leaf, as DeepSpeed does.
DEFAULT_MIN_COMPRESSED_SIZE = 4096
_NEVER = np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True)
class Leaves:
  """How each leaf of a gradient tree travels, decided from static shapes.

  Attributes:
    sizes: each leaf's elements one device exchanges (its own shard, on a mesh
      whose model is sharded over other axes, as ``shards.spread`` lays it
      out), in tree order.
    kinds: ``"compressed"``, ``"float32"`` or ``"other"`` (not float) a leaf.
  """

  sizes: tuple[int, ...]
  kinds: tuple[str, ...]

  def indices(self, kind: str) -> tuple[int, ...]:
    return tuple(i for i, k in enumerate(self.kinds) if k == kind)

  @functools.cached_property
  def compressed(self) -> tuple[int, ...]:
    return self.indices("compressed")

  @functools.cached_property
  def float32(self) -> tuple[int, ...]:
    return self.indices("float32")

  def elements(self, kind: str) -> int:
    """Elements of the leaves of ``kind`` on one device."""
    return sum(self.sizes[i] for i in self.indices(kind))


def leaves_of(tree, min_compressed_size: int, compression_mask) -> Leaves:
  """The :class:`Leaves` of ``tree`` (arrays or shapes).

  Args:
    tree: the gradients or parameters (or their ``jax.eval_shape``).
    min_compressed_size: float leaves with fewer elements (whole leaves, however
      they are laid out over a mesh) take the float32 path.
    compression_mask: ``None``, a pytree of bools with ``tree``'s structure, or
      a callable returning one from ``tree``; ``False`` leaves take the
      float32 path.
  """
  leaves = jax.tree.leaves(tree)
  if compression_mask is None:
    mask = [True] * len(leaves)
  else:
    given = compression_mask(tree) if callable(compression_mask) else compression_mask
    mask = jax.tree.leaves(given)
    if len(mask) != len(leaves):
      raise ValueError(
          f"compression_mask has {len(mask)} leaves and the tree {len(leaves)}: give one bool "
          "a leaf, in the parameters' structure (or a callable that returns it).")
  kinds = []
  for leaf, compress in zip(leaves, mask, strict=True):
    dtype = jnp.result_type(leaf)
    if not jnp.issubdtype(dtype, jnp.floating):
      kinds.append("other")
    elif bool(compress) and math.prod(leaf.shape) >= max(min_compressed_size, 1):
      kinds.append("compressed")
    else:
      kinds.append("float32")
  # What a device exchanges of each: its part of the leaf as shards.spread lays it out.
  sizes = tuple(math.prod(shards.spread_shape(leaf)) for leaf in leaves)
  return Leaves(sizes, tuple(kinds))


def check_options(owner: str, *, b1, b2, eps, min_compressed_size) -> None:
  """Raises ``ValueError`` for decay rates outside ``[0, 1)``, a negative ``eps`` or size."""
  for name, value in (("b1", b1), ("b2", b2)):
    if not isinstance(value, int | float) or not 0 <= value < 1:
      raise ValueError(
          f"{owner}: {name} must be a float in [0, 1) (a decay rate of a moving average), "
          f"got {value!r}.")
  if not isinstance(eps, int | float) or eps < 0:
    raise ValueError(f"{owner}: eps must be a non-negative float, got {eps!r}.")
  if (not isinstance(min_compressed_size, int) or isinstance(min_compressed_size, bool)
      or min_compressed_size < 0):
    raise ValueError(
        f"{owner}: min_compressed_size must be a non-negative int (0 compresses every float "
        f"leaf, as DeepSpeed does), got {min_compressed_size!r}.")


def check_positive_int(owner: str, name: str, value, hint: str = "") -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f"{owner}: {name} must be a positive int{hint}, got {value!r}.")


def check_freeze_step(owner: str, name: str, value: FreezeStep) -> None:
  if value == "auto":
    return
  check_positive_int(
      owner, name, value,
      " (the number of float32 steps before the variance is frozen) or 'auto'")


def mapped_sizes(axes: axes_lib.Axes, axis_size, owner: str) -> tuple[int, ...]:
  """Each axis's size, outer first: bound, or given by ``axis_size`` (an int for one axis,
  a dict by name) where ``init`` runs outside the mapped function."""
  given = axis_size if isinstance(axis_size, dict) else (
      {} if axis_size is None else {axes.outer: axis_size})
  sizes = []
  for name in axes.names:
    try:
      sizes.append(jax.lax.axis_size(name))
    except NameError:
      if name not in given:
        raise NameError(
            f"{owner}: axis_name {name!r} is not bound here, so the size of the per-device "
            "error buffers is unknown. Call init inside jax.pmap / jax.shard_map over it (as "
            "qsgd_jax.data_parallel does), or pass axis_size=<number of devices on that axis> "
            "(a dict by axis name for several axes).") from None
      sizes.append(given[name])
  return tuple(sizes)


def check_axis_size(owner: str, axis_size) -> None:
  if axis_size is None:
    return
  for value in (axis_size.values() if isinstance(axis_size, dict) else (axis_size,)):
    check_positive_int(owner, "axis_size", value, " (or a dict of them by axis name)")


def check_tree(owner: str, updates, params, moments) -> None:
  """Raises ``ValueError`` where the gradients' structure is not the parameters' or the state's."""
  structure = jax.tree.structure(updates)
  for name, tree in (("params", params), ("the state's moments", moments)):
    if tree is None:
      continue
    other = jax.tree.structure(tree)
    if other != structure:
      raise ValueError(
          f"{owner}: the gradients' tree structure differs from {name}'s: {structure} against "
          f"{other}. Pass gradients of exactly the parameters the optimizer was initialized "
          "with (jax.grad of the loss with respect to them).")


def zero_update(x) -> jax.Array:
  """The update of a leaf the optimizer does not change: zeros of its dtype (``float0`` kept)."""
  return np.zeros(jnp.shape(x), jax.dtypes.float0) if jnp.result_type(
      x) == jax.dtypes.float0 else zeros_laid_out_as(x, jnp.result_type(x))


def zeros_laid_out_as(x, dtype) -> jax.Array:
  """Zeros of ``x``'s shape in ``dtype``, laid out over the explicit mesh axes as ``x`` is (on
  a mesh whose model is sharded, its shards' layout), and the same on every device of the
  mapped axes whatever ``x`` is there (``jnp.zeros_like`` would keep a per-device type)."""
  sharding = jax.typeof(x).sharding if any(shards.spec_of(x)) else None
  return jnp.zeros(jnp.shape(x), dtype, out_sharding=sharding)


class AutoFreeze:
  """The rule of ``freeze_step="auto"``: freeze once the variance has stopped moving.

  The statistic is each compressed leaf's share of the variance,
  ``p_i = ||v_i||_1 / sum_j ||v_j||_1``, and its drift is the total variation
  distance between the mean shares of the newer and the older half of the
  last ``window`` updates: ``sum_i |mean(p_i newer) - mean(p_i older)| / 2``,
  a number in ``[0, 1]`` whose step-to-step noise the means average out. The
  variance is frozen after the first update at which the window is full and
  the drift is at most ``tolerance``.

  Shares, not the norm ``||v||_1`` that the 1-bit Adam paper plots (Tang et
  al. 2021, Section 3), because the norm stands still for the wrong reasons:
  while gradients are clipped, ``||v||_1`` is the square of the clipping norm
  whatever the model does, and a rule on it froze a small GPT in its first
  twenty updates, 0.15 nats a byte worse at the end than freezing at a fifth
  of training. Shares are unchanged by any factor common to all gradients
  (clipping, the learning rate's schedule) and move while the layers' roles
  settle. With a single compressed leaf the share is always 1, and the rule
  reads the relative drift of its norm instead, ``|mean(newer) -
  mean(older)| / mean(all)``.

  Every device holds the same variance, updated from the float32 mean
  gradient, so every device decides alike.
  """

  def __init__(self, window: int, tolerance: float):
    self.window = window
    self.tolerance = tolerance

  def initial(self, num_leaves: int) -> jax.Array:
    """``float32[window, num_leaves]``: no update recorded yet (NaN)."""
    return jnp.full((self.window, num_leaves), jnp.nan, jnp.float32)

  def record(self, history: jax.Array, updates_seen: jax.Array,
             statistic: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``history`` with ``statistic`` (a norm a leaf) as update ``updates_seen`` (1-based);
    whether to freeze."""
    history = history.at[(updates_seen - 1) % self.window].set(statistic)
    # How many updates ago each row was recorded: 0 for this one.
    age = (updates_seen - 1 - jnp.arange(self.window)) % self.window
    half = self.window // 2
    newer, older = (age < half)[:, None], (age >= self.window - half)[:, None]
    if history.shape[1] > 1:
      shares = history / jnp.sum(history, axis=1, keepdims=True)
      drift = jnp.sum(jnp.abs(jnp.mean(shares, axis=0, where=newer)
                              - jnp.mean(shares, axis=0, where=older))) / 2
    else:
      drift = (jnp.abs(jnp.mean(history, where=newer) - jnp.mean(history, where=older))
               / jnp.mean(history))
    settled = (updates_seen >= self.window) & (drift <= self.tolerance)
    return history, settled

  def update(self, history: jax.Array, freeze_count: jax.Array, *, variances: list[jax.Array],
             updates_seen: jax.Array, recorded: jax.Array, count: jax.Array, b2: float,
             bias_correction: bool) -> tuple[jax.Array, jax.Array]:
    """The history and freeze count after an update that moved ``variances`` (the compressed
    leaves' second moments, the ``updates_seen``-th time): recorded only where ``recorded``
    (a finite update before the freeze), the variance frozen from ``count`` on if settled."""
    if not variances:  # Nothing compressed: nothing to freeze.
      return history, freeze_count
    correction = 1 - b2 ** updates_seen if bias_correction else 1.0
    new_history, settled = self.record(history, updates_seen, statistic(variances, correction))
    return (jnp.where(recorded, new_history, history),
            jnp.where(recorded & settled, count, freeze_count))


def auto_freeze(owner: str, freeze_step: FreezeStep, window: int,
                tolerance: float) -> AutoFreeze | None:
  """The rule of ``"auto"``, its options checked; ``None`` for a given freeze step."""
  if not isinstance(window, int) or isinstance(window, bool) or window < 2:
    raise ValueError(f"{owner}: auto_freeze_window must be an int of at least 2, got {window!r}.")
  if not isinstance(tolerance, int | float) or tolerance < 0:
    raise ValueError(
        f"{owner}: auto_freeze_tolerance must be a non-negative float, got {tolerance!r}.")
  return AutoFreeze(window, tolerance) if freeze_step == "auto" else None


def initial_freeze_count(freeze_step: FreezeStep) -> jax.Array:
  """``int32[]``: the count from which the variance is frozen (``int32`` max: not yet chosen)."""
  return jnp.asarray(_NEVER if freeze_step == "auto" else freeze_step, jnp.int32)


def statistic(nu_leaves: list[jax.Array], correction) -> jax.Array:
  """``float32[leaves]``: ``||v||_1`` of each compressed leaf's variance over ``correction``."""
  return jnp.stack([jnp.sum(v.astype(jnp.float32)) for v in nu_leaves]) / correction


def pmean_float32(leaves: list[jax.Array], axes: axes_lib.Axes) -> list[jax.Array]:
  """Each leaf in float32, averaged over every axis by one ``jax.lax.pmean`` (as it is, locally).

  A leaf whole over explicit mesh axes is averaged in parts laid out over them
  (:func:`qsgd_jax._src.shards.spread`): each device sends its part, not all of it.
  """
  leaves = [leaf.astype(jnp.float32) for leaf in leaves]
  if axes.is_local or not leaves:
    return leaves
  leaves, specs = shards.spread(leaves)
  return shards.gather_back(jax.lax.pmean(leaves, axes.name), specs)


def inner_mean(leaves: list[jax.Array], axes: axes_lib.Axes) -> list[jax.Array]:
  """Each leaf in float32 averaged over the inner axes (the fast links), if any."""
  leaves = [leaf.astype(jnp.float32) for leaf in leaves]
  if not axes.inner or not leaves:
    return leaves
  return jax.lax.pmean(leaves, _inner_name(axes))


def _inner_name(axes: axes_lib.Axes):
  return axes.inner if len(axes.inner) > 1 else axes.inner[0]


def tree_select(condition: jax.Array, new: Any, old: Any) -> Any:
  return jax.tree.map(lambda a, b: jnp.where(condition, a, b), new, old)


def variance_zeros(params) -> Any:
  """The second moment's zeros: in each parameter's dtype, but float32 for float16 ones, laid
  out as the parameter is.

  Squared gradients underflow float16 (its smallest value is about
  :math:`6 \\times 10^{-8}`: :math:`(1 - \\beta_2) g^2` is zero for
  :math:`|g| < 8 \\times 10^{-3}`), and Adam would divide a momentum by
  :math:`\\sqrt{0} + \\epsilon`; bfloat16 has float32's range.
  """
  return jax.tree.map(
      lambda x: zeros_laid_out_as(x, jnp.float32 if jnp.result_type(x) == jnp.float16
                                  else jnp.result_type(x)), params)


def cast_like(new: list, old: list) -> list:
  """Each of ``new`` in the dtype of ``old``'s leaf at its place: one cast a branch output, so
  that the branches of a ``jax.lax.cond`` agree whatever the parameters' dtypes."""
  return [x.astype(jnp.result_type(like)) for x, like in zip(new, old, strict=True)]


def unseen_masked(momentum: jax.Array, variance: jax.Array) -> jax.Array:
  r"""``momentum`` with zeros where ``variance`` is exactly zero.

  A coordinate whose second moment is zero has had a zero mean gradient at
  every update that moved the variance (an embedding row whose token never
  came, a padding row, a dead unit). Adam moves it by
  :math:`\hat m / (\sqrt{0} + \epsilon) = 0` there. A 1-bit exchange cannot
  send a zero: every element gets its tensor's scale with some sign, and
  :math:`m / \epsilon` would move such a coordinate by about :math:`10^8` times
  that scale a step. Its momentum is kept at zero instead, so it moves no
  further than AdamW moves it (weight decay alone). DeepSpeed's answer to the
  same problem is a mask the user gives (``exp_avg_mask``, multiplied into
  the momentum after the compressed all-reduce, for e.g. the unused tail of a
  positional embedding); here it is read from the variance, for every leaf.
  """
  return jnp.where(variance == 0, jnp.zeros((), momentum.dtype), momentum)


def as_callable_schedule(learning_rate) -> Callable[[jax.Array], jax.Array]:
  return learning_rate if callable(learning_rate) else (lambda count: learning_rate)
