"""SparseLoCo's outer average (Sarfi et al. 2025): chunked top-k of error feedback, 2-bit values."""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qsgd_jax._src import axes, base, participation, shards, stats, wire
from qsgd_jax._src.sparse import blocks as blocks_lib
from qsgd_jax._src.sparse import exchange as exchange_lib
from qsgd_jax._src.sparse.topk import TopK, kept_count

_OWNER = "qsgd_jax.sparseloco_average"


class SparseLoCoState(NamedTuple):
  """State of :func:`sparseloco_average` on one device.

  Attributes:
    error: this device's error feedback, a tuple of ``float32[*shape]``, one a
      leaf of what it averages: :math:`e`, kept across rounds. Each device's
      own: under ``jax.shard_map`` lay it out along the axis
      (:func:`~qsgd_jax.state_partition_specs`).
    stats: the last exchange's :class:`~qsgd_jax.CompressionStats`.

  Examples:
    >>> import jax.numpy as jnp, qsgd_jax
    >>> state = qsgd_jax.sparseloco_average(None).init((jnp.zeros((64, 64)),))
    >>> state.error[0].shape
    (64, 64)
  """

  error: tuple[jax.Array, ...]
  stats: stats.CompressionStats


def sparseloco_average(
    axis_name: axes.AxisName,
    *,
    density: float = 64 / 4096,
    chunk: int = 64,
    value_bits: int | None = 2,
    error_decay: float = 0.95,
    aggregation: exchange_lib.Aggregation = "mean_over_contributors",
    matrix_view: blocks_lib.MatrixView | None = None,
) -> participation.AverageOverParticipants:
  r"""SparseLoCo's average of DiLoCo's outer gradients, for ``qsgd_jax.diloco(..., average=...)``.

  Each worker :math:`r` keeps an error-feedback buffer :math:`e_r` in place of
  the outer momentum and, each round, for its outer gradient
  :math:`\Delta_r` (SparseLoCo, Algorithm 1; ``sparseloco.py`` lines 394-452):

  .. math::

    e_r &\leftarrow \beta e_r + \Delta_r \\
    \hat\Delta_r &= Q(\mathrm{top}_k(e_r)) \qquad \text{(per block, by magnitude)} \\
    e_r &\leftarrow e_r - \hat\Delta_r \\
    \Delta &= \mathrm{mean}_r\, \hat\Delta_r \qquad
      \text{(each element over the workers that kept it)}

  Pass it with ``outer_optimizer=optax.sgd(1.0)`` (the paper's outer learning
  rate :math:`\alpha = 1`, no momentum), so that the global parameters move by
  :math:`-\Delta`. ``sparseloco.py`` folds :math:`\alpha` into the buffer
  (``e += lr * grad``), this the paper's :math:`e \leftarrow \beta e +
  \Delta`: the same at :math:`\alpha = 1`. The mean is over the workers that
  kept each element, as the code's ``scatter_reduce(mean)`` takes it (the
  paper writes :math:`\frac1R \sum_r`); :math:`Q` is SparseLoCo's quantizer,
  :class:`~qsgd_jax.TopK` with ``quantizer="bin_means"``, whose error is part
  of what the buffer keeps.

  Blocks as DeMo's (:func:`~qsgd_jax.scale_by_demo`), without its DCT: each
  leaf cut into blocks of at most ``chunk x chunk`` (a vector into runs of at
  most ``chunk``), each keeping ``max(1, round(density * block))`` elements,
  the density the same in every block, as ``sparseloco.py`` rescales its
  ``top_k`` (lines 416-424). ``diloco`` hands it a tuple of leaves, so
  ``matrix_view`` sees the leaves' index as their path: the default
  ``(prod(shape[:-1]), shape[-1])`` view. On a mesh whose model is laid out
  over other axes (explicit axes, as :func:`~qsgd_jax.data_parallel` runs
  the update), the blocks are of each device's own part
  of a leaf, a leaf whole over some model axes split among them, and the
  buffer is laid out as the leaves are.

  On the wire: one all-gather of every leaf's payload, a kept element
  :math:`\lceil \log_2 (hw) \rceil + b` bits (14 in a 64 x 64 block at 2
  bits) plus a table of :math:`1 + 2^b` float32 a leaf; at the default
  density (1.56%, Templar's) about 0.22 bits a parameter. A NaN or inf in the
  input of any worker taking part makes the average NaN on every worker and
  keeps the error feedback (``diloco`` leaves such a worker out before it gets
  here, and skips a round whose average is not finite).

  It is an :class:`~qsgd_jax.AverageOverParticipants`: ``update(deltas,
  state, participating=False)`` on a worker leaves it out of the round (it
  neither adds to its buffer nor sends into the average, and its buffer stays
  as it was), as ``diloco`` does with a worker whose outer gradient is not
  finite; the means are over the workers left in.

  Args:
    axis_name: the workers' axis (or axes), or ``None`` for one worker.
    density: the fraction of each block kept, in ``(0, 1]``: ``top_k /
      chunk**2`` of ``sparseloco.py`` (the paper's 512M runs: 128 / 4096).
    chunk: the target side of a block.
    value_bits: 2, 4 or 8 (``2**value_bits`` bins), or ``None`` for float32
      values.
    error_decay: :math:`\beta`, in ``[0, 1]`` (the paper's 512M runs: 0.95).
    aggregation: ``"mean_over_contributors"`` (``sparseloco.py``'s
      ``scatter_reduce(mean)``) or ``"mean_over_workers"`` (the paper's
      :math:`\frac1R \sum_r`: an element one worker of two sent moves half
      as far).
    matrix_view: ``(path, shape) -> (rows, columns)`` for leaves of two or
      more dimensions.

  Returns:
    An :class:`~qsgd_jax.AverageOverParticipants`; ``update(deltas, state,
    participating=True)`` returns the average, the same on every worker.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, qsgd_jax
    >>> tx = qsgd_jax.diloco(optax.adamw(1e-3), "workers", sync_every=15,
    ...                      outer_optimizer=optax.sgd(1.0),
    ...                      average=qsgd_jax.sparseloco_average("workers"))

  References:
    Sarfi, Thérien, Lidin and Belilovsky, `Communication Efficient LLM
    Pre-training with SparseLoCo <https://arxiv.org/abs/2508.15706>`_, 2025;
    ``sparseloco.py`` (commit 276fa59).
  """
  base.check_static_options(_OWNER, chunk=chunk, value_bits=value_bits)
  base.check_int_in_range(_OWNER, "chunk", chunk, 1, 2**12)
  kept_count(None, density, chunk * chunk, _OWNER)
  if (not isinstance(error_decay, int | float) or isinstance(error_decay, bool)
      or not 0 <= error_decay <= 1):
    raise ValueError(f"{_OWNER}: error_decay must be in [0, 1], got {error_decay!r}.")
  quantized = {} if value_bits is None else {"value_bits": value_bits, "quantizer": "bin_means"}
  TopK(k=1, **quantized)  # Checks value_bits now.
  exchange_lib.check_aggregation(aggregation, _OWNER)
  parsed = axes.parse(axis_name, _OWNER)

  def codecs(tree):
    layouts = blocks_lib.leaf_layouts(tree, matrix_view, chunk, _OWNER)
    return layouts, [TopK(k=min(layout.block_size, max(1, round(layout.block_size * density))),
                          chunk=layout.block_size, **quantized) for layout in layouts]

  def init_fn(params):
    base.check_float_leaves(params, _OWNER)
    codecs(params)
    return SparseLoCoState(
        error=tuple(jnp.zeros_like(x, jnp.float32) for x in jax.tree.leaves(params)),
        stats=stats.empty())

  def update_fn(updates, state, params=None, *, participating=True, **extra_args):
    del params, extra_args
    base.check_float_leaves(updates, _OWNER)
    deltas, treedef = jax.tree.flatten(updates)
    # Blocks of each device's own part of a leaf (shards.map_spread): none spans two.
    layouts, compressors = codecs(treedef.unflatten(
        [jax.ShapeDtypeStruct(shards.spread_shape(d), jnp.float32) for d in deltas]))
    wire_bits = []

    def exchange_parts(members, columns, taking_part):
      parts, errors = columns
      # A worker left out keeps its buffer: what it encodes is not counted.
      error = [jnp.where(taking_part, error_decay * e + d.astype(jnp.float32), e)
               for e, d in zip(errors, parts, strict=True)]
      out = exchange_lib.exchange(
          [compressors[i] for i in members],
          [blocks_lib.to_blocks(e, layouts[i]) for e, i in zip(error, members, strict=True)],
          jax.random.key(0), axis_name, aggregation, base.all_finite(parts), taking_part)
      wire_bits.append(out.wire_bits)
      averaged = [blocks_lib.from_blocks(a, layouts[i])
                  for a, i in zip(out.averaged, members, strict=True)]
      kept = [e - blocks_lib.from_blocks(sent, layouts[i])
              for e, sent, i in zip(error, out.sent, members, strict=True)]
      return [averaged, kept], out.all_finite

    (averaged, kept), all_finite = shards.map_spread(
        exchange_parts, [deltas, state.error], _OWNER, jnp.asarray(participating))
    keep_sent = all_finite & participating
    new_error = tuple(axes.as_varying(jnp.where(keep_sent, e, old), axis_name)
                      for e, old in zip(kept, state.error, strict=True))
    averaged = [jnp.where(all_finite, a, jnp.nan).astype(d.dtype)
                for a, d in zip(averaged, deltas, strict=True)]
    size = 1 if parsed.is_local else math.prod(parsed.sizes(_OWNER))
    float32_bits = wire.float32_allreduce_bits(sum(d.size for d in deltas), size)
    return treedef.unflatten(averaged), SparseLoCoState(
        error=new_error, stats=stats.make(sum(wire_bits), float32_bits, np.nan))

  return participation.AverageOverParticipants(init_fn, update_fn)
