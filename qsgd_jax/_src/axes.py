"""Mapped axis names, normalized once for every collective and transform.

A reduction runs over one mapped axis (``"batch"``) or over several,
``("node", "local")``: the first, *outer*, axis is the slow link that the
quantized collectives cross; the others, *inner*, are fast links reduced in
full precision first. :func:`parse` turns what a user passes into an
:class:`Axes`, and everything else in the library reads names and sizes from
it.
"""

import dataclasses
import math

import jax

AxisName = str | tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Axes:
  """The axes of one reduction.

  Attributes:
    outer: the axis the quantized collectives run over.
    inner: axes reduced in full precision before and after them; empty for
      a single axis.
  """

  outer: str
  inner: tuple[str, ...] = ()

  @property
  def names(self) -> tuple[str, ...]:
    """Every axis, outer first."""
    return (self.outer, *self.inner)

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

  def size(self, owner: str) -> int:
    """Devices taking part in the whole reduction: the product of the axes' sizes."""
    return math.prod(self.sizes(owner))


def parse(axis_name: AxisName, owner: str) -> Axes:
  """The :class:`Axes` of a user's ``axis_name``.

  Args:
    axis_name: a mapped axis name, or a non-empty tuple (or list) of names,
      outer first.
    owner: the caller, named in errors.

  Raises:
    TypeError: ``axis_name`` is not a name or a sequence of names.
    ValueError: it is an empty sequence.
  """
  names = tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)
  if not names:
    raise ValueError(f"{owner}: axis_name must name at least one axis, got {axis_name!r}.")
  for name in names:
    if not isinstance(name, str):
      raise TypeError(
          f"{owner}: axis_name must be a mapped axis name (str) or a tuple of them, "
          f"got {axis_name!r}."
      )
  return Axes(outer=names[0], inner=names[1:])


def as_varying(tree, axis_name: AxisName):
  """``tree`` with every leaf typed as varying over ``axis_name``: each device's own copy.

  Under ``jax.shard_map`` a value is either replicated over an axis (the same
  on every device) or varying. Differentiating a loss with respect to
  replicated parameters makes autodiff sum the gradient over the axis, in
  float32, before any optimizer sees it; with respect to varying copies it
  gives each device its own gradient, which a quantized reduction then
  averages. Leaves already varying are left alone; under ``jax.pmap`` this
  changes nothing.

  Args:
    tree: a pytree of arrays, inside ``jax.shard_map`` or ``jax.pmap``.
    axis_name: a mapped axis name, or a tuple of names.

  Returns:
    ``tree``, each leaf cast with ``jax.lax.pcast(..., to="varying")`` over
    the axes it does not vary over yet.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("batch",))
    >>> def local_grad(w, x):
    ...   return jax.grad(lambda w: jnp.sum(w * x))(qsgd_jax.as_varying(w, "batch"))
    >>> jax.shard_map(local_grad, mesh=mesh, in_specs=(P(), P("batch")),
    ...               out_specs=P("batch"))(jnp.ones(2), jnp.arange(2.0))
    Array([0., 1.], dtype=float32)
  """
  names = parse(axis_name, "as_varying").names

  def cast(x):
    manual = jax.typeof(x).manual_axis_type
    missing = tuple(name for name in names if manual is None or name not in manual.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, tree)


def _bound_size(name: str, owner: str) -> int:
  try:
    return jax.lax.axis_size(name)
  except NameError as error:
    raise NameError(
        f"{owner}: axis_name {name!r} is not bound ({error}): call it inside "
        f"jax.pmap(..., axis_name={name!r}) or a jax.shard_map over a mesh with that axis."
    ) from error
