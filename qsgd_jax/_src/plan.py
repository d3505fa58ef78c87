"""The reduction plan: every static decision about one quantized reduction of a tree.

A quantized sum of a gradient tree decides a great deal from static shapes
alone: which leaves travel compressed and which in float32, how many
elements each device quantizes, how long its piece of each leaf is, how the
pieces are batched into a few encodes, what each batched payload looks like,
and in which integer type codes are summed. :func:`make_plan` decides all of
it once, in one hashable :class:`ReductionPlan`; the reduction executes the
plan, and everything that accounts for it (the bits on the wire, the shapes of
the error-feedback residuals, the statistics) reads the same plan, so what is
sent and what is counted cannot disagree. It plays the part that
``_factored_dims`` plays in optax's factored optimizer, for ``init`` and
``update`` alike.

With ``n`` devices on the outer axis and ``m`` on the inner ones:

* leaves under ``min_compressed_size`` elements are summed in float32 by one
  fused all-reduce over every axis;
* each other leaf of ``d`` elements is first reduce-scattered in float32 over
  the inner axes, leaving each device ``ceil(d / m)`` elements to quantize
  (``d`` without inner axes): its *sent length*;
* ``"two_phase"`` cuts that vector into ``n`` *pieces* of whole buckets,
  ``ceil(ceil(d' / n) / bucket) * bucket`` elements each (zero-padded), and
  quantizes ``[n, piece]`` a leaf; ``"psum"`` quantizes the vector itself;
* the arrays are batched into blocks by :mod:`grouping`: with a fixed bucket
  size, all side by side in one block; otherwise stacked by shape.
"""

import dataclasses
import functools
import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qsgd_jax._src import axes as axes_lib
from qsgd_jax._src import base, grouping, serialize, wire

Method = Literal["two_phase", "psum"]
METHODS = ("two_phase", "psum")

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
    carries: what it moves: ``"float32 leaves"``, ``"inner reduce-scatter"``,
      ``"inner all-gather"``, ``"first phase"`` and ``"second phase"``
      (packed payloads), ``"shared scales"`` or ``"code sums"``.
  """

  kind: str
  dtype: np.dtype
  shape: tuple[int, ...]
  group_size: int
  carries: str

  @property
  def result_bytes(self) -> int:
    return math.prod(self.shape) * np.dtype(self.dtype).itemsize

  @property
  def bytes_sent(self) -> float:
    """Bytes one device sends for it, by :func:`wire.bytes_sent`."""
    return wire.bytes_sent(self.kind, self.result_bytes, self.group_size)


@dataclasses.dataclass(frozen=True)
class ReductionPlan:
  """What one quantized reduction of a tree sends, decided from static shapes.

  Build it with :func:`make_plan`. Fields are the inputs; properties derive
  the decisions from them (each computed once).

  Attributes:
    leaf_shapes: each leaf's shape, in tree order.
    axes: the reduction's axes.
    axis_sizes: the size of each of ``axes.names``; ``None`` where unknown
      (an ``init`` outside the mapped function), and then the decisions that
      depend on it raise a ``ValueError`` saying how to give it.
    compressor: the compressor.
    method: ``"two_phase"`` or ``"psum"``.
    min_compressed_size: leaves with fewer elements go in float32.
    owner: the public function this plan serves, named in errors.
  """

  leaf_shapes: tuple[tuple[int, ...], ...]
  axes: axes_lib.Axes
  axis_sizes: tuple[int | None, ...]
  compressor: base.Compressor
  method: Method
  min_compressed_size: int
  owner: str

  @property
  def outer_size(self) -> int:
    return self._known_size(0)

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
  def compressed(self) -> tuple[int, ...]:
    """Indices of the leaves sent compressed, in tree order."""
    return tuple(i for i, shape in enumerate(self.leaf_shapes)
                 if math.prod(shape) >= self.min_compressed_size)

  @functools.cached_property
  def full_precision(self) -> tuple[int, ...]:
    """Indices of the leaves summed in float32, in tree order."""
    return tuple(i for i, shape in enumerate(self.leaf_shapes)
                 if math.prod(shape) < self.min_compressed_size)

  @functools.cached_property
  def sent_lengths(self) -> tuple[int, ...]:
    """For each compressed leaf, the elements one device quantizes."""
    sizes = [math.prod(self.leaf_shapes[i]) for i in self.compressed]
    if not self.axes.inner:
      return tuple(sizes)
    return tuple(-(-size // self.inner_size) for size in sizes)

  @functools.cached_property
  def piece_lengths(self) -> tuple[int, ...]:
    """Two-phase: for each compressed leaf, one device's piece, in whole buckets."""
    bucket = grouping.fixed_bucket_size(self.compressor)
    pieces = []
    for length in self.sent_lengths:
      per_device = max(1, -(-length // self.outer_size))
      pieces.append(per_device if bucket is None else -(-per_device // bucket) * bucket)
    return tuple(pieces)

  @functools.cached_property
  def layout(self) -> grouping.Layout:
    """The blocks of the quantized arrays: ``[n, piece]`` a leaf (two-phase), or the vectors."""
    if self.method == "two_phase":
      arrays = [_f32((self.outer_size, piece)) for piece in self.piece_lengths]
    else:
      arrays = [_f32((length,)) for length in self.sent_lengths]
    return grouping.layout(self.compressor, arrays)

  @functools.cached_property
  def block_templates(self) -> tuple[base.Payload, ...]:
    """Two-phase: for each block, the payload of one encoded element (``[width]``)."""
    return tuple(
        jax.eval_shape(self.compressor.encode, jax.random.key(0), _f32((width,)))
        for _, width in self.layout.block_sizes())

  @functools.cached_property
  def block_words(self) -> tuple[int, ...]:
    """Two-phase: for each block, ``uint32`` words of its whole batch of payloads."""
    return tuple(batch * serialize.num_words(template) for (batch, _), template
                 in zip(self.layout.block_sizes(), self.block_templates, strict=True))

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
    planned = []
    if self.full_precision:
      size = sum(math.prod(self.leaf_shapes[i]) for i in self.full_precision)
      planned.append(PlannedCollective(
          "all-reduce", np.dtype(np.float32), (size,), self.num_devices, "float32 leaves"))
    if not self.compressed:
      return tuple(planned)
    inner_elements = sum(self.sent_lengths)
    if self.axes.inner:
      planned.append(PlannedCollective(
          "reduce-scatter", np.dtype(np.float32), (inner_elements,), self.inner_size,
          "inner reduce-scatter"))
    n = self.outer_size
    if self.method == "two_phase":
      words = (n, sum(self.block_words))
      planned.append(PlannedCollective(
          "all-to-all", np.dtype(np.uint32), words, n, "first phase"))
      planned.append(PlannedCollective(
          "all-gather", np.dtype(np.uint32), words, n, "second phase"))
    else:
      blocks = self.layout.block_sizes()
      scales = sum(batch * math.prod(jax.eval_shape(self.compressor.local_scales,
                                                    _f32((width,))).shape)
                   for batch, width in blocks)
      codes = sum(batch * width for batch, width in blocks)
      planned.append(PlannedCollective(
          "all-reduce", np.dtype(np.float32), (scales,), n, "shared scales"))
      planned.append(PlannedCollective("all-reduce", self.sum_dtype, (codes,), n, "code sums"))
    if self.axes.inner:
      planned.append(PlannedCollective(
          "all-gather", np.dtype(np.float32), (self.inner_size, inner_elements),
          self.inner_size, "inner all-gather"))
    return tuple(planned)

  @functools.cached_property
  def wire_bits(self) -> float:
    """Bits one device sends, summed over :attr:`collectives`."""
    return 8 * sum(c.bytes_sent for c in self.collectives)

  def local_error_shapes(self) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Worker error feedback: one ``float32[sent_length]`` residual a compressed leaf."""
    return tuple(_f32((length,)) for length in self.sent_lengths)

  def owner_error_shapes(self) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Owner error feedback (two-phase): one ``float32[batch, width]`` a block.

    Device ``j`` owns piece ``j`` of every block; its residual is the error of
    re-quantizing the sum of those pieces.
    """
    if self.method != "two_phase":
      raise ValueError(f"{self.owner}: only method='two_phase' has piece owners.")
    return tuple(_f32(size) for size in self.layout.block_sizes())

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


def make_plan(
    tree,
    axis_name: axes_lib.AxisName,
    compressor: base.Compressor,
    *,
    method: Method = "two_phase",
    min_compressed_size: int = DEFAULT_MIN_COMPRESSED_SIZE,
    axis_sizes: dict[str, int | None] | None = None,
    owner: str = "quantized reduction",
) -> ReductionPlan:
  """The :class:`ReductionPlan` of reducing ``tree`` over ``axis_name``.

  Args:
    tree: a pytree of float arrays or ``jax.ShapeDtypeStruct``.
    axis_name: a mapped axis name, or ``(outer, inner, ...)``.
    compressor: a :class:`~qsgd_jax.Compressor`.
    method: ``"two_phase"`` or ``"psum"``.
    min_compressed_size: leaves with fewer elements go in float32.
    axis_sizes: sizes by axis name, ``None`` for one not known. Without it,
      every axis must be bound (``jax.lax.axis_size``).
    owner: the public function asking, named in errors.

  Returns:
    A plan, cached: the same arguments give the same object.

  Raises:
    TypeError: ``compressor`` is not a compressor.
    ValueError: an unknown ``method``, or ``"psum"`` with a compressor that
      has no shared-scale form.
    NameError: an axis is neither bound nor in ``axis_sizes``.
  """
  if not isinstance(compressor, base.Compressor):
    raise TypeError(
        f"{owner}: compressor must be a qsgd_jax.Compressor, got "
        f"{type(compressor).__name__}: {compressor!r}."
    )
  if method not in METHODS:
    raise ValueError(f"{owner}: method must be one of {METHODS}, got {method!r}.")
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
  shapes = tuple(tuple(jnp.shape(leaf)) for leaf in jax.tree.leaves(tree))
  return _cached_plan(shapes, axes, sizes, compressor, method, min_compressed_size, owner)


@functools.lru_cache(maxsize=256)
def _cached_plan(*fields) -> ReductionPlan:
  return ReductionPlan(*fields)


def _f32(shape: tuple[int, ...]) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, jnp.float32)
