"""Verified checkpoints: damaged ones are reported and set aside, a good older one is used.

A small optimizer state is saved at steps 2, 4 and 6 (the latest two kept);
then the newest is truncated, has bytes flipped, loses its metadata, or lacks
its manifest (a crash between orbax's commit and the manifest), and the
resume must take step 4, or fail clearly when nothing is good. Last, a state
saved on 8 devices resumes on 4 and on 2.
"""

import functools
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qsgd_jax
from examples import checkpoints as checkpointing

AXIS = "batch"
_SETTINGS = {"compression": "onebit"}
_PARAMS = {"w": jnp.zeros((64, 128)), "b": jnp.zeros(100)}


def _loss(params, batch):
  return sum(jnp.mean((params[name] - batch[name]) ** 2) for name in params)


def _tx():
  return optax.chain(qsgd_jax.onebit_sgd(AXIS, error_feedback="both", min_compressed_size=0),
                     optax.sgd(0.1))


@functools.cache
def _program(count: int):
  mesh = jax.make_mesh((count,), (AXIS,), devices=jax.devices()[:count])
  return mesh, qsgd_jax.data_parallel(_loss, _tx(), mesh, AXIS)


def _batch(mesh, step):
  keys = jax.random.split(jax.random.key(step), 2)
  batch = {name: jax.random.normal(key, (mesh.size, *x.shape))
           for key, (name, x) in zip(keys, _PARAMS.items(), strict=True)}
  return jax.device_put(batch, NamedSharding(mesh, P(AXIS)))


def _train(directory: pathlib.Path, count: int = 8, steps: int = 6) -> dict[int, object]:
  """Trains ``steps`` steps on ``count`` devices, saving every 2; returns each step's state."""
  mesh, program = _program(count)
  params = jax.device_put(_PARAMS, NamedSharding(mesh, P()))
  state = {"params": params, "opt_state": program.init(params)}
  states = {}
  with checkpointing.VerifiedCheckpoints(directory, every_steps=2, keep=2, settings=_SETTINGS,
                                         num_devices=count) as checkpoints:
    for step in range(1, steps + 1):
      params, opt_state, _ = program.step(state["params"], state["opt_state"], _batch(mesh, step))
      state = {"params": params, "opt_state": opt_state}
      states[step] = jax.device_get(state)
      checkpoints.save(step, state)
  return states


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A directory with the checkpoints of steps 4 and 6, and every step's state."""
  directory = tmp_path_factory.mktemp("saved") / "checkpoints"
  return directory, _train(directory)


def _resume(directory, count=8):
  mesh, program = _program(count)
  params = jax.device_put(_PARAMS, NamedSharding(mesh, P()))
  fresh = {"params": params, "opt_state": program.init(params)}
  with checkpointing.VerifiedCheckpoints(directory, every_steps=2, keep=2, settings=_SETTINGS,
                                         num_devices=count) as checkpoints:
    return checkpointing.resume(checkpoints, fresh, stacked=False)


def _assert_state_equal(got, expected):
  got, expected = jax.device_get(got), expected
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
    if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
      a, b = jax.random.key_data(a), jax.random.key_data(b)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _largest_file(step_dir: pathlib.Path) -> pathlib.Path:
  return max((p for p in step_dir.rglob("*") if p.is_file() and p.name != "checksums.json"),
             key=lambda p: p.stat().st_size)


def _truncate(step_dir):
  data = _largest_file(step_dir)
  data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def _flip(step_dir):
  data = _largest_file(step_dir)
  content = bytearray(data.read_bytes())
  middle = len(content) // 2
  content[middle:middle + 64] = bytes(b ^ 0xFF for b in content[middle:middle + 64])
  data.write_bytes(bytes(content))


def _delete_metadata(step_dir):
  (step_dir / "default" / "_METADATA").unlink()


def _crash_before_the_manifest(step_dir):
  (step_dir / "checksums.json").unlink()


@pytest.mark.parametrize("damage", [_truncate, _flip, _delete_metadata,
                                    _crash_before_the_manifest],
                         ids=["truncated", "flipped", "metadata_deleted", "no_manifest"])
def test_a_damaged_newest_checkpoint_is_reported_set_aside_and_the_one_before_used(
    saved, tmp_path, damage, caplog):
  source, states = saved
  directory = tmp_path / "checkpoints"
  shutil.copytree(source, directory)
  damage(directory / "6")
  state, step = _resume(directory)
  assert step == 4
  _assert_state_equal(state, states[4])
  assert not (directory / "6").exists() and (tmp_path / "invalid_checkpoints" / "6").is_dir()
  reports = [r.getMessage() for r in caplog.records if "fails verification" in r.getMessage()]
  assert len(reports) == 1 and "step 6" in reports[0] and "\n" not in reports[0]


def test_intact_checkpoints_and_unfinished_saves(saved, tmp_path):
  source, states = saved
  directory = tmp_path / "checkpoints"
  shutil.copytree(source, directory)
  # A save cut short inside orbax leaves only its temporary directory: never listed.
  shutil.copytree(directory / "6", directory / "8.orbax-checkpoint-tmp-1234567")
  state, step = _resume(directory)
  assert step == 6
  _assert_state_equal(state, states[6])
  assert checkpointing.verify(directory / "6") is None
  assert json.loads((directory / "6" / "checksums.json").read_text())["layout"] == {
      "num_devices": 8, "settings": _SETTINGS}


def test_no_good_checkpoint_is_a_clear_error_and_none_is_a_fresh_start(saved, tmp_path):
  source, _ = saved
  directory = tmp_path / "checkpoints"
  shutil.copytree(source, directory)
  _flip(directory / "6")
  _truncate(directory / "4")
  with pytest.raises(checkpointing.CheckpointError) as raised:
    _resume(directory)
  message = str(raised.value)
  assert "\n" not in message
  assert "No checkpoint in" in message and "step 6:" in message and "step 4:" in message
  assert "move the directory away to start afresh" in message
  with pytest.raises(checkpointing.CheckpointError):  # Nothing was moved: the next start too.
    _resume(directory)
  empty = tmp_path / "empty"
  fresh, step = _resume(empty)
  assert step == 0 and not np.asarray(fresh["opt_state"][0].count)


def test_other_settings_are_refused_naming_them(saved, tmp_path):
  source, _ = saved
  directory = tmp_path / "checkpoints"
  shutil.copytree(source, directory)
  mesh, program = _program(8)
  params = jax.device_put(_PARAMS, NamedSharding(mesh, P()))
  with checkpointing.VerifiedCheckpoints(directory, every_steps=2, keep=2,
                                         settings={"compression": "qsgd4"}) as checkpoints:
    with pytest.raises(checkpointing.CheckpointError,
                       match="saved with compression='onebit'; this run has compression='qsgd4'"):
      checkpointing.resume(checkpoints, {"params": params, "opt_state": program.init(params)},
                           stacked=False)


# Resuming on 2 devices averages the residuals of groups of 4 as resuming on 4 does of pairs.
@pytest.mark.parametrize("count", [4, pytest.param(2, marks=pytest.mark.slow)])
def test_saved_on_8_devices_resumes_on_fewer_and_trains(saved, tmp_path, count):
  source, states = saved
  directory = tmp_path / "checkpoints"
  shutil.copytree(source, directory)
  state, step = _resume(directory, count)
  assert step == 6
  _assert_state_equal(state["params"], states[6]["params"])
  local = np.asarray(state["opt_state"][0].local_error[0]).reshape(count, -1)
  saved_local = np.asarray(states[6]["opt_state"][0].local_error[0]).reshape(8, -1)
  np.testing.assert_allclose(local, np.broadcast_to(saved_local.mean(0), local.shape),
                             rtol=1e-6, atol=1e-7)
  mesh, program = _program(count)
  params, opt_state, loss = program.step(state["params"], state["opt_state"], _batch(mesh, 7))
  assert np.isfinite(float(loss)) and int(opt_state[0].count) == 7
