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
import os
import sys

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
  names = tracked(axes.names)
  if not names:
    return
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
      continue
    manual = jax.typeof(leaf).manual_axis_type
    missing = [name for name in names if name not in manual.varying]
    if missing:
      raise ValueError(
          f"{owner}: leaf {jax.tree_util.keystr(path) or '<root>'} is replicated over axis "
          f"{missing[0]!r}, not a per-device value. Under jax.shard_map, jax.grad with respect "
          "to replicated params returns the gradient already summed over the axis in "
          "float32, and reducing it again would give n times the mean. Differentiate with "
          f"respect to qsgd_jax.as_varying(params, {axes.name!r}) (that is, "
          f"jax.lax.pcast(params, {axes.name!r}, to='varying')) instead."
      )


# optax.apply_if_finite runs the transformation it wraps in this function of this file: one
# branch of a jax.lax.cond whose predicate each device computes from its own updates.
_APPLY_IF_FINITE_BRANCH = ("do_update", os.path.join("optax", "transforms", "_conditionality.py"))


def check_not_in_apply_if_finite(owner: str, instead: str) -> None:
  """Raises when traced inside ``optax.apply_if_finite``, whose devices would hang.

  ``apply_if_finite(inner)`` tests each device's own updates for NaN and inf
  and runs ``inner`` in one branch of a ``jax.lax.cond``: a device whose
  gradient is not finite takes the other branch, and the devices that took
  this one wait in its collectives for it until the runtime gives up (under
  ``jax.pmap``; ``jax.shard_map`` refuses the branches' types with a less
  direct message). The predicate is a value, known only when the step runs:
  trace time can only tell where the trace is, so the Python frames that
  called this are read for ``apply_if_finite``'s branch.

  Args:
    owner: the transformation, named in the error.
    instead: what to do instead, the error's last sentence.

  Raises:
    ValueError: naming ``owner``, the reason and ``instead``.
  """
  name, path = _APPLY_IF_FINITE_BRANCH
  frame = sys._getframe(1)
  while frame is not None:
    if frame.f_code.co_name == name and frame.f_code.co_filename.endswith(path):
      raise ValueError(
          f"{owner} is wrapped in optax.apply_if_finite, which tests each device's own "
          "updates: devices that disagree would take different branches around its "
          f"collectives and hang. {instead}")
    frame = frame.f_back


def _bound_size(name: str, owner: str) -> int:
  try:
    return jax.lax.axis_size(name)
  except NameError as error:
    raise NameError(
        f"{owner}: axis_name {name!r} is not bound ({error}): call it inside "
        f"jax.pmap(..., axis_name={name!r}) or a jax.shard_map over a mesh with that axis."
    ) from error
