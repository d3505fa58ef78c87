"""The quantized all-gather: each device encodes its shards once, everyone decodes them all.

With ``N`` devices, each device lays the float leaves it compresses end to
end (the plan's segments, ``plan.py``, with ``method="gather"``), encodes
them in a few batched encodes, and appends the bits of the leaves it sends
as they are (integer and bool leaves, and float leaves under the size threshold, in
their own dtype): one ``uint32`` word vector. One ``all_gather`` of those words
gives every device every device's words, and every device decodes all ``N``
of them, its own included, in the same way: the result is bit-identical on
every device, and a shard decodes to the same values on its owner as
everywhere else, so replicas computed from it cannot drift apart.

Over two axes ``(outer, inner)`` (devices ``i * m + j``), the words are
gathered over the outer axis first and then over the inner axes: what a
device holds between the two, the payloads of the ``n`` shards of its inner
position, is the "secondary copy" that hpZ keeps within a node
(:func:`qsgd_jax.fsdp_gather`).

A device sends ``(N - 1) / N`` of its words: a ``b``-bit code is ``32 / b``
times fewer bytes than a float32 all-gather. Each shard is quantized in
buckets cut to fit it (``plan.gather_run``: ``ceil(s / B)`` buckets of about
equal length, whole words of codes, for a shard of ``s`` elements and the
compressor's ``bucket_size`` ``B``), so padding costs less than a word a
bucket: a shard of at least 128 elements costs at most ``b + 0.5`` bits a
coordinate, its scales included.
"""

import math

import jax
import jax.numpy as jnp

from qsgd_jax._src import axes as axes_lib
from qsgd_jax._src import base, serialize
from qsgd_jax._src.collectives import exchange, layout, plan
from qsgd_jax._src.compressors.onebit import OneBit


def quantized_all_gather(
    tree,
    axis_name: axes_lib.AxisName,
    compressor: base.Compressor,
    *,
    key: jax.Array | int | None = None,
    axis: int = 0,
    tiled: bool = True,
    min_compressed_size: int = plan.DEFAULT_MIN_COMPRESSED_SIZE,
):
  """``jax.lax.all_gather`` of a pytree of shards, sending compressed payloads.

  Each device encodes its shards once; the packed codes and scales of every
  leaf travel in one all-gather (an all-gather an axis level over
  ``(outer, inner)``), and every device decodes all of them, its own
  included. The result is bit-identical on every device and, under
  ``jax.shard_map``, typed as replicated (return it with ``out_specs=P()``).

  For weights, use a deterministic compressor that rounds to nearest,
  :class:`~qsgd_jax.NearestAbsMax` (ZeRO++'s qwZ): gathered weights are not
  averaged, so the half-step error of rounding to nearest beats the unbiased
  but larger error of stochastic rounding, and no key is needed.

  Args:
    tree: a pytree of arrays, this device's shards. Float leaves of at least
      ``min_compressed_size`` elements are quantized (in float32, decoded to
      their dtype); smaller float leaves, integer leaves and bool leaves (a
      byte an element, as ``jax.lax.all_gather`` sends them) are gathered bit
      for bit in their own dtype, in the same all-gather.
    axis_name: a mapped axis name, or ``(outer, inner, ...)``: the shards are
      those of devices ``outer_index * inner_size + inner_index``, as a
      ``PartitionSpec(("outer", "inner"))`` lays them out.
    compressor: a :class:`~qsgd_jax.Compressor`; not :class:`~qsgd_jax.OneBit`.
    key: a PRNG key or seed, the same on every device, for a compressor that
      rounds stochastically (each device folds in its index); ``None`` for a
      deterministic one.
    axis: where the shards are joined, as in ``jax.lax.all_gather``.
    tiled: concatenate the shards along ``axis`` (``True``, the FSDP gather) or
      stack them in a new dimension there (``False``).
    min_compressed_size: float leaves with fewer elements go as they are.

  Returns:
    A pytree like ``tree``, each leaf gathered from every device's shard.

  Raises:
    TypeError: ``compressor`` is not a compressor.
    ValueError: ``OneBit``, a stochastic compressor without ``key``, or an
      ``axis`` a leaf does not have.
    NameError: an axis is not bound.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> n = jax.local_device_count()
    >>> shards = jnp.arange(n * 4096, dtype=jnp.float32).reshape(n, 4096) / 4096
    >>> full = jax.pmap(lambda w: qsgd_jax.quantized_all_gather(
    ...     w, "batch", qsgd_jax.NearestAbsMax(bits=8)), axis_name="batch")(shards)
    >>> full.shape == (n, n * 4096), bool(jnp.all(full == full[0]))
    (True, True)
    >>> bool(jnp.max(jnp.abs(full[0] - shards.reshape(-1))) <= n / 254)
    True

  References:
    Wang et al., ZeRO++, ICLR 2024 (qwZ, hpZ); Rajbhandari et al., ZeRO,
    SC 2020.
  """
  owner = "quantized_all_gather"
  gather_plan = make_gather_plan(tree, axis_name, compressor, axis=axis, tiled=tiled,
                                 min_compressed_size=min_compressed_size, owner=owner)
  leaves, treedef = jax.tree.flatten(tree)
  words = encode(gather_plan, [jnp.asarray(leaf) for leaf in leaves], key)
  gathered = gather_inner(gather_plan, gather_outer(gather_plan, words, replicated=True),
                          replicated=True)
  return jax.tree.unflatten(treedef, decode(gather_plan, gathered))


def make_gather_plan(tree, axis_name, compressor, *, axis: int, tiled: bool,
                     min_compressed_size: int, owner: str) -> plan.ReductionPlan:
  """The plan of gathering ``tree``'s shards, after the checks that only a gather needs."""
  check_gatherable(compressor, owner)
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if jnp.result_type(leaf) == jax.dtypes.float0:
      raise ValueError(f"{owner}: leaf {jax.tree_util.keystr(path) or '<root>'} is float0 "
                       "(a gradient of an integer input): there is nothing to gather.")
  return plan.make_plan(tree, axis_name, compressor, method=plan.GATHER,
                        min_compressed_size=min_compressed_size, owner=owner,
                        scatter_dimension=axis, tiled=tiled)


def check_gatherable(compressor: base.Compressor, owner: str, what: str = "compressor") -> None:
  """Raises for a compressor that only makes sense with error feedback: :class:`OneBit`."""
  if isinstance(compressor, OneBit):
    raise ValueError(
        f"{owner}: {what} {compressor!r} cannot be all-gathered: 1-bit quantization keeps "
        "only each element's sign and two values a bucket, which is usable only with error "
        "feedback, a residual carried from step to step into the next sum; weights are not "
        "summed, so there is nothing to carry it into, and every device would compute with "
        "a two-valued copy. Gather weights with qsgd_jax.NearestAbsMax(bits=8) (ZeRO++'s "
        "qwZ), or a QSGD or MinMax compressor.")


def _device_key(gather_plan: plan.ReductionPlan, key) -> jax.Array:
  """This device's PRNG key: ``key`` with the device's index folded in."""
  if key is None:
    if not gather_plan.compressor.deterministic:
      raise ValueError(
          f"{gather_plan.owner}: {gather_plan.compressor!r} rounds stochastically and needs "
          "a key (the same on every device, new every step); or gather with a deterministic "
          "compressor such as qsgd_jax.NearestAbsMax.")
    key = 0  # Deterministic: ignored.
  return jax.random.fold_in(base.as_key(key), jax.lax.axis_index(gather_plan.axes.names))


def encode(gather_plan: plan.ReductionPlan, leaves: list[jax.Array], key) -> jax.Array:
  """``uint32[words]``: this device's compressed leaves' payloads, then its other leaves' bits."""
  words = []
  if gather_plan.compressed:
    blocks = layout.join(gather_plan, layout.segment_vectors(gather_plan, leaves))
    payloads = exchange.encode_blocks(gather_plan.block_compressors, _device_key(gather_plan, key),
                                      blocks, batch_dims=2)
    words = [jax.vmap(jax.vmap(serialize.to_words))(p).reshape(-1) for p in payloads]
  words += [serialize.to_words(leaves[i]) for i in _raw(gather_plan)]
  return jnp.concatenate(words)


def _raw(gather_plan: plan.ReductionPlan) -> tuple[int, ...]:
  """The leaves sent bit for bit, in the order of their words."""
  return (*gather_plan.integer, *gather_plan.full_precision)


def gather_outer(gather_plan: plan.ReductionPlan, words: jax.Array, *,
                 replicated: bool) -> jax.Array:
  """``uint32[n, words]``: every outer device's words (over one axis, every device's).

  Args:
    gather_plan: the gather's plan.
    words: this device's, from :func:`encode`.
    replicated: type the result replicated over the axis where ``jax.shard_map``
      tracks it (a plain collective's result); else varying (a result that
      autodiff is to send a per-device cotangent, :func:`qsgd_jax.fsdp_gather`).
  """
  return _all_gather(words, gather_plan.axes.outer, replicated)


def gather_inner(gather_plan: plan.ReductionPlan, outer_words: jax.Array, *,
                 replicated: bool) -> jax.Array:
  """``uint32[N, words]``, device ``i * m + j``'s row ``i * m + j``, from :func:`gather_outer`'s
  rows on every inner device (the identity over one axis)."""
  inner = gather_plan.axes.inner
  if not inner:
    return outer_words
  n, m = gather_plan.outer_size, gather_plan.inner_size
  stacked = _all_gather(outer_words, inner, replicated)  # [m, n, words]
  return jnp.swapaxes(stacked, 0, 1).reshape(n * m, -1)


def _all_gather(x: jax.Array, axis_name, replicated: bool) -> jax.Array:
  x = axes_lib.as_varying(x, axis_name)
  if replicated:
    return axes_lib.all_gather_replicated(x, axis_name)
  return jax.lax.all_gather(x, axis_name, tiled=False)


def decode(gather_plan: plan.ReductionPlan, gathered: jax.Array) -> list[jax.Array]:
  """Every leaf joined from all devices' shards, from ``uint32[N, words]``."""
  n = gather_plan.num_devices
  out = [None] * len(gather_plan.leaf_shapes)
  start = sum(gather_plan.block_words)
  if gather_plan.compressed:
    payloads = exchange.payload_rows(gather_plan, gathered[:, :start])
    decoded = exchange.decode_blocks(gather_plan.block_compressors, payloads, batch_dims=2)
    for block, data in zip(gather_plan.blocks, decoded, strict=True):  # [N, batch, ...]
      for b, k in enumerate(block.segments):
        segment = gather_plan.segments[k]
        vectors = data[:, b].reshape(n, -1)
        for i, offset in zip(segment.leaves, segment.offsets, strict=True):
          size = math.prod(gather_plan.leaf_shapes[i])
          out[i] = vectors[:, offset:offset + size]
  for i in _raw(gather_plan):
    template = jax.ShapeDtypeStruct(gather_plan.leaf_shapes[i], gather_plan.leaf_dtypes[i])
    count = serialize.num_words(template)
    out[i] = jax.vmap(lambda w, t=template: serialize.from_words(w, t))(
        gathered[:, start:start + count])
    start += count
  return [_join(gather_plan, i, shards) for i, shards in enumerate(out)]


def _join(gather_plan: plan.ReductionPlan, i: int, shards: jax.Array) -> jax.Array:
  """Leaf ``i`` gathered, from every device's shard, ``[N, ...]`` (flattened or not)."""
  shape, axis = gather_plan.leaf_shapes[i], gather_plan.scatter_dimension
  stacked = jnp.moveaxis(shards.reshape(gather_plan.num_devices, *shape), 0, axis)
  return stacked.reshape(gather_plan.output_shape(i)).astype(gather_plan.leaf_dtypes[i])
