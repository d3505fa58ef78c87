"""Quantized psum, pmean and psum_scatter whose wire carries packed low-bit codes.

Three methods for the sum, all called inside ``jax.pmap``, ``jax.shard_map``
or ``jax.vmap`` with an axis name: ``"two_phase"`` (default: an all-to-all of
packed pieces, then an all-gather of packed sums; see ``two_phase.py``),
``"psum"`` (shared scales, then one integer psum of the codes; see
``shared_scale.py``) and ``"all_gather"`` (every device's payload to every
device; see ``all_gather.py``); the reduce-scatter is the two-phase method's
first phase. What is sent is decided from static shapes by a reduction plan
(``plan.py``), and executed by ``reduction.py``.

Leaves with fewer than ``min_compressed_size`` elements (biases, norm scales)
travel in full precision in one fused ``psum``, as the QSGD paper and CGX do.

The large leaves are encoded in a few batched encodes, not one a leaf (see
``plan.py``): with a fixed ``bucket_size`` (or ``OneBit``'s rows, by row
length), each padded to whole buckets and laid end to end as one vector, cut
into pieces of whole buckets; otherwise each leaf is a segment of its own, and
segments of one per-device width are stacked under one ``vmap``. The compiled program stays
small, and every bucket is quantized as the compressor defines.

A leaf whose size is not a multiple of ``bucket_size`` is padded with zeros to
whole buckets. The padding is dropped after decoding; QSGD's scales ignore
it, MinMax's last bucket widens its range to include 0, and OneBit's last
bucket counts it among the non-negative entries (a small bias of one bucket a
leaf, which error feedback absorbs).
"""

import jax

from qsgd_jax._src import axes, base
from qsgd_jax._src.collectives import plan, reduction


def quantized_psum(
    tree,
    axis_name: axes.AxisName,
    compressor: base.Compressor,
    key: jax.Array,
    *,
    method: plan.Method = "two_phase",
    min_compressed_size: int = plan.DEFAULT_MIN_COMPRESSED_SIZE,
    exact_own_piece: bool = True,
):
  """Sums a pytree over ``axis_name``, sending compressed payloads.

  Call it inside ``jax.pmap`` or ``jax.shard_map`` where ``axis_name`` is
  bound. Every device passes the same ``key``; each folds in its axis index,
  so their rounding draws are independent. The result is bit-identical on all
  devices and, under ``shard_map``, typed as replicated (return it with
  ``out_specs=P()``).

  ``"two_phase"`` (CNTK's stripes, QSGD-TF's two rounds, CGX's
  scatter-reduce-allgather): every large leaf is cut into ``n`` pieces of whole
  buckets, one ``all_to_all`` sends piece ``j`` to device ``j``, which sums the
  pieces it received and re-quantizes the sum, and one ``all_gather`` gives
  every device every sum. A device sends ``2 (n - 1) / n`` payloads of its
  gradient: a ``b``-bit code is ``32 / b`` times fewer bytes than a float32
  all-reduce. Unbiased for an unbiased compressor, with the error of two
  quantizations.

  ``"psum"``: the devices agree on each bucket's scale (one ``pmax``), quantize
  against it, and add the integer codes in one ``psum`` of the narrowest
  integer type that cannot overflow. One rounding, so less error; but at most
  4x fewer bytes, as an all-reduce of 8-bit integers sends a byte a
  coordinate. Only for :class:`~qsgd_jax.QSGD` and :class:`~qsgd_jax.MinMax`.

  ``"all_gather"`` (the QSGD paper's Algorithm 1): every device broadcasts its
  payload and every device decodes and adds all of them in one fixed order.
  One quantization a device and none of the sum, so the least error (the
  mean's variance is the devices' average over ``n``); but ``n - 1`` payloads
  on the wire: worth it for a few devices, or where accuracy matters most.

  Under ``jax.shard_map``, every float leaf must vary over the axes (a
  per-device value): a gradient taken with respect to replicated parameters
  has already been summed over the axis by autodiff, and summing it again
  would give ``n`` times the answer, so that is an error; differentiate with
  respect to :func:`~qsgd_jax.as_varying` params.

  Args:
    tree: a pytree of arrays. Float leaves (float32, bfloat16, float16) are
      quantized or summed in float32 by size; integer leaves are summed as
      ``jax.lax.psum`` sums them, bool leaves come back ``True`` where any
      device's is; ``float0`` leaves (``jax.grad`` with ``allow_int=True``)
      are returned as they are.
    axis_name: a mapped axis name, or a tuple ``(outer, inner, ...)``: then the
      sum over the inner axes is taken in full precision (a reduce-scatter
      and an all-gather over the fast links) and only the outer axis is
      quantized, as CGX's and BytePS's two-level reducers do. ``None`` for one
      device alone: each leaf as the compressor would send it
      (``decode(encode(x))``), no collective, for debugging.
    compressor: a :class:`~qsgd_jax.Compressor`.
    key: a PRNG key, the same on every device.
    method: ``"two_phase"``, ``"psum"`` or ``"all_gather"``.
    min_compressed_size: float leaves with fewer elements are summed in full
      precision.
    exact_own_piece: two-phase: each device adds its own piece of the first
      phase unquantized, as QSGD-TF does (it never crosses the wire, so
      nothing of it need be lost); ``False`` quantizes it like the others, as
      CNTK's aggregator does by default (``useQuantizationForSelfStripe``).

  Returns:
    A pytree like ``tree``: the sum over the axis, in each leaf's dtype.

  Raises:
    ValueError: under ``jax.shard_map``, a float leaf replicated over the axis.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> n = jax.local_device_count()
    >>> grads = jnp.ones((n, 8192))
    >>> total = jax.pmap(
    ...     lambda g: qsgd_jax.quantized_psum(
    ...         g, "batch", qsgd_jax.MinMax(bits=8), jax.random.key(0)),
    ...     axis_name="batch")(grads)
    >>> bool(jnp.all(total == n))
    True

  References:
    Alistarh et al., QSGD, NeurIPS 2017; Seide et al., 1-Bit SGD,
    Interspeech 2014; Markov et al., CGX, Middleware 2022.
  """
  return _reduce(tree, axis_name, compressor, key, method, min_compressed_size,
                 exact_own_piece, owner="quantized_psum", mean=False)


def quantized_pmean(
    tree,
    axis_name: axes.AxisName,
    compressor: base.Compressor,
    key: jax.Array,
    *,
    method: plan.Method = "two_phase",
    min_compressed_size: int = plan.DEFAULT_MIN_COMPRESSED_SIZE,
    exact_own_piece: bool = True,
):
  """Averages a pytree over ``axis_name``, sending compressed payloads.

  The mean counterpart of :func:`quantized_psum`, with the same arguments
  and guarantees; the sum is divided by the axis size before the second
  quantization. Integer and bool leaves keep their dtype: ``jax.lax.pmean``'s
  mean cast back, ``pmean(x).astype(x.dtype)`` (rounded toward zero; a bool
  ``True`` where any device's is).

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> n = jax.local_device_count()
    >>> grads = jnp.arange(n, dtype=jnp.float32)[:, None] * jnp.ones((n, 8192))
    >>> mean = jax.pmap(
    ...     lambda g: qsgd_jax.quantized_pmean(
    ...         g, "batch", qsgd_jax.QSGD(bits=8), jax.random.key(0)),
    ...     axis_name="batch")(grads)
    >>> bool(jnp.allclose(mean, (n - 1) / 2, rtol=1e-2))
    True
  """
  return _reduce(tree, axis_name, compressor, key, method, min_compressed_size,
                 exact_own_piece, owner="quantized_pmean", mean=True)


def quantized_psum_scatter(
    tree,
    axis_name: axes.AxisName,
    compressor: base.Compressor,
    key: jax.Array,
    *,
    scatter_dimension: int = 0,
    tiled: bool = False,
    min_compressed_size: int = plan.DEFAULT_MIN_COMPRESSED_SIZE,
):
  """``jax.lax.psum_scatter`` of a pytree, sending compressed payloads.

  Device ``j`` of ``n`` gets shard ``j`` of the sum of every leaf, split along
  ``scatter_dimension``: the gradient reduction of FSDP / ZeRO, where each
  device keeps and updates only its shard of the parameters (DeepSpeed
  ZeRO++ quantizes exactly this, "qgZ"). Each device cuts its leaves into
  ``n`` shards and encodes them (the shards of leaves with a fixed bucket
  size end to end, each padded to whole buckets), one ``all_to_all`` sends
  shard ``j`` to device ``j``, and device ``j`` adds the ``n - 1`` decoded
  shards to its own, which never crossed the wire. A device sends
  ``(n - 1) / n`` payloads of its gradient: half the bytes of
  :func:`quantized_psum`'s two-phase method, and one quantization instead of
  two. Unbiased for an unbiased compressor.

  A leaf whose ``scatter_dimension`` the devices do not divide is zero-padded
  to ``n`` whole shards of ``ceil(size / n)``; the padding is exactly zero in
  the result (the shards of :class:`~qsgd_jax.FlatShard` are made so).

  Over ``(outer, inner)`` axes, device ``i * m + j`` (outer index ``i`` of
  ``n``, inner ``j`` of ``m``, as ``P(("outer", "inner"))`` places shards) gets
  shard ``i * m + j``: the leaves are reduce-scattered in float32 over the fast
  inner axes first (device ``j`` keeps the ``n`` shards ``i * m + j``), and only
  that ``1/m`` of the gradient crosses the outer axis, quantized.

  A gradient that autodiff has already reduced is an error at trace time:
  under ``jax.shard_map``, one taken with respect to replicated values
  (already summed), and, in a traced program, one that comes out of a
  ``psum_scatter`` over the axis, which is what autodiff makes of
  differentiating through ``jax.lax.all_gather`` (gather with
  :func:`~qsgd_jax.fsdp_gather` instead: its gradient is this reduce-scatter).

  Args:
    tree: a pytree of arrays, as for :func:`quantized_psum`; every leaf must
      have ``scatter_dimension`` (of size ``n`` where not ``tiled``).
    axis_name: a mapped axis name, or ``(outer, inner, ...)``.
    compressor: a :class:`~qsgd_jax.Compressor`. A compressor that quantizes
      rows (``OneBit(bucket_size=None)``) sees each shard with the scatter
      dimension first.
    key: a PRNG key, the same on every device.
    scatter_dimension: the dimension to split, as in ``jax.lax.psum_scatter``.
    tiled: keep that dimension, of ``ceil(size / n)`` (``True``), or remove
      it (``False``: it must have size ``n``), as in ``jax.lax.psum_scatter``.
    min_compressed_size: float leaves with fewer elements are reduce-scattered
      in float32.

  Returns:
    A pytree like ``tree`` of this device's shards of the sum, in each leaf's
    dtype.

  Raises:
    ValueError: a leaf lacks ``scatter_dimension`` (or, untiled, it is not of
      size ``n``), a float leaf is replicated over the axes (under
      ``jax.shard_map``), or a leaf was reduce-scattered over them already.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> n = jax.local_device_count()
    >>> grads = jnp.ones((n, 8 * 8192))
    >>> shards = jax.pmap(
    ...     lambda g: qsgd_jax.quantized_psum_scatter(
    ...         g, "batch", qsgd_jax.QSGD(bits=8), jax.random.key(0), tiled=True),
    ...     axis_name="batch")(grads)
    >>> shards.shape == (n, 8 * 8192 // n), bool(jnp.all(shards == n))
    (True, True)

  References:
    Rajbhandari et al., ZeRO, SC 2020; Wang et al., ZeRO++, ICLR 2024.
  """
  reduction_plan = plan.make_plan(
      tree, axis_name, compressor, method=plan.REDUCE_SCATTER,
      min_compressed_size=min_compressed_size, owner="quantized_psum_scatter",
      scatter_dimension=scatter_dimension, tiled=tiled)
  return reduction.reduce_scatter(reduction_plan, tree, key).tree


def _reduce(tree, axis_name, compressor, key, method, min_compressed_size, exact_own_piece, *,
            owner: str, mean: bool):
  """The sum (or mean) of ``tree`` over ``axis_name`` by a plan of a user's ``method``."""
  plan.check_method(method, owner)
  reduction_plan = plan.make_plan(tree, axis_name, compressor, method=method,
                                  min_compressed_size=min_compressed_size, owner=owner,
                                  exact_own_piece=exact_own_piece)
  return reduction.reduce(reduction_plan, tree, key, mean=mean).tree
