"""Which parameters make up each fragment of Streaming DiLoCo, and when each fragment syncs."""

import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

_OWNER = "qsgd_jax.diloco"
Fragments = int | Callable[[Any], Any]


def assign(params, fragments: Fragments) -> tuple[int, tuple[int, ...]]:
  """The number of fragments and each leaf's fragment (in ``jax.tree.leaves`` order).

  Args:
    params: the parameters (arrays or shapes).
    fragments: a positive int ``P`` (the default strided partition, see
      :func:`strided`) or a function from ``params`` to a pytree of ints, one
      for each leaf (or for each subtree, which all its leaves then share).

  Raises:
    ValueError: ``P < 1``, more fragments than leaves, a fragment id out of
      range, or a fragment without leaves.
  """
  leaves = jax.tree.leaves(params)
  if callable(fragments):
    given = fragments(params)
    try:
      ids = jax.tree.structure(params).flatten_up_to(
          jax.tree.broadcast(given, params, is_leaf=lambda x: x is None))
    except (ValueError, TypeError) as error:
      raise ValueError(
          f"{_OWNER}: fragments(params) must return a pytree of ints shaped like params (or a "
          f"prefix of it), got {given!r}: {error}") from None
    ids = tuple(_fragment_id(i) for i in ids)
    count = max(ids, default=-1) + 1
    empty = sorted(set(range(count)) - set(ids))
    if empty:
      raise ValueError(
          f"{_OWNER}: fragments(params) gives no leaf to fragment(s) {empty} of 0..{count - 1}: "
          "number the fragments 0, 1, ..., P - 1 with every number used.")
    return count, ids
  if not isinstance(fragments, int) or isinstance(fragments, bool) or fragments < 1:
    raise ValueError(
        f"{_OWNER}: fragments must be a positive int or a function from the params to each "
        f"leaf's fragment, got {fragments!r}.")
  if fragments > len(leaves):
    raise ValueError(
        f"{_OWNER}: fragments={fragments} but the params have {len(leaves)} leaves: every "
        "fragment needs at least one leaf. Pass fewer fragments.")
  return fragments, strided(params, fragments)


def strided(params, count: int) -> tuple[int, ...]:
  """The default partition: the model's layers strided over the fragments, the rest by size.

  The *modules* are the children of the first node of ``params`` with more
  than one child, going down through nodes with a single child (Flax's
  ``{'params': {...}}``). Its *layers* are the modules named as a stem and a
  number that another module shares the stem of (``Block_0``,
  ``Block_1``, ...; ``block_0``, ``block_1``, ...). In natural order
  (``Block_2`` before ``Block_10``), layer ``k`` goes to fragment
  ``k mod count``, every leaf of it with it, as Streaming DiLoCo strides its
  transformer blocks over the fragments. Each other module (embeddings, a
  head, a final norm), the largest first, then goes to the fragment with the
  fewest coordinates so far (of those tied, the one holding the fewest
  modules, then the first), so that the
  fragments, and the outer gradients a sync sends, are about ``1 / count``
  of the model each. With fewer modules than fragments, leaf ``i`` (in
  ``jax.tree.leaves`` order) goes to fragment ``i mod count`` instead.
  """
  paths_and_leaves = jax.tree_util.tree_leaves_with_path(params)
  paths = [path for path, _ in paths_and_leaves]
  depth = 0
  while all(len(path) > depth for path in paths) and len({path[depth] for path in paths}) == 1:
    depth += 1
  module_of = [path[depth] if len(path) > depth else None for path in paths]
  modules = sorted(set(module_of), key=lambda entry: (_natural_key(_name(entry)), _name(entry)))
  if len(modules) < count:
    return tuple(i % count for i in range(len(paths)))
  sizes = dict.fromkeys(modules, 0)
  for module, (_, leaf) in zip(module_of, paths_and_leaves, strict=True):
    sizes[module] += int(np.prod(np.shape(leaf)))
  stems = [_layer_stem(_name(module)) for module in modules]
  layers = [m for m, stem in zip(modules, stems, strict=True)
            if stem is not None and stems.count(stem) > 1]
  fragment = {module: k % count for k, module in enumerate(layers)}
  filled, held = [0] * count, [0] * count
  for module in layers:
    filled[fragment[module]] += sizes[module]
    held[fragment[module]] += 1
  for module in sorted((m for m in modules if m not in fragment), key=lambda m: -sizes[m]):
    # Ties go to the fragment holding the fewest modules: an empty one before any other.
    fragment[module] = min(range(count), key=lambda p: (filled[p], held[p]))
    filled[fragment[module]] += sizes[module]
    held[fragment[module]] += 1
  return tuple(fragment[module] for module in module_of)


def offsets(sync_every: int, count: int) -> tuple[int, ...]:
  """Fragment ``p``'s offset ``(p + 1) * sync_every // count``: it syncs when
  ``(step + 1 - offset) % sync_every == 0``, ``step`` counted from 0.

  The offsets are spread evenly over a round, the last fragment's equal to
  ``sync_every`` (so one fragment syncs as DiLoCo does, every
  ``sync_every``-th step); torchft's ``DiLoCo`` gives fragment ``p`` the same
  offset, ``floor(sync_every / P * (p + 1))`` (``torchft/local_sgd.py``).
  """
  return tuple((p + 1) * sync_every // count for p in range(count))


def _fragment_id(value) -> int:
  array = np.asarray(value)
  if array.shape != () or not np.issubdtype(array.dtype, np.integer) or int(array) < 0:
    raise ValueError(
        f"{_OWNER}: fragments(params) must give each leaf a non-negative int, got {value!r}.")
  return int(array)


def _natural_key(name: str) -> tuple:
  return tuple((0, int(part), "") if part.isdigit() else (1, 0, part)
               for part in re.findall(r"\d+|\D+", name))


def _layer_stem(name: str) -> str | None:
  """``'Block_'`` for ``'Block_3'``; ``None`` for a name that does not end in a number."""
  match = re.fullmatch(r"(.*?)\d+", name)
  return match.group(1) if match else None


def _name(entry) -> str:
  """A path entry's name: a dict's key, an attribute's name, a sequence's index."""
  for field in ("key", "name", "idx"):
    if hasattr(entry, field):
      return str(getattr(entry, field))
  return str(entry)
