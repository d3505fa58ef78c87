"""Checks of the benchmark suite's model code: the gradient trees and the cost model."""

import importlib.util
import json
import math
import pathlib

import jax
import pytest

_BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name):
  spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", _BENCHMARKS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


collectives = _load("collectives")
cost_model = _load("cost_model")


def _parameters(shapes):
  return sum(math.prod(shape) for shape in shapes.values())


def test_gradient_trees_have_the_published_sizes():
  assert (len(collectives.resnet50_shapes()), _parameters(collectives.resnet50_shapes())) == (
      161, 25_557_032)
  assert (len(collectives.gpt2_small_shapes()), _parameters(collectives.gpt2_small_shapes())) == (
      148, 124_439_808)


def test_cost_model_sizes_are_the_benchmarked_trees():
  assert cost_model.MODELS == {
      "ResNet-50": _parameters(collectives.resnet50_shapes()),
      "GPT-2 small": _parameters(collectives.gpt2_small_shapes()),
  }


@pytest.mark.parametrize("efficiency", [0.6, 0.1])
def test_compression_wins_exactly_below_the_crossover_bandwidth(efficiency):
  methods = cost_model.assumed_gpu_methods(efficiency)
  fp32, devices, coordinates = methods[0], 8, 25_557_032
  for method in methods[1:]:
    crossover = cost_model.crossover_bandwidth(method, devices)
    for factor, wins in ((0.5, True), (2.0, False)):
      link = cost_model.Link("test", factor * crossover, 5e-6)
      ratio = (cost_model.allreduce_seconds(fp32, link, devices, coordinates)
               / cost_model.allreduce_seconds(method, link, devices, coordinates))
      assert (ratio > 1) == wins, (method.name, factor, ratio)
    at_crossover = cost_model.Link("test", crossover, 5e-6)
    assert cost_model.allreduce_seconds(method, at_crossover, devices, coordinates) == (
        pytest.approx(cost_model.allreduce_seconds(fp32, at_crossover, devices, coordinates)))


def test_slow_kernels_lose_on_nvlink():
  """The case the README states plainly: 10% of H100 bandwidth, NVLink4, ResNet-50."""
  nvlink = next(link for link in cost_model.LINKS if link.name.startswith("NVLink4"))
  fp32, *compressed = cost_model.assumed_gpu_methods(0.1)
  qsgd4 = next(m for m in compressed if m.name == "qsgd 4-bit")
  coordinates = cost_model.MODELS["ResNet-50"]
  assert (cost_model.allreduce_seconds(qsgd4, nvlink, 8, coordinates)
          > cost_model.allreduce_seconds(fp32, nvlink, 8, coordinates))


@pytest.mark.slow
def test_accelerator_benchmark_runs_at_tiny_sizes(tmp_path, monkeypatch, capsys):
  accelerator = _load("accelerator")
  monkeypatch.setattr(accelerator, "COMPRESSORS",
                      {"qsgd_4bit": accelerator.COMPRESSORS["qsgd_4bit"],
                       "onebit": accelerator.COMPRESSORS["onebit"]})


  def kernels_that_fail_to_lower(compressor):  # A fused kernel Pallas cannot lower here.
    def encode(key, x):
      raise NotImplementedError("no Triton here")
    return encode, compressor.decode

  monkeypatch.setattr(accelerator, "_fused_compressor", kernels_that_fail_to_lower)
  accelerator.main(["--small", "--sizes", "16384", "--modes", "qsgd_4bit", "--repeats", "1",
                    "--step-repeats", "1", "--out", str(tmp_path)])
  record = json.loads((tmp_path / "accelerator.json").read_text())
  assert record["kernels"]["16384"]["qsgd_4bit_pallas"] == {
      "error": "NotImplementedError: no Triton here"}
  assert record["kernels"]["16384"]["qsgd_4bit"]["encode"]["gb_per_s"] > 0
  assert set(record["steps"]["modes"]) == {"adamw", "qsgd_4bit"}
  assert record["cost_model"]["steps"]["qsgd_4bit"]["projected_ms"].keys() == {
      f"{devices}x{gbit}" for devices in (8, 64) for gbit in (10, 100, 400)}
  assert {row["what"].split(",")[0] for row in record["targets"]} >= {
      "qsgd_4bit encode+decode", "onebit encode+decode", "exchange pack", "exchange unpack",
      "qsgd_4bit step over AdamW's"}
  assert "| target | figure | goal | met |" in capsys.readouterr().out

  other = jax.devices()[-1]  # --check's CPU run: its programs must run where it says.
  with jax.default_device(other):
    assert accelerator._one_device_mesh().devices.ravel().tolist() == [other]
    params = accelerator._check_programs()["powersgd_rank4"][0]()
    assert all(leaf.devices() == {other} for leaf in jax.tree.leaves(params))

  checks = accelerator._check_programs()
  monkeypatch.setattr(accelerator, "_check_programs", lambda: {
      "qsgd_4bit_encode": checks["qsgd_4bit_encode"]})
  accelerator.main(["--check", "--out", str(tmp_path)])
  report = json.loads((tmp_path / "accelerator_check.json").read_text())
  assert all(row["passed"] for row in report["checks"].values())


@pytest.mark.slow
def test_step_profile_names_each_modes_kernels_by_their_jax_operation(tmp_path):
  step_profile = _load("step_profile")
  step_profile.main(["--small", "--modes", "powersgd", "diloco", "--repeats", "1",
                     "--traced", "1", "--out", str(tmp_path / "profile.json")])
  record = json.loads((tmp_path / "profile.json").read_text())
  powersgd = record["modes"]["powersgd"]
  assert set(record["modes"]) == {"adamw", "powersgd", "diloco"}
  assert any("TransformerLM" in op for op in record["modes"]["diloco"]["operations"])
  assert 0 < powersgd["traced_ms"] and 0 < powersgd["step_ms"] and 0 < powersgd["call_ms"]
  # PowerSGD's own work (its QR on the CPU) is found under its name, the model's under the model's.
  assert any("qr" in op for op in powersgd["operations"])
  assert any("TransformerLM" in op for op in record["modes"]["adamw"]["operations"])
  assert not any(op.startswith(("conditional", "while")) for op in powersgd["operations"])


@pytest.mark.slow
def test_orthogonalize_benchmark_measures_every_way_on_gpt2s_factors(tmp_path):
  orthogonalize = _load("orthogonalize")
  orthogonalize.main(["--small", "--repeats", "1", "--out", str(tmp_path / "o.json")])
  record = json.loads((tmp_path / "o.json").read_text())
  for which in ("P", "Q"):
    ways = record["factors"][which]["ways"]
    assert set(ways) == set(orthogonalize.WAYS) - {"qr_batched"}  # It deadlocks on a CPU.
    # On nearly rank-one factors one pass is not enough; two are, as LAPACK's QR is.
    assert ways["gram_schmidt_once"]["orthonormality"] > 1e-5
    assert ways["gram_schmidt_twice"]["orthonormality"] <= 1e-6
    assert ways["qr_one_at_a_time"]["orthonormality"] <= 1e-6


def test_diloco_sweep_trains_only_the_runs_its_results_lack(tmp_path, monkeypatch):
  sweep = _load("diloco_sweep")
  dp, added = "fp32", "diloco+fp32+sync_every=5"
  monkeypatch.setattr(sweep, "RUNS", (("data parallel", dp), ("sync every", added)))
  config = sweep.configured(dp)
  settings = {"optimizer": config.optimizer} | {k: config[k] for k in sweep.SETTINGS}
  stored = {"mode": dp, "group": "data parallel", "settings": settings, "optimizer": "adamw",
            "steps": 300, "eval_loss": 1.9, "eval_curve": [[100, 2.5], [300, 1.9]],
            "wire_bytes_per_step": 4000.0, "num_params": 1000, "train_seconds": 60.0,
            "compile_seconds": 20.0, "eval_loss_minus_fp32": 0.5}
  # The DiLoCo run is stored too, but from other settings: it trains again.
  other = stored | {"mode": added, "settings": settings | {"sync_every": 7}}
  prefix = tmp_path / "lm_diloco"
  prefix.with_suffix(".json").write_text(json.dumps(
      {"config": config.to_dict(), "runs": [stored, other]}))
  trained = []

  def train(mode, workdir, reuse_runs):
    trained.append(mode)
    return stored | {"optimizer": "diloco", "eval_loss": 2.2, "mean_wire_bytes_per_step": 40.0}

  monkeypatch.setattr(sweep, "summary_of", train)
  sweep.main(["--workdir", str(tmp_path), "--reuse_results", "--results", str(prefix),
              "--lm_comparison", str(tmp_path / "absent.json")])
  runs = {run["mode"]: run for run in json.loads(prefix.with_suffix(".json").read_text())["runs"]}
  assert trained == [added]
  assert runs[dp]["eval_loss"] == 1.9 and runs[dp]["eval_loss_minus_fp32"] == 0
  assert runs[added]["eval_loss_minus_fp32"] == pytest.approx(0.3)
  assert runs[added]["fp32_steps_to_this_loss"] == pytest.approx(100 + 200 * 0.3 / 0.6)
  assert runs[added]["fp32_bytes_over_bytes"] == 100

  # Results of another config are not taken: every run trains again.
  trained.clear()
  results = json.loads(prefix.with_suffix(".json").read_text())
  results["config"]["width"] += 1
  prefix.with_suffix(".json").write_text(json.dumps(results))
  sweep.main(["--workdir", str(tmp_path), "--reuse_results", "--results", str(prefix),
              "--lm_comparison", str(tmp_path / "absent.json")])
  assert trained == [dp, added]
