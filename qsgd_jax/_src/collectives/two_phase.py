"""The two-phase quantized sum: an all-to-all of packed pieces, then an all-gather of packed sums.

CNTK's stripes, QSGD-TF's two rounds, CGX's scatter-reduce-allgather. With
``n`` devices, each device cuts every segment it quantizes into ``n`` pieces
of whole buckets (the plan's blocks, ``[batch, n, ...]``) and encodes them,
reading the leaves where they lie when it has nothing to add to them. One
``all_to_all`` sends piece ``j`` to device ``j``, which decodes the ``n - 1``
pieces it received, adds its own piece ``j`` unquantized (it never crossed
the wire, so nothing of it need be lost, as in QSGD-TF), sums in
float32 (divided by the divisor for a mean), and encodes that sum with fresh
randomness; one ``all_gather`` gives every device every owner's sum, and
every device decodes the same gathered bytes, so the result is bit-identical
everywhere.

Each device sends ``2 (n - 1) / n`` payloads of its gradient: a ``b``-bit code
is ``32 / b`` times fewer bytes than a float32 all-reduce. With an unbiased
compressor the result is unbiased (a sum of unbiased pieces, re-quantized
unbiasedly); its error is that of the ``n - 1`` other devices' pieces
quantized once, and of the sum quantized again.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from qsgd_jax._src import axes as axes_lib
from qsgd_jax._src import base, serialize
from qsgd_jax._src.collectives import exchange, layout
from qsgd_jax._src.collectives.plan import ReductionPlan


class TwoPhaseOutput(NamedTuple):
  """What :func:`two_phase_sum` returns.

  Attributes:
    results: for each segment, ``float32[length]``: the sum.
    sent_error: for each segment, ``float32[length]``: what the device's
      first-phase quantization dropped, ``input - decode(encode(input))``;
      with ``exact_own_piece``, zero on its own piece, which it adds exactly
      (``None`` unless asked for).
    owner_error: for each block, ``float32[batch, *element_shape]``: the error
      of this device's re-quantized sum (``None`` unless ``owner_error`` was
      given).
    first_phase: for each block, the batched payloads this device sent,
      ``[batch, n, ...]``.
    second_phase: for each block, every owner's gathered payloads,
      ``[n, batch, ...]`` (the same on every device).
  """

  results: list[jax.Array]
  sent_error: list[jax.Array] | None
  owner_error: list[jax.Array] | None
  first_phase: list[base.Payload]
  second_phase: list[base.Payload]


def two_phase_sum(plan: ReductionPlan, blocks: list[layout.BlockParts], key: jax.Array, *,
                  divisor: int, owner_error: tuple[jax.Array, ...] | None,
                  want_sent_error: bool) -> TwoPhaseOutput:
  """Sums the plan's blocks over its outer axis by the two-phase method.

  Args:
    plan: the reduction's plan, ``method="two_phase"``.
    blocks: for each block, ``[batch, n, ...]`` as its parts
      (:func:`layout.block_parts`) or written out
      (:func:`layout.written_blocks`): row ``j`` goes to device ``j``.
    key: this device's PRNG key (already folded with its axis index).
    divisor: the sum of the pieces is divided by it before re-quantizing.
    owner_error: for each block, ``float32[batch, *element_shape]``, added to
      the sum this device owns before it is re-quantized.
    want_sent_error: return the first phase's error.

  Returns:
    A :class:`TwoPhaseOutput`.
  """
  compressor, axis = plan.compressor, plan.axes.outer
  index = jax.lax.axis_index(axis)
  send_key, gather_key = jax.random.split(key)

  # Phase 1: piece j goes to device j, which adds its own piece as it is.
  first = scatter_phase(plan, blocks, send_key, want_sent_error)
  owned = first.owned
  if divisor != 1:
    owned = [o / divisor for o in owned]
  if owner_error is not None:
    owned = [o + e for o, e in zip(owned, owner_error, strict=True)]

  # Phase 2: each owner re-quantizes its sums; everyone decodes every sum.
  mine = jnp.concatenate([
      jax.vmap(serialize.to_words)(p).reshape(-1)
      for p in exchange.encode_blocks(compressor, gather_key, owned)
  ])
  gathered_words = axes_lib.all_gather_replicated(mine, axis)
  second = exchange.payload_rows(plan, gathered_words)
  gathered = exchange.decode_blocks(compressor, second, batch_dims=2)  # [n, batch, ...]
  results = layout.split(plan, [jnp.swapaxes(g, 0, 1) for g in gathered])

  new_owner_error = None
  if owner_error is not None:
    new_owner_error = [o - jax.lax.dynamic_index_in_dim(g, index, keepdims=False)
                       for o, g in zip(owned, gathered, strict=True)]
  return TwoPhaseOutput(results, first.sent_error, new_owner_error, first.payloads, second)


class ScatterPhase(NamedTuple):
  """What :func:`scatter_phase` returns.

  Attributes:
    owned: for each block, ``float32[batch, *element_shape]``: the sum of
      every device's piece ``j`` on device ``j``.
    sent_error: for each segment, ``float32[length]``: what this device's
      quantization dropped, zero on its own piece if that is exact (``None``
      unless asked for).
    payloads: for each block, the payloads this device sent, ``[batch, n, ...]``.
  """

  owned: list[jax.Array]
  sent_error: list[jax.Array] | None
  payloads: list[base.Payload]


def scatter_phase(plan: ReductionPlan, blocks: list[layout.BlockParts], key: jax.Array,
                  want_sent_error: bool) -> ScatterPhase:
  """The first phase, a quantized reduce-scatter: piece ``j`` of every block to device ``j``.

  Device ``j`` decodes the pieces the others sent and adds its own piece
  ``j`` as it is, since it never crossed the wire (with the plan's
  ``exact_own_piece``, the default; else decoded like the others).

  Args:
    plan: the reduction's plan (two-phase or reduce-scatter).
    blocks: for each block, ``[batch, n, *element_shape]``, as its parts
      (:func:`layout.block_parts`: of these only the device's own piece, and
      with ``want_sent_error`` the whole block, is written out) or written out.
    key: this device's PRNG key for the encode.
    want_sent_error: return what the quantization dropped.

  Returns:
    A :class:`ScatterPhase`.
  """
  compressor, axis, n = plan.compressor, plan.axes.outer, plan.outer_size
  index = jax.lax.axis_index(axis)
  payloads, send = exchange.encode_block_parts(compressor, key, blocks)
  received = jax.lax.all_to_all(axes_lib.as_varying(send, axis), axis, 0, 0, tiled=False)
  owned = []
  for block, decoded in zip(blocks, exchange.decode_rows(plan, received), strict=True):
    if plan.exact_own_piece:
      own = layout.piece(block, index)
      decoded = jnp.where(_piece_mask(index, n, decoded.ndim, 0), own, decoded)
    owned.append(exchange.sum_rows(decoded))
  sent_error = None
  if want_sent_error:
    decoded = exchange.decode_blocks(compressor, payloads, batch_dims=2)
    errors = [layout.materialize(b) - d for b, d in zip(blocks, decoded, strict=True)]
    if plan.exact_own_piece:
      errors = [jnp.where(_piece_mask(index, n, e.ndim, 1), 0.0, e) for e in errors]
    sent_error = layout.split(plan, errors)
  return ScatterPhase(owned, sent_error, payloads)


def _piece_mask(index: jax.Array, n: int, ndim: int, axis: int) -> jax.Array:
  """True where ``axis`` (of ``n`` pieces) is ``index``, broadcastable to ``ndim`` dimensions."""
  shape = [1] * ndim
  shape[axis] = n
  return (jnp.arange(n) == index).reshape(shape)
