"""DeMo's and SparseLoCo's chunks: each leaf as a matrix cut into blocks, and the DCT of a block.

A leaf is seen as a matrix of ``rows x cols`` (a vector as one row) and cut
into blocks of ``h x w``, where ``h`` is the largest divisor of ``rows`` at most
the target side (``rows`` itself if smaller), and ``w`` likewise of ``cols``:
no padding, and a side with no divisor near the target gets small blocks (a
prime number of rows above the target gets blocks one row high). Blocks are
numbered row-chunk first, and each block's elements row-major, as DeMo's
``rearrange("(y h) (x w) -> y x (h w)")`` lays them out (``demo.py`` lines
172-258 and 396-449; SparseLoCo's ``sparseloco.py`` lines 142-183).

The DCT of a block is the orthonormal DCT-II along both of its sides,
:math:`C_h X C_w^\\top` with
:math:`C_n[k, m] = \\sqrt{2 / n}\\, \\cos(\\pi (2 m + 1) k / (2 n))` (row 0
scaled by :math:`1 / \\sqrt 2`), ``scipy.fft.dctn(block, norm="ortho")``; its
inverse is :math:`C_h^\\top Y C_w`.
"""

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qsgd_jax._src.powersgd import low_rank

MatrixView = Callable[[tuple[str, ...], tuple[int, ...]], tuple[int, int]]


def largest_divisor_at_most(n: int, target: int) -> int:
  """The largest divisor of ``n`` that is at most ``target``: DeMo's ``_get_smaller_split``."""
  for size in range(min(n, target), 0, -1):
    if n % size == 0:
      return size
  return 1


class BlockLayout(NamedTuple):
  """How one leaf is cut into blocks.

  Attributes:
    shape: the leaf's shape.
    rows: rows of the matrix the leaf is seen as.
    cols: its columns (``rows * cols`` is the leaf's size).
    block_rows: ``h``, rows of a block (a divisor of ``rows``).
    block_cols: ``w``, columns of a block (a divisor of ``cols``).
  """

  shape: tuple[int, ...]
  rows: int
  cols: int
  block_rows: int
  block_cols: int

  @property
  def num_blocks(self) -> int:
    return (self.rows // self.block_rows) * (self.cols // self.block_cols)

  @property
  def block_size(self) -> int:
    return self.block_rows * self.block_cols


def block_layout(shape: tuple[int, ...], matrix: tuple[int, int], side: int) -> BlockLayout:
  """The layout of a leaf of ``shape`` seen as ``matrix``, cut into blocks of sides at most
  ``side``."""
  rows, cols = matrix
  return BlockLayout(tuple(shape), rows, cols, largest_divisor_at_most(rows, side),
                     largest_divisor_at_most(cols, side))


def leaf_layouts(tree, matrix_view: MatrixView | None, side: int,
                 owner: str) -> list[BlockLayout]:
  """Each leaf of ``tree`` as a matrix cut into blocks of sides at most ``side``: the matrix
  ``matrix_view(path, shape)`` for leaves of two or more dimensions (by default
  :func:`~qsgd_jax.attention_matrix_view`), one row otherwise.

  Raises:
    ValueError: a view whose size is not the leaf's, naming the leaf.
  """
  view = low_rank.attention_matrix_view if matrix_view is None else matrix_view
  layouts = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    shape = tuple(jnp.shape(leaf))
    matrix = (1, math.prod(shape)) if len(shape) < 2 else tuple(
        view(low_rank.path_names(path), shape))
    if len(matrix) != 2 or matrix[0] * matrix[1] != math.prod(shape):
      raise ValueError(
          f"{owner}: matrix_view gave {matrix!r} for the leaf "
          f"{jax.tree_util.keystr(path) or '<root>'} of shape {shape}; a view must be "
          "(rows, columns) with rows * columns the leaf's size.")
    layouts.append(block_layout(shape, (int(matrix[0]), int(matrix[1])), side))
  return layouts


def to_blocks(x: jax.Array, layout: BlockLayout) -> jax.Array:
  """``float32[num_blocks, block_size]``: the leaf's blocks, each flattened row-major."""
  h, w = layout.block_rows, layout.block_cols
  grid = x.astype(jnp.float32).reshape(layout.rows // h, h, layout.cols // w, w)
  return jnp.transpose(grid, (0, 2, 1, 3)).reshape(layout.num_blocks, layout.block_size)


def from_blocks(blocks: jax.Array, layout: BlockLayout) -> jax.Array:
  """Inverse of :func:`to_blocks`: the leaf, ``float32[*layout.shape]``."""
  h, w = layout.block_rows, layout.block_cols
  grid = blocks.reshape(layout.rows // h, layout.cols // w, h, w)
  return jnp.transpose(grid, (0, 2, 1, 3)).reshape(layout.shape)


@functools.lru_cache(maxsize=64)
def dct_matrix(n: int) -> np.ndarray:
  """The orthonormal DCT-II matrix of size ``n``, ``float32[n, n]`` (computed in float64)."""
  k = np.arange(n)[:, None]
  m = np.arange(n)[None, :]
  basis = np.sqrt(2.0 / n) * np.cos(np.pi * (2 * m + 1) * k / (2 * n))
  basis[0] /= np.sqrt(2.0)
  return basis.astype(np.float32)


def dct(blocks: jax.Array, layout: BlockLayout) -> jax.Array:
  """Each block's 2-d DCT-II, :math:`C_h X C_w^\\top`, in the same flat layout."""
  return _both_sides(blocks, layout, "ij,bjk,lk->bil")


def inverse_dct(coefficients: jax.Array, layout: BlockLayout) -> jax.Array:
  """Inverse of :func:`dct`: :math:`C_h^\\top Y C_w` a block."""
  return _both_sides(coefficients, layout, "ji,bjk,kl->bil")


def _both_sides(blocks: jax.Array, layout: BlockLayout, subscripts: str) -> jax.Array:
  """Each block, as ``h x w``, multiplied by ``C_h`` and ``C_w`` as ``subscripts`` say."""
  h, w = layout.block_rows, layout.block_cols
  out = jnp.einsum(subscripts, dct_matrix(h), blocks.reshape(-1, h, w), dct_matrix(w),
                   precision=jax.lax.Precision.HIGHEST)
  return out.reshape(blocks.shape)
