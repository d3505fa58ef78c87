"""Deep Gradient Compression (Lin et al. 2018): top-k of momentum-corrected, masked velocities."""

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from qsgd_jax._src import axes, base, stats, wire
from qsgd_jax._src.sparse import exchange as exchange_lib
from qsgd_jax._src.sparse.topk import TopK, check_fraction, kept_count

_OWNER = "qsgd_jax.scale_by_dgc"
# A non-finite step is always skipped (optax.apply_if_finite's count never runs out).
_ALWAYS_SKIP = 2**31 - 1


class ScaleByDGCState(NamedTuple):
  """State of :func:`scale_by_dgc` on one device.

  Attributes:
    count: ``int32[]``, steps taken (a skipped non-finite step does not
      count): it picks the warm-up's density.
    momentum: a tuple of ``float32[*shape]``, one a leaf: :math:`u`. A
      compressed leaf's is this device's own (momentum correction, masked
      where it sent); a leaf sent dense has the momentum of the averaged
      gradient, the same on every device.
    velocity: a tuple of ``float32[*shape]``, one a leaf: :math:`v`, what a
      compressed leaf has accumulated and not sent (its error feedback),
      this device's own; zeros for a leaf sent dense.
    stats: the last step's :class:`~qsgd_jax.CompressionStats`.

  Examples:
    >>> import jax.numpy as jnp, qsgd_jax
    >>> state = qsgd_jax.scale_by_dgc(None).init({"w": jnp.zeros((64, 64))})
    >>> int(state.count), state.velocity[0].shape
    (0, (64, 64))
  """

  count: jax.Array
  momentum: tuple[jax.Array, ...]
  velocity: tuple[jax.Array, ...]
  stats: stats.CompressionStats


def scale_by_dgc(
    axis_name: axes.AxisName,
    *,
    density: float = 0.001,
    chunk: int = 4096,
    momentum: float = 0.9,
    nesterov: bool = False,
    momentum_masking: bool = True,
    clip_norm: float | None = None,
    warmup_densities: Sequence[float] = (),
    warmup_steps: int = 0,
) -> optax.GradientTransformationExtraArgs:
  r"""DGC's exchange: momentum correction, top-k of the velocity, momentum factor masking.

  For each leaf of two or more dimensions, on each device (Lin et al. 2018,
  Algorithm 1 and Section 3; ``memory.py`` and ``compression.py`` of
  ``synxlin/deep-gradient-compression``):

  .. math::

    u &\leftarrow m u + g, \quad v \leftarrow v + u
      \qquad \text{(momentum correction; Nesterov: } u \leftarrow m (u + g),\
      v \leftarrow v + u + g) \\
    S &= \text{the } k \text{ largest } |v_i| \text{ of each chunk} \\
    v_S &\leftarrow 0, \quad u_S \leftarrow 0
      \qquad \text{(momentum factor masking)}

  and the update is the devices' sent velocities averaged, a sum over the
  devices divided by their number (the released code's average; the paper
  writes the sum and scales the learning rate). Leaves of fewer dimensions
  (biases, normalization) are averaged dense in float32 and their momentum
  applied after, :math:`u \leftarrow m u + \bar g`, as the released code
  does. Chain ``optax.scale_by_learning_rate`` after it (:func:`dgc`), not
  another momentum.

  Deviations: DGC picks the top :math:`k` of a whole tensor from a sampled
  threshold, then cuts the selection to :math:`k` by position; here the
  exact top :math:`k` of each chunk of ``chunk`` elements
  (:class:`~qsgd_jax.TopK`, float32 values), the leaf zero-padded to whole
  chunks.

  Local gradient clipping (Section 3.2): with ``clip_norm`` each device
  clips its own gradient by its global norm, over the leaves, before the
  accumulation. The paper clips at :math:`T N^{-1/2}` for a threshold
  :math:`T` on the *sum* of :math:`N` devices' gradients (the nodes' norms
  add in quadrature); the average here is that sum over :math:`N`, so a
  threshold ``clip_norm`` on the average is :math:`\mathrm{clip\_norm}
  \cdot N^{1/2}` on each device.

  Warm-up (Section 4): the density of step :math:`t` is
  ``warmup_densities[t // warmup_steps]`` while that exists, then
  ``density``; the paper's ``(0.25, 0.0625, 0.015625, 0.004, 0.001)``, one
  an epoch. Each density is a branch of a ``jax.lax.switch`` on the count (the
  same on every device) with its own payload shape.

  On the wire: one all-gather of the compressed leaves' payloads (a kept
  element :math:`\lceil \log_2 c \rceil + 32` bits) and a flag, and one
  float32 all-reduce of the dense leaves. A NaN or inf in any device's
  gradient makes the update NaN on every device and keeps the state.

  Args:
    axis_name: the devices' axis (or axes), or ``None`` for one device.
    density: the fraction of each chunk sent after the warm-up, in ``(0, 1]``.
    chunk: elements a chunk, in ``[1, 2**24]``.
    momentum: :math:`m`, in ``[0, 1)``.
    nesterov: the released code's Nesterov form.
    momentum_masking: clear :math:`u` where sent (the paper's; the released
      code's ``configs/dgc/nm.py`` turns it off).
    clip_norm: a threshold on the averaged gradient's global norm, applied
      locally as above, or ``None``.
    warmup_densities: the densities of the warm-up's stages.
    warmup_steps: steps a warm-up stage.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` takes this
    device's own gradients.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, qsgd_jax
    >>> tx = optax.chain(qsgd_jax.scale_by_dgc("batch", density=0.01),
    ...                  optax.scale_by_learning_rate(0.1))

  References:
    Lin, Han, Mao, Wang and Dally, `Deep Gradient Compression: Reducing the
    Communication Bandwidth for Distributed Training
    <https://arxiv.org/abs/1712.01887>`_, ICLR 2018.
  """
  base.check_static_options(_OWNER, chunk=chunk, warmup_steps=warmup_steps)
  base.check_int_in_range(_OWNER, "chunk", chunk, 1, 2**24)
  for i, warmup_density in enumerate(warmup_densities):
    check_fraction(_OWNER, f"warmup_densities[{i}]", warmup_density)
  if warmup_steps and not warmup_densities:
    raise ValueError(
        f"{_OWNER}: warmup_steps={warmup_steps!r} without warmup_densities warms nothing up: "
        "give the stages' densities too (the paper's: (0.25, 0.0625, 0.015625, 0.004)), or "
        "leave warmup_steps at 0.")
  densities = (*warmup_densities, density)
  ks = tuple(kept_count(None, d, chunk, _OWNER) for d in densities)
  if not isinstance(momentum, int | float) or isinstance(momentum, bool) or not 0 <= momentum < 1:
    raise ValueError(f"{_OWNER}: momentum must be in [0, 1), got {momentum!r}.")
  if warmup_densities and (not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool)
                           or warmup_steps < 1):
    raise ValueError(f"{_OWNER}: warmup_densities need warmup_steps, a positive int (steps a "
                     f"stage), got {warmup_steps!r}.")
  if clip_norm is not None and not (isinstance(clip_norm, int | float) and clip_norm > 0):
    raise ValueError(f"{_OWNER}: clip_norm must be a positive float or None, got "
                     f"{clip_norm!r}.")
  parsed = axes.parse(axis_name, _OWNER)

  def init_fn(params):
    base.check_float_leaves(params, _OWNER)
    zeros = tuple(jnp.zeros(jnp.shape(x), jnp.float32) for x in jax.tree.leaves(params))
    return ScaleByDGCState(jnp.zeros((), jnp.int32), zeros, zeros, stats.empty())

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    base.check_float_leaves(updates, _OWNER)
    if not parsed.is_local:
      axes.check_not_in_apply_if_finite(
          _OWNER, axis_name, "It skips a non-finite step on every device together: put "
          "optax.apply_if_finite after it in the chain, as qsgd_jax.dgc does.")
    grads, treedef = jax.tree.flatten(updates)
    size = 1 if parsed.is_local else math.prod(parsed.sizes(_OWNER))
    grads = [g.astype(jnp.float32) for g in grads]
    if clip_norm is not None:
      grads = optax.clip_by_global_norm(clip_norm * math.sqrt(size)).update(grads, None)[0]
    sparse = [i for i, g in enumerate(grads) if g.ndim > 1]
    dense = [i for i, g in enumerate(grads) if g.ndim <= 1]

    def step_with(k):
      return lambda: _step(grads, state, sparse, dense, TopK(k=k, chunk=chunk), axis_name,
                           parsed, momentum, nesterov, momentum_masking)

    stage = (jnp.minimum(state.count // warmup_steps, len(ks) - 1) if warmup_densities
             else jnp.int32(0))
    branches = [step_with(k) for k in ks]
    out, moment, velocity, bits = (jax.lax.switch(stage, branches) if len(branches) > 1
                                   else branches[0]())
    finite = base.all_finite(out)
    float32_bits = wire.float32_allreduce_bits(sum(g.size for g in grads), size)
    return treedef.unflatten([jnp.where(finite, o, jnp.nan).astype(u.dtype) for o, u in
                              zip(out, jax.tree.leaves(updates), strict=True)]), ScaleByDGCState(
        count=jnp.where(finite, optax.safe_increment(state.count), state.count),
        momentum=_kept(finite, moment, state.momentum, axis_name, sparse),
        velocity=_kept(finite, velocity, state.velocity, axis_name, sparse),
        stats=stats.make(bits, float32_bits, np.nan))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _step(grads, state, sparse, dense, compressor, axis_name, parsed, momentum, nesterov,
          masking):
  """One step at one density: the updates, new momenta and velocities, and the bits sent."""
  out = list(grads)
  moment, velocity = list(state.momentum), list(state.velocity)
  bits = jnp.float32(0)
  if sparse:
    accumulated = []
    for i in sparse:
      u = momentum * (state.momentum[i] + grads[i]) if nesterov else (
          momentum * state.momentum[i] + grads[i])
      accumulated.append((u, state.velocity[i] + u + (grads[i] if nesterov else 0.0)))
    sent = exchange_lib.exchange(
        [compressor] * len(sparse), [v for _, v in accumulated], jax.random.key(0),
        axis_name, "mean_over_workers", base.all_finite([grads[i] for i in sparse]))
    for j, i in enumerate(sparse):
      u, v = accumulated[j]
      kept = compressor.support(sent.payloads[j]) > 0
      velocity[i] = v - sent.sent[j]
      moment[i] = jnp.where(kept, 0.0, u) if masking else u
      out[i] = jnp.where(sent.all_finite, sent.averaged[j], jnp.nan)
    bits += sent.wire_bits
  if dense:
    flat = jnp.concatenate([grads[i].reshape(-1) for i in dense])
    if not parsed.is_local:
      flat = jax.lax.pmean(flat, axis_name)
      bits += wire.float32_allreduce_bits(flat.size, math.prod(parsed.sizes(_OWNER)))
    start = 0
    for i in dense:
      mean = flat[start:start + grads[i].size].reshape(grads[i].shape)
      start += grads[i].size
      moment[i] = momentum * state.momentum[i] + mean
      out[i] = mean + momentum * moment[i] if nesterov else moment[i]
  return out, tuple(moment), tuple(velocity), bits


def _kept(finite, new, old, axis_name, own):
  """``new`` where the step was finite, else ``old``; the leaves ``own`` (indices) typed as
  this device's own, the others (the same on every device) as they are."""
  kept = [jnp.where(finite, n, o) for n, o in zip(new, old, strict=True)]
  return tuple(axes.as_varying(x, axis_name) if i in own else x for i, x in enumerate(kept))


def dgc(
    learning_rate: optax.ScalarOrSchedule,
    axis_name: axes.AxisName,
    *,
    density: float = 0.001,
    chunk: int = 4096,
    momentum: float = 0.9,
    nesterov: bool = False,
    momentum_masking: bool = True,
    clip_norm: float | None = None,
    warmup_densities: Sequence[float] = (),
    warmup_steps: int = 0,
    weight_decay: float = 0.0,
    mask=None,
) -> optax.GradientTransformationExtraArgs:
  r"""Momentum SGD with Deep Gradient Compression: :func:`scale_by_dgc`, then the step.

  ``optax.add_decayed_weights(weight_decay, mask)`` on each device's gradient
  (so the decay, as PyTorch's SGD adds it, goes through the momentum
  correction with the gradient; the released code keeps the decay's momentum
  apart, uncompressed), :func:`scale_by_dgc`, and the learning rate, wrapped
  in ``optax.apply_if_finite`` so that a NaN or inf on any device skips the
  step on every device together, the velocities kept.

  When to choose it: momentum SGD at densities of 0.1-1%, where plain top-k
  with error feedback (``compressed_allreduce(TopK(...), axis,
  error_feedback=True)``) then a momentum optimizer lets stale momentum
  push coordinates already sent. Its ``update`` takes each device's own
  gradients: do not average them first.

  Args:
    learning_rate: a float or an optax schedule.
    axis_name: the devices' axis (or axes), or ``None`` for one device.
    density, chunk, momentum, nesterov, momentum_masking, clip_norm: see
      :func:`scale_by_dgc`.
    warmup_densities, warmup_steps: see :func:`scale_by_dgc`.
    weight_decay: coupled weight decay, added to the gradient.
    mask: which leaves are decayed, as in ``optax.add_decayed_weights``.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> n = jax.local_device_count()
    >>> tx = qsgd_jax.dgc(0.1, "batch", density=0.01, chunk=1024)
    >>> params = jnp.zeros((n, 64, 64))
    >>> state = jax.pmap(tx.init, axis_name="batch")(params)
    >>> grads = jnp.ones((n, 64, 64))
    >>> updates, state = jax.pmap(tx.update, axis_name="batch")(grads, state, params)
    >>> int(jnp.sum(updates[0] != 0))  # 10 of each chunk of 1024
    40

  References:
    Lin et al., `Deep Gradient Compression <https://arxiv.org/abs/1712.01887>`_, ICLR 2018.
  """
  return optax.chain(
      optax.add_decayed_weights(weight_decay, mask),
      scale_by_dgc(axis_name, density=density, chunk=chunk, momentum=momentum,
                   nesterov=nesterov, momentum_masking=momentum_masking, clip_norm=clip_norm,
                   warmup_densities=warmup_densities, warmup_steps=warmup_steps),
      optax.apply_if_finite(optax.scale_by_learning_rate(learning_rate),
                            max_consecutive_errors=_ALWAYS_SKIP),
  )
