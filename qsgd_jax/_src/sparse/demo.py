"""DeMo (Peng, Quesnelle and Kingma 2024): decoupled momentum, its fast components exchanged."""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from qsgd_jax._src import axes, base, shards, stats, wire
from qsgd_jax._src.sparse import blocks as blocks_lib
from qsgd_jax._src.sparse import exchange as exchange_lib
from qsgd_jax._src.sparse.topk import TopK

_OWNER = "qsgd_jax.demo"
# A non-finite step is always skipped (optax.apply_if_finite's count never runs out).
_ALWAYS_SKIP = 2**31 - 1


class ScaleByDemoState(NamedTuple):
  """State of :func:`scale_by_demo` on one device.

  Attributes:
    count: ``int32[]``, steps taken (a skipped non-finite step does not
      count); the learning rate folded into the momentum is the schedule's
      at it.
    momentum: this device's momentum, a tuple of ``float32[*shape]``, one a
      parameter leaf: :math:`m`, what it has not sent yet (its error
      feedback). Each device's own: under ``jax.shard_map`` lay it out along
      the axis (:func:`~qsgd_jax.state_partition_specs`).
    stats: the last step's :class:`~qsgd_jax.CompressionStats`.

  Examples:
    >>> import jax.numpy as jnp, qsgd_jax
    >>> state = qsgd_jax.scale_by_demo(1e-3, None).init({"w": jnp.zeros((64, 64))})
    >>> int(state.count), state.momentum[0].shape
    (0, (64, 64))
  """

  count: jax.Array
  momentum: tuple[jax.Array, ...]
  stats: stats.CompressionStats


def scale_by_demo(
    learning_rate: optax.ScalarOrSchedule,
    axis_name: axes.AxisName,
    *,
    chunk: int = 64,
    k: int = 32,
    decay: float = 0.999,
    value_dtype=jnp.float32,
    matrix_view: blocks_lib.MatrixView | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""DeMo's exchange: each device's momentum, its top DCT components averaged, their sign.

  On each device :math:`w`, for each parameter leaf, with :math:`\eta_t` the
  learning rate of step :math:`t` (``demo.py``, ``DeMo.step``, lines
  107-170):

  .. math::

    m_w &\leftarrow \beta m_w + \eta_t g_w \\
    q_w &= \mathrm{top}_k(\mathrm{DCT}(m_w)) \qquad
      \text{(per block, by magnitude)} \\
    m_w &\leftarrow m_w - \mathrm{DCT}^{-1}(q_w) \\
    u &= \mathrm{DCT}^{-1}(\mathrm{mean}_w\, q_w) \qquad
      \text{(each coefficient over the devices that kept it)}

  and the update is :math:`\mathrm{sign}(u)` (zero where :math:`u` is). The
  learning rate is folded into the momentum, as ``demo.py`` folds it
  (``delta += lr * grad``); the paper's Algorithm 1 writes
  :math:`m \leftarrow \beta m + g`. What a device does not send stays in
  its momentum: that is DeMo's error feedback.

  Blocks (``qsgd_jax/_src/sparse/blocks.py``): a leaf of two or more
  dimensions is seen as the matrix ``matrix_view`` gives (by default
  :func:`~qsgd_jax.attention_matrix_view`) and cut into blocks of at most
  ``chunk x chunk``, each side the largest divisor of the matrix's at most
  ``chunk``; a vector into runs of at most ``chunk``. Each block's orthonormal
  2-d DCT-II keeps its ``k`` largest coefficients (fewer in a smaller block:
  all of it). ``demo.py`` handles only vectors and matrices; the view of a
  leaf of more dimensions is this library's choice. On a mesh whose model is
  laid out over other axes (explicit axes, as
  :func:`~qsgd_jax.data_parallel` runs the update), the blocks are of each
  device's own part of a leaf, a leaf whole over some model axes split among
  them, and the momentum is laid out as the parameters are.

  On the wire: one all-gather of every leaf's payload (:class:`~qsgd_jax.TopK`
  of a block: ``k`` positions of :math:`\lceil \log_2 (hw) \rceil` bits and
  ``k`` values in ``value_dtype``), plus a word saying whether the device's
  gradient was finite. ``demo.py`` sends int64 positions and values in the
  parameters' dtype: at ``k = 32`` of a 64 x 64 block, 384 bytes where this
  sends 176 (float32 values) or 112 (bfloat16). A device sends
  ``(n - 1)`` payloads' bytes (``qsgd_jax/_src/sparse/exchange.py``).

  A NaN or inf in any device's gradient makes the update NaN on every device
  and keeps the momentum and the count: :func:`~qsgd_jax.demo` then skips
  the step.

  Args:
    learning_rate: :math:`\eta`, a float or an optax schedule (of the count).
    axis_name: the devices' axis (or axes), or ``None`` for one device.
    chunk: the target side of a block.
    k: coefficients kept a block, in ``[1, chunk**2]``.
    decay: the momentum's decay :math:`\beta`, in ``[0, 1)``.
    value_dtype: ``jnp.float32`` or ``jnp.bfloat16``: the kept coefficients on
      the wire.
    matrix_view: ``(path, shape) -> (rows, columns)`` for leaves of two or
      more dimensions.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` takes this
    device's own gradients (inside ``jax.pmap`` or ``jax.shard_map`` over
    ``axis_name``) and returns the sign of the averaged components, the same
    on every device.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> tx = qsgd_jax.scale_by_demo(0.1, None, chunk=4, k=1)
    >>> grads = jnp.array([[1.0, 1.0], [1.0, 1.0]])
    >>> updates, state = tx.update(grads, tx.init(grads))
    >>> updates  # The mean coefficient alone: +1 everywhere.
    Array([[1., 1.],
           [1., 1.]], dtype=float32)

  References:
    Peng, Quesnelle and Kingma, `DeMo: Decoupled Momentum Optimization
    <https://arxiv.org/abs/2411.19870>`_, 2024 (Algorithm 1); ``demo.py`` of
    ``bloc97/DeMo``.
  """
  base.check_static_options(_OWNER, chunk=chunk, k=k)
  base.check_int_in_range(_OWNER, "chunk", chunk, 1, 2**12)
  base.check_int_in_range(_OWNER, "k", k, 1, chunk * chunk)
  if not isinstance(decay, int | float) or isinstance(decay, bool) or not 0 <= decay < 1:
    raise ValueError(f"{_OWNER}: decay must be in [0, 1), got {decay!r}.")
  TopK(k=1, value_dtype=value_dtype)  # Checks value_dtype now.
  parsed = axes.parse(axis_name, _OWNER)

  def codecs(tree):
    layouts = blocks_lib.leaf_layouts(tree, matrix_view, chunk, _OWNER)
    return layouts, [TopK(k=min(k, layout.block_size), chunk=layout.block_size,
                          value_dtype=value_dtype) for layout in layouts]

  def init_fn(params):
    base.check_float_leaves(params, _OWNER)
    codecs(params)  # A bad matrix_view fails here.
    return ScaleByDemoState(
        count=jnp.zeros((), jnp.int32),
        momentum=tuple(jnp.zeros_like(x, jnp.float32) for x in jax.tree.leaves(params)),
        stats=stats.empty())

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    base.check_float_leaves(updates, _OWNER)
    if not parsed.is_local:
      axes.check_not_in_apply_if_finite(
          _OWNER, axis_name, "It skips a non-finite step on every device together: put "
          "optax.apply_if_finite after it in the chain, as qsgd_jax.demo does.")
    grads, treedef = jax.tree.flatten(updates)
    # Blocks of each device's own part of a leaf (shards.map_spread): none spans two.
    layouts, compressors = codecs(treedef.unflatten(
        [jax.ShapeDtypeStruct(shards.spread_shape(g), jnp.float32) for g in grads]))
    rate = learning_rate(state.count) if callable(learning_rate) else learning_rate
    wire_bits = []

    def exchange_parts(members, columns, rate):
      parts, momenta = columns
      momentum = [decay * m + rate * g.astype(jnp.float32)
                  for m, g in zip(momenta, parts, strict=True)]
      coefficients = [blocks_lib.dct(blocks_lib.to_blocks(m, layouts[i]), layouts[i])
                      for m, i in zip(momentum, members, strict=True)]
      out = exchange_lib.exchange([compressors[i] for i in members], coefficients,
                                  jax.random.key(0), axis_name, "mean_over_contributors",
                                  base.all_finite(parts))
      wire_bits.append(out.wire_bits)
      kept = [m - blocks_lib.from_blocks(blocks_lib.inverse_dct(sent, layouts[i]), layouts[i])
              for m, sent, i in zip(momentum, out.sent, members, strict=True)]
      directions = [
          jnp.sign(blocks_lib.from_blocks(blocks_lib.inverse_dct(a, layouts[i]), layouts[i]))
          for a, i in zip(out.averaged, members, strict=True)]
      return [directions, kept], out.all_finite

    (directions, kept), finite = shards.map_spread(
        exchange_parts, [grads, state.momentum], _OWNER, jnp.asarray(rate, jnp.float32))
    directions = [jnp.where(finite, d, jnp.nan).astype(g.dtype)
                  for d, g in zip(directions, grads, strict=True)]
    # A skipped step keeps the momentum, as it was before this step's gradient.
    new_momentum = tuple(axes.as_varying(jnp.where(finite, m, old), axis_name)
                         for m, old in zip(kept, state.momentum, strict=True))
    size = 1 if parsed.is_local else math.prod(parsed.sizes(_OWNER))
    float32_bits = wire.float32_allreduce_bits(sum(g.size for g in grads), size)
    return treedef.unflatten(directions), ScaleByDemoState(
        count=jnp.where(finite, optax.safe_increment(state.count), state.count),
        momentum=new_momentum,
        stats=stats.make(sum(wire_bits), float32_bits, np.nan))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def demo(
    learning_rate: optax.ScalarOrSchedule,
    axis_name: axes.AxisName,
    *,
    chunk: int = 64,
    k: int = 32,
    decay: float = 0.999,
    weight_decay: float = 0.0,
    mask=None,
    value_dtype=jnp.float32,
    matrix_view: blocks_lib.MatrixView | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""DeMo as an optax optimizer: :func:`scale_by_demo`, decoupled weight decay, a sign step.

  Each step, with :math:`u` the averaged fast components of
  :func:`scale_by_demo` (``demo.py`` lines 124-125 and 161-170):

  .. math::

    \theta \leftarrow (1 - \eta \lambda)\, \theta - \eta\, \mathrm{sign}(u).

  Its ``update`` takes each device's **own** gradients, inside ``jax.pmap``
  or ``jax.shard_map`` over ``axis_name`` (or through
  :func:`~qsgd_jax.data_parallel`): it communicates by itself, so do not
  average them first. DeMo's runs clip each device's gradient by its norm
  before the optimizer (OLMo's ``max_grad_norm: 1.0``):
  ``optax.chain(optax.clip_by_global_norm(1.0), qsgd_jax.demo(...))``. A NaN
  or inf in any device's gradient skips the step on every device, momentum
  kept (the decay and the learning rate wrapped in ``optax.apply_if_finite``).

  When to choose it: DeMo replaces both the all-reduce and Adam. With
  ``k = 16`` of a 64 x 64 block and float32 values a payload is 0.17 bits a
  parameter, and a device sends ``n - 1`` payloads: at 8 devices 1.2 bits a
  parameter against a float32 all-reduce's 56, 46x fewer bytes (34x on
  ``examples/lm``, whose vectors keep a quarter of each run of 64). The
  gather's bytes grow with the devices, an all-reduce's do not. Its paper
  matched AdamW's loss at 300M and 1B parameters over long runs; on the short,
  small-batch runs of ``examples/lm`` it stayed behind AdamW (the optimizers
  guide has the figures).

  Args:
    learning_rate: :math:`\eta`, a float or an optax schedule.
    axis_name: the devices' axis (or axes), or ``None`` for one device.
    chunk, k, decay, value_dtype, matrix_view: see :func:`scale_by_demo`
      (``demo.py``'s ``compression_chunk``, ``compression_topk``,
      ``compression_decay``).
    weight_decay: :math:`\lambda`, decoupled, as ``demo.py``'s.
    mask: which leaves are decayed, as in ``optax.adamw``.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> n = jax.local_device_count()
    >>> tx = qsgd_jax.demo(1e-3, "batch", weight_decay=0.1)
    >>> params = jnp.ones((n, 64, 64))
    >>> state = jax.pmap(tx.init, axis_name="batch")(params)
    >>> updates, state = jax.pmap(tx.update, axis_name="batch")(params, state, params)
    >>> bool(jnp.all(jnp.abs(updates) <= 1e-3 * (1 + 0.1) + 1e-9))
    True

  References:
    Peng, Quesnelle and Kingma, `DeMo: Decoupled Momentum Optimization
    <https://arxiv.org/abs/2411.19870>`_, 2024; ``demo.py`` of ``bloc97/DeMo``.
  """
  return optax.chain(
      scale_by_demo(learning_rate, axis_name, chunk=chunk, k=k, decay=decay,
                    value_dtype=value_dtype, matrix_view=matrix_view),
      optax.apply_if_finite(
          optax.chain(optax.add_decayed_weights(weight_decay, mask),
                      optax.scale_by_learning_rate(learning_rate)),
          max_consecutive_errors=_ALWAYS_SKIP),
  )
