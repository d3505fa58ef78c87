"""Whether a transform's averaged axes are axes it can average over where it runs.

A transform that averages over ``axis_name`` runs where that axis is mapped:
``jax.pmap``, or a ``jax.shard_map`` manual over it. On a mesh, an axis that
is not manual there is one of two mistakes, each worth its own message rather
than JAX's "unbound axis name": an axis the mesh lacks (a misspelt or other
mesh's name), or an axis the leaves themselves are laid out over. The latter
is FSDP's layout: each device holds a piece of the parameter, not a gradient
of its own, and the piece is gathered before use and its gradient
reduce-scattered, which :func:`~qsgd_jax.fsdp_gather` does.
"""

import jax

from qsgd_jax._src import axes, shards


def check_mesh_axes(tree, reduction_axes: axes.Axes, owner: str) -> None:
  """Raises where an axis of ``reduction_axes`` is not mapped here and the mesh says why.

  Outside a mesh (``jax.vmap``, a bare call) nothing is checked: the
  transform's own check of bound axes speaks.

  Args:
    tree: the leaves the transform averages (arrays, traced or not).
    reduction_axes: the transform's axes.
    owner: the transform, named in errors.

  Raises:
    ValueError: an axis the mesh lacks (naming ``axis_name``), or one a leaf
      is laid out over (naming the leaf).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return
  for name in reduction_axes.names:
    if _is_mapped(name):
      continue
    if name not in mesh.axis_names:
      raise ValueError(
          f"{owner}: axis_name {name!r} is not an axis of the mesh, whose axes are "
          f"{tuple(mesh.axis_names)}: pass the axis the gradients are averaged over (the one "
          "the batch is split over, e.g. 'data').")
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      spec = shards.spec_of(leaf)
      if name in jax.tree.leaves(tuple(spec)):  # Each entry's axes: None, a name or names.
        raise ValueError(
            f"{owner}: leaf {jax.tree_util.keystr(path) or '<root>'} is laid out over the axis "
            f"{name!r} (PartitionSpec{tuple(spec)}) that this transform averages over: each "
            "device holds a piece of that leaf, not a value of its own to average. That is "
            "FSDP's layout: gather the parameters with qsgd_jax.fsdp_gather (its gradient "
            "reduce-scatters the pieces), or lay the leaf out over the other mesh axes only. "
            f"(A leaf holding one copy a device along {name!r} is each device's own inside a "
            f"jax.shard_map manual over {name!r}: call the transform there.)")


def _is_mapped(name: str) -> bool:
  try:
    jax.lax.axis_size(name)
  except NameError:
    return False
  return True
