"""The static plan of a PowerSGD step, and the orthogonalization of its factors.

:func:`make_plan` decides from a tree's shapes alone which leaves PowerSGD
compresses and how they are batched; :func:`orthogonalize` is the step's
Gram-Schmidt or QR. :mod:`qsgd_jax._src.powersgd.transform` runs the step.

The matrix of a leaf is what a ``MatrixView`` says, by default
:func:`attention_matrix_view`: of a leaf of shape ``(d_1, ..., d_k)``, its
``(d_1 ... d_{k-1}, d_k)`` view, the output features, last in a Flax kernel
(``(in, out)`` for ``Dense``, ``(kh, kw, in, out)`` for ``Conv``), being its
columns; Flax's attention query, key and value kernels ``(in, heads,
head_dim)`` are ``(in, heads * head_dim)``. PyTorch views its ``(out, in, kh,
kw)`` weight as ``(out, in * kh * kw)``: the transpose of the same layer's
matrix, with the rows of ours ordered ``(kh, kw, in)`` instead of ``(in, kh,
kw)``.
"""

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Group:
  """Compressed leaves of one matrix shape and dtype, batched into one matmul.

  Attributes:
    rows: ``n``, the rows of each leaf's matrix.
    columns: ``m``, its columns.
    rank: ``min(n, m, rank)``, the rank of its factors.
    dtype: the leaves' dtype (the step computes in float32).
    leaves: indices of the leaves in the flattened tree, in tree order.
  """

  rows: int
  columns: int
  rank: int
  dtype: np.dtype
  leaves: tuple[int, ...]

  @property
  def p_shape(self) -> tuple[int, int, int]:
    """``(count, n, rank)``: the group's P factors, stacked."""
    return (len(self.leaves), self.rows, self.rank)

  @property
  def q_shape(self) -> tuple[int, int, int]:
    """``(count, m, rank)``: the group's Q factors, stacked."""
    return (len(self.leaves), self.columns, self.rank)

  @property
  def matrix_shape(self) -> tuple[int, int, int]:
    """``(count, n, m)``: the group's matrices, stacked."""
    return (len(self.leaves), self.rows, self.columns)


@dataclasses.dataclass(frozen=True)
class LowRankPlan:
  """Every static decision of a PowerSGD step on one tree.

  Attributes:
    paths: each leaf's ``jax.tree_util.keystr`` path, in tree order.
    shapes: each leaf's shape.
    groups: the compressed leaves, grouped by matrix shape and dtype in the
      order their first leaf appears.
    exact: indices of the leaves averaged exactly (float32 all-reduce): float
      leaves not compressed, and integer leaves (averaged to floats, as
      ``jax.lax.pmean`` does); ``float0`` leaves are in neither.
  """

  paths: tuple[str, ...]
  shapes: tuple[tuple[int, ...], ...]
  groups: tuple[Group, ...]
  exact: tuple[int, ...]

  @property
  def p_elements(self) -> int:
    """Elements of every P factor: what the P all-reduce sums."""
    return sum(math.prod(group.p_shape) for group in self.groups)

  @property
  def q_elements(self) -> int:
    """Elements of every Q factor: what the Q all-reduce sums."""
    return sum(math.prod(group.q_shape) for group in self.groups)

  @property
  def exact_elements(self) -> int:
    """Elements of the leaves averaged exactly."""
    return sum(math.prod(self.shapes[i]) for i in self.exact)

  @property
  def num_elements(self) -> int:
    """Elements of every leaf but ``float0`` ones: what a float32 all-reduce would send."""
    return self.exact_elements + sum(math.prod(g.matrix_shape) for g in self.groups)


MatrixView = Callable[[tuple[str, ...], tuple[int, ...]], tuple[int, int]]
"""``(path, shape) -> (rows, columns)``: the matrix PowerSGD sees of a leaf.

``path`` is the leaf's path in the tree, one ``str`` an entry (dict keys,
attribute names, sequence indices), e.g. ``("params", "Block_0", "attention",
"query", "kernel")``; ``shape`` its shape, of two or more dimensions. ``rows``
must be the product of the leading ``k`` dimensions for some ``0 < k <
len(shape)`` and ``columns`` the product of the rest: the leaf's leading axes
are the layer's inputs, the others its outputs.
"""

# Flax's MultiHeadDotProductAttention (linen) and MultiHeadAttention (NNX) name their
# DenseGeneral projections so: query, key and value kernels are (in, heads, head_dim).
_ATTENTION_INPUT_PROJECTIONS = ("query", "key", "value")


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
  """``(prod(shape[:-1]), shape[-1])``: a leaf's matrix when its last axis alone is its output.

  Examples:
    >>> from qsgd_jax._src import low_rank
    >>> low_rank.matrix_shape((3, 3, 64, 128))  # A Flax Conv kernel, HWIO.
    (576, 128)
  """
  return (math.prod(shape[:-1]), shape[-1])


def attention_matrix_view(path: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, int]:
  """PowerSGD's default ``matrix_view``: each kernel as its layer's input-to-output map.

  * A 3-d ``kernel`` of a layer named ``query``, ``key`` or ``value`` (Flax's
    ``linen.MultiHeadDotProductAttention`` and
    ``nnx.MultiHeadAttention``, whose ``DenseGeneral`` kernels are
    ``(in, heads, head_dim)``) is ``(in, heads * head_dim)``. The layer is
    the path's entry before its last ``"kernel"``, which is the path's last
    entry (linen's params) or the one before it (NNX's ``"value"`` of a
    variable).
  * Every other leaf is ``(prod(shape[:-1]), shape[-1])``: its last axis is
    the output. That is the layer's map for ``Dense`` ``(in, out)``,
    ``Conv`` ``(kh, kw, in, out)``, and the attention's ``out`` kernel
    ``(heads, head_dim, out)``; not for a ``DenseGeneral`` with several
    output features under another name (pass your own view for it).

  Shapes alone cannot tell ``(in, heads, head_dim)`` from ``(heads,
  head_dim, out)``: the names decide, and a leaf the names do not mark keeps
  the last-axis view.

  Args:
    path: the leaf's path, one ``str`` an entry.
    shape: the leaf's shape, of two or more dimensions.

  Returns:
    ``(rows, columns)``.

  Examples:
    >>> import qsgd_jax
    >>> qsgd_jax.attention_matrix_view(("params", "attention", "query", "kernel"), (64, 4, 16))
    (64, 64)
    >>> qsgd_jax.attention_matrix_view(("params", "attention", "out", "kernel"), (4, 16, 64))
    (64, 64)
    >>> qsgd_jax.attention_matrix_view(("params", "Conv_0", "kernel"), (3, 3, 64, 128))
    (576, 128)
  """
  names = tuple(path[-2:])
  layer = None
  if len(path) >= 2 and names[-1] == "kernel":
    layer = path[-2]
  elif len(path) >= 3 and names[0] == "kernel":
    layer = path[-3]
  if len(shape) == 3 and layer in _ATTENTION_INPUT_PROJECTIONS:
    return (shape[0], shape[1] * shape[2])
  return matrix_shape(shape)


def path_names(path) -> tuple[str, ...]:
  """A ``jax.tree_util`` key path as one ``str`` an entry (dict key, attribute, index)."""
  names = []
  for entry in path:
    for field in ("key", "name", "idx"):
      if hasattr(entry, field):
        names.append(str(getattr(entry, field)))
        break
    else:
      names.append(str(entry))
  return tuple(names)


def checked_view(view: MatrixView, path: tuple[str, ...], keystr: str,
                 shape: tuple[int, ...]) -> tuple[int, int]:
  """``view(path, shape)``, or a ``ValueError`` naming the leaf if it is not a matrix view."""
  result = view(path, shape)
  prefixes = {math.prod(shape[:k]) for k in range(1, len(shape))}
  ok = (isinstance(result, tuple) and len(result) == 2
        and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in result))
  if ok:
    rows, columns = int(result[0]), int(result[1])
    if rows in prefixes and rows * columns == math.prod(shape):
      return (rows, columns)
  raise ValueError(
      f"powersgd: matrix_view gave {result!r} for the leaf {keystr} of shape {shape}; a view "
      "is a tuple (rows, columns) of ints where rows is the product of the leaf's leading "
      f"dimensions (one of {sorted(prefixes)}) and columns that of the rest.")


def should_compress(rows: int, columns: int, rank: int, min_compression_rate: float) -> bool:
  """PyTorch's test: ``(n + m) r * min_compression_rate < n m``, ``r = min(n, m, rank)``."""
  rank = min(rows, columns, rank)
  return (rows + columns) * rank * min_compression_rate < rows * columns


def make_plan(tree, rank: int, min_compression_rate: float,
              view: MatrixView = attention_matrix_view) -> LowRankPlan:
  """The :class:`LowRankPlan` of ``tree``'s leaves (arrays or shape-dtype structs).

  A float leaf of two or more dimensions is compressed when
  :func:`should_compress` says so for its matrix, as ``view`` sees it; 0-d
  and 1-d leaves (biases, norm scales) never are.
  """
  return plan_leaves(jax.tree_util.tree_leaves_with_path(tree), rank, min_compression_rate,
                     view)


def plan_leaves(leaves, rank: int, min_compression_rate: float,
                view: MatrixView = attention_matrix_view) -> LowRankPlan:
  """:func:`make_plan` of ``(path, leaf)`` pairs, as ``jax.tree_util.tree_leaves_with_path``
  gives them: the plan's indices are the pairs' positions."""
  paths = tuple(jax.tree_util.keystr(path) or "<root>" for path, _ in leaves)
  shapes = tuple(tuple(np.shape(leaf)) for _, leaf in leaves)
  by_key: dict[tuple, list[int]] = {}
  exact = []
  for index, (_, leaf) in enumerate(leaves):
    dtype = jnp.result_type(leaf)
    if dtype == jax.dtypes.float0:
      continue
    shape = shapes[index]
    if len(shape) >= 2 and jnp.issubdtype(dtype, jnp.floating):
      matrix = checked_view(view, path_names(leaves[index][0]), paths[index], shape)
      if should_compress(*matrix, rank, min_compression_rate):
        by_key.setdefault((matrix, np.dtype(dtype)), []).append(index)
        continue
    exact.append(index)
  groups = tuple(
      Group(rows=n, columns=m, rank=min(n, m, rank), dtype=dtype, leaves=tuple(indices))
      for ((n, m), dtype), indices in by_key.items())
  return LowRankPlan(paths=paths, shapes=shapes, groups=groups, exact=tuple(exact))


def orthogonalize(matrices: jax.Array, epsilon: float) -> jax.Array:
  """Orthonormal columns spanning those of each matrix of ``matrices``, ``float32[b, n, r]``.

  As PyTorch's ``_orthogonalize`` for ``r <= 2``: Gram-Schmidt, each column
  divided by its norm (plus ``epsilon``) and removed from the columns after
  it. A column of norm zero with ``epsilon == 0`` becomes zeros: PyTorch
  divides it by zero and gets NaN there (its ``except ZeroDivisionError``,
  meant to write the zeros, never runs, as dividing tensors does not raise).

  For ``r > 2`` PyTorch takes a reduced QR decomposition's Q, and so does this
  on the CPU. On other platforms, Gram-Schmidt twice: the second pass removes
  what rounding left of the first's projections, so the columns are
  orthonormal to float32 precision as QR's are (``epsilon`` unused, as by the
  QR). On an H100 a GPT-2-small-shaped step of PowerSGD took 7.4 ms more than
  AdamW's 53.5 ms, the QR's kernels 3.6 ms of it; with the two passes, 0.3
  ms more (``benchmarks/step_profile.py``). Timed alone on that step's
  factors (``benchmarks/orthogonalize.py``): the batched QR 6.8 ms, the two
  passes 0.6 ms; on the CPU the passes take 11-14x LAPACK's QR of one matrix
  at a time, and their columns are the closer to float64's span (1e-5 out of
  it against 4e-4 for float32 QR's, on nearly rank-one factors).

  Any orthonormal basis of the span gives PowerSGD the same step in exact
  arithmetic: its approximation ``P Q^T = P P^T M`` is the projection onto
  the span, and a basis ``P R`` (``R`` orthogonal) gives the next factors
  times ``R``. A rank-deficient ``P`` differs: QR completes the basis with
  arbitrary directions, Gram-Schmidt with those of the rounding residue
  (zero columns where it is exactly zero); neither is in the span.

  On CPU the QR takes the matrices one at a time (``jax.lax.map``), not as
  one batch: jaxlib's batched LAPACK kernels (``geqrf``, ``orgqr``; jaxlib
  0.10) split a large enough batch over XLA:CPU's intra-op thread pool and
  block their own pool thread until the pieces are done. Under a collective
  every device runs its QR at once, each on a pool thread, and a small host
  has about one pool thread a device: with all of them blocked, none is left
  to run the pieces, and the step deadlocks (XLA reports the next all-reduce
  as stuck in its rendezvous; on a 2-core host the batch of GPT-2 small's
  factors deadlocked on one device alone). A matrix alone is run on the
  calling thread.
  Q is the same to the bit, as LAPACK factors each matrix alone either way.
  """
  if matrices.shape[-1] > 2:
    return jax.lax.platform_dependent(
        matrices, cpu=lambda x: jax.lax.map(_reduced_q, x),
        default=gram_schmidt_twice)
  return _gram_schmidt(matrices, epsilon)


def gram_schmidt_twice(matrices: jax.Array) -> jax.Array:
  """:func:`orthogonalize`'s ``r > 2`` off the CPU: Gram-Schmidt, then again on its output."""
  return _gram_schmidt(_gram_schmidt(matrices, 0.0), 0.0)


def _gram_schmidt(matrices: jax.Array, epsilon: float) -> jax.Array:
  """Modified Gram-Schmidt over the last axis's columns, zero columns kept zero when
  ``epsilon == 0``."""
  rank = matrices.shape[-1]
  columns = [matrices[..., i : i + 1] for i in range(rank)]
  for i in range(rank):
    norm = jnp.sqrt(jnp.sum(columns[i] * columns[i], axis=-2, keepdims=True))
    if epsilon:
      columns[i] = columns[i] / (norm + epsilon)
    else:
      nonzero = norm > 0
      columns[i] = jnp.where(nonzero, columns[i] / jnp.where(nonzero, norm, 1), 0)
    for j in range(i + 1, rank):
      projection = jnp.sum(columns[i] * columns[j], axis=-2, keepdims=True)
      columns[j] = columns[j] - projection * columns[i]
  return jnp.concatenate(columns, axis=-1)


def _reduced_q(matrices: jax.Array) -> jax.Array:
  return jnp.linalg.qr(matrices, mode="reduced")[0]
