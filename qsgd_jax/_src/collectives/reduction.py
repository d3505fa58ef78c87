"""Executing a :class:`~qsgd_jax._src.collectives.plan.ReductionPlan`: a quantized sum of a tree.

The steps, each a few lines here, the algorithms in their own modules:

1. the leaves the plan sends in float32 are summed by one fused ``psum``;
2. the others are laid end to end in the plan's segments (float32, padded)
   and, with inner axes, reduce-scattered over them in float32 (all segments
   in one collective); the two-phase method over one axis with nothing to
   add reads them where they lie instead (:func:`layout.segment_parts`),
   from :data:`IN_PLACE_MIN_ELEMENTS` compressed elements on;
3. each device adds its error-feedback residual to what it will quantize;
4. the outer axis's quantized sum: :mod:`two_phase`, :mod:`shared_scale` or
   :mod:`all_gather`;
5. with inner axes, the sums are all-gathered over them in float32;
6. the segments are cut back into the leaves' shapes and dtypes.

Every device passes the same ``key`` and folds in its index along all the
axes, so devices draw independently.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from qsgd_jax._src import axes as axes_lib
from qsgd_jax._src import base
from qsgd_jax._src.collectives import exchange, layout, provenance
from qsgd_jax._src.collectives.all_gather import all_gather_sum
from qsgd_jax._src.collectives.plan import ReductionPlan
from qsgd_jax._src.collectives.shared_scale import shared_scale_sum
from qsgd_jax._src.collectives.two_phase import scatter_phase, two_phase_sum


class Reduction(NamedTuple):
  """What :func:`reduce` returns.

  Attributes:
    tree: the sum or mean, like the input tree, replicated over the axes.
    local_error: for each segment, ``float32[length]``: what this device's
      quantization dropped of what it sent (``None`` unless asked for).
    owner_error: for each block, ``float32[batch, *element_shape]``: the new
      residual of the sum this device owns (two-phase, ``None`` unless
      ``owner_error`` was given).
    payloads: the payloads of each collective that carries them, by its
      :attr:`~qsgd_jax._src.collectives.plan.PlannedCollective.carries`: for each block,
      ``[batch, n, ...]`` this device sent in the two-phase all-to-all
      (``"first phase"``), ``[n, batch, ...]`` as gathered (``"second
      phase"``, ``"payloads"``); empty for ``"psum"``.
  """

  tree: object
  local_error: tuple[jax.Array, ...] | None
  owner_error: tuple[jax.Array, ...] | None
  payloads: dict[str, tuple[base.Payload, ...]]


def reduce(plan: ReductionPlan, tree, key: jax.Array, *, mean: bool,
           local_error: tuple[jax.Array, ...] | None = None,
           owner_error: tuple[jax.Array, ...] | None = None,
           want_local_error: bool = False) -> Reduction:
  """Sums (or averages) ``tree`` over the plan's axes as the plan says.

  Call it inside ``jax.pmap`` or ``jax.shard_map`` where the axes are bound.

  Args:
    plan: from :func:`~qsgd_jax._src.collectives.plan.make_plan` for this tree.
    tree: a pytree of arrays, this device's values: float leaves are reduced
      as the plan says, integer and bool ones by :func:`reduce_integer`,
      ``float0`` ones returned as they are.
    key: a PRNG key, the same on every device.
    mean: divide by the number of devices (before the second quantization).
    local_error: for each segment, ``float32[length]``, added to what this
      device quantizes (the residual of 1-bit SGD).
    owner_error: for each block, ``float32[batch, *element_shape]``, added to
      the sum this device owns before it is re-quantized (two-phase only).
    want_local_error: return :attr:`Reduction.local_error` (implied by
      ``local_error``).

  Returns:
    A :class:`Reduction`.

  Raises:
    ValueError: under ``jax.shard_map``, a float leaf is replicated over an
      axis rather than a per-device value (the error names it).
  """
  axes = plan.axes
  if not axes.is_local:
    axes_lib.check_varying(tree, axes, plan.owner)
  leaves, treedef = jax.tree.flatten(tree)
  leaves = [jnp.asarray(leaf) for leaf in leaves]
  divisor = plan.num_devices if mean else 1
  out = list(leaves)  # "unchanged" leaves (float0) stay as they are.
  want_local_error = want_local_error or local_error is not None
  sent_error = new_owner_error = None
  payloads = {}

  if plan.integer and not axes.is_local:
    for i in plan.integer:
      out[i] = reduce_integer(leaves[i], axes.name, mean=mean)
  if plan.full_precision and not axes.is_local:
    summed = _psum_flat([leaves[i] for i in plan.full_precision], axes.name)
    for i, value in zip(plan.full_precision, summed, strict=True):
      out[i] = (value / divisor if mean else value).astype(leaves[i].dtype)

  if plan.compressed:
    vectors = None
    if not _reads_leaves_in_place(plan, local_error):
      vectors = layout.segment_vectors(plan, leaves)
      if axes.inner:
        vectors = _reduce_scatter(vectors, plan.inner_size, axes.inner)
      if local_error is not None:
        vectors = [v + e for v, e in zip(vectors, local_error, strict=True)]
    key = base.as_key(key)
    if axes.is_local:
      results, sent_error = _roundtrip(plan, vectors, key, want_local_error)
    else:
      key = jax.random.fold_in(key, jax.lax.axis_index(axes.names))
      results, sent_error, new_owner_error, payloads = _outer_sum(
          plan, leaves, vectors, key, divisor, owner_error, want_local_error)
    if axes.inner:
      results = _all_gather_flat(results, axes.inner)
    for i, value in layout.segment_leaves(plan, results).items():
      out[i] = value.astype(leaves[i].dtype)

  return Reduction(
      tree=jax.tree.unflatten(treedef, out),
      local_error=tuple(sent_error or ()) if want_local_error else None,
      owner_error=None if new_owner_error is None else tuple(new_owner_error),
      payloads=payloads,
  )


def reduce_integer(x: jax.Array, axis_name, *, mean: bool) -> jax.Array:
  """An integer or bool leaf's sum or mean over ``axis_name``, in its own dtype.

  The sum is ``jax.lax.psum``'s (integers wrap around as it wraps them); the
  mean is ``jax.lax.pmean``'s cast back, ``pmean(x).astype(x.dtype)``, as its
  user would cast it: rounded toward zero (exact while the sum fits float32's
  24 bits). A bool leaf comes back ``True`` where any device's is, from its sum
  and from its mean alike.
  """
  reduced = jax.lax.pmean(x, axis_name) if mean else jax.lax.psum(x, axis_name)
  return reduced.astype(x.dtype)


# The payloads in which each method encodes all the values a device compresses.
_PAYLOADS_OF_INPUTS = {"two_phase": "first phase", "all_gather": "payloads"}


def encoded_all_finite(plan: ReductionPlan, out: Reduction) -> jax.Array | None:
  """Whether the values this device quantized were all finite, read from the payloads it saw.

  Those values are its compressed leaves, with the residual added where it
  has one: a NaN or inf in the leaves is one there too. (The all-gather
  method's payloads are every device's.)

  Returns:
    ``bool[]``, or ``None`` where the payloads cannot tell: nothing is
    compressed, the method sends none (``"psum"``, one device), the values
    quantized are sums over inner axes (a NaN in this device's leaves may be
    quantized by another), or the compressor's payloads do not say
    (:meth:`~qsgd_jax.Compressor.encoded_all_finite`).
  """
  carries = _PAYLOADS_OF_INPUTS.get(plan.method)
  if not plan.compressed or plan.axes.inner or carries not in out.payloads:
    return None
  flags = [plan.compressor.encoded_all_finite(p) for p in out.payloads[carries]]
  if any(flag is None for flag in flags):
    return None
  return jnp.all(jnp.stack(flags))


# The two-phase method reads the leaves in place (a scales and a quantize
# kernel a leaf and piece) from this many compressed elements on; below it,
# it copies them end to end first (a few kernels in all). The copy of a
# segment this size costs about a millisecond a step on a CPU core, while the
# extra kernels doubled compile time (ResNet-50 at 1/8 width, 8 CPU devices:
# 5.0 s against 2.5 s), which small trees, and a test suite of them, would
# pay many times over.
IN_PLACE_MIN_ELEMENTS = 1 << 20


def _reads_leaves_in_place(plan: ReductionPlan, local_error) -> bool:
  """Whether the compressed leaves are encoded where they lie (two-phase, one axis, no residual)."""
  axes = plan.axes
  return (plan.method == "two_phase" and not axes.is_local and not axes.inner
          and local_error is None
          and sum(segment.length for segment in plan.segments) >= IN_PLACE_MIN_ELEMENTS)


def reduce_scatter(plan: ReductionPlan, tree, key: jax.Array) -> Reduction:
  """Each device's shard of the sum of ``tree``, as the reduce-scatter plan says.

  Like :func:`reduce`, for a plan of ``method="reduce_scatter"``: device ``j``
  (counted over all the plan's axes, outer first) gets shard ``j`` of every
  leaf, along the plan's scatter dimension, summed over the axes. A leaf the
  devices do not divide is zero-padded to whole shards, and the padding is
  zero in the shards too. Integer leaves go by ``jax.lax.psum_scatter``,
  float leaves under the size threshold by one fused float32 one; the
  compressed ones are summed in float32 over the inner axes first (one
  ``psum_scatter`` of every leaf's shards for the outer devices), then by the
  two-phase method's first phase over the outer axis, an all-to-all of packed
  pieces, the device's own piece added exactly.

  Returns:
    A :class:`Reduction` whose tree holds the shards and whose payloads are
    the first phase's; ``local_error`` and ``owner_error`` ``None`` (no
    error feedback).

  Raises:
    ValueError: a float leaf is replicated over an axis (under
      ``jax.shard_map``), or was reduced over it already
      (:func:`provenance.check_not_reduced`).
  """
  axes_lib.check_varying(tree, plan.axes, plan.owner)
  provenance.check_not_reduced(tree, plan.axes, plan.owner)
  with jax.named_scope(provenance.scope(plan.axes)):  # Marks the result as reduced.
    return _reduce_scatter_in_scope(plan, tree, key)


def _reduce_scatter_in_scope(plan: ReductionPlan, tree, key: jax.Array) -> Reduction:
  leaves, treedef = jax.tree.flatten(tree)
  leaves = [jnp.asarray(leaf) for leaf in leaves]
  everyone = plan.axes.names
  index = jax.lax.axis_index(everyone)
  out = list(leaves)
  payloads = {}
  for i in plan.integer:
    rows = axes_lib.as_varying(layout.scatter_rows(plan, i, leaves[i]), everyone)
    out[i] = layout.output_leaf(
        plan, i, jax.lax.psum_scatter(rows, everyone, tiled=False)).astype(leaves[i].dtype)
  if plan.full_precision:
    rows = [layout.scatter_rows(plan, i, leaves[i].astype(jnp.float32))
            for i in plan.full_precision]
    mine = jax.lax.psum_scatter(axes_lib.as_varying(jnp.concatenate(rows, axis=1), everyone),
                                everyone, scatter_dimension=0, tiled=False)
    for i, shard in zip(plan.full_precision, _split(mine, [r.shape[1] for r in rows]),
                        strict=True):
      out[i] = layout.output_leaf(plan, i, shard).astype(leaves[i].dtype)
  if plan.compressed:
    rows = {i: layout.scatter_rows(plan, i, leaves[i].astype(jnp.float32))
            for i in plan.compressed}
    if plan.axes.inner:
      rows = _inner_sum_of_rows(plan, rows)
    vectors = layout.scatter_segment_vectors(plan, rows)
    key = jax.random.fold_in(base.as_key(key), index)
    first = scatter_phase(plan, layout.written_blocks(plan, vectors), key,
                          want_sent_error=False)
    shards = layout.split(plan, first.owned,
                          length=lambda segment: segment.length // plan.outer_size)
    for i, shard in layout.segment_leaves(plan, shards).items():
      out[i] = shard.astype(leaves[i].dtype)
    payloads = {"first phase": tuple(first.payloads)}
  for i in (*plan.integer, *plan.full_precision, *plan.compressed):
    out[i] = _zero_padding(plan, i, out[i], index)
  return Reduction(
      tree=jax.tree.unflatten(treedef, out), local_error=None, owner_error=None,
      payloads=payloads)


def _inner_sum_of_rows(plan: ReductionPlan, rows: dict[int, jax.Array]) -> dict[int, jax.Array]:
  """Each leaf's ``[n * m, shard]`` rows summed over the inner axes, in one ``psum_scatter``.

  Shard ``i * m + j`` goes to outer device ``i``, inner device ``j``: inner
  device ``j`` keeps the sum over its inner group of rows ``i * m + j`` for
  every ``i``, ``[n, shard]``, which the outer axis then reduce-scatters.
  """
  n, m = plan.outer_size, plan.inner_size
  by_inner = [jnp.swapaxes(r.reshape(n, m, -1), 0, 1).reshape(m, -1) for r in rows.values()]
  mine = jax.lax.psum_scatter(
      axes_lib.as_varying(jnp.concatenate(by_inner, axis=1), plan.axes.inner),
      plan.axes.inner, scatter_dimension=0, tiled=False)
  summed = _split(mine, [b.shape[1] for b in by_inner])
  return {i: s.reshape(n, -1) for i, s in zip(rows, summed, strict=True)}


def _zero_padding(plan: ReductionPlan, i: int, shard: jax.Array, index: jax.Array) -> jax.Array:
  """Shard ``index`` of leaf ``i`` with its rows past the leaf's end (padding) set to zero.

  Zeros in sum to zeros, but a quantizer need not decode a zero to zero
  (MinMax's grid passes through its bucket's minimum): the padding is made
  exactly zero, so that it adds nothing to a norm or an update.
  """
  size = plan.leaf_shapes[i][plan.scatter_dimension]
  rows = plan.shard_rows(i)
  if not plan.tiled or size % plan.num_devices == 0:
    return shard
  real = index * rows + jnp.arange(rows) < size
  shape = [1] * shard.ndim
  shape[plan.scatter_dimension] = rows
  return jnp.where(real.reshape(shape), shard, jnp.zeros((), shard.dtype))


def _outer_sum(plan: ReductionPlan, leaves, vectors, key, divisor, owner_error,
               want_sent_error):
  """The quantized sum over the outer axis, by the plan's method.

  The segments are ``vectors``, or when that is ``None`` (the two-phase
  method only) the compressed ``leaves`` where they lie.

  Returns ``(results, sent_error, owner_error, payloads)``.
  """
  if plan.method == "two_phase":
    if vectors is None:
      blocks = layout.block_parts(plan, layout.segment_parts(plan, leaves))
    else:
      blocks = layout.written_blocks(plan, vectors)
    out = two_phase_sum(plan, blocks, key, divisor=divisor,
                        owner_error=owner_error, want_sent_error=want_sent_error)
    payloads = {"first phase": tuple(out.first_phase), "second phase": tuple(out.second_phase)}
    return out.results, out.sent_error, out.owner_error, payloads
  if plan.method == "all_gather":
    out = all_gather_sum(plan, vectors, key, divisor=divisor, want_sent_error=want_sent_error)
    return out.results, out.sent_error, None, {"payloads": tuple(out.payloads)}
  results, sent_error = shared_scale_sum(plan, vectors, key, divisor=divisor,
                                         want_sent_error=want_sent_error)
  return results, sent_error, None, {}


def _roundtrip(plan: ReductionPlan, vectors, key, want_sent_error):
  """One device alone (no axis): each segment as the compressor sends it, no collective."""
  blocks = layout.join(plan, vectors)
  decoded = exchange.decode_blocks(
      plan.compressor, exchange.encode_blocks(plan.compressor, key, blocks, batch_dims=2),
      batch_dims=2)
  results = layout.split(plan, decoded)
  sent_error = None
  if want_sent_error:
    sent_error = layout.split(plan, [b - d for b, d in zip(blocks, decoded, strict=True)])
  return results, sent_error


def _psum_flat(leaves: list[jax.Array], axis_name) -> list[jax.Array]:
  """Full-precision sum of several leaves in one fused all-reduce."""
  flat = jnp.concatenate([leaf.astype(jnp.float32).reshape(-1) for leaf in leaves])
  summed = jax.lax.psum(flat, axis_name)
  out, start = [], 0
  for leaf in leaves:
    out.append(summed[start : start + leaf.size].reshape(leaf.shape))
    start += leaf.size
  return out


def _reduce_scatter(vectors: list[jax.Array], n: int, axes: tuple[str, ...]) -> list[jax.Array]:
  """Full-precision reduce-scatter over the inner axes, every segment at once.

  Device ``k`` of the inner axes gets elements ``[k * length, (k + 1) * length)``
  of each segment (of ``n * length``), summed over the inner axes.
  """
  lengths = [v.size // n for v in vectors]
  rows = jnp.concatenate([v.reshape(n, length) for v, length in zip(vectors, lengths,
                                                                      strict=True)], axis=1)
  mine = jax.lax.psum_scatter(axes_lib.as_varying(rows, axes), axes, scatter_dimension=0,
                              tiled=False)
  return _split(mine, lengths)


def _all_gather_flat(chunks: list[jax.Array], axes: tuple[str, ...]) -> list[jax.Array]:
  """Inverse of :func:`_reduce_scatter`: every device gets every segment whole."""
  lengths = [c.size for c in chunks]
  gathered = axes_lib.all_gather_replicated(
      axes_lib.as_varying(jnp.concatenate(chunks), axes), axes)
  return [g.reshape(-1) for g in _split(gathered, lengths, axis=1)]


def _split(x: jax.Array, lengths, axis: int = 0) -> list[jax.Array]:
  out, start = [], 0
  for length in lengths:
    out.append(jax.lax.slice_in_dim(x, start, start + length, axis=axis))
    start += length
  return out


def elias_wire_bits(plan: ReductionPlan, sent: Reduction) -> jax.Array:
  """Bits this device sent in ``plan``, were every payload Elias-coded.

  Each collective that carries QSGD payloads (the two-phase all-to-all and
  all-gather, the all-gather method's all-gather) counts ``bytes_sent``
  scaled by the Elias size of the payloads it carried over their
  fixed-width size: this device's pieces for the all-to-all, every device's
  payloads for an all-gather. Every other collective (float32 leaves, inner
  axes) counts as it is.

  Args:
    plan: a plan for a :class:`~qsgd_jax.QSGD` compressor.
    sent: what :func:`reduce` returned for it.

  Returns:
    A float32 scalar, this device's own estimate.
  """
  elias_bits = jax.vmap(jax.vmap(plan.compressor.elias_bits))
  total = jnp.float32(0)
  for collective in plan.collectives:
    bits = 8 * collective.bytes_sent
    if collective.carries in sent.payloads:
      coded = sum(jnp.sum(elias_bits(p).smaller)
                  for p in sent.payloads[collective.carries])
      bits = bits * coded / (8 * collective.result_bytes)
    total += bits
  return total
