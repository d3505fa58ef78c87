"""The reduction plan: every static decision about one quantized reduction of a tree.

A quantized sum of a gradient tree decides a great deal from static shapes
alone: which leaves travel compressed and which in float32, how the others
are laid out and padded, how long each device's piece is, how the pieces are
batched into a few encodes, what each batched payload looks like, and in which
integer type codes are summed. :func:`make_plan` decides all of it once, in
one hashable :class:`ReductionPlan`; the reduction executes the plan, and
everything that accounts for it (the bits on the wire, the shapes of the
error-feedback residuals, the statistics) reads the same plan, so what is sent
and what is counted cannot disagree. It plays the part that ``_factored_dims``
plays in optax's factored optimizer, for ``init`` and ``update`` alike.

With ``n`` devices on the outer axis and ``m`` on the inner ones:

* leaves under ``min_compressed_size`` elements are summed in float32 by one
  fused all-reduce over every axis;
* the others are laid end to end in :class:`Segment` s: leaves whose
  compressor quantizes runs of ``L`` elements on their own
  (:meth:`~qsgd_jax.Compressor.bucket_length`: a bucket, or a row) share one
  segment, each zero-padded to whole runs, so that no run straddles two
  leaves; a leaf whose scale spans the whole array has a segment of its own;
* a segment is padded to ``m`` whole runs per inner device and
  reduce-scattered in float32 over the inner axes (all segments in one
  collective): what remains, ``length`` elements, is what a device quantizes;
* ``"two_phase"`` cuts that into ``n`` pieces of whole runs, so padding is paid
  once a segment (at most ``n`` runs), not once a leaf; ``"psum"`` and
  ``"all_gather"`` quantize it whole;
* the quantized arrays are batched into :class:`Block` s, one encode each: a
  segment of runs alone, whole-array segments of one length stacked.

Two plans of their own serve FSDP: the reduce-scatter
(:func:`~qsgd_jax.quantized_psum_scatter`) lays each leaf out as its ``n * m``
shards, zero-padded to whole shards, summed in float32 over the inner axes
first; the all-gather (:func:`~qsgd_jax.quantized_all_gather`) encodes the
shards a device holds, whole, each in buckets cut to fit it (:func:`gather_run`:
a shard of ``B + 1`` elements is two buckets of about ``B / 2``, not two of
``B``), and sends their words with those of the leaves it does not compress in
one all-gather an axis level.
"""

import dataclasses
import functools
import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qsgd_jax._src import axes as axes_lib
from qsgd_jax._src import base, serialize, wire

Method = Literal["two_phase", "psum", "all_gather"]
METHODS = ("two_phase", "psum", "all_gather")
# The quantized reduce-scatter of quantized_psum_scatter: the two-phase method's first phase.
REDUCE_SCATTER = "reduce_scatter"
# The quantized all-gather of quantized_all_gather: each device's payload to every device.
GATHER = "gather"

# Leaves under this many elements go in full precision. Padding a leaf to whole
# buckets on every device costs up to n * bucket_size elements, and a tiny
# leaf saves almost nothing; measured in benchmarks/collectives.py.
DEFAULT_MIN_COMPRESSED_SIZE = 4096


class PlannedCollective(NamedTuple):
  """One collective the reduction issues, as the compiled HLO will show it.

  Attributes:
    kind: the HLO kind: ``"all-reduce"``, ``"reduce-scatter"``,
      ``"all-to-all"`` or ``"all-gather"``.
    dtype: the element type of its result.
    shape: the shape of its result on one device.
    group_size: devices in one group.
    link: the axes it crosses: ``"outer"``, ``"inner"``, or ``"all"`` of them.
    carries: what it moves: ``"integer leaves"``, ``"float32 leaves"``,
      ``"inner reduce-scatter"``,
      ``"inner all-gather"``, ``"first phase"`` and ``"second phase"``
      (the two-phase method's packed payloads), ``"payloads"`` (the
      all-gather method's, and the all-gather's over the outer axis),
      ``"inner payloads"`` (the all-gather's over the inner axes),
      ``"shared scales"`` or ``"code sums"``.
  """

  kind: str
  dtype: np.dtype
  shape: tuple[int, ...]
  group_size: int
  link: str
  carries: str

  @property
  def result_bytes(self) -> int:
    return math.prod(self.shape) * np.dtype(self.dtype).itemsize

  @property
  def bytes_sent(self) -> float:
    """Bytes one device sends for it, by :func:`wire.bytes_sent`."""
    return wire.bytes_sent(self.kind, self.result_bytes, self.group_size)


class Segment(NamedTuple):
  """Compressed leaves laid end to end: what one device quantizes as one vector.

  For the reduce-scatter, the segment is ``n`` rows, row ``j`` holding shard
  ``j`` of each leaf end to end; ``offsets`` are then within a row.

  Attributes:
    leaves: the leaves' indices in the tree.
    offsets: each leaf's first element in the segment.
    run: elements quantized on their own (a bucket or a row), each leaf
      padded to whole runs; ``None`` for a single leaf with one scale.
    full_length: elements of the segment on every device before the inner
      reduce-scatter, padded: ``inner_size * length``.
    length: elements one device quantizes.
  """

  leaves: tuple[int, ...]
  offsets: tuple[int, ...]
  run: int | None
  full_length: int
  length: int


class Block(NamedTuple):
  """Segments encoded together, ``[batch, rows, *element_shape]``, in one batched encode.

  Attributes:
    segments: the segments' indices, one a batch element.
    rows: ``n`` for the two-phase method and the reduce-scatter (row ``j`` is
      piece ``j``), else 1.
    width: elements of a row, whole runs.
    element_shape: the shape one row is encoded in: ``(width // run, run)``
      for a segment of runs (so a compressor that quantizes rows sees them),
      else ``(width,)``.
  """

  segments: tuple[int, ...]
  rows: int
  width: int
  element_shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ReductionPlan:
  """What one quantized reduction of a tree sends, decided from static shapes.

  Build it with :func:`make_plan`. Fields are the inputs; properties derive
  the decisions from them (each computed once).

  Attributes:
    leaf_shapes: each leaf's shape, in tree order.
    leaf_dtypes: each leaf's dtype.
    axes: the reduction's axes (local: none).
    axis_sizes: the size of each of ``axes.names``; ``None`` where unknown
      (an ``init`` outside the mapped function), and then the decisions that
      depend on it raise a ``ValueError`` saying how to give it.
    compressor: the compressor.
    method: ``"two_phase"``, ``"psum"``, ``"all_gather"``,
      ``"reduce_scatter"`` for :func:`~qsgd_jax.quantized_psum_scatter`, or
      ``"gather"`` for :func:`~qsgd_jax.quantized_all_gather` (then the
      leaves are the shards each device holds).
    min_compressed_size: float leaves with fewer elements go in float32.
    owner: the public function this plan serves, named in errors.
    scatter_dimension: the reduce-scatter's dimension of every leaf, or the
      all-gather's ``axis``.
    tiled: the reduce-scatter keeps that dimension (of ``ceil(size / n)``,
      padded) rather than removing it (of size ``n``); the all-gather
      concatenates the shards along ``axis`` rather than stacking them.
    exact_own_piece: in the two-phase method's first phase, each device adds
      its own piece unquantized (it never crosses the wire); ``False``
      quantizes it like the others, as CNTK does by default.
  """

  leaf_shapes: tuple[tuple[int, ...], ...]
  leaf_dtypes: tuple[np.dtype, ...]
  axes: axes_lib.Axes
  axis_sizes: tuple[int | None, ...]
  compressor: base.Compressor
  method: str
  min_compressed_size: int
  owner: str
  scatter_dimension: int = 0
  tiled: bool = False
  exact_own_piece: bool = True

  @property
  def outer_size(self) -> int:
    return 1 if self.axes.is_local else self._known_size(0)

  @property
  def inner_size(self) -> int:
    return math.prod(self._known_size(i) for i in range(1, len(self.axis_sizes)))

  @property
  def num_devices(self) -> int:
    return self.outer_size * self.inner_size

  @property
  def num_elements(self) -> int:
    """Elements of the whole tree."""
    return sum(math.prod(shape) for shape in self.leaf_shapes)

  @functools.cached_property
  def kinds(self) -> tuple[str, ...]:
    """How each leaf travels: ``"unchanged"`` (``float0``, as ``jax.grad`` gives for
    integer inputs), ``"integer"`` (by the plain ``jax.lax`` collective),
    ``"float32"`` (small float leaves, fused) or ``"compressed"``."""
    kinds = []
    for shape, dtype in zip(self.leaf_shapes, self.leaf_dtypes, strict=True):
      if dtype == jax.dtypes.float0:
        kinds.append("unchanged")
      elif not jnp.issubdtype(dtype, jnp.floating):
        kinds.append("integer")
      elif math.prod(shape) < self.min_compressed_size:
        kinds.append("float32")
      else:
        kinds.append("compressed")
    return tuple(kinds)

  def _indices(self, kind: str) -> tuple[int, ...]:
    return tuple(i for i, k in enumerate(self.kinds) if k == kind)

  @property
  def integer(self) -> tuple[int, ...]:
    return self._indices("integer")

  @property
  def full_precision(self) -> tuple[int, ...]:
    """Indices of the float leaves summed in float32, in tree order."""
    return self._indices("float32")

  @property
  def compressed(self) -> tuple[int, ...]:
    """Indices of the leaves sent compressed, in tree order."""
    return self._indices("compressed")

  def output_shape(self, i: int) -> tuple[int, ...]:
    """Leaf ``i``'s shape in the result: its shape, its shard's for the reduce-scatter, or
    the gathered shape for the all-gather."""
    shape, d, n = self.leaf_shapes[i], self.scatter_dimension, self.num_devices
    if self.method == GATHER:
      if self.tiled:
        return (*shape[:d], n * shape[d], *shape[d + 1:])
      return (*shape[:d], n, *shape[d:])
    if self.method != REDUCE_SCATTER:
      return shape
    if self.tiled:
      return (*shape[:d], self.shard_rows(i), *shape[d + 1:])
    return (*shape[:d], *shape[d + 1:])

  def shard_rows(self, i: int) -> int:
    """Tiled reduce-scatter: rows of leaf ``i`` a shard, ``ceil(size / n)`` along the
    scatter dimension (the leaf zero-padded to ``n`` whole shards)."""
    return -(-self.leaf_shapes[i][self.scatter_dimension] // self.num_devices)

  def _shard_rows_shape(self, i: int) -> tuple[int, ...]:
    """Reduce-scatter: a shard of leaf ``i`` with the scatter dimension first."""
    shape = self.leaf_shapes[i]
    d = self.scatter_dimension
    rest = (*shape[:d], *shape[d + 1:])
    return (self.shard_rows(i), *rest) if self.tiled else rest

  @functools.cached_property
  def segments(self) -> tuple[Segment, ...]:
    """The compressed leaves laid end to end, in tree order of their first leaf."""
    scatter = self.method == REDUCE_SCATTER
    groups = {}  # Leaves of one run length together; a whole-array leaf alone.
    for i in self.compressed:
      shape = self._shard_rows_shape(i) if scatter else self.leaf_shapes[i]
      run = self.compressor.bucket_length(shape)
      if self.method == GATHER:
        run = gather_run(self.compressor, run, math.prod(shape))
      groups.setdefault(("leaf", i) if run is None else ("run", run), (run, []))[1].append(i)
    m = 1 if self.method == GATHER else self.inner_size  # A gather's shards stay whole.
    segments = []
    for run, leaves in groups.values():
      unit = run or 1
      offsets, end = padded_offsets(
          [math.prod(self._shard_rows_shape(i) if scatter else self.leaf_shapes[i])
           for i in leaves], unit)
      if scatter:  # n rows of the shards end to end.
        length = self.outer_size * end
      else:
        length = -(-end // (m * unit)) * unit
      segments.append(Segment(tuple(leaves), offsets, run, m * length, length))
    return tuple(segments)

  @functools.cached_property
  def blocks(self) -> tuple[Block, ...]:
    """The batched encodes: a segment of runs alone; whole-array segments stacked by width."""
    scatters = self.method in ("two_phase", REDUCE_SCATTER) and not self.axes.is_local
    rows = self.outer_size if scatters else 1
    blocks = {}
    for k, segment in enumerate(self.segments):
      unit = segment.run or 1
      width = max(1, -(-segment.length // (rows * unit))) * unit
      if segment.run is None:
        key, shape = ("whole", width), (width,)
      else:
        key, shape = ("runs", k), (width // unit, unit)
      block = blocks.setdefault(key, Block((), rows, width, shape))
      blocks[key] = block._replace(segments=(*block.segments, k))
    return tuple(blocks.values())

  @functools.cached_property
  def block_compressors(self) -> tuple[base.Compressor, ...]:
    """For each block, the compressor that encodes it: :attr:`compressor`, but for a
    gather's segment of runs, whose buckets are its run (:func:`gather_run`)."""
    out = []
    for block in self.blocks:
      run = self.segments[block.segments[0]].run
      if (self.method == GATHER and isinstance(self.compressor, base.FixedBuckets)
          and run is not None and run != self.compressor.bucket_size):
        out.append(dataclasses.replace(self.compressor, bucket_size=run))
      else:
        out.append(self.compressor)
    return tuple(out)

  @functools.cached_property
  def block_templates(self) -> tuple[base.Payload, ...]:
    """For each block, the payload of one encoded element (one row)."""
    return tuple(jax.eval_shape(compressor.encode, jax.random.key(0), _f32(block.element_shape))
                 for block, compressor in zip(self.blocks, self.block_compressors, strict=True))

  @functools.cached_property
  def block_words(self) -> tuple[int, ...]:
    """For each block, ``uint32`` words of one row's payloads, the whole batch."""
    return tuple(len(block.segments) * serialize.num_words(template)
                 for block, template in zip(self.blocks, self.block_templates, strict=True))

  @functools.cached_property
  def raw_words(self) -> int:
    """Gather: ``uint32`` words of the leaves sent as they are (integer, small float)."""
    return sum(serialize.num_words(jax.ShapeDtypeStruct(self.leaf_shapes[i], self.leaf_dtypes[i]))
               for i in (*self.integer, *self.full_precision))

  @functools.cached_property
  def sum_dtype(self) -> np.dtype:
    """Psum: the narrowest integer type that holds a sum of every device's codes."""
    low, high = self.compressor.code_range
    n = self.outer_size
    for dtype in (np.int8, np.int16, np.int32):
      info = np.iinfo(dtype)
      if info.min <= n * low and n * high <= info.max:
        return np.dtype(dtype)
    raise ValueError(
        f"{self.owner}: sums of {n} devices' codes in [{low}, {high}] overflow int32; "
        "use method='two_phase'."
    )

  @functools.cached_property
  def collectives(self) -> tuple[PlannedCollective, ...]:
    """Every collective the reduction issues, in program order."""
    if self.axes.is_local:
      return ()
    f32 = np.dtype(np.float32)
    m, n, everyone = self.inner_size, self.outer_size, self.num_devices
    scatter = self.method == REDUCE_SCATTER
    u32 = np.dtype(np.uint32)
    if self.method == GATHER:  # Every leaf's words, in one all-gather an axis level.
      words = sum(self.block_words) + self.raw_words
      planned = [PlannedCollective("all-gather", u32, (n, words), n, "outer", "payloads")]
      if self.axes.inner:
        planned.append(PlannedCollective("all-gather", u32, (m, n, words), m, "inner",
                                         "inner payloads"))
      return tuple(planned)
    planned = []
    for i in self.integer:
      kind = "reduce-scatter" if scatter else "all-reduce"
      planned.append(PlannedCollective(kind, self.leaf_dtypes[i], self.output_shape(i),
                                       everyone, "all", "integer leaves"))
    if self.full_precision:
      size = sum(math.prod(self.output_shape(i)) for i in self.full_precision)
      kind = "reduce-scatter" if scatter else "all-reduce"
      planned.append(PlannedCollective(kind, f32, (size,), everyone, "all", "float32 leaves"))
    if not self.compressed:
      return tuple(planned)
    if scatter:  # Every compressed leaf's n rows of shards, summed over the inner axes first.
      inner_elements = n * sum(math.prod(self._shard_rows_shape(i)) for i in self.compressed)
    else:
      inner_elements = sum(segment.length for segment in self.segments)
    if self.axes.inner:
      planned.append(PlannedCollective("reduce-scatter", f32, (inner_elements,), m, "inner",
                                       "inner reduce-scatter"))
    words = (u32, (n, sum(self.block_words)), n, "outer")
    if self.method in ("two_phase", REDUCE_SCATTER):
      planned.append(PlannedCollective("all-to-all", *words, "first phase"))
    if self.method == "two_phase":
      planned.append(PlannedCollective("all-gather", *words, "second phase"))
    elif self.method == "all_gather":
      planned.append(PlannedCollective("all-gather", *words, "payloads"))
    elif self.method == "psum":
      scales = sum(len(block.segments) * math.prod(jax.eval_shape(
          self.compressor.local_scales, _f32(block.element_shape)).shape)
          for block in self.blocks)
      codes = sum(len(block.segments) * block.width for block in self.blocks)
      planned.append(PlannedCollective("all-reduce", f32, (scales,), n, "outer",
                                       "shared scales"))
      planned.append(PlannedCollective("all-reduce", self.sum_dtype, (codes,), n, "outer",
                                       "code sums"))
    if self.axes.inner and not scatter:
      planned.append(PlannedCollective("all-gather", f32, (m, inner_elements), m, "inner",
                                       "inner all-gather"))
    return tuple(planned)

  @functools.cached_property
  def wire_bits(self) -> float:
    """Bits one device sends, summed over :attr:`collectives`."""
    return 8 * sum(c.bytes_sent for c in self.collectives)

  @functools.cached_property
  def outer_wire_bits(self) -> float:
    """Bits one device sends across the outer axis: the slow links between nodes.

    A collective over the outer axis counts whole. One over every axis counts
    ``1 / inner_size`` of its bits: done hierarchically (reduce-scatter inside
    the node, the outer collective on a shard, all-gather inside), that is what
    crosses the outer axis. Inner collectives count nothing.
    """
    share = {"outer": 1.0, "all": 1.0 / self.inner_size, "inner": 0.0}
    return 8 * sum(c.bytes_sent * share[c.link] for c in self.collectives)

  def local_error_shapes(self) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Worker error feedback: one ``float32[length]`` residual a segment."""
    return tuple(_f32((segment.length,)) for segment in self.segments)

  def owner_error_shapes(self) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Owner error feedback (two-phase): one ``float32[batch, *element_shape]`` a block.

    Device ``j`` owns piece ``j`` of every block; its residual is the error of
    re-quantizing the sum of those pieces.
    """
    if self.method != "two_phase":
      raise ValueError(f"{self.owner}: only method='two_phase' has piece owners.")
    return tuple(_f32((len(block.segments), *block.element_shape)) for block in self.blocks)

  def _known_size(self, i: int) -> int:
    size = self.axis_sizes[i]
    if size is None:
      name = self.axes.names[i]
      raise ValueError(
          f"{self.owner}: the state's shapes depend on the size of axis {name!r}, which is "
          f"not bound here: pass axis_size={{{name!r}: ...}} (or an int for one axis), or "
          "call init inside the mapped function."
      )
    return size


def gather_run(compressor: base.Compressor, run: int | None, size: int) -> int | None:
  """The run a gather quantizes a shard of ``size`` elements in: buckets cut to fit the shard.

  A shard is encoded on its own, so its buckets need not be the compressor's
  ``bucket_size`` ``B``: the shard is cut into ``k = ceil(size / B)`` buckets
  of ``ceil(size / k)`` elements, rounded up to whole words of codes (4 codes
  of 8 bits, 8 of 4) where that stays within ``B``. It pads at most ``k``
  buckets by a word's codes, where buckets of ``B`` would pad a shard of
  ``B + 1`` elements to ``2 B``: at ``b`` bits a code, a shard of ``s >= 128``
  elements costs at most ``b + 0.5`` bits a coordinate, scales and padding
  included (``b + 64 k / s``, as each bucket adds a float32 scale and less
  than a word of padding). Every bucket is at most ``B`` long, so it rounds
  within the same bound as before. Compressors without a fixed
  ``bucket_size`` (one scale an array, or an element a run) keep ``run``.
  """
  if not isinstance(compressor, base.FixedBuckets) or run is None or run <= 1 or size == 0:
    return run
  count = -(-size // run)
  length = -(-size // count)
  bits = getattr(compressor, "bits", None)
  word = 32 // bits if isinstance(bits, int) and 32 % bits == 0 else 1
  rounded = -(-length // word) * word
  return rounded if rounded <= run else length


def padded_offsets(sizes, unit: int) -> tuple[tuple[int, ...], int]:
  """Where arrays of ``sizes`` elements start, laid end to end each zero-padded to whole
  runs of ``unit``; and where the last one ends."""
  offsets, end = [], 0
  for size in sizes:
    offsets.append(end)
    end += -(-size // unit) * unit
  return tuple(offsets), end


def check_method(method, owner: str) -> None:
  """Raises unless ``method`` is one of :data:`METHODS`, those a user may ask for.

  The reduce-scatter is a plan of its own, made by ``quantized_psum_scatter``:
  asked for by name elsewhere it would keep one device's shard of the sum.
  """
  if method not in METHODS:
    raise ValueError(f"{owner}: method must be one of {METHODS}, got {method!r}.")


def make_plan(
    tree,
    axis_name: axes_lib.AxisName,
    compressor: base.Compressor,
    *,
    method: str = "two_phase",
    min_compressed_size: int = DEFAULT_MIN_COMPRESSED_SIZE,
    axis_sizes: dict[str, int | None] | None = None,
    owner: str = "quantized reduction",
    scatter_dimension: int = 0,
    tiled: bool = False,
    exact_own_piece: bool = True,
) -> ReductionPlan:
  """The :class:`ReductionPlan` of reducing ``tree`` over ``axis_name``.

  Args:
    tree: a pytree of arrays or ``jax.ShapeDtypeStruct``.
    axis_name: a mapped axis name, ``(outer, inner, ...)``, or ``None``.
    compressor: a :class:`~qsgd_jax.Compressor`.
    method: one of :data:`METHODS`, ``"reduce_scatter"`` or ``"gather"``
      (only ``quantized_psum_scatter`` and ``quantized_all_gather`` ask for
      them; public entry points call :func:`check_method` first).
    min_compressed_size: float leaves with fewer elements go in float32.
    axis_sizes: sizes by axis name, ``None`` for one not known. Without it,
      every axis must be bound (``jax.lax.axis_size``).
    owner: the public function asking, named in errors.
    scatter_dimension, tiled: the reduce-scatter's, as ``jax.lax.psum_scatter``'s, or
      the all-gather's ``axis`` and ``tiled``, as ``jax.lax.all_gather``'s.
    exact_own_piece: see :class:`ReductionPlan`.

  Returns:
    A plan, cached: the same arguments give the same object.

  Raises:
    TypeError: ``compressor`` is not a compressor.
    ValueError: an unknown ``method``, ``"psum"`` with a compressor that has
      no shared-scale form, or a leaf the reduce-scatter cannot split (the
      all-gather cannot join).
    NameError: an axis is neither bound nor in ``axis_sizes``.
  """
  if not isinstance(compressor, base.Compressor):
    raise TypeError(
        f"{owner}: compressor must be a qsgd_jax.Compressor, got "
        f"{type(compressor).__name__}: {compressor!r}."
    )
  if method not in (*METHODS, REDUCE_SCATTER, GATHER):
    raise ValueError(f"{owner}: method must be one of {METHODS}, got {method!r}.")
  if (not isinstance(min_compressed_size, int | np.integer)
      or isinstance(min_compressed_size, bool) or min_compressed_size < 0):
    raise ValueError(
        f"{owner}: min_compressed_size must be a non-negative int (elements), got "
        f"{min_compressed_size!r}.")
  if compressor.gather_only and method in ("two_phase", "psum", REDUCE_SCATTER):
    raise ValueError(
        f"{owner}: {compressor!r} sends sparse payloads, which a {method!r} reduction would "
        "add up and re-encode (sparsifying the sum a second time); they can only be "
        "all-gathered and decoded one by one. Use method='all_gather' (compressed_allreduce's "
        "default for it), or a dense compressor here.")
  if method == "psum" and not isinstance(compressor, base.SharedScaleCompressor):
    raise ValueError(
        f"{owner}: method='psum' needs a compressor with a shared-scale form (QSGD or "
        f"MinMax), got {compressor!r}; use method='two_phase'."
    )
  axes = axes_lib.parse(axis_name, owner)
  if axis_sizes is None:
    sizes = axes.sizes(owner)
  else:
    sizes = tuple(axis_sizes.get(name) for name in axes.names)
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  shapes = tuple(tuple(jnp.shape(leaf)) for _, leaf in leaves)
  dtypes = tuple(np.dtype(jnp.result_type(leaf)) for _, leaf in leaves)
  if method in (REDUCE_SCATTER, GATHER):
    if axes.is_local:
      raise ValueError(f"{owner}: axis_name must name a mapped axis, got {axis_name!r}.")
    check = _check_scatter if method == REDUCE_SCATTER else _check_gather
    for path, shape in zip((p for p, _ in leaves), shapes, strict=True):
      check(shape, scatter_dimension, tiled, math.prod(sizes), owner,
            jax.tree_util.keystr(path) or "<root>")
  if not isinstance(exact_own_piece, bool):
    raise TypeError(f"{owner}: exact_own_piece must be a bool, got {exact_own_piece!r}.")
  # Float leaves are quantized in float32 and cast back: no decode may exceed the narrowest
  # compressed dtype's largest value (a float16 leaf's float32 mean, re-quantized).
  narrowest = min((float(jnp.finfo(dtype).max) for shape, dtype in zip(shapes, dtypes, strict=True)
                   if jnp.issubdtype(dtype, jnp.floating)
                   and math.prod(shape) >= min_compressed_size),
                  default=None)
  if narrowest is not None and narrowest < float(jnp.finfo(jnp.float32).max):
    compressor = compressor.bounded_to(narrowest)
  return _cached_plan(shapes, dtypes, axes, sizes, compressor, method, min_compressed_size,
                      owner, scatter_dimension, tiled, exact_own_piece)


def _check_scatter(shape, dimension: int, tiled: bool, n: int, owner: str, name: str) -> None:
  """Raises unless a leaf of ``shape`` splits into ``n`` shards along ``dimension`` (padded
  to whole shards where tiled)."""
  if not 0 <= dimension < len(shape):
    raise ValueError(
        f"{owner}: leaf {name} of shape {shape} has no dimension {dimension}: "
        f"scatter_dimension={dimension} is out of range.")
  if not tiled and shape[dimension] != n:
    raise ValueError(
        f"{owner}: with tiled=False, leaf {name} must have the axis size {n} along "
        f"scatter_dimension={dimension}, got shape {shape}; pass tiled=True to split it.")


def _check_gather(shape, axis: int, tiled: bool, n: int, owner: str, name: str) -> None:
  """Raises unless the shards of a leaf of ``shape`` can be joined along ``axis``."""
  del n  # Any number of shards joins.
  if not (0 <= axis < len(shape) if tiled else 0 <= axis <= len(shape)):
    raise ValueError(
        f"{owner}: leaf {name} of shape {shape} has no dimension {axis}: axis={axis} is out "
        f"of range{' for tiled=True' if tiled else ''}.")


@functools.lru_cache(maxsize=256)
def _cached_plan(*fields) -> ReductionPlan:
  return ReductionPlan(*fields)


def _f32(shape: tuple[int, ...]) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, jnp.float32)
