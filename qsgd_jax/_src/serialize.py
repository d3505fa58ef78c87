"""Flattening a payload pytree into one ``uint32`` word vector and back.

Collectives move a single buffer: every array of a payload (packed codes,
float32 scales, bf16 values) is reinterpreted bit for bit as ``uint32`` words
and the words are concatenated. The inverse needs the payload's static
structure, a ``jax.ShapeDtypeStruct`` tree from ``jax.eval_shape``.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

_WORD_BYTES = 4


def _num_words(leaf) -> int:
  return math.ceil(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize / _WORD_BYTES)


def num_words(template) -> int:
  """Words that :func:`to_words` makes of a pytree with this structure."""
  return sum(_num_words(leaf) for leaf in jax.tree.leaves(template))


def _leaf_to_words(leaf: jax.Array) -> jax.Array:
  if leaf.dtype == jnp.uint32:
    return leaf.reshape(-1)
  if leaf.dtype == jnp.bool_:  # A byte each, as XLA stores a bool; bitcasts refuse bools.
    leaf = leaf.astype(jnp.uint8)
  as_bytes = jax.lax.bitcast_convert_type(leaf.reshape(-1), jnp.uint8).reshape(-1)
  as_bytes = jnp.pad(as_bytes, (0, _num_words(leaf) * _WORD_BYTES - as_bytes.size))
  return jax.lax.bitcast_convert_type(as_bytes.reshape(-1, _WORD_BYTES), jnp.uint32)


def _leaf_from_words(words: jax.Array, leaf) -> jax.Array:
  dtype = np.dtype(leaf.dtype)
  if dtype == np.uint32:
    return words.reshape(leaf.shape)
  size = math.prod(leaf.shape)
  as_bytes = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)[: size * dtype.itemsize]
  if dtype == np.bool_:
    return (as_bytes != 0).reshape(leaf.shape)
  if dtype.itemsize == 1:
    return jax.lax.bitcast_convert_type(as_bytes, dtype).reshape(leaf.shape)
  values = jax.lax.bitcast_convert_type(as_bytes.reshape(size, dtype.itemsize), dtype)
  return values.reshape(leaf.shape)


def to_words(tree) -> jax.Array:
  """All arrays of ``tree``, bit for bit, as one ``uint32`` vector."""
  leaves = jax.tree.leaves(tree)
  return jnp.concatenate([_leaf_to_words(leaf) for leaf in leaves]) if leaves else jnp.zeros(
      (0,), jnp.uint32
  )


def from_words(words: jax.Array, template):
  """Inverse of :func:`to_words` for a tree shaped like ``template``."""
  leaves, treedef = jax.tree.flatten(template)
  arrays, start = [], 0
  for leaf in leaves:
    count = _num_words(leaf)
    arrays.append(_leaf_from_words(words[start : start + count], leaf))
    start += count
  return jax.tree.unflatten(treedef, arrays)
