"""Mapped axis names, normalized once for every collective and transform.

A reduction runs over one mapped axis (``"batch"``) or over several,
``("node", "local")``: the first, *outer*, axis is the slow link that the
quantized collectives cross; the others, *inner*, are fast links reduced in
full precision first. ``None`` names no axis: one device alone, whose
reductions apply the compressor locally and communicate nothing (for
debugging a training step without a mesh). :func:`parse` turns what a user
passes into an :class:`Axes`, and everything else in the library reads names
and sizes from it.
"""

import dataclasses
import functools
import inspect
import os
import sys
import types
from typing import NamedTuple

import jax
import jax.numpy as jnp

AxisName = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class Axes:
  """The axes of one reduction.

  Attributes:
    outer: the axis the quantized collectives run over; ``None`` for one
      device alone.
    inner: axes reduced in full precision before and after them; empty for
      a single axis.
  """

  outer: str | None
  inner: tuple[str, ...] = ()

  @property
  def is_local(self) -> bool:
    """Whether there is no axis: one device, no collective."""
    return self.outer is None

  @property
  def names(self) -> tuple[str, ...]:
    """Every axis, outer first (none when local)."""
    return () if self.is_local else (self.outer, *self.inner)

  @property
  def name(self) -> AxisName:
    """What ``jax.lax`` collectives and ``PartitionSpec`` take for all the axes."""
    return self.names if self.inner else self.outer

  def sizes(self, owner: str) -> tuple[int, ...]:
    """The size of each of :attr:`names`, read with ``jax.lax.axis_size``.

    Args:
      owner: the caller, named in errors.

    Raises:
      NameError: an axis is not bound; it says how to bind it.
    """
    return tuple(_bound_size(name, owner) for name in self.names)


def parse(axis_name: AxisName, owner: str) -> Axes:
  """The :class:`Axes` of a user's ``axis_name``.

  Args:
    axis_name: a mapped axis name, a non-empty tuple (or list) of names,
      outer first, or ``None`` for one device alone.
    owner: the caller, named in errors.

  Raises:
    TypeError: ``axis_name`` is not a name, a sequence of names, or None.
    ValueError: it is an empty sequence.
  """
  if axis_name is None:
    return Axes(outer=None)
  names = tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)
  if not names:
    raise ValueError(f"{owner}: axis_name must name at least one axis, got {axis_name!r}.")
  for name in names:
    if not isinstance(name, str):
      raise TypeError(
          f"{owner}: axis_name must be a mapped axis name (str), a tuple of them, or None "
          f"for one device, got {axis_name!r}."
      )
  return Axes(outer=names[0], inner=names[1:])


def as_varying(tree, axis_name: AxisName):
  """``tree`` with every leaf typed as varying over ``axis_name``: each device's own copy.

  Under ``jax.shard_map`` a value is either replicated over an axis (the same
  on every device) or varying. Differentiating a loss with respect to
  replicated parameters makes autodiff sum the gradient over the axis, in
  float32, before any optimizer sees it; with respect to varying copies it
  gives each device its own gradient, which a quantized reduction then
  averages. Leaves already varying are left alone; under ``jax.pmap`` and
  ``jax.vmap``, which do not type values so, this changes nothing.

  Args:
    tree: a pytree of arrays, inside ``jax.shard_map`` or ``jax.pmap``.
    axis_name: a mapped axis name, a tuple of names, or ``None`` (then
      ``tree`` is returned as it is).

  Returns:
    ``tree``, each leaf cast with ``jax.lax.pcast(..., to="varying")`` over
    the axes it does not vary over yet.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("batch",))
    >>> def local_grad(w, x):
    ...   return jax.grad(lambda w: jnp.sum(w * x))(qsgd_jax.as_varying(w, "batch"))
    >>> x = jax.device_put(jnp.arange(2.0), NamedSharding(mesh, P("batch")))
    >>> jax.shard_map(local_grad, mesh=mesh, in_specs=(P(), P("batch")),
    ...               out_specs=P("batch"))(jnp.ones(2), x)
    Array([0., 1.], dtype=float32)
  """
  names = tracked(parse(axis_name, "as_varying").names)
  if not names:
    return tree

  def cast(x):
    manual = jax.typeof(x).manual_axis_type
    missing = tuple(name for name in names if manual is None or name not in manual.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, tree)


def tracked(names: tuple[str, ...]) -> tuple[str, ...]:
  """The axes among ``names`` over which values are typed varying or replicated.

  ``jax.shard_map`` (with ``check_vma``, its default) tracks it; ``jax.pmap``,
  ``jax.vmap`` and ``check_vma=False`` do not. Read from the axis index, which
  varies over its axis exactly where that is tracked.
  """
  return tuple(name for name in names
               if name in jax.typeof(jax.lax.axis_index(name)).manual_axis_type.varying)


def varying_axes(x) -> tuple[str, ...]:
  """The axes ``jax.shard_map`` types ``x`` (an array or a ``jax.ShapeDtypeStruct``) as
  varying over, sorted; none where nothing is tracked (``jax.pmap``, no mapped axis)."""
  manual = (x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)).manual_axis_type
  return tuple(sorted(manual.varying)) if manual else ()


def varying_like(tree, like):
  """``tree``, each leaf also typed as varying over the axes its match in ``like`` (a tree of
  arrays or ``jax.ShapeDtypeStruct``, of ``tree``'s structure) varies over.

  The two branches of a ``jax.lax.cond`` under ``jax.shard_map`` must return the same types:
  ``varying_like(a, b)`` and ``varying_like(b, a)`` are ``a`` and ``b`` typed alike.
  """

  def cast(x, other):
    names = varying_axes(other)
    return as_varying(x, names) if names else x

  return jax.tree.map(cast, tree, like)


def all_gather_replicated(x: jax.Array, axis_name) -> jax.Array:
  """``jax.lax.all_gather(x, axis_name)`` (stacked), typed replicated where that is tracked.

  Every device gets the same gathered array, so where ``jax.shard_map``
  tracks it the result is typed invariant, to be returned with ``P()``.
  """
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  to = "invarying" if tracked(names) else "varying"
  return jax.lax.all_gather(x, axis_name, tiled=False, to=to)


def check_varying(tree, axes: Axes, owner: str) -> None:
  """Raises where a float leaf of ``tree`` is replicated over an axis it should vary over.

  Under ``jax.shard_map`` (which types values as varying or replicated over
  each axis), a gradient taken with respect to replicated parameters has
  already been summed over the axis by autodiff, in float32: reducing it again
  would send it a second time and give ``n`` times the mean, silently. Under
  ``jax.pmap`` and ``jax.vmap`` nothing is typed, and nothing is checked.

  Raises:
    ValueError: naming the leaf and the axis, and what to do.
  """
  found = first_replicated(tree, axes.names, floats_only=True)
  if found is not None:
    path, missing = found
    raise ValueError(
        f"{owner}: leaf {path} is replicated over axis {missing!r}, not a per-device value. "
        "Under jax.shard_map, jax.grad with respect to replicated params returns the "
        "gradient already summed over the axis in float32, and reducing it again would give "
        f"n times the mean. Differentiate with respect to qsgd_jax.as_varying(params, "
        f"{axes.name!r}) (that is, jax.lax.pcast(params, {axes.name!r}, to='varying')) "
        "instead.")


def first_replicated(tree, names, *, floats_only: bool = False) -> tuple[str, str] | None:
  """``(path, axis)`` of the first leaf of ``tree`` that ``jax.shard_map`` types as replicated
  over one of the axes ``names``, or ``None`` (also outside ``shard_map``, where nothing is
  typed). ``path`` is the leaf's ``keystr``, ``<root>`` for a bare array; with
  ``floats_only`` other leaves are not looked at."""
  names = tracked(tuple(names))
  if not names:
    return None
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if floats_only and not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
      continue
    varying = jax.typeof(leaf).manual_axis_type.varying
    missing = [name for name in names if name not in varying]
    if missing:
      return jax.tree_util.keystr(path) or "<root>", missing[0]
  return None


def check_not_in_apply_if_finite(owner: str, axis_name: AxisName, instead: str) -> None:
  """Raises when traced in a branch that only some devices of ``axis_name`` may take.

  A transform with collectives over ``axis_name`` must run on every device
  of it together. ``optax.apply_if_finite(inner)`` runs ``inner`` in one
  branch of a ``jax.lax.cond`` whose predicate each device computes from its
  own updates, and so does ``optax.MultiSteps`` given a
  ``should_skip_update_fn`` (``optax.skip_not_finite``): a device whose
  gradient is not finite takes the other branch, and the others wait for it
  in the branch's collectives until the runtime gives up. A predicate that is
  the same on every device (a step count, as in
  ``optax.conditionally_transform``) is safe.

  Every ``jax.lax.cond`` that encloses this trace is read, by its predicate:
  a constant is safe; under ``jax.shard_map``, which types each value as
  varying over an axis or not, the predicate must not vary over
  ``axis_name``; under ``jax.pmap``, which does not type values so, the
  branches of the two optax wrappers above whose predicate is read from each
  device's own updates are refused, and other predicates are trusted.

  Args:
    owner: the transformation, named in the error.
    axis_name: the axes of its collectives.
    instead: what to do instead, the error's last sentence.

  Raises:
    ValueError: naming ``owner``, the reason and ``instead``.
  """
  if axis_name is None:
    return
  try:
    names = tracked(parse(axis_name, owner).names)
  except NameError:  # Unbound: the transform's own check says so.
    return
  codes = _branch_codes()
  frame = sys._getframe(1)
  while frame is not None:
    if frame.f_code is codes.cond:
      predicate = frame.f_locals.get("pred")
      if isinstance(predicate, jax.core.Tracer) and _per_device(
          predicate, names, _caller(frame), codes):
        raise ValueError(
            f"{owner} runs in a branch of a jax.lax.cond whose predicate each device "
            "computes for itself (optax.apply_if_finite, or optax.MultiSteps with a "
            "should_skip_update_fn, test each device's own updates): devices that disagree "
            f"would take different branches around its collectives and hang. {instead}")
    frame = frame.f_back


def _per_device(predicate, names: tuple[str, ...], caller, codes: "_BranchCodes") -> bool:
  """Whether a traced ``cond`` predicate may differ between the devices of ``names``."""
  if names:
    varying = jax.typeof(predicate).manual_axis_type.varying
    return any(name in varying for name in names)
  if caller is None:
    return False
  if caller.f_code is codes.apply_if_finite:
    return True
  if caller.f_code is codes.multi_steps:  # Its default predicate is a constant False.
    skip = getattr(caller.f_locals.get("self"), "_should_skip_update_fn", None)
    return getattr(skip, "__code__", None) is not codes.never_skip
  return False


def _caller(frame):
  """The first frame above ``frame`` that is not JAX's own (its API wrappers)."""
  jax_dir = os.path.dirname(jax.__file__)
  frame = frame.f_back
  while frame is not None and frame.f_code.co_filename.startswith(jax_dir):
    frame = frame.f_back
  return frame


class _BranchCodes(NamedTuple):
  cond: types.CodeType
  apply_if_finite: types.CodeType
  multi_steps: types.CodeType
  never_skip: types.CodeType


@functools.cache
def _branch_codes() -> _BranchCodes:
  """The code of ``jax.lax.cond``, and of the optax updates that call it on a predicate of each
  device's own updates (taken from the objects optax makes, not from file names)."""
  import optax

  return _BranchCodes(
      cond=inspect.unwrap(jax.lax.cond).__code__,
      apply_if_finite=optax.apply_if_finite(optax.identity(), 1).update.__code__,
      multi_steps=inspect.unwrap(optax.MultiSteps.update).__code__,
      never_skip=optax.MultiSteps(optax.identity(), 1)._should_skip_update_fn.__code__)


def _bound_size(name: str, owner: str) -> int:
  try:
    return jax.lax.axis_size(name)
  except NameError as error:
    raise NameError(
        f"{owner}: axis_name {name!r} is not bound ({error}): call it inside "
        f"jax.pmap(..., axis_name={name!r}) or a jax.shard_map over a mesh with that axis."
    ) from error
