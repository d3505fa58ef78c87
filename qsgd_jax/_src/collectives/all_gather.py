"""The all-gather quantized sum of the QSGD paper: every device broadcasts its payload once.

Algorithm 1 of Alistarh et al.: each device quantizes its vector once, one
``all_gather`` gives every device every device's packed payload, and every
device decodes all ``n`` of them and adds them in the same fixed order, so the
result is bit-identical everywhere. One quantization of each device's
gradient, and none of the sum: with an unbiased compressor the mean's variance
is the average of the devices' variances over ``n`` (Lemma 3.1's bound, divided
by ``n``), below the two-phase method's, which quantizes the sum again.

The price is bandwidth: a device receives ``n - 1`` whole payloads (the
accounting of ``wire.py`` counts ``(n - 1) / n`` of the gathered ``n``), against
``2 (n - 1) / n`` for the two-phase method: worth it for a few devices, or
where accuracy matters more than bytes.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from qsgd_jax._src import axes as axes_lib
from qsgd_jax._src import base, serialize
from qsgd_jax._src.collectives import exchange, layout
from qsgd_jax._src.collectives.plan import ReductionPlan


class AllGatherOutput(NamedTuple):
  """What :func:`all_gather_sum` returns.

  Attributes:
    results: for each segment, ``float32[length]``: the sum.
    sent_error: for each segment, ``float32[length]``: what this device's
      quantization dropped (``None`` unless asked for).
    payloads: for each block, every device's gathered payloads,
      ``[n, batch, ...]`` (the same on every device).
  """

  results: list[jax.Array]
  sent_error: list[jax.Array] | None
  payloads: list[base.Payload]


def all_gather_sum(plan: ReductionPlan, vectors: list[jax.Array], key: jax.Array, *,
                   divisor: int, want_sent_error: bool) -> AllGatherOutput:
  """Sums ``vectors`` over the plan's outer axis by the all-gather method.

  Args:
    plan: the reduction's plan, ``method="all_gather"``.
    vectors: for each segment, ``float32[length]``.
    key: this device's PRNG key (already folded with its axis index).
    divisor: the sum is divided by it.
    want_sent_error: return what this device's quantization dropped.

  Returns:
    An :class:`AllGatherOutput`.
  """
  compressor, axis = plan.compressor, plan.axes.outer
  blocks = layout.join(plan, vectors)  # [batch, 1, ...]
  mine = exchange.encode_blocks(compressor, key, blocks, batch_dims=2)
  words = jnp.concatenate(
      [jax.vmap(jax.vmap(serialize.to_words))(p).reshape(-1) for p in mine])
  gathered = axes_lib.all_gather_replicated(words, axis)
  payloads = exchange.payload_rows(plan, gathered)  # [n, batch, ...] a block
  summed = [exchange.sum_rows(decoded) / divisor
            for decoded in exchange.decode_blocks(compressor, payloads, batch_dims=2)]
  sent_error = None
  if want_sent_error:
    decoded = exchange.decode_blocks(compressor, mine, batch_dims=2)
    sent_error = layout.split(plan, [b - d for b, d in zip(blocks, decoded, strict=True)])
  return AllGatherOutput(layout.split(plan, summed), sent_error, payloads)
