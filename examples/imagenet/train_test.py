"""Tests of the ImageNet example: a few steps of every compression mode, and a whole run."""

import json
import math
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from examples.imagenet import input_pipeline, train
from examples.imagenet.configs import smoke

REQUIRED_SUMMARY_KEYS = (
    "steps", "final_train_loss", "eval_accuracy", "wire_bytes_per_step",
    "fp32_wire_bytes_per_step", "compression_ratio", "hlo_wire_bytes_per_step",
    "hlo_wire_bytes_least", "hlo_wire_bytes_most",
)
REQUIRED_METRICS = ("loss", "accuracy", "steps_per_second", "wire_bytes", "compression_ratio")


def _fake_data_config(compression: str, parallelism: str):
  """ResNet-1 on fake 8x8 images: only the 1000-way head is large enough to compress."""
  config = smoke.get_config()
  config.dataset = "fake"
  config.image_size = 8
  config.batch_size = 16
  config.min_compressed_size = 4096
  config.compression = compression
  config.parallelism = parallelism
  config.powersgd_start_iter = 2
  config.powersgd_rank = 1  # The head's kernel is (8, 1000): rank 4 would not halve it.
  return config


def _device_copies(tree) -> list[list[np.ndarray]]:
  """For each leaf, what every device holds of it."""
  return [[np.asarray(shard.data) for shard in leaf.addressable_shards]
          for leaf in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def initial_variables():
  """``(params, batch_stats)`` of ResNet-1 on fake data, the same for every mode."""
  config = _fake_data_config("fp32", "pmap")
  info = input_pipeline.dataset_info(config)
  model = train.create_model(config, info.num_classes)
  return train.initialized(jax.random.key(0), info.image_shape, model)


# Every mode under shard_map; under pmap and under the jit step (qsgd_jax.data_parallel)
# one mode of each kind of state: none, error feedback, and (pmap) a model per device, which
# jit does not support.
_STEP_CASES = ([(compression, "shard_map") for compression in train.COMPRESSIONS]
               + [(compression, "pmap") for compression in ("qsgd4", "onebit", "decentralized8")]
               + [("qsgd4", "jit"), ("onebit", "jit")])


@pytest.mark.slow
@pytest.mark.parametrize("compression, parallelism", _STEP_CASES)
def test_train_steps(compression, parallelism, initial_variables):
  config = _fake_data_config(compression, parallelism)
  model = train.create_model(config, input_pipeline.dataset_info(config).num_classes)
  learning_rate_fn = train.create_learning_rate_fn(config, steps_per_epoch=10, num_steps=10)
  tx = train.create_optimizer(config, learning_rate_fn)
  mapped, state = train.parallelize(config, model, tx, learning_rate_fn, *initial_variables)

  batches = input_pipeline.train_batches(config)
  # PowerSGD's first config.powersgd_start_iter = 2 steps are exact means.
  for _ in range(3 if compression == "powersgd" else 2):
    state, metrics = mapped.train_step(state, mapped.put_batch(next(batches)))
    jax.block_until_ready((state, metrics))

  assert math.isfinite(train._scalar(metrics["loss"]))
  copies = _device_copies(state.params)
  assert all(len(leaf) == jax.device_count() for leaf in copies)
  identical = [all(np.array_equal(leaf[0], other) for other in leaf[1:]) for leaf in copies]
  if compression == "decentralized8":  # Every device keeps its own model.
    assert not all(identical)
  else:
    assert all(identical)
    wire, fp32 = train._scalar(metrics["wire_bytes"]), train._scalar(metrics["fp32_wire_bytes"])
    if compression == "fp32":
      assert wire == pytest.approx(fp32, rel=1e-3)
    else:
      assert wire < fp32


@pytest.mark.slow
def test_train_and_evaluate_writes_metrics_and_summary(tmp_path):
  summary = train.train_and_evaluate(smoke.get_config(), str(tmp_path))

  written = json.loads((tmp_path / "summary.json").read_text())
  assert written == summary
  for key in REQUIRED_SUMMARY_KEYS:
    assert key in written, key
  assert written["steps"] == smoke.get_config().num_train_steps
  assert math.isfinite(written["final_train_loss"])
  assert 0.0 <= written["eval_accuracy"] <= 1.0
  assert written["wire_bytes_per_step"] < written["fp32_wire_bytes_per_step"]
  assert (0 < written["hlo_wire_bytes_least"] <= written["hlo_wire_bytes_most"]
          <= written["hlo_wire_bytes_per_step"])

  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
  train_records = [r for r in records if "loss" in r]
  assert [r["step"] for r in train_records] == list(range(1, written["steps"] + 1))
  for key in REQUIRED_METRICS:
    assert all(key in r for r in train_records), key
  assert any("eval_accuracy" in r for r in records)


def test_jit_with_a_model_per_device_is_a_config_error(tmp_path):
  with pytest.raises(ValueError, match="'decentralized8' keeps one model per device"):
    train.train_and_evaluate(_fake_data_config("decentralized8", "jit"), str(tmp_path))


def _checkpoint(workdir, step):
  """The saved state as a tree of numpy arrays (PRNG keys as their data)."""
  with ocp.CheckpointManager((workdir / "checkpoints").absolute()) as checkpoints:
    saved = checkpoints.restore(step, args=ocp.args.StandardRestore())
  return jax.tree.map(
      lambda x: np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
          x.dtype, jax.dtypes.prng_key) else x), saved)


_TIMINGS = ("steps_per_second", "train_seconds", "wall_seconds")


def _records_without_timings(workdir):
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").open()]
  return [{key: value for key, value in record.items() if key not in _TIMINGS}
          for record in records]


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", train.PARALLELISMS)
def test_a_resumed_run_equals_an_uninterrupted_run(parallelism, tmp_path):
  config = _fake_data_config("onebit", parallelism)  # Error feedback: residuals in the state.
  config.num_train_steps = 6
  config.checkpoint_every_steps = 4
  config.log_every_steps = 2
  config.eval_every_steps = 6
  config.steps_per_eval = 1
  uninterrupted, interrupted = tmp_path / "uninterrupted", tmp_path / "interrupted"
  train.train_and_evaluate(config, str(uninterrupted))

  # A run stopped after step 6 has the checkpoints of steps 4 and 6 and the metrics of steps 1
  # to 6; then the checkpoint of step 6 is damaged (64 bytes flipped in its largest file).
  for step in (4, 6):
    shutil.copytree(uninterrupted / "checkpoints" / str(step),
                    interrupted / "checkpoints" / str(step))
  data = max((p for p in (interrupted / "checkpoints" / "6").rglob("*") if p.is_file()),
             key=lambda p: p.stat().st_size)
  content = bytearray(data.read_bytes())
  content[100:164] = bytes(b ^ 0xFF for b in content[100:164])
  data.write_bytes(bytes(content))
  records = (uninterrupted / "metrics.jsonl").read_text().splitlines()
  (interrupted / "metrics.jsonl").write_text(
      "".join(line + "\n" for line in records if json.loads(line)["step"] <= 6))
  summary = train.train_and_evaluate(config, str(interrupted))

  assert summary["first_step"] == 4  # Step 6 failed verification and was set aside.
  assert (interrupted / "invalid_checkpoints" / "6").is_dir()
  final = _checkpoint(uninterrupted, 6)
  resumed = _checkpoint(interrupted, 6)
  assert jax.tree.structure(resumed) == jax.tree.structure(final)
  for got, expected in zip(jax.tree.leaves(resumed), jax.tree.leaves(final), strict=True):
    np.testing.assert_array_equal(got, expected)
  assert np.asarray(final["opt_state"][0]["local_error"][0]).any()  # The residuals came back.
  assert _records_without_timings(interrupted) == _records_without_timings(uninterrupted)


def _poisoned_at(step: int, monkeypatch):
  """Makes the batch of training step ``step`` (from 1) all NaN images."""
  batches = input_pipeline.train_batches

  def poisoned(config, start_step=0):
    for index, batch in enumerate(batches(config, start_step), start=start_step + 1):
      if index == step:
        batch = dict(batch, image=np.full_like(batch["image"], np.nan))
      yield batch

  monkeypatch.setattr(input_pipeline, "train_batches", poisoned)


def _nonfinite_config():
  config = _fake_data_config("qsgd4", "shard_map")
  config.num_train_steps = 4
  config.checkpoint_every_steps = 2
  config.log_every_steps = 4
  config.eval_every_steps = 4
  config.steps_per_eval = 1
  return config


@pytest.mark.slow
def test_a_nonfinite_loss_stops_the_run_at_its_step_before_a_checkpoint_holds_it(
    tmp_path, monkeypatch):
  _poisoned_at(3, monkeypatch)
  with pytest.raises(train.NonFiniteLossError, match=r"Non-finite training loss \(nan\) at "
                     r"step 3: stopping.*config.skip_nonfinite_steps") as raised:
    train.train_and_evaluate(_nonfinite_config(), str(tmp_path))
  assert "\n" not in str(raised.value)
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2"]


@pytest.mark.slow
def test_a_skipped_nonfinite_step_leaves_params_and_batch_statistics_as_they_were(
    tmp_path, monkeypatch):
  _poisoned_at(3, monkeypatch)
  config = _nonfinite_config()
  config.skip_nonfinite_steps = 1
  summary = train.train_and_evaluate(config, str(tmp_path))
  assert summary["skipped_nonfinite_steps"] == 1
  final = _checkpoint(tmp_path, 4)
  for leaf in jax.tree.leaves((final["params"], final["batch_stats"])):
    assert np.isfinite(leaf).all()


@pytest.mark.parametrize("dataset", ["digits", "fake"])
def test_train_batches_resume_at_a_step(dataset):
  config = smoke.get_config()
  config.dataset = dataset
  config.image_size = 8
  # Past the end of an epoch of digits (1437 images, 22 batches of 64).
  start_step, num_batches = 20, 5
  stream = input_pipeline.train_batches(config)
  expected = [next(stream) for _ in range(start_step + num_batches)][start_step:]
  resumed = input_pipeline.train_batches(config, start_step)
  for batch in expected:
    got = next(resumed)
    assert got.keys() == batch.keys()
    for key in batch:
      np.testing.assert_array_equal(got[key], batch[key])
