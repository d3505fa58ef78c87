r"""The sparse exchange: every device's payloads all-gathered, decoded and averaged in one order.

Sparse payloads do not add up in an all-reduce: each device keeps other
positions. So each device lays the ``uint32`` words of its payloads (one a
leaf) end to end, with one more word saying whether what it encoded was all
finite, and one ``all_gather`` gives every device every device's words. Each
device then decodes the ``n`` payloads of a leaf one after the other, in the
devices' order, adding them up as it goes: the same operations on the same
bits, so the same result on every device, whatever the order the words
arrived in. Two averages:

* ``"mean_over_workers"``: the sum divided by ``n``, as GRACE's all-gather
  communicator and DGC's released code average
  (:math:`\frac1n \sum_w \hat x_w`, which SparseLoCo's paper writes too);
* ``"mean_over_contributors"``: each position's sum divided by the number of
  devices that kept it (0 where none did), as DeMo's and SparseLoCo's code
  does (``scatter_reduce(..., reduce="mean", include_self=False)``,
  ``demo.py`` lines 296-307, ``sparseloco.py`` line 301).

Cost against a dense all-reduce: a device sends ``(n - 1) P`` bytes for a
payload of ``P`` bytes (and receives as much), where a float32 ring all-reduce
of ``d`` coordinates sends ``2 (n - 1) / n \cdot 4 d``. With a density
:math:`\rho` and :math:`b` bits a kept element (its position and value),
:math:`P = \rho d b / 8`, so the gather sends fewer bytes while
:math:`\rho b n < 64`: at 8 devices, 32-bit values and 6-bit positions (chunks
of 64) up to a density of 21%; 2-bit values and 12-bit positions (chunks of
4096) up to 57%. The gather's bytes grow with ``n``, an all-reduce's do not:
at ``n = 64`` those break-even densities are 2.6% and 7.1%.
"""

from collections.abc import Sequence
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qsgd_jax._src import axes, base, serialize, wire
from qsgd_jax._src.sparse.topk import TopK

Aggregation = Literal["mean_over_workers", "mean_over_contributors"]
AGGREGATIONS = ("mean_over_workers", "mean_over_contributors")


class Exchanged(NamedTuple):
  """What :func:`exchange` returns.

  Attributes:
    payloads: for each array, this device's payload.
    sent: for each array, ``float32`` of its shape: what this device's payload
      decodes to (what it sent, as every device reads it).
    averaged: for each array, the average over the devices that take part of
      what they sent, the same on every device (zeros where none takes part).
    all_finite: ``bool[]``, whether every device that takes part had finite
      values, the same on every device.
    wire_bits: bits this device sent, a Python float.
  """

  payloads: list[base.Payload]
  sent: list[jax.Array]
  averaged: list[jax.Array]
  all_finite: jax.Array
  wire_bits: float


def check_aggregation(aggregation, owner: str) -> None:
  """Raises ``ValueError`` naming ``owner`` unless ``aggregation`` is one of
  :data:`AGGREGATIONS`."""
  if aggregation not in AGGREGATIONS:
    raise ValueError(f"{owner}: aggregation must be one of {AGGREGATIONS}, got "
                     f"{aggregation!r}.")


def exchange(compressors: Sequence[TopK], arrays: Sequence[jax.Array], key: jax.Array,
             axis_name: axes.AxisName, aggregation: Aggregation, finite: jax.Array,
             participating: jax.Array | bool = True) -> Exchanged:
  """Encodes each array with its compressor, all-gathers the payloads, and averages them.

  Args:
    compressors: one :class:`TopK` an array.
    arrays: this device's ``float32`` arrays.
    key: a PRNG key for the values' stochastic rounding (fold in the device's
      index for draws of its own); unused by deterministic values.
    axis_name: the devices' axis, or ``None`` for one device (nothing sent).
    aggregation: ``"mean_over_workers"`` or ``"mean_over_contributors"``.
    finite: ``bool[]``, whether this device's values are all finite; it
      travels with the payloads.
    participating: ``bool[]``, whether this device's payloads enter the
      average; it travels with them. A device that does not take part still
      sends (the gather's shape is fixed), but its payloads are neither
      added nor counted, and its values' finiteness does not matter.

  Returns:
    An :class:`Exchanged`.
  """
  keys = jax.random.split(key, max(1, len(arrays)))
  payloads = [c.encode(k, a) for c, k, a in zip(compressors, keys, arrays, strict=True)]
  sent = [c.decode(p) for c, p in zip(compressors, payloads, strict=True)]
  # One word a device: 1 (in), 0 (left out) or NaN (in, but not finite).
  flag = jnp.where(participating, jnp.where(finite, np.float32(1), np.float32(np.nan)),
                   np.float32(0))[None]
  words = jnp.concatenate([serialize.to_words(p) for p in payloads]
                          + [jax.lax.bitcast_convert_type(flag, jnp.uint32)])
  if axes.parse(axis_name, "sparse exchange").is_local:
    return Exchanged(payloads, sent, [jnp.where(participating, s, 0.0) for s in sent],
                     finite | ~jnp.asarray(participating), 0.0)
  gathered = axes.all_gather_replicated(axes.as_varying(words, axis_name), axis_name)
  n = gathered.shape[0]
  flags = jax.lax.bitcast_convert_type(gathered[:, -1], jnp.float32)
  taking_part = flags != 0  # NaN != 0: a non-finite device takes part, and poisons the sum.
  averaged, start = [], 0
  for compressor, payload in zip(compressors, payloads, strict=True):
    count = serialize.num_words(payload)
    rows = jax.vmap(lambda w, t=payload: serialize.from_words(w, t))(
        gathered[:, start:start + count])
    averaged.append(average(compressor, rows, aggregation, taking_part))
    start += count
  bits = 8 * wire.bytes_sent("all-gather", 4 * n * words.shape[0], n)
  return Exchanged(payloads, sent, averaged, jnp.all(jnp.isfinite(flags)), bits)


def average(compressor: TopK, rows: base.Payload, aggregation: Aggregation,
            taking_part: jax.Array) -> jax.Array:
  """The average of the payloads ``rows``, ``[n, ...]``, of the devices ``taking_part``
  (``bool[n]``), added in the devices' order.

  A ``jax.lax.scan`` over the devices decodes one payload at a time into a
  running sum (and, for ``"mean_over_contributors"``, a running count of the
  devices that kept each position), skipping those not taking part: one
  leaf's worth of memory, however many devices, and a fixed order of
  additions. ``"mean_over_workers"`` divides by the number taking part.
  """
  shape = rows.shape

  def add(carry, row_and_in):
    (total, count), (row, taking) = carry, row_and_in
    positions, kept = compressor.kept(row)
    total = jnp.where(taking, total + compressor.scattered(shape, positions, kept), total)
    if aggregation == "mean_over_contributors":
      count = jnp.where(taking, count + compressor.support(row), count)
    return (total, count), None

  # Typed as the payloads are (varying over any axis other than the gather's, under shard_map).
  zeros = jnp.zeros(shape, jnp.float32)
  if names := axes.varying_axes(rows.packed):
    zeros = axes.as_varying(zeros, names)
  (total, count), _ = jax.lax.scan(add, (zeros, zeros), (rows, taking_part))
  if aggregation == "mean_over_workers":
    return total / jnp.maximum(jnp.sum(taking_part, dtype=jnp.float32), 1.0)
  return jnp.where(count > 0, total / jnp.maximum(count, 1.0), 0.0)
