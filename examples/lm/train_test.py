"""Tests of the language-model example: the text, steps in each parallelism, a resumed run.

One small config throughout; each test's compiled step is reused where the
config is the same (``train.programs``): each distinct config compiles once.
"""

import doctest
import json
import math
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import qsgd_jax
from examples.lm import grammar, input_pipeline, models, train
from examples.lm.configs import smoke

# The runs of the resumption test: error feedback keeps per-device residuals in the state;
# 1-bit Adam under FSDP, shards and per-device worker errors (1-bit from step 3 of 6).
RUN_CASE = ("qsgd4_ef", "shard_map")
FSDP_RUN_CASE = ("fp32", "fsdp", "onebit_adam")
FSDP_CASE = ("qsgd4", "fsdp")
# (average, parallelism, optimizer): each average and optimizer once, each parallelism.
STEP_CASES = (RUN_CASE + ("adamw",), ("bf16", "pmap", "adamw"), ("onebit", "jit", "adamw"),
              ("powersgd", "shard_map", "adamw"), ("fp32", "shard_map", "onebit_adam"),
              ("fp32", "pmap", "zero_one_adam"), ("topk_ef", "pmap", "adamw"),
              ("fp32", "shard_map", "demo"))
TIMINGS = ("steps_per_second", "tokens_per_second", "train_seconds", "wall_seconds")


def _config(average: str, parallelism: str, optimizer: str = "adamw"):
  config = smoke.get_config()
  config.average = average
  config.parallelism = parallelism
  config.optimizer = optimizer
  return config


def test_the_text_is_deterministic_and_its_splits_differ():
  config = smoke.get_config()
  corpus = input_pipeline.corpus(config)
  assert corpus.train.dtype == corpus.held_out.dtype == np.uint8
  assert (len(corpus.train), len(corpus.held_out)) == (config.train_bytes, config.eval_bytes)
  text = grammar.Language(config.text_seed).text(f"train {config.text_seed}", config.train_bytes)
  assert text.encode()[: config.train_bytes] == corpus.train.tobytes()
  # No 64-byte stretch of the held-out text is in the training text.
  train_text = corpus.train.tobytes()
  held_out = corpus.held_out.tobytes()
  assert not any(held_out[i : i + 64] in train_text for i in range(0, len(held_out) - 64, 64))
  other = grammar.Language(config.text_seed + 1).text(f"train {config.text_seed}", 1000)
  assert other.encode()[:1000] != train_text[:1000]
  assert doctest.testmod(grammar).failed == 0


def test_train_batches_are_windows_of_the_text_and_resume_at_a_step():
  config = smoke.get_config()
  train_text = input_pipeline.corpus(config).train.tobytes()
  stream = input_pipeline.train_batches(config)
  batches = [next(stream)["tokens"] for _ in range(5)]
  for tokens in batches:
    assert tokens.shape == (config.batch_size, config.context_length + 1)
    assert tokens.dtype == np.int32
    assert all(bytes(row.astype(np.uint8)) in train_text for row in tokens)
  assert not np.array_equal(batches[0], batches[1])
  resumed = input_pipeline.train_batches(config, start_step=3)
  for expected in batches[3:]:
    np.testing.assert_array_equal(next(resumed)["tokens"], expected)


def test_eval_batches_tile_the_held_out_text():
  config = smoke.get_config()
  held_out = input_pipeline.corpus(config).held_out
  num_batches = input_pipeline.num_eval_batches(config)
  assert num_batches == config.num_eval_batches
  tokens = np.concatenate([b["tokens"] for b in input_pipeline.eval_batches(config, num_batches)])
  window = config.context_length + 1
  np.testing.assert_array_equal(tokens.reshape(-1), held_out[: len(tokens) * window])
  again = next(input_pipeline.eval_batches(config, 1))["tokens"]
  np.testing.assert_array_equal(again, tokens[: config.batch_size])


def test_a_hybrid_batch_splits_over_the_data_groups_not_their_devices():
  config = _config("qsgd4_ef", "hybrid")  # 2 data groups of fsdp 2 x tensor 2 devices.
  config.batch_size = 2  # A sequence a group, read by each of its 4 devices.
  assert input_pipeline.local_batch_size(config) == 2  # This process feeds both groups.
  tokens = next(input_pipeline.train_batches(config))["tokens"]
  assert tokens.shape == (2, config.context_length + 1)
  config.batch_size = 3
  with pytest.raises(ValueError, match="divisible by the 2 data groups"):
    input_pipeline.local_batch_size(config)
  config.parallelism, config.batch_size = "shard_map", 2
  with pytest.raises(ValueError, match="divisible by the 8 devices"):
    input_pipeline.local_batch_size(config)


def test_conditional_entropy_counts_what_the_context_determines():
  alternating = np.array([1, 2] * 500, np.uint8)
  assert input_pipeline.conditional_entropy(alternating, 0) == pytest.approx(math.log(2))
  assert input_pipeline.conditional_entropy(alternating, 1) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("field, value, allowed", [
    ("optimizer", "lamb", "adamw, onebit_adam, zero_one_adam, diloco, demo"),
    ("average", "qsgd2", "fp32, bf16, qsgd4, qsgd8, qsgd4_ef, onebit, powersgd, topk_ef"),
    ("parallelism", "pjit", "pmap, shard_map, jit, fsdp, hybrid"),
])
def test_unknown_choices_are_errors_that_list_the_allowed_ones(field, value, allowed):
  config = smoke.get_config()
  config[field] = value
  with pytest.raises(ValueError, match=f"config.{field} must be one of {allowed}; got '{value}'"):
    train.programs(config)


def test_weight_decay_applies_to_dense_kernels_only():
  params = train.initialized(jax.random.key(0), train.create_model(smoke.get_config()))
  decayed = {jax.tree_util.keystr(path) for path, decay in
             jax.tree_util.tree_leaves_with_path(train.weight_decay_mask(params)) if decay}
  assert decayed == {"['block_0']['attention']['qkv']['kernel']",
                     "['block_0']['attention']['out']['kernel']",
                     "['block_0']['mlp_in']['kernel']", "['block_0']['mlp_out']['kernel']",
                     "['head']['kernel']"}


def test_powersgd_sees_each_kernel_as_its_layers_matrix():
  config = smoke.get_config()
  params = train.initialized(jax.random.key(0), train.create_model(config))
  width = config.width
  views = {jax.tree_util.keystr(path): models.powersgd_matrix_view(
      tuple(key.key for key in path), leaf.shape)
      for path, leaf in jax.tree_util.tree_leaves_with_path(params) if leaf.ndim >= 2}
  assert views["['block_0']['attention']['qkv']['kernel']"] == (width, 3 * width)
  assert views["['block_0']['attention']['out']['kernel']"] == (width, width)
  assert views["['block_0']['mlp_in']['kernel']"] == (width, 4 * width)


def _device_copies(tree) -> list[list[np.ndarray]]:
  """For each leaf, what every device holds of it."""
  return [[np.asarray(shard.data) for shard in leaf.addressable_shards]
          for leaf in jax.tree.leaves(tree)]


@pytest.mark.slow
@pytest.mark.parametrize("average, parallelism, optimizer", STEP_CASES)
def test_steps_on_a_repeated_batch_lower_the_loss_and_keep_replicas_equal(average, parallelism,
                                                                         optimizer):
  """Five steps: past the compressed Adams' freeze (step 3) and PowerSGD's warm-up (2)."""
  config = _config(average, parallelism, optimizer)
  model, _, _, mapped = train.programs(config)
  state = mapped.init(train.initialized(jax.random.key(0), model))
  batch = mapped.put_batch(next(input_pipeline.train_batches(config)))
  losses = []
  for _ in range(5):
    state, metrics = mapped.train_step(state, batch)
    jax.block_until_ready((state, metrics))
    losses.append(train._scalar(metrics["loss"]))

  assert all(math.isfinite(loss) for loss in losses)
  assert losses[-1] < losses[0] - 0.1, losses
  for copies in _device_copies(state.params):
    assert len(copies) == jax.device_count()
    assert all(np.array_equal(copies[0], other) for other in copies[1:])
  assert train._scalar(metrics["wire_bytes"]) < train._scalar(metrics["fp32_wire_bytes"])


def _steps(config, num_steps):
  """The state after ``num_steps`` steps on the training stream, and each step's loss."""
  model, _, _, mapped = train.programs(config)
  state = mapped.init(train.initialized(jax.random.key(0), model))
  batches = input_pipeline.train_batches(config)
  losses = []
  for _ in range(num_steps):
    state, metrics = mapped.train_step(state, mapped.put_batch(next(batches)))
    jax.block_until_ready((state, metrics))
    losses.append(train._scalar(metrics["loss"]))
  return state, losses


def _whole(params) -> list[np.ndarray]:
  """The leaves of FSDP's parameters (or of any), each whole, as numpy arrays."""
  def whole(leaf):
    if isinstance(leaf, qsgd_jax.FlatShard):
      return np.asarray(leaf.shard)[:math.prod(leaf.shape)].reshape(leaf.shape)
    return np.asarray(leaf)
  return [whole(leaf) for leaf in jax.tree.leaves(
      params, is_leaf=lambda x: isinstance(x, qsgd_jax.FlatShard))]


@pytest.mark.slow
def test_fsdp_shards_the_state_and_follows_float32_fsdp_which_is_data_parallel_float32():
  """8-bit weights and 4-bit gradients against float32 FSDP (Identity both ways), and that
  against float32 data parallelism: the same steps, up to float32 rounding."""
  compressed = _config(*FSDP_CASE)
  exact = _config("fp32", "fsdp")
  exact.fsdp_weights = "fp32"
  state, losses = _steps(compressed, 5)
  exact_state, exact_losses = _steps(exact, 5)
  replicated_state, replicated_losses = _steps(_config("fp32", "shard_map"), 5)

  # A kernel and its moments: a different eighth on each device; a bias whole everywhere.
  adam = state.opt_state[1][0]
  for tree in (state.params, adam.mu, adam.nu):
    copies = [np.asarray(s.data) for s in tree["block_0"]["mlp_in"]["kernel"].addressable_shards]
    assert len(copies) == jax.device_count()
    assert all(c.shape == (compressed.width // jax.device_count(), 4 * compressed.width)
               for c in copies)
    assert not np.array_equal(copies[0], copies[1])
  assert isinstance(state.params["block_0"]["attention"]["out"]["kernel"], qsgd_jax.FlatShard)
  for copies in _device_copies(state.params["block_0"]["mlp_in"]["bias"]):
    assert all(np.array_equal(copies[0], other) for other in copies[1:])

  np.testing.assert_allclose(exact_losses, replicated_losses, rtol=1e-6)
  for got, expected in zip(_whole(exact_state.params), _whole(replicated_state.params),
                           strict=True):
    np.testing.assert_allclose(got, expected, atol=1e-5)
  # Compressed: the loss falls as float32's does, and the parameters move the same way.
  assert losses[-1] < losses[0] - 0.3, losses
  np.testing.assert_allclose(losses, exact_losses, atol=0.05)
  initial = _whole(train.initialized(jax.random.key(0), train.create_model(compressed)))
  moved, exact_moved = (np.concatenate([(a - b).ravel() for a, b in zip(
      _whole(s.params), initial, strict=True)]) for s in (state, exact_state))
  cosine = moved @ exact_moved / np.linalg.norm(moved) / np.linalg.norm(exact_moved)
  assert cosine > 0.85, cosine


@pytest.fixture(scope="module", params=[RUN_CASE, FSDP_RUN_CASE], ids="-".join)
def runs(request, tmp_path_factory):
  """An uninterrupted run, and one resumed from its checkpoint of step 4 after step 5."""
  config = _config(*request.param)
  uninterrupted = tmp_path_factory.mktemp("uninterrupted")
  interrupted = tmp_path_factory.mktemp("interrupted")
  summary = train.train_and_evaluate(config, str(uninterrupted))
  shutil.copytree(uninterrupted / "checkpoints" / "4", interrupted / "checkpoints" / "4")
  records = (uninterrupted / "metrics.jsonl").read_text().splitlines()
  (interrupted / "metrics.jsonl").write_text(
      "".join(line + "\n" for line in records if json.loads(line)["step"] <= 5))
  resumed_summary = train.train_and_evaluate(config, str(interrupted))
  return config, (uninterrupted, summary), (interrupted, resumed_summary)


@pytest.mark.slow
def test_a_run_writes_its_metrics_and_summary(runs):
  config, (workdir, summary), _ = runs
  assert json.loads((workdir / "summary.json").read_text()) == summary
  assert summary["steps"] == config.num_train_steps and summary["first_step"] == 0
  assert math.isfinite(summary["eval_loss"]) and math.isfinite(summary["final_train_loss"])
  assert summary["entropy_given_0_bytes"] > summary["entropy_given_1_bytes"] > 0
  keys = ["learning_rate", "tokens_per_second"]
  if config.parallelism == "fsdp":  # Its collectives are autodiff's: only the HLO counts them.
    assert summary["wire_bytes_per_step"] is None and summary["hlo_wire_bytes_per_step"] > 0
  else:
    assert summary["wire_bytes_per_step"] < summary["fp32_allreduce_bytes_per_step"]
    # The HLO also counts the metrics' means.
    assert summary["hlo_wire_bytes_per_step"] >= summary["wire_bytes_per_step"]
    # A step sends what runs on every step plus one branch of each switch.
    by_branch = summary["hlo_wire_bytes_by_branch"]
    assert by_branch["most"] >= summary["wire_bytes_per_step"]
    assert by_branch["unconditional"] <= by_branch["least"] <= by_branch["most"] <= (
        summary["hlo_wire_bytes_per_step"])
    keys += ["wire_bytes", "compression_ratio"]
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").open()]
  train_records = [r for r in records if "loss" in r]
  assert [r["step"] for r in train_records] == list(range(1, config.num_train_steps + 1))
  for key in keys:
    assert all(key in r for r in train_records), key
  assert [r["step"] for r in records if "eval_loss" in r] == [3, 6]


def _checkpoint(workdir, step):
  """The saved state as a tree of numpy arrays (PRNG keys as their data)."""
  with ocp.CheckpointManager((workdir / "checkpoints").absolute()) as checkpoints:
    saved = checkpoints.restore(step, args=ocp.args.StandardRestore())
  return jax.tree.map(
      lambda x: np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
          x.dtype, jax.dtypes.prng_key) else x), saved)


def _records_without_timings(workdir):
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").open()]
  return [{key: value for key, value in record.items() if key not in TIMINGS}
          for record in records]


def _fields_named(tree, name: str) -> list:
  """The leaves under every mapping key ``name`` of a restored checkpoint's tree."""
  if isinstance(tree, dict):
    return [leaf for key, value in tree.items()
            for leaf in (jax.tree.leaves(value) if key == name else _fields_named(value, name))]
  if isinstance(tree, (list, tuple)):
    return [leaf for value in tree for leaf in _fields_named(value, name)]
  return []


@pytest.mark.slow
def test_a_resumed_run_equals_an_uninterrupted_run(runs):
  config, (uninterrupted, summary), (interrupted, resumed_summary) = runs
  assert resumed_summary["first_step"] == 4
  assert resumed_summary["eval_loss"] == summary["eval_loss"]
  final, resumed = _checkpoint(uninterrupted, 6), _checkpoint(interrupted, 6)
  assert jax.tree.structure(resumed) == jax.tree.structure(final)
  for got, expected in zip(jax.tree.leaves(resumed), jax.tree.leaves(final), strict=True):
    np.testing.assert_array_equal(got, expected)
  # The per-device residuals came back.
  residuals = (_fields_named(final["opt_state"], "worker_error")
               if config.optimizer == "onebit_adam" else final["opt_state"][0]["local_error"])
  assert residuals and all(np.asarray(r).any() for r in residuals)
  assert _records_without_timings(interrupted) == _records_without_timings(uninterrupted)


@pytest.mark.slow
def test_a_resumed_diloco_run_equals_an_uninterrupted_one(tmp_path):
  """DiLoCo resumed from step 4 of 6, mid-round (syncs at 3 and 6): the global parameters,
  every worker's inner state and the outer average's error feedback come back bit for bit.
  The uninterrupted run decides each step's kind in its one program, the resumed one on the
  host from the restored step (``diloco_events_on_host``): the same bits too."""
  config = _config("fp32", "shard_map", "diloco")
  config.diloco_workers, config.sync_every, config.outer_average = 2, 3, "qsgd4_ef"
  uninterrupted, interrupted = tmp_path / "uninterrupted", tmp_path / "interrupted"
  config.diloco_events_on_host = False
  train.train_and_evaluate(config, str(uninterrupted))
  shutil.copytree(uninterrupted / "checkpoints" / "4", interrupted / "checkpoints" / "4")
  records = (uninterrupted / "metrics.jsonl").read_text().splitlines()
  (interrupted / "metrics.jsonl").write_text(
      "".join(line + "\n" for line in records if json.loads(line)["step"] <= 5))
  config.diloco_events_on_host = True
  assert train.train_and_evaluate(config, str(interrupted))["first_step"] == 4
  final, resumed = _checkpoint(uninterrupted, 6), _checkpoint(interrupted, 6)
  assert jax.tree.structure(resumed) == jax.tree.structure(final)
  for got, expected in zip(jax.tree.leaves(resumed), jax.tree.leaves(final), strict=True):
    np.testing.assert_array_equal(got, expected)
  residuals = _fields_named(_checkpoint(uninterrupted, 4)["opt_state"], "local_error")
  assert residuals and any(np.asarray(r).any() for r in residuals)  # Saved mid-round.
  assert _records_without_timings(interrupted) == _records_without_timings(uninterrupted)


@pytest.mark.slow
@pytest.mark.parametrize("outer_average", ["qsgd4_ef", "sparseloco"])
def test_diloco_trains_and_sends_across_workers_only_at_syncs(tmp_path, outer_average):
  """``--config.optimizer=diloco``: 2 workers of 4 devices, a sync every 3 steps of 6, the
  outer gradients in 4 bits with error feedback, or SparseLoCo's top-k in 2 bits."""
  config = _config("fp32", "shard_map", "diloco")
  config.diloco_workers, config.sync_every, config.outer_average = 2, 3, outer_average
  config.checkpoint_every_steps = 0
  summary = train.train_and_evaluate(config, str(tmp_path))

  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
  train_records = [r for r in records if "loss" in r]
  assert all(math.isfinite(r["loss"]) for r in train_records)
  assert train_records[-1]["loss"] < train_records[0]["loss"]
  assert math.isfinite(summary["eval_loss"])
  sent = [r["wire_bytes"] for r in train_records]
  assert [s > 0 for s in sent] == [False, False, True] * 2, sent
  # At most 4 bits and a scale a coordinate against a float32 all-reduce's 2 (n - 1) / n * 32.
  assert 0 < sent[2] < summary["fp32_allreduce_bytes_per_step"] / 6
  assert summary["mean_wire_bytes_per_step"] == pytest.approx(sum(sent) / len(sent))
  # The baseline is float32 data parallel's: a float32 all-reduce over all 8 devices, every
  # step, also where DiLoCo sent nothing.
  assert all(r["fp32_wire_bytes"] == pytest.approx(summary["fp32_allreduce_bytes_per_step"])
             for r in train_records)
  assert summary["mean_inner_wire_bytes_per_step"] > 0  # The float32 average inside a worker.
  # Its two programs, chosen on the host: a step sends the inner average, or that and the outer.
  by_branch = summary["hlo_wire_bytes_by_branch"]
  assert 0 < by_branch["least"] < by_branch["most"] == summary["hlo_wire_bytes_per_step"]


@pytest.mark.slow
def test_a_split_diloco_exchange_sends_a_quarter_across_workers(tmp_path):
  """``--config.outer_split``: each of a worker's 4 devices exchanges a quarter of the outer
  gradient; with a float32 outer average the run is the unsplit one's, bit for bit."""
  runs = {}
  for split in (False, True):
    config = _config("fp32", "shard_map", "diloco")
    config.diloco_workers, config.sync_every, config.outer_average = 2, 3, "fp32"
    config.checkpoint_every_steps, config.outer_split = 0, split
    config.diloco_events_on_host = False  # One program a run: the split is what is tested.
    summary = train.train_and_evaluate(config, str(tmp_path / str(split)))
    records = [json.loads(line) for line in (tmp_path / str(split) / "metrics.jsonl").open()]
    runs[split] = summary, [r["wire_bytes"] for r in records if "loss" in r]
  (whole, whole_sent), (split, split_sent) = runs[False], runs[True]
  assert split["eval_loss"] == whole["eval_loss"]
  assert split["final_train_loss"] == whole["final_train_loss"]
  # A quarter of the parameters (rounded up), in float32 between the two workers, and the
  # count of the finite workers (one float32); the gather of the other three quarters inside
  # the worker counts with the worker's own average.
  assert split_sent[2] == 4 * (math.ceil(whole["num_params"] / 4) + 1)
  assert whole_sent[2] == 4 * (whole["num_params"] + 1)
  assert split["mean_inner_wire_bytes_per_step"] > whole["mean_inner_wire_bytes_per_step"]


def test_the_comparison_reads_a_switched_step_as_its_lightest_and_heaviest_branch():
  from examples.lm import compare  # noqa: PLC0415  (its flags only where it is used)

  run = {"mode": "onebit_adam", "eval_loss": 1.9, "final_train_loss": 1.8,
         "wire_bytes_per_step": 130.0, "hlo_wire_bytes_per_step": 3_555.0,
         "hlo_wire_bytes_by_branch": {"unconditional": 10.0, "conditionals": [[3_400.0, 125.0]],
                                      "least": 135.0, "most": 3_410.0},
         "tokens_per_second": 1.0, "train_seconds": 1.0}
  fp32 = run | {"mode": "fp32", "wire_bytes_per_step": 3_400.0, "hlo_wire_bytes_per_step": 3_410.0,
                "hlo_wire_bytes_by_branch": {"unconditional": 3_410.0, "conditionals": [],
                                             "least": 3_410.0, "most": 3_410.0}}
  assert compare.hlo_bytes_range(run) == (135.0, 3_410.0)
  assert compare.hlo_bytes_range(fp32) == (3_410.0, 3_410.0)
  older = {k: v for k, v in run.items() if k != "hlo_wire_bytes_by_branch"}
  assert compare.hlo_bytes_range(older) == (3_555.0, 3_555.0)  # Recorded before the branches.
  rows = compare.table(compare.compared([fp32, run])).splitlines()
  assert "| 3,410 |" in rows[2] and "| 135-3,410 |" in rows[3]


@pytest.mark.slow
def test_a_hybrid_mesh_keeps_the_models_layout_and_sends_less_across_the_data_axis(tmp_path):
  """``parallelism=hybrid``: 2 data groups of 2 x 2 devices, the model sharded inside each by
  its logical axis rules; 4-bit error-feedback QSGD over the data axis."""
  config = _config("qsgd4_ef", "hybrid")
  config.checkpoint_every_steps = 0
  summary = train.train_and_evaluate(config, str(tmp_path))
  assert math.isfinite(summary["eval_loss"]) and summary["eval_loss"] < 5.4
  _, _, _, mapped = train.programs(config)
  state = mapped.init(train.initialized(jax.random.key(0), train.create_model(config)))
  kernel = state.params["block_0"]["mlp_in"]["kernel"]  # ("embed", "mlp"): fsdp, tensor.
  assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
  assert summary["param_bytes_per_device"] < 4 * summary["num_params"] / 3
  # What crosses the data axis: the 4-bit exchange of each device's shards (and the metrics'
  # means), well under the float32 all-reduce of a data group's whole gradient.
  groups = jax.device_count() // 4
  float32_across = 2 * (groups - 1) / groups * 4 * summary["num_params"] / 4
  assert summary["hlo_across_data_bytes_least"] < float32_across / 3


@pytest.mark.slow
def test_hybrid_diloco_chooses_each_steps_program_on_the_host_with_the_same_bits(tmp_path):
  """DiLoCo over the data groups of a hybrid mesh, a worker a group, syncs at 3 and 6: the
  programs chosen on the host (``diloco_events_on_host``) give the bits of the one program
  that decides each step's kind itself."""
  config = _config("fp32", "hybrid", "diloco")
  config.sync_every, config.outer_average, config.checkpoint_every_steps = 3, "qsgd4_ef", 6
  runs = {}
  for on_host in (False, True):
    config.diloco_events_on_host = on_host
    runs[on_host] = tmp_path / str(on_host)
    train.train_and_evaluate(config, str(runs[on_host]))
  in_program, on_host = _checkpoint(runs[False], 6), _checkpoint(runs[True], 6)
  for got, expected in zip(jax.tree.leaves(on_host), jax.tree.leaves(in_program), strict=True):
    np.testing.assert_array_equal(got, expected)
  assert _records_without_timings(runs[True]) == _records_without_timings(runs[False])
