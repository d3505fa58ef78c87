"""Writes the small intersphinx inventories that ``docs/conf.py`` reads.

  python docs/inventories/make.py

Sphinx links a name such as ``jax.Array`` or ``optax.GradientTransformation`` to
another project's page through that project's ``objects.inv``, which it
downloads when it builds. The docs are built where only package registries
are reachable, so each inventory here holds only the names these docs
reference, each with the address of its page on the project's published
site, in the format Sphinx writes (version 2: a header, then zlib-compressed
lines ``name domain:role priority uri display-name``). The pages follow each
site's layout as its documentation sources lay it out: JAX's
``_autosummary/NAME.html`` and ``jax.sharding.html``; optax's ``api/*.html``
pages by topic (``docs/api/*.rst`` in its repository); Flax's
``api_reference/...``. A page that moves is a broken link on the site, not a
failed build. A build that references a name missing here fails
(``nitpicky``): add the name and its page below, and run this file again.
"""

import pathlib
import zlib

# project: (title, version, {name: (role, page)}); the anchor is the name itself.
INVENTORIES = {
    "python": ("Python", "3", {
        "ValueError": ("py:exception", "library/exceptions.html"),
        "TypeError": ("py:exception", "library/exceptions.html"),
        "NameError": ("py:exception", "library/exceptions.html"),
        "RuntimeError": ("py:exception", "library/exceptions.html"),
        "SystemExit": ("py:exception", "library/exceptions.html"),
    }),
    "numpy": ("NumPy", "2", {
        "numpy.ndarray": ("py:class", "reference/generated/numpy.ndarray.html"),
    }),
    "jax": ("JAX", "0.10", {
        "jax.jit": ("py:function", "_autosummary/jax.jit.html"),
        "jax.pmap": ("py:function", "_autosummary/jax.pmap.html"),
        "jax.vmap": ("py:function", "_autosummary/jax.vmap.html"),
        "jax.shard_map": ("py:function", "_autosummary/jax.shard_map.html"),
        "jax.make_mesh": ("py:function", "_autosummary/jax.make_mesh.html"),
        "jax.device_put": ("py:function", "_autosummary/jax.device_put.html"),
        "jax.block_until_ready": ("py:function", "_autosummary/jax.block_until_ready.html"),
        "jax.make_array_from_process_local_data": (
            "py:function", "_autosummary/jax.make_array_from_process_local_data.html"),
        "jax.Array": ("py:class", "_autosummary/jax.Array.html"),
        "jax.ShapeDtypeStruct": ("py:class", "_autosummary/jax.ShapeDtypeStruct.html"),
        "jax.lax.pmean": ("py:function", "_autosummary/jax.lax.pmean.html"),
        "jax.lax.psum": ("py:function", "_autosummary/jax.lax.psum.html"),
        "jax.lax.psum_scatter": ("py:function", "_autosummary/jax.lax.psum_scatter.html"),
        "jax.lax.all_gather": ("py:function", "_autosummary/jax.lax.all_gather.html"),
        "jax.distributed.initialize": (
            "py:function", "_autosummary/jax.distributed.initialize.html"),
        "jax.sharding.Mesh": ("py:class", "jax.sharding.html"),
        "jax.sharding.NamedSharding": ("py:class", "jax.sharding.html"),
        "jax.sharding.PartitionSpec": ("py:class", "jax.sharding.html"),
    }),
    "optax": ("Optax", "0.2", {
        "optax.GradientTransformation": ("py:class", "api/transformations.html"),
        "optax.GradientTransformationExtraArgs": ("py:class", "api/transformations.html"),
        "optax.clip_by_global_norm": ("py:function", "api/transformations.html"),
        "optax.add_decayed_weights": ("py:function", "api/transformations.html"),
        "optax.scale_by_learning_rate": ("py:function", "api/transformations.html"),
        "optax.apply_if_finite": ("py:function", "api/optimizer_wrappers.html"),
        "optax.MultiSteps": ("py:class", "api/optimizer_wrappers.html"),
        "optax.masked": ("py:function", "api/optimizer_wrappers.html"),
        "optax.adamw": ("py:function", "api/optimizers.html"),
        "optax.sgd": ("py:function", "api/optimizers.html"),
    }),
    "flax": ("Flax", "0.12", {
        "flax.nnx.Module": ("py:class", "api_reference/flax.nnx/module.html"),
        "flax.linen.Module": ("py:class", "api_reference/flax.linen/module.html"),
        "flax.training.train_state.TrainState": (
            "py:class", "api_reference/flax.training.html"),
    }),
}

_HEADER = "# Sphinx inventory version 2\n# Project: {}\n# Version: {}\n"
_NOTE = "# The remainder of this file is compressed using zlib.\n"


def write(directory: pathlib.Path) -> list[pathlib.Path]:
  """One ``NAME.inv`` a project in ``directory``; returns their paths."""
  paths = []
  for project, (title, version, names) in INVENTORIES.items():
    lines = []
    for name, (role, page) in sorted(names.items()):
      lines.append(f"{name} {role} 1 {page}#$ -\n")  # "$": the name is the anchor.
    path = directory / f"{project}.inv"
    path.write_bytes((_HEADER.format(title, version) + _NOTE).encode()
                     + zlib.compress("".join(lines).encode(), 9))
    paths.append(path)
  return paths


if __name__ == "__main__":
  for written in write(pathlib.Path(__file__).parent):
    print(f"wrote {written}")
