"""The model's layout over the mesh axes other than the data axes, for a training step.

On a mesh such as Flax ``lm1b``'s ``('data', 'fsdp', 'tensor')`` the model is
sharded over the fast axes inside each data group, and data parallel runs
over the slow ``data`` axis. These helpers read the parameters' layout over
the *model axes* (every mesh axis but the data ones), run an optimizer's
``init`` and ``update`` with those axes explicit (so that each transform sees,
in the leaves' types, which shard of each leaf is a device's own), and lay
the optimizer's state out over the whole mesh.
"""

from collections.abc import Callable, Sequence

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


def model_axes(mesh: jax.sharding.Mesh, data_axes: Sequence[str]) -> tuple[str, ...]:
  """The mesh's axes other than ``data_axes``, in the mesh's order."""
  return tuple(name for name in mesh.axis_names if name not in data_axes)


def param_specs(params, mesh: jax.sharding.Mesh, data_axes: Sequence[str], owner: str, *,
                stacked: bool = False):
  """Each leaf's ``PartitionSpec`` over the model axes, one entry a dimension of one copy.

  Read from the leaves' shardings: arrays, or ``jax.ShapeDtypeStruct`` with a
  ``sharding``, laid out by a ``NamedSharding`` over ``mesh``'s axes (as Flax
  linen's ``nn.logical_to_mesh_sharding`` or NNX's ``nnx.get_named_sharding``
  give them); a leaf with no such sharding (a numpy array) is whole on every
  device. With ``stacked``, each leaf holds a copy a data group along its
  first dimension (a local-update optimizer's params), laid out over the data
  axes there.

  Raises:
    ValueError: a leaf is laid out over a data axis (each data group holds
      the whole model: that is FSDP's layout), or over an axis ``mesh`` lacks.
  """

  def spec(path, leaf):
    sharding = getattr(leaf, "sharding", None)
    entries = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    entries += (None,) * (len(jax.numpy.shape(leaf)) - len(entries))
    if stacked:  # The copies' dimension, over the data axes; the rest is one copy's.
      entries = entries[1:]
    for entry in entries:
      for name in () if entry is None else (entry if isinstance(entry, tuple) else (entry,)):
        if name in data_axes:
          raise ValueError(
              f"{owner}: params leaf {jax.tree_util.keystr(path) or '<root>'} is laid out "
              f"over the data axis {name!r} (PartitionSpec{entries}): every data group holds "
              "the whole model, sharded over the other axes only. To shard parameters over "
              "the axis the gradients are averaged over, use qsgd_jax.fsdp_gather.")
        if name not in mesh.axis_names:
          raise ValueError(
              f"{owner}: params leaf {jax.tree_util.keystr(path) or '<root>'} is laid out "
              f"over the axis {name!r}, which the mesh (axes {tuple(mesh.axis_names)}) "
              "lacks. Lay the params out over this mesh.")
    return _canonical(entries)

  return jax.tree_util.tree_map_with_path(spec, params)


def with_model_axes(fn: Callable, axes: tuple[str, ...], in_specs) -> Callable:
  """``fn`` run with the model ``axes`` explicit, its arguments laid out by ``in_specs``
  (``jax.sharding.explicit_axes``): the leaves' types then say each one's layout."""
  if not axes:
    return fn
  return jax.sharding.explicit_axes(fn, axes=axes, in_sharding=in_specs)


def explicit_specs(tree):
  """Each array's ``PartitionSpec`` over the explicit mesh axes, from its type (one
  ``P()`` entry-less spec where it has none)."""

  def spec(leaf):
    sharding = getattr(jax.typeof(leaf), "sharding", None)
    return _canonical(tuple(getattr(sharding, "spec", ()) or ()))

  return jax.tree.map(spec, tree)


def full_specs(data_specs, model_specs):
  """The specs over the whole mesh of leaves laid out by ``data_specs`` over the data axes
  (``P()``, or the data axes along the first dimension) and ``model_specs`` over the
  model axes: a per-device leaf's first dimension split over the data axes, then the
  model axes its first dimension is split over."""

  def combine(data, model):
    if data == P():
      return model
    (data_first,) = tuple(data)
    first = model[0] if len(model) else None
    joined = _names(data_first) + _names(first)
    return P(joined if len(joined) > 1 else joined[0], *model[1:])

  return jax.tree.map(combine, data_specs, model_specs, is_leaf=lambda x: isinstance(x, P))


def auto_model_axes(fn: Callable, mesh: jax.sharding.Mesh, axes: tuple[str, ...],
                    out_specs) -> Callable:
  """``fn`` run with those of the model ``axes`` that ``mesh`` makes explicit turned
  automatic (``jax.sharding.auto_axes``), its outputs laid out by ``out_specs``.

  A ``jax.shard_map`` manual over the data axes alone all-gathers every leaf
  over the *explicit* axes it leaves to the compiler, on the way in and on
  the way out; over automatic ones it keeps each leaf's layout.
  """
  explicit = tuple(name for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
                   if name in axes and kind == AxisType.Explicit)
  if not explicit:
    return fn
  return jax.sharding.auto_axes(fn, axes=explicit, out_sharding=out_specs)


def _canonical(entries: tuple) -> P:
  """The spec of ``entries`` without trailing whole dimensions, as one writes it: ``P()``
  for ``P(None)``."""
  while entries and entries[-1] is None:
    entries = entries[:-1]
  return P(*entries)


def _names(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)
