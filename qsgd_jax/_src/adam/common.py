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
from qsgd_jax._src.adam import sign_exchange

FreezeStep = int | Literal["auto"]
# The float32 path for leaves under this many elements (biases, norm scales), as the
# library's other averages do; 0 compresses every float leaf, as DeepSpeed does.
DEFAULT_MIN_COMPRESSED_SIZE = 4096
_NEVER = np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True)
class Leaves:
  """How each leaf of a gradient tree travels, decided from static shapes.

  Attributes:
    shapes: each leaf's shape, in tree order.
    kinds: ``"compressed"``, ``"float32"`` or ``"other"`` (not float) a leaf.
  """

  shapes: tuple[tuple[int, ...], ...]
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
    return sum(math.prod(self.shapes[i]) for i in self.indices(kind))

  def shares(self, inner_size: int) -> tuple[int, ...]:
    """Elements of each compressed leaf that one of ``inner_size`` devices of a node exchanges."""
    return tuple(-(-math.prod(self.shapes[i]) // inner_size) for i in self.compressed)

  def layout(self, num_devices: int, inner_size: int = 1) -> sign_exchange.SignLayout:
    """The exchange's layout of the compressed leaves' shares over ``num_devices``."""
    return sign_exchange.sign_layout(self.shares(inner_size), num_devices)


def leaves_of(tree, min_compressed_size: int, compression_mask) -> Leaves:
  """The :class:`Leaves` of ``tree`` (arrays or shapes).

  Args:
    tree: the gradients or parameters (or their ``jax.eval_shape``).
    min_compressed_size: float leaves with fewer elements take the float32 path.
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
  return Leaves(tuple(tuple(leaf.shape) for leaf in leaves), tuple(kinds))


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


def initial_errors(layout: sign_exchange.SignLayout, axes: axes_lib.Axes):
  """Zero worker and server errors for ``layout``; empty tuples when nothing is compressed.

  Each device's own: typed varying over the axes where ``init`` runs inside
  ``jax.shard_map``, as the exchange's new errors are, so that an update in
  the same mapped function finds the same types in both branches of its
  switch.
  """
  if not layout.sizes:
    return (), ()
  errors = (jnp.zeros(layout.worker_error_shape().shape, jnp.float32),
            jnp.zeros(layout.server_error_shape().shape, jnp.float32))
  if axes.is_local:
    return errors
  try:
    return axes_lib.as_varying(errors, axes.name)
  except NameError:  # init outside the mapped function, sized by axis_size.
    return errors


def check_error_shapes(owner: str, worker_error, layout: sign_exchange.SignLayout) -> None:
  """Raises ``ValueError`` where the state's error buffers are not the layout's shapes."""
  expected = layout.worker_error_shape().shape if layout.sizes else None
  held = getattr(worker_error, "shape", None)
  if held == expected:
    return
  devices = f"{held[0]} devices" if held and len(held) == 2 else "no compressed leaf"
  raise ValueError(
      f"{owner}: the state's worker_error has shape {held}, this step needs {expected}: the "
      f"state was made for {devices} on the compressed axis and this step runs on "
      f"{layout.num_devices}, or for another parameter tree. Initialize the optimizer for this "
      "mesh, or carry the state over with qsgd_jax.resize_state(..., drop=True).")


def zero_update(x) -> jax.Array:
  """The update of a leaf the optimizer does not change: zeros of its dtype (``float0`` kept)."""
  return np.zeros(jnp.shape(x), jax.dtypes.float0) if jnp.result_type(
      x) == jax.dtypes.float0 else jnp.zeros(jnp.shape(x), jnp.result_type(x))


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
  """Each leaf in float32, averaged over every axis by one ``jax.lax.pmean`` (as it is, locally)."""
  leaves = [leaf.astype(jnp.float32) for leaf in leaves]
  if axes.is_local or not leaves:
    return leaves
  return jax.lax.pmean(leaves, axes.name)


def inner_mean(leaves: list[jax.Array], axes: axes_lib.Axes) -> list[jax.Array]:
  """Each leaf in float32 averaged over the inner axes (the fast links), if any."""
  leaves = [leaf.astype(jnp.float32) for leaf in leaves]
  if not axes.inner or not leaves:
    return leaves
  return jax.lax.pmean(leaves, _inner_name(axes))


def _inner_name(axes: axes_lib.Axes):
  return axes.inner if len(axes.inner) > 1 else axes.inner[0]


def exchange(vectors: list[jax.Array], worker_error: jax.Array, server_error: jax.Array,
             leaves: Leaves, axes: axes_lib.Axes,
             sizes: tuple[int, ...]) -> sign_exchange.Exchanged:
  """The 1-bit average over every axis of the compressed leaves' ``vectors``.

  Over one axis, DeepSpeed's exchange of each vector whole. With inner axes
  (``m`` devices a node), each vector is zero-padded to a multiple of ``m``
  and reduce-scattered over the inner axes in float32, so that each device of
  a node holds the node's mean of one ``1/m`` share; the shares are averaged
  over the outer axis by the 1-bit exchange (a scale a share), and
  all-gathered over the inner axes. The outer links carry ``1/m`` of each
  vector's signs a device.

  Args:
    vectors: this device's vectors, one a compressed leaf (any shape).
    worker_error, server_error: this device's errors, for the layout of the
      shares (:meth:`Leaves.layout` with ``inner_size=m``).
    leaves: the tree's :class:`Leaves`.
    axes: the reduction's axes.
    sizes: their sizes, outer first (empty for one device).

  Returns:
    :class:`~qsgd_jax._src.adam.sign_exchange.Exchanged`, its ``vectors`` the
    averages in the leaves' shapes, the same on every device.
  """
  if not vectors:
    return sign_exchange.Exchanged([], worker_error, server_error, jnp.bool_(True))
  n = sizes[0] if sizes else 1
  m = math.prod(sizes[1:])
  flat = [v.reshape(-1).astype(jnp.float32) for v in vectors]
  layout = leaves.layout(n, m)
  if m > 1:
    rows = jnp.concatenate(
        [jnp.pad(v, (0, m * share - v.shape[0])).reshape(m, share)
         for v, share in zip(flat, layout.sizes, strict=True)], axis=1)
    rows = axes_lib.as_varying(rows, _inner_name(axes))
    mine = jax.lax.psum_scatter(rows, _inner_name(axes), scatter_dimension=0) / np.float32(m)
    flat = list(jnp.split(mine, np.cumsum(layout.sizes)[:-1]))
  out = sign_exchange.exchange(flat, worker_error, server_error, layout, axes.outer)
  averages = out.vectors
  if m > 1:
    # Each share's finiteness travels with it, as a last element that is NaN if not.
    flag = jnp.where(out.all_finite, np.float32(0), np.float32(np.nan))[None]
    gathered = axes_lib.all_gather_replicated(jnp.concatenate([*averages, flag]),
                                              _inner_name(axes))
    averages = [part.reshape(-1) for part in jnp.split(
        gathered[:, :-1], np.cumsum(layout.sizes)[:-1], axis=1)]
    out = out._replace(all_finite=jnp.all(jnp.isfinite(gathered[:, -1])))
  shapes = [leaves.shapes[i] for i in leaves.compressed]
  return out._replace(vectors=[a[:math.prod(shape)].reshape(shape)
                               for a, shape in zip(averages, shapes, strict=True)])


def tree_select(condition: jax.Array, new: Any, old: Any) -> Any:
  return jax.tree.map(lambda a, b: jnp.where(condition, a, b), new, old)


def variance_zeros(params) -> Any:
  """The second moment's zeros: in each parameter's dtype, but float32 for float16 ones.

  Squared gradients underflow float16 (its smallest value is about
  :math:`6 \\times 10^{-8}`: :math:`(1 - \\beta_2) g^2` is zero for
  :math:`|g| < 8 \\times 10^{-3}`), and Adam would divide a momentum by
  :math:`\\sqrt{0} + \\epsilon`; bfloat16 has float32's range.
  """
  return jax.tree.map(
      lambda x: jnp.zeros(jnp.shape(x), jnp.float32 if jnp.result_type(x) == jnp.float16
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
