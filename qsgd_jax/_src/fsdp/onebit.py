r"""1-bit Adam under FSDP: a gather whose gradient goes 1-bit with error feedback.

1-bit Adam (Tang et al. 2021) freezes Adam's variance after a float32
warm-up and then averages the momentum :math:`m_k = \beta_1 m + (1 - \beta_1)
g_k` of the ``n`` devices by a 1-bit exchange with error feedback. Under FSDP
(ZeRO-3) device ``j`` holds only shard ``j`` of :math:`m` and :math:`v`, and
the average it needs is of its shard only:
:math:`\frac{1}{n}\sum_k m_k = \beta_1 m + (1 - \beta_1) \bar g`, where
:math:`\bar g` is the mean gradient, so exchanging momenta is the same as
reduce-scattering the gradients and stepping each shard's momentum with its
averaged gradient. :func:`fsdp_onebit_gather` is :func:`~qsgd_jax.fsdp_gather`
whose gradient, once ``compress`` is true, is that reduce-scatter in one bit
an element: DeepSpeed's worker half of the exchange (each device adds its
worker error to its cotangent, sends one scale a tensor and the signs, keeps
what the signs missed as its next error), after which device ``j`` sums the
``n`` decoded copies of its shard in float32. The exchange's second half, the
server's 1-bit all-gather of the averaged momentum (and with it the server
error), has nothing to do: the server of a shard is its owner, the only
device that needs it. :func:`fsdp_onebit_adam` is Adam on the shards with
the variance frozen after the warm-up.

What travels: ``(n - 1) / n`` of one bit an element (plus a float32 scale a
tensor and device), against 32 bits for a float32 reduce-scatter, and the
weights' gather as :func:`~qsgd_jax.fsdp_gather` sends them. What it costs:
each device keeps a worker error of every parameter it gathers, in float32,
``4 P`` bytes for ``P`` parameters, against ``4 P / n`` for a shard of each of
the parameters and the two moments; DeepSpeed's 1-bit Adam keeps the same
buffer (and a server error of ``P / n``).

References:
  Tang et al., `1-bit Adam: Communication Efficient Large-Scale Training with
  Adam's Convergence Speed <https://arxiv.org/abs/2102.02888>`_, ICML 2021;
  Rajbhandari et al., ZeRO, SC 2020.
"""

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from qsgd_jax._src import axes as axes_lib
from qsgd_jax._src import base
from qsgd_jax._src.collectives import gather, plan, provenance
from qsgd_jax._src.compressors import packing
from qsgd_jax._src.compressors.baselines import Identity
from qsgd_jax._src.fsdp import gather as fsdp
from qsgd_jax._src.fsdp import onebit_state, passes
from qsgd_jax._src.fsdp.shards import FlatShard

# The gradients' compressor while warming up: float32, as 1-bit Adam warms up.
DEFAULT_WARM_UP = Identity()


@dataclasses.dataclass(frozen=True)
class _Config:
  """What the gather's derivative needs that is static (hashable).

  Attributes:
    base: :func:`~qsgd_jax.fsdp_gather`'s, its ``backward`` the warm-up's compressor.
    sizes: each gathered leaf's elements, whole.
    shards: each gathered leaf's elements a device.
  """

  base: passes.GatherConfig
  sizes: tuple[int, ...]
  shards: tuple[int, ...]

  @property
  def num_devices(self) -> int:
    return math.prod(self.base.axes.sizes("fsdp_onebit_gather"))

  @property
  def onebit(self) -> tuple[int, ...]:
    """The leaves that go 1-bit: at least ``min_compressed_size`` elements."""
    return tuple(i for i, size in enumerate(self.sizes)
                 if size >= self.base.min_compressed_size)

  @property
  def width(self) -> int:
    """Elements of a row of the worker error: one shard of every 1-bit leaf."""
    return sum(self.shards[i] for i in self.onebit)


def fsdp_onebit_gather(
    shards,
    worker_error: jax.Array,
    axis_name: str,
    *,
    compress: jax.Array | bool,
    forward: base.Compressor = fsdp.DEFAULT_FORWARD,
    warm_up: base.Compressor = DEFAULT_WARM_UP,
    key: jax.Array | int | None = None,
    min_compressed_size: int = plan.DEFAULT_MIN_COMPRESSED_SIZE,
):
  r""":func:`~qsgd_jax.fsdp_gather` whose gradient, once ``compress`` is true, is 1-bit.

  Forward: the parameters gathered from their shards with ``forward``, as
  :func:`~qsgd_jax.fsdp_gather` gathers them. Derivative with respect to
  ``shards``: while ``compress`` is false, the reduce-scatter of the devices'
  cotangents with ``warm_up`` (float32 by default, as 1-bit Adam warms up);
  once it is true, their 1-bit reduce-scatter: for each leaf of at least
  ``min_compressed_size`` elements, each device forms
  :math:`c = g + e` (its cotangent of the whole parameter plus its worker
  error), the scale :math:`s = \|c\|_2 / \sqrt{d}` and the signs
  (:math:`c \ge 0` gives :math:`+1`, as DeepSpeed), keeps
  :math:`e \leftarrow c - s\,\mathrm{sign}(c)`, and sends device ``j`` the
  packed signs of shard ``j`` with the scales (one ``all_to_all``); device
  ``j`` returns :math:`\sum_k s_k\,\mathrm{sign}(c_k)` over its shard. Smaller
  leaves are reduce-scattered in float32. The ``compress`` switch is a
  ``jax.lax.cond``: it must be the same on every device (a step count is).

  The "gradient" that ``jax.grad`` returns for ``worker_error`` is not a
  derivative: it is the new worker error (while warming up, the old one), the
  one way a custom derivative can hand state out of the backward pass.
  Differentiate with respect to ``(shards, worker_error)`` and carry the
  second result to the next step: best in the optimizer's state, with
  :func:`fsdp_onebit_adam`'s ``worker_errors=`` (``compress`` and
  ``worker_error`` then come from :func:`~qsgd_jax.fsdp_onebit_step_inputs`).
  Call it once a step for each error buffer (autodiff would add the new
  errors of two calls), on the cotangents of one loss whose scale does not
  change between steps.

  A 1-bit step on which any device's cotangent holds a NaN or inf gives NaN
  gradients on every device (each device's scales tell every other) and
  returns the worker error as it was, so that one bad batch does not poison
  the error for good: skip the optimizer's step when its gradients are not
  finite (every device sees the same). While warming up, the float32
  reduce-scatter carries a non-finite value to the shards it touches only.

  Args:
    shards: this device's shards, as for :func:`~qsgd_jax.fsdp_gather`
      (arrays joined along their first dimension, :class:`~qsgd_jax.FlatShard`,
      replicated leaves).
    worker_error: ``float32[n, width]``, this device's worker error (zeros at
      first: :func:`fsdp_onebit_error`).
    axis_name: the mapped axis the parameters are sharded over (one axis).
    compress: ``bool[]``, whether the gradient goes 1-bit this step.
    forward: the weights' compressor (8-bit :class:`~qsgd_jax.NearestAbsMax`).
    warm_up: the gradients' compressor while ``compress`` is false.
    key: as for :func:`~qsgd_jax.fsdp_gather`.
    min_compressed_size: leaves whose whole parameter has fewer elements are
      gathered bit for bit and reduce-scattered in float32.

  Returns:
    The whole parameters, as :func:`~qsgd_jax.fsdp_gather` returns them.

  Raises:
    ValueError: two or more axes (no hpZ here), or a ``worker_error`` of
      another shape than :func:`fsdp_onebit_error`'s.

  Examples:
    >>> import functools, jax, jax.numpy as jnp, qsgd_jax
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("batch",))
    >>> w = qsgd_jax.fsdp_shard(jnp.ones((64, 128)), mesh, "batch")
    >>> @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("batch"), P("batch")),
    ...                    out_specs=(P("batch"), P("batch")))
    ... def grads(w, x):
    ...   error = qsgd_jax.fsdp_onebit_error(w, "batch")
    ...   def loss(w, error):
    ...     whole = qsgd_jax.fsdp_onebit_gather(w, error, "batch", compress=True)
    ...     return jax.lax.pmean(jnp.sum(x @ whole), "batch")
    ...   return jax.grad(loss, argnums=(0, 1))(w, error)
    >>> x = jax.device_put(jnp.ones((jax.device_count(), 64)), w.sharding)
    >>> with jax.set_mesh(mesh):
    ...   g, new_error = jax.jit(grads)(w, x)
    >>> g.shape, bool(jnp.allclose(g, 1.0))
    ((64, 128), True)
  """
  config, internal = _configure(shards, axis_name, forward, warm_up, min_compressed_size)
  expected = (config.num_devices, config.width)
  if jnp.shape(worker_error) != expected:
    raise ValueError(
        f"fsdp_onebit_gather: worker_error has shape {jnp.shape(worker_error)} on this device; "
        f"these shards need {expected}: make it with qsgd_jax.fsdp_onebit_error(shards, "
        "axis_name) for these shards and carry it from step to step (fsdp_onebit_adam's "
        "worker_errors= keeps it in the optimizer's state).")
  if not internal:
    return shards
  key = None if key is None else base.as_key(key)
  whole = iter(_gather(config, key, internal, worker_error, jnp.asarray(compress)))
  return _restore(shards, config, whole)


def fsdp_onebit_error(shards, axis_name: str, *,
                      min_compressed_size: int = plan.DEFAULT_MIN_COMPRESSED_SIZE) -> jax.Array:
  """The zero worker error of :func:`fsdp_onebit_gather` for ``shards``, inside the mapped function.

  Returns:
    ``float32[n, width]``: for each of the ``n`` devices, one shard of every
    leaf that goes 1-bit, end to end; varying over the axis under
    ``jax.shard_map`` (each device has its own).

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> n = jax.local_device_count()
    >>> shards = jnp.zeros((n, 64, 128))  # Each device's shard of a (64 n, 128) kernel.
    >>> error = jax.pmap(lambda w: qsgd_jax.fsdp_onebit_error(w, "batch"),
    ...                  axis_name="batch")(shards)
    >>> error.shape[1:] == (n, 64 * 128)
    True
  """
  config, _ = _configure(shards, axis_name, fsdp.DEFAULT_FORWARD, DEFAULT_WARM_UP,
                         min_compressed_size)
  zeros = jnp.zeros((config.num_devices, config.width), jnp.float32)
  return axes_lib.as_varying(zeros, axis_name)


def _configure(shards, axis_name, forward, warm_up, min_compressed_size):
  """The static configuration, and the gathered leaves as the gather takes them."""
  owner = "fsdp_onebit_gather"
  gather.check_gatherable(forward, owner, "forward")
  gather.check_gatherable(warm_up, owner, "warm_up")
  axes = axes_lib.parse(axis_name, owner)
  if axes.is_local or axes.inner:
    raise ValueError(f"{owner}: axis_name must name one mapped axis (the parameters' shards); "
                     f"got {axis_name!r}.")
  n = math.prod(axes.sizes(owner))
  internal, flat_shapes, sizes = [], [], []
  leaves = jax.tree.leaves(shards, is_leaf=passes.is_flat)
  for path, leaf in zip(passes.paths(shards), leaves, strict=True):
    if isinstance(leaf, FlatShard):
      internal.append(passes.check_flat(leaf, n, path))
      flat_shapes.append(leaf.shape)
      sizes.append(math.prod(leaf.shape))
    elif not passes.replicated(leaf, axes, path, owner):
      internal.append(jnp.asarray(leaf))
      flat_shapes.append(None)
      sizes.append(n * math.prod(jnp.shape(leaf)))
  base_config = passes.GatherConfig(axes, forward, warm_up, min_compressed_size,
                                         tuple(flat_shapes))
  config = _Config(base_config, tuple(sizes), tuple(math.prod(x.shape) for x in internal))
  return config, internal


def _restore(shards, config: _Config, whole):
  """``shards``' tree with the gathered leaves whole (a FlatShard unpadded, reshaped)."""
  leaves, treedef = jax.tree.flatten(shards, is_leaf=passes.is_flat)
  out = []
  for leaf in leaves:
    if isinstance(leaf, FlatShard):
      out.append(next(whole)[:math.prod(leaf.shape)].reshape(leaf.shape))
    elif passes.replicated(leaf, config.base.axes, None, "fsdp_onebit_gather"):
      out.append(leaf)
    else:
      out.append(next(whole))
  return jax.tree.unflatten(treedef, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather(config: _Config, key, shards, worker_error, compress):
  del worker_error, compress
  return passes.gather_forward(config.base, key, shards)[0]


def _gather_forward(config: _Config, key, shards, worker_error, compress):
  whole, backward_key = passes.gather_forward(config.base, key, shards)
  return whole, (backward_key, worker_error, compress)


def _gather_backward(config: _Config, residuals, cotangents):
  backward_key, worker_error, compress = residuals

  def warm_up(_):
    return passes.gather_backward(config.base, backward_key, cotangents)[1], worker_error

  def onebit(_):
    with jax.named_scope(provenance.scope(config.base.axes)):  # Marks the result as reduced.
      return _onebit_reduce_scatter(config, cotangents, worker_error)

  grads, new_error = jax.lax.cond(compress, onebit, warm_up, None)
  return None, grads, new_error, None


_gather.defvjp(_gather_forward, _gather_backward)


def _onebit_reduce_scatter(config: _Config, cotangents, worker_error):
  """Each device's shard of the 1-bit sum of the cotangents, and its new worker error."""
  axis = config.base.axes.name
  n = config.num_devices
  me = jax.lax.axis_index(axis)
  onebit = config.onebit
  grads = [None] * len(cotangents)
  for i, cotangent in enumerate(cotangents):
    if i not in onebit:  # Small: float32.
      grads[i] = jax.lax.psum_scatter(cotangent.astype(jnp.float32), axis,
                                      scatter_dimension=0, tiled=True).astype(cotangent.dtype)
  if not onebit:
    return grads, worker_error
  # Row j: shard j of every 1-bit leaf, end to end. A FlatShard's padding stays exactly zero.
  rows = jnp.concatenate(
      [cotangents[i].astype(jnp.float32).reshape(n, config.shards[i]) for i in onebit], axis=1)
  valid = jnp.concatenate([_valid(config.sizes[i], n, config.shards[i]) for i in onebit], axis=1)
  compensated = rows + worker_error
  scales = jnp.stack([
      jnp.sqrt(jnp.sum(jnp.square(part))) / np.float32(math.sqrt(config.sizes[i]))
      for i, part in zip(onebit, _columns(compensated, config), strict=True)])
  nonnegative = compensated >= 0
  new_error = compensated - _scaled_signs(scales, nonnegative, valid, config)
  # A device whose cotangents are not all finite sends NaN scales, so that every device,
  # receiving every worker's scales, knows: the step's gradients are then NaN everywhere,
  # and every device keeps its error as it was.
  finite_here = base.all_finite(
      [compensated] + [cotangents[i] for i in range(len(cotangents)) if i not in onebit])
  scales = jnp.where(finite_here, scales, np.float32(np.nan))
  words = jax.vmap(lambda bits: packing.pack(bits.astype(jnp.uint32), 1))(nonnegative)
  scale_words = jax.lax.bitcast_convert_type(scales, jnp.uint32)
  send = jnp.concatenate([words, jnp.broadcast_to(scale_words, (n, len(onebit)))], axis=1)
  received = jax.lax.all_to_all(send, axis, 0, 0)  # Row k: worker k's copy of this shard.
  sign_words = words.shape[1]
  bits = jax.vmap(lambda w: packing.unpack(w, config.width, 1))(received[:, :sign_words])
  received_scales = jax.lax.bitcast_convert_type(received[:, sign_words:], jnp.float32)
  all_finite = jnp.all(jnp.isfinite(received_scales))
  mine = jnp.sum(_scaled_signs(received_scales, bits.astype(bool), valid[me][None], config),
                 axis=0)
  for i, part in zip(onebit, _columns(mine[None], config), strict=True):
    grads[i] = part.reshape(cotangents[i].shape[0] // n, *cotangents[i].shape[1:]).astype(
        cotangents[i].dtype)
  grads = [jnp.where(all_finite, g, jnp.asarray(np.nan, g.dtype)) for g in grads]
  return grads, jnp.where(all_finite, new_error, worker_error)


def _valid(size: int, n: int, shard: int) -> jax.Array:
  """``bool[n, shard]``: which elements of the padded ``[n * shard]`` leaf are the parameter's."""
  return jnp.arange(n * shard).reshape(n, shard) < size


def _columns(rows: jax.Array, config: _Config) -> list[jax.Array]:
  """Each 1-bit leaf's columns of ``rows``."""
  offsets = np.cumsum([0] + [config.shards[i] for i in config.onebit])
  return [rows[:, start:end] for start, end in zip(offsets[:-1], offsets[1:], strict=True)]


def _scaled_signs(scales: jax.Array, nonnegative: jax.Array, valid: jax.Array,
                  config: _Config) -> jax.Array:
  """``s * sign``: ``scales`` ``[len(onebit)]`` or ``[rows, len(onebit)]``, zero off ``valid``."""
  rows = nonnegative.shape[0]
  scales = jnp.broadcast_to(scales, (rows, len(config.onebit)))
  by_column = jnp.concatenate(
      [jnp.broadcast_to(scales[:, k:k + 1], (rows, config.shards[i]))
       for k, i in enumerate(config.onebit)], axis=1)
  signs = jnp.where(nonnegative, np.float32(1), np.float32(-1))
  return jnp.where(valid, by_column * signs, np.float32(0))


class FSDPOneBitAdamState(NamedTuple):
  """State of :func:`fsdp_onebit_adam`, on each device's shards.

  Attributes:
    count: ``int32[]``, updates taken.
    mu: the first moment, like the parameters (their shards).
    nu: the second moment, like the parameters; no longer updated for the
      ``frozen_mask`` leaves from update ``freeze_step`` on.

  Examples:
    >>> import jax.numpy as jnp, qsgd_jax
    >>> state = qsgd_jax.scale_by_fsdp_onebit_adam(freeze_step=10).init(jnp.zeros(4))
    >>> int(state.count), state.mu.shape
    (0, (4,))
  """

  count: jax.Array
  mu: optax.Updates
  nu: optax.Updates


def scale_by_fsdp_onebit_adam(
    *, freeze_step: int, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
    bias_correction: bool = True, frozen_mask=None,
    min_compressed_size: int = plan.DEFAULT_MIN_COMPRESSED_SIZE,
) -> optax.GradientTransformation:
  r"""Adam's scaling of averaged gradient shards, the variance frozen after ``freeze_step``.

  Updates ``count < freeze_step``:
  :math:`m \leftarrow \beta_1 m + (1 - \beta_1) g`,
  :math:`v \leftarrow \beta_2 v + (1 - \beta_2) g^2`; later ones leave
  :math:`v` of the ``frozen_mask`` leaves as it is. The direction is
  :math:`\hat m / (\sqrt{\hat v} + \epsilon)`, with
  :math:`\hat m = m / (1 - \beta_1^t)` and :math:`\hat v = v / (1 - \beta_2^{t_v})`,
  :math:`t_v` the updates that changed :math:`v` (as
  :func:`~qsgd_jax.scale_by_onebit_adam` corrects). No collective: ``g`` is
  the averaged gradient of this device's shards, from
  :func:`fsdp_onebit_gather`'s derivative.

  Where the frozen :math:`v` is exactly zero (no gradient in the whole
  warm-up: an embedding's unused rows, a dead unit's weights), :math:`m` is
  kept at zero, as DeepSpeed's momentum mask (``exp_avg_mask``) keeps the
  momentum of parameters whose gradient is always zero, here read from the
  variance. A 1-bit gradient gives every element the tensor's scale with
  some sign (a zero's sign is :math:`+1`, and the error feedback flips it back
  and forth), and :math:`m / (\sqrt{0} + \epsilon)` would move such an
  element by :math:`10^8` times that.

  Args:
    freeze_step: the float32 warm-up updates; pass
      ``compress=step >= freeze_step`` to :func:`fsdp_onebit_gather`.
    b1, b2, eps, bias_correction: Adam's.
    frozen_mask: a pytree of bools like the parameters (or a callable of
      them): the leaves whose gradient goes 1-bit, whose variance freezes.
      ``None``: the leaves :func:`fsdp_onebit_gather` sends in one bit, those
      of at least ``min_compressed_size`` elements whole; the others take
      Adam's float32 steps throughout, as :func:`~qsgd_jax.onebit_adam`'s
      small leaves do. Under ``jax.shard_map`` a leaf's whole size is its
      shard's times the sizes of the axes its gradient varies over (a
      replicated leaf's, the same on every device, is its own size: one of
      that many elements freezes too, though its gradient is float32);
      elsewhere, the size of the array the update sees. Under ``jax.pmap``,
      which sees shards and does not type them, pass the mask.
    min_compressed_size: the gather's, for the ``None`` mask.

  Returns:
    An ``optax.GradientTransformation``.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> tx = qsgd_jax.scale_by_fsdp_onebit_adam(freeze_step=1)
    >>> params = {"kernel": jnp.zeros((64, 128)), "bias": jnp.zeros(128)}
    >>> state = tx.init(params)
    >>> _, state = tx.update(jax.tree.map(jnp.ones_like, params), state)  # Warm-up: v moves.
    >>> _, frozen = tx.update(jax.tree.map(lambda x: x + 5, params), state)
    >>> # The kernel's variance stays; the bias, too small to go 1-bit, keeps Adam's.
    >>> bool(jnp.all(frozen.nu["kernel"] == state.nu["kernel"]))
    True
    >>> bool(jnp.all(frozen.nu["bias"] == state.nu["bias"]))
    False
  """
  owner = "qsgd_jax.scale_by_fsdp_onebit_adam"
  if not isinstance(freeze_step, int) or isinstance(freeze_step, bool) or freeze_step < 1:
    raise ValueError(f"{owner}: freeze_step must be a positive int (the float32 warm-up "
                     f"updates), got {freeze_step!r}.")
  for name, value in (("b1", b1), ("b2", b2)):
    if not 0 <= value < 1:
      raise ValueError(f"{owner}: {name} must be in [0, 1), got {value!r}.")

  def init_fn(params):
    return FSDPOneBitAdamState(count=jnp.zeros((), jnp.int32),
                               mu=optax.tree.zeros_like(params), nu=optax.tree.zeros_like(params))

  def update_fn(updates, state, params=None):
    mask = frozen_mask(params if params is not None else updates) if callable(
        frozen_mask) else frozen_mask
    if mask is None:
      mask = jax.tree.map(lambda g: _whole_size(g) >= min_compressed_size, updates)
    frozen = state.count >= freeze_step
    count = optax.safe_increment(state.count)
    mu = optax.tree.update_moment(updates, state.mu, b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)
    nu = jax.tree.map(lambda new, old, freezes: jnp.where(frozen & freezes, old, new),
                      nu, state.nu, mask)
    # No gradient in the warm-up (v = 0, frozen): the momentum stays zero.
    mu = jax.tree.map(lambda m, v, freezes: jnp.where(frozen & freezes & (v == 0), 0, m),
                      mu, nu, mask)
    m_hat, v_hat = mu, nu
    if bias_correction:
      m_hat = optax.tree.bias_correction(mu, b1, count)
      frozen_count = jnp.minimum(count, freeze_step)
      v_hat = jax.tree.map(
          lambda v, freezes: optax.tree.bias_correction(
              v, b2, jnp.where(freezes, frozen_count, count)), nu, mask)
    directions = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), m_hat, v_hat)
    return directions, FSDPOneBitAdamState(count=count, mu=mu, nu=nu)

  return optax.GradientTransformation(init_fn, update_fn)


def _whole_size(gradient) -> int:
  """Elements of the whole parameter of a gradient shard: times the axes it varies over."""
  varying = jax.typeof(gradient).manual_axis_type.varying
  return math.prod(jnp.shape(gradient)) * math.prod(jax.lax.axis_size(a) for a in varying)


def fsdp_onebit_adam(
    learning_rate: optax.ScalarOrSchedule, *, freeze_step: int, b1: float = 0.9,
    b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0, mask=None,
    bias_correction: bool = True, frozen_mask=None, worker_errors=None,
    min_compressed_size: int = plan.DEFAULT_MIN_COMPRESSED_SIZE,
) -> optax.GradientTransformation:
  """1-bit Adam for FSDP: AdamW on the shards, its variance frozen after the warm-up.

  The optimizer half of 1-bit Adam under FSDP; the communication is
  :func:`fsdp_onebit_gather`'s derivative, called with
  ``compress=step >= freeze_step``, which gives each device the averaged
  gradient of its shards: float32 for the first ``freeze_step`` steps, 1-bit
  with error feedback after. :func:`scale_by_fsdp_onebit_adam`, then
  ``optax.add_decayed_weights(weight_decay, mask)`` and the learning rate, as
  :func:`~qsgd_jax.onebit_adam` chains them.

  With ``worker_errors`` the state also holds the gather's worker errors and
  its switch (:func:`~qsgd_jax.keep_fsdp_onebit_error`, first in the chain):
  a step reads them with :func:`~qsgd_jax.fsdp_onebit_step_inputs` and hands
  the new errors to ``update(..., worker_error=...)``, so that
  ``state_partition_specs``, ``resize_state`` and checkpoints of the state
  see them and the switch follows the optimizer's own count.

  Args:
    learning_rate: a float or an optax schedule.
    freeze_step, b1, b2, eps, bias_correction, frozen_mask, min_compressed_size:
      see :func:`scale_by_fsdp_onebit_adam`.
    weight_decay, mask: decoupled weight decay, as in ``optax.adamw``.
    worker_errors: ``None`` (the caller carries the errors), or a function of
      the shards that returns their zero worker errors, e.g.
      ``functools.partial(qsgd_jax.fsdp_onebit_error, axis_name="batch")``.

  Returns:
    An ``optax.GradientTransformation`` whose ``update`` takes the averaged
    gradients of this device's shards, inside ``jax.shard_map`` or outside
    (with ``worker_errors``, ``worker_error=`` too).

  Examples:
    >>> import jax.numpy as jnp, qsgd_jax
    >>> tx = qsgd_jax.fsdp_onebit_adam(1e-3, freeze_step=2)
    >>> params = jnp.zeros(4)
    >>> state = tx.init(params)
    >>> for _ in range(3):  # Two warm-up updates, then one with the variance frozen.
    ...   updates, state = tx.update(jnp.ones(4), state, params)
    >>> bool(jnp.allclose(updates, -1e-3)), state[0].count
    (True, Array(3, dtype=int32))
  """
  carried = ([] if worker_errors is None else
             [onebit_state.keep_fsdp_onebit_error(worker_errors, freeze_step=freeze_step)])
  return optax.chain(
      *carried,
      scale_by_fsdp_onebit_adam(freeze_step=freeze_step, b1=b1, b2=b2, eps=eps,
                                bias_correction=bias_correction, frozen_mask=frozen_mask,
                                min_compressed_size=min_compressed_size),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
  )
