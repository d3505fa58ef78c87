"""Orbax checkpoints that a run verifies before it resumes from them.

Orbax writes a checkpoint into a temporary directory and renames it when
every process has written its part, so a save cut short is never listed.
What it does not do is check the bytes it reads back: its zarr3 shard indexes
carry a CRC32C, the arrays' chunks none, so a flipped byte in an
error-feedback residual came back as 3.3e38 and training went on to NaN.

So each checkpoint gets a manifest, ``checksums.json`` in its step directory:
the size and SHA-256 of every file the save wrote, written by process 0 after
orbax has committed the save, atomically (a temporary file, fsynced, renamed).
A checkpoint without one (the process died between orbax's commit and the
manifest), or whose files differ from it (truncated, flipped, deleted), fails
verification. On resume the newest checkpoint that passes is used; each newer
one that fails is reported in one line and moved to ``invalid_checkpoints/``
beside the checkpoints (kept for inspection, out of orbax's way). If none
passes, nothing is moved and the run stops with a :class:`CheckpointError`,
at every start, rather than start afresh over them.

The manifest also holds the state's layout: the device count, and the
settings that shape the state (parallelism, compression). :func:`resume`
restores the newest good checkpoint; saved on another device count, it is
read as saved and laid out for this one by :func:`qsgd_jax.resize_state`.
Both examples use this module: it depends on orbax, as they do; the library
does not.
"""

import hashlib
import json
import os
import pathlib
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import qsgd_jax

MANIFEST = "checksums.json"
INVALID = "invalid_checkpoints"
_CHUNK = 1 << 22


class CheckpointError(RuntimeError):
  """The run cannot resume from its checkpoints; the message is one line: why, and what to do."""


def write_manifest(step_dir: pathlib.Path, layout: dict[str, Any]) -> None:
  """Writes ``step_dir/checksums.json``: every file's size and SHA-256, and ``layout``."""
  files = {str(path.relative_to(step_dir)): _checksum(path)
           for path in sorted(step_dir.rglob("*")) if path.is_file() and path.name != MANIFEST}
  temporary = step_dir / f"{MANIFEST}.tmp"
  with open(temporary, "w") as stream:
    json.dump({"files": files, "layout": layout}, stream, indent=1)
    stream.flush()
    os.fsync(stream.fileno())
  os.replace(temporary, step_dir / MANIFEST)
  directory = os.open(step_dir, os.O_RDONLY)
  try:
    os.fsync(directory)
  finally:
    os.close(directory)


def verify(step_dir: pathlib.Path) -> str | None:
  """Why the checkpoint in ``step_dir`` cannot be trusted, or ``None`` if it passes."""
  manifest = step_dir / MANIFEST
  if not manifest.is_file():
    return f"no {MANIFEST}: its save did not complete"
  try:
    files = json.loads(manifest.read_text())["files"]
  except (ValueError, KeyError, TypeError):
    return f"its {MANIFEST} is unreadable"
  for name, expected in files.items():
    path = step_dir / name
    if not path.is_file():
      return f"{name} is missing"
    if path.stat().st_size != expected["bytes"]:
      return f"{name} has {path.stat().st_size} bytes, its save wrote {expected['bytes']}"
    if _checksum(path) != expected:
      return f"{name} does not match its SHA-256"
  return None


def layout(step_dir: pathlib.Path) -> dict[str, Any]:
  """What the run that saved ``step_dir`` wrote about its state's layout."""
  return json.loads((step_dir / MANIFEST).read_text())["layout"]


def _checksum(path: pathlib.Path) -> dict[str, Any]:
  digest = hashlib.sha256()
  with open(path, "rb") as stream:
    while chunk := stream.read(_CHUNK):
      digest.update(chunk)
  return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


class VerifiedCheckpoints:
  """An orbax ``CheckpointManager`` whose checkpoints carry a manifest, checked on resume.

  Use it in a ``with`` statement, as the manager: leaving it waits for saves.

  Args:
    directory: where the step directories go.
    every_steps: save every this many steps (and when forced).
    keep: how many of the newest checkpoints to keep.
    settings: what shapes the state besides the device count (parallelism,
      compression, ...); a checkpoint saved with other settings is refused.
    num_devices: the devices the state is laid out over (by default, all).
  """

  def __init__(self, directory: pathlib.Path, every_steps: int, keep: int,
               settings: dict[str, Any], num_devices: int | None = None):
    self.directory = pathlib.Path(directory).absolute()
    self.layout = {"num_devices": num_devices or jax.device_count(), "settings": dict(settings)}
    self._manager = ocp.CheckpointManager(
        self.directory,
        # Named, so that a fresh manager can read a checkpoint's metadata before restoring it.
        item_handlers=ocp.StandardCheckpointHandler(),
        options=ocp.CheckpointManagerOptions(
            save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(every_steps),
            preservation_policy=ocp.checkpoint_managers.LatestN(keep),
        ),
    )

  def __enter__(self) -> "VerifiedCheckpoints":
    return self

  def __exit__(self, *exc_info) -> None:
    self._manager.close()

  def should_save(self, step: int) -> bool:
    return self._manager.should_save(step)

  def save(self, step: int, state, force: bool = False) -> bool:
    """Saves ``state`` if the policy (or ``force``) says so; then writes its manifest.

    The save is waited for: the manifest must describe what orbax committed.
    """
    if not self._manager.save(step, args=ocp.args.StandardSave(state), force=force):
      return False
    self._manager.wait_until_finished()
    if jax.process_index() == 0:
      write_manifest(self.directory / str(step), self.layout)
    return True

  def latest_valid_step(self) -> int | None:
    """The newest step whose checkpoint passes :func:`verify`; ``None`` if there are none.

    Process 0 verifies and sets failing checkpoints aside; every process gets
    its answer.

    Raises:
      CheckpointError: there are checkpoints, and none passes.
    """
    steps = sorted(self._manager.all_steps(), reverse=True)
    if not steps:
      return None
    chosen, failures = -1, {}
    if jax.process_index() == 0:
      for step in steps:
        failures[step] = verify(self.directory / str(step))
        if failures[step] is None:
          del failures[step]
          chosen = step
          break
      if chosen >= 0:  # Out of orbax's way: the run will save those steps again.
        for step, reason in failures.items():
          logging.warning("Checkpoint of step %d fails verification (%s): moved to %s.", step,
                          reason, self._set_aside(step))
    if jax.process_count() > 1:
      chosen = int(multihost_utils.broadcast_one_to_all(np.int32(chosen)))
      multihost_utils.sync_global_devices("qsgd_jax examples: checkpoints verified")
    self._manager.reload()
    if chosen < 0:  # Left where they are: every start fails the same way until someone looks.
      reasons = "; ".join(f"step {step}: {reason}" for step, reason in failures.items())
      raise CheckpointError(
          f"No checkpoint in {self.directory} passes verification ({reasons or 'see process 0'}"
          f"). Restore good copies, or move the directory away to start afresh.")
    return chosen

  def layout_of(self, step: int) -> dict[str, Any]:
    return layout(self.directory / str(step))

  def restore(self, step: int, target):
    """The state saved at ``step``, laid out as ``target``'s arrays (shapes and shardings)."""
    return self._manager.restore(step, args=ocp.args.StandardRestore(target))

  def saved_shapes(self, step: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Each saved array's shape and dtype, by its path joined with dots ("opt_state.0.count")."""
    flat = jax.tree_util.tree_flatten_with_path(self._manager.item_metadata(step))[0]
    return {dotted(path): (tuple(leaf.shape), np.dtype(leaf.dtype)) for path, leaf in flat}

  def _set_aside(self, step: int) -> pathlib.Path:
    invalid = self.directory.parent / INVALID
    invalid.mkdir(exist_ok=True)
    destination, copies = invalid / str(step), 0
    while destination.exists():
      copies += 1
      destination = invalid / f"{step}.{copies}"
    shutil.move(self.directory / str(step), destination)
    return destination


def dotted(path) -> str:
  """A tree path as orbax names its arrays: the keys joined with dots."""
  names = []
  for entry in path:
    for attribute in ("name", "key", "idx"):
      if hasattr(entry, attribute):
        names.append(str(getattr(entry, attribute)))
        break
  return ".".join(names)


def resume(checkpoints: VerifiedCheckpoints | None, state, *, stacked: bool,
           drop_residuals: bool = False):
  """The newest good checkpoint's state and step, or ``(state, 0)`` without one.

  Args:
    checkpoints: the run's checkpoints, or ``None`` when they are off.
    state: the freshly initialized state: its arrays' shapes, dtypes and
      shardings are the target, so each comes back laid out as training lays
      it out.
    stacked: the state's per-device leaves carry a leading device axis (pmap's
      layout), as :func:`qsgd_jax.resize_state` takes it.
    drop_residuals: on another device count, start error-feedback residuals
      at zero instead of redistributing them.

  Raises:
    CheckpointError: no checkpoint passes verification, or the newest good
      one was saved with other settings.
  """
  step = checkpoints.latest_valid_step() if checkpoints is not None else None
  if step is None:
    return state, 0
  saved, now = checkpoints.layout_of(step), checkpoints.layout
  if saved["settings"] != now["settings"]:
    differs = {k: (saved["settings"].get(k), v) for k, v in now["settings"].items()
               if saved["settings"].get(k) != v}
    raise CheckpointError(
        f"The checkpoint of step {step} in {checkpoints.directory} was saved with "
        + ", ".join(f"{k}={old!r}" for k, (old, _) in differs.items()) + "; this run has "
        + ", ".join(f"{k}={new!r}" for k, (_, new) in differs.items())
        + ": resume with its settings (only the device count may change), or use another "
        "workdir.")
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state)
  if saved["num_devices"] == now["num_devices"]:
    return checkpoints.restore(step, target), step
  logging.warning(
      "Resuming the checkpoint of step %d, saved on %d devices, on %d: per-device state %s "
      "(qsgd_jax.resize_state).", step, saved["num_devices"], now["num_devices"],
      "redistributed, error-feedback residuals dropped" if drop_residuals else "redistributed")
  as_saved = _restore_as_saved(checkpoints, step, target)
  try:
    resized = qsgd_jax.resize_state(as_saved, target, from_devices=saved["num_devices"],
                                    to_devices=now["num_devices"], stacked=stacked,
                                    drop=drop_residuals)
  except ValueError as error:
    raise CheckpointError(f"{error} (checkpoint of step {step} in {checkpoints.directory})") \
        from None
  return jax.tree.map(_place, resized, target), step


def _restore_as_saved(checkpoints: VerifiedCheckpoints, step: int, target):
  """The checkpoint's arrays with their saved shapes, on the host (every process reads all)."""
  shapes = checkpoints.saved_shapes(step)
  everywhere = NamedSharding(Mesh(np.array(jax.devices()), ("devices",)), P())

  def as_saved(path, leaf):
    shape, dtype = shapes[dotted(path)]
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):  # Orbax lists a key by its data.
      key_dims = len(jax.eval_shape(jax.random.key_data, leaf).shape) - len(leaf.shape)
      shape, dtype = shape[:len(shape) - key_dims], leaf.dtype
    return jax.ShapeDtypeStruct(shape, dtype, sharding=everywhere)

  restored = checkpoints.restore(step, jax.tree_util.tree_map_with_path(as_saved, target))
  return jax.tree.map(_host_copy, restored)


def _host_copy(x):
  """One process's copy of a replicated array, as NumPy (a PRNG key as a key array)."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    data = np.asarray(jax.random.key_data(x).addressable_data(0))
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
  return np.asarray(x.addressable_data(0))


def _place(value, like: jax.ShapeDtypeStruct):
  """A host array onto the devices of ``like``'s sharding, each process its own shards."""
  if jnp.issubdtype(like.dtype, jax.dtypes.prng_key):
    data = np.asarray(jax.random.key_data(value))
    placed = jax.make_array_from_callback(data.shape, like.sharding, lambda index: data[index])
    return jax.random.wrap_key_data(placed, impl=jax.random.key_impl(value))
  value = np.asarray(value)
  return jax.make_array_from_callback(value.shape, like.sharding, lambda index: value[index])
