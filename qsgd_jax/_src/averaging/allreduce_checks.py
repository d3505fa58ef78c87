"""What :func:`~qsgd_jax.compressed_allreduce` checks of its options and state, and warns of."""

import math
import warnings

import jax

from qsgd_jax._src import axes
from qsgd_jax._src.collectives import plan


def given_axis_sizes(axis_name, axis_size) -> dict[str, int]:
  """``axis_size`` by axis name, checked: ``None``, a positive int (one axis) or a dict of them."""
  names = axes.parse(axis_name, "compressed_allreduce").names
  if axis_size is None:
    return {}
  if isinstance(axis_size, dict):
    given = dict(axis_size)
  elif len(names) == 1:
    given = {names[0]: axis_size}
  else:
    raise ValueError(
        f"compressed_allreduce: axis_size must be a dict naming each of {names}, "
        f"got {axis_size!r}.")
  for name, size in given.items():
    if name not in names:
      raise ValueError(
          f"compressed_allreduce: axis_size names axis {name!r}, not one of {names}.")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
      raise ValueError(
          f"compressed_allreduce: axis_size must be a positive int (or a dict of them by "
          f"axis name), got {axis_size!r}.")
  return given


def check_residual_shapes(plans, groups, state, axis_size) -> None:
  """Raises where the state's residuals are not the shapes this step's plans hold (a
  group's laid end to end over its shard axes, as the state holds them)."""
  mesh = jax.sharding.get_abstract_mesh()
  for field, shapes_of in (("local_error", plan.ReductionPlan.local_error_shapes),
                           ("chunk_error", plan.ReductionPlan.owner_error_shapes)):
    held = getattr(state, field)
    if not held:
      continue
    expected = []
    for group_plan, group in zip(plans, groups, strict=True):
      shards_count = math.prod(mesh.shape[name] for name in group.axes)
      expected += [(shards_count * e.shape[0], *e.shape[1:]) for e in shapes_of(group_plan)]
    if tuple(e.shape for e in held) != tuple(expected):
      raise ValueError(
          f"compressed_allreduce: the state's {field} has shapes "
          f"{[e.shape for e in held]}, this step needs {expected}: init "
          f"saw another axis size (axis_size={axis_size!r}), another tree or another layout "
          "than update. Pass the mapped axis's true size as axis_size, or call init inside "
          "the mapped function, on params laid out as the updates are.")


def axis_sizes(axis_name, given: dict[str, int]) -> dict[str, int | None]:
  """Each axis's size: as given, else as bound here, else ``None`` (unknown)."""
  sizes = {}
  for name in axes.parse(axis_name, "compressed_allreduce").names:
    try:
      sizes[name] = given[name] if name in given else jax.lax.axis_size(name)
    except NameError:
      sizes[name] = None
  return sizes


# Plans already warned about (with what), so that each tree is warned about once.
_WARNED: set = set()


def warn_if_little_is_compressed(plans) -> None:
  """Warns, once a tree, when under half of its elements would travel compressed."""
  plans = tuple(plans)
  compressed = sum(math.prod(group_plan.leaf_shapes[i])
                   for group_plan in plans for i in group_plan.compressed)
  total = sum(group_plan.num_elements for group_plan in plans)
  if plans in _WARNED or not total or 2 * compressed >= total:
    return
  _WARNED.add(plans)
  largest = max(math.prod(shape) for group_plan in plans for shape in group_plan.leaf_shapes)
  warnings.warn(
      f"compressed_allreduce: only {compressed} of the {total} elements of the updates are "
      f"in leaves of min_compressed_size={plans[0].min_compressed_size} or more, so "
      f"{100 * (1 - compressed / total):.0f}% travel in float32 and the step saves little "
      f"(the largest leaf has {largest} elements). Lower min_compressed_size to quantize "
      "smaller leaves.", stacklevel=3)


def warn_if_chunks_pad(plans) -> None:
  """Warns, once a tree, when a sparse compressor's chunks do not divide leaves it encodes.

  Each such leaf is zero-padded to whole chunks (so that no chunk spans two
  leaves), and its last chunk still sends ``k`` elements: a leaf much
  smaller than a chunk goes far denser than the density asked for.
  """
  plans = tuple(plans)
  if not plans or not getattr(plans[0].compressor, "gather_only", False):
    return
  compressor = plans[0].compressor  # One compressor, whichever group.
  encoded_sizes = [math.prod(group_plan.leaf_shapes[i]) for group_plan in plans
                   for i in group_plan.compressed]
  padded = [size for size in encoded_sizes if size % compressor.chunk]
  if (plans, "chunks") in _WARNED or not padded:
    return
  _WARNED.add((plans, "chunks"))
  padding = sum(-size % compressor.chunk for size in padded)
  sizes = sorted(set(padded))
  warnings.warn(
      f"compressed_allreduce: {type(compressor).__name__}'s chunks of {compressor.chunk} do "
      f"not divide {len(padded)} of the {len(encoded_sizes)} leaves it encodes (of "
      f"{', '.join(map(str, sizes[:5]))}{', ...' if len(sizes) > 5 else ''} elements on a "
      f"device): each is zero-padded to whole chunks ({padding} elements of padding against "
      f"the {sum(encoded_sizes)} encoded), and its last chunk still sends k={compressor.k}, so "
      "those leaves go denser than asked. A chunk that divides them sends no padding; "
      "min_compressed_size above the small ones sends those in float32.", stacklevel=3)
