"""Quantized psum and pmean whose wire carries packed low-bit codes.

Two methods, both called inside ``jax.pmap`` or ``jax.shard_map``:
``"two_phase"`` (default: an all-to-all of packed pieces, then an all-gather of
packed sums; see ``two_phase.py``) and ``"psum"`` (shared scales, then one
integer psum of the codes; see ``shared_scale.py``). What is sent is decided
from static shapes by a reduction plan (``plan.py``), and executed by
``reduction.py``.

Leaves with fewer than ``min_compressed_size`` elements (biases, norm scales)
travel in full precision in one fused ``psum``, as the QSGD paper and CGX do.

The large leaves are encoded in a few batched encodes, not one a leaf (see
``plan.py``): with a fixed ``bucket_size``, each padded to whole buckets and
laid end to end as one vector, cut into pieces of whole buckets; otherwise
leaves of one shape stacked under one ``vmap``. The compiled program stays
small, and every bucket is quantized as the compressor defines.

A leaf whose size is not a multiple of ``bucket_size`` is padded with zeros to
whole buckets. The padding is dropped after decoding; QSGD's scales ignore
it, MinMax's last bucket widens its range to include 0, and OneBit's last
bucket counts it among the non-negative entries (a small bias of one bucket a
leaf, which error feedback absorbs).
"""

import jax

from qsgd_jax._src import axes, base, plan, reduction


def quantized_psum(
    tree,
    axis_name: axes.AxisName,
    compressor: base.Compressor,
    key: jax.Array,
    *,
    method: plan.Method = "two_phase",
    min_compressed_size: int = plan.DEFAULT_MIN_COMPRESSED_SIZE,
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

  Args:
    tree: a pytree of float arrays (float32, bfloat16, float16).
    axis_name: a mapped axis name, or a tuple ``(outer, inner, ...)``: then the
      sum over the inner axes is taken in full precision (a reduce-scatter
      and an all-gather over the fast links) and only the outer axis is
      quantized, as CGX's and BytePS's two-level reducers do.
    compressor: a :class:`~qsgd_jax.Compressor`.
    key: a PRNG key, the same on every device.
    method: ``"two_phase"`` or ``"psum"``.
    min_compressed_size: leaves with fewer elements are summed in full
      precision.

  Returns:
    A pytree like ``tree``: the sum over the axis, in each leaf's dtype.

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
  reduction_plan = plan.make_plan(tree, axis_name, compressor, method=method,
                                  min_compressed_size=min_compressed_size,
                                  owner="quantized_psum")
  return reduction.reduce(reduction_plan, tree, key, mean=False).tree


def quantized_pmean(
    tree,
    axis_name: axes.AxisName,
    compressor: base.Compressor,
    key: jax.Array,
    *,
    method: plan.Method = "two_phase",
    min_compressed_size: int = plan.DEFAULT_MIN_COMPRESSED_SIZE,
):
  """Averages a pytree over ``axis_name``, sending compressed payloads.

  The mean counterpart of :func:`quantized_psum`, with the same arguments
  and guarantees; the sum is divided by the axis size before the second
  quantization.

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
  reduction_plan = plan.make_plan(tree, axis_name, compressor, method=method,
                                  min_compressed_size=min_compressed_size,
                                  owner="quantized_pmean")
  return reduction.reduce(reduction_plan, tree, key, mean=True).tree
