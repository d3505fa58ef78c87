"""``benchmarks/network_lm.py``'s reading of training records: time to a loss, by kind of step."""

import importlib.util
import pathlib

import pytest

_SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "network_lm.py"
_spec = importlib.util.spec_from_file_location("benchmarks_network_lm", _SCRIPT)
network_lm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(network_lm)

_FLOAT32, _ONE_BIT = 4000.0, 200.0


def _records(losses, wire_bytes, seconds, log_every=1):
  """metrics.jsonl's records: a window's steps share its mean time and end's train_seconds."""
  records, total = [], 0.0
  for start in range(0, len(losses), log_every):
    window = range(start, min(start + log_every, len(losses)))
    elapsed = sum(seconds[i] for i in window)
    total += elapsed
    records += [{"step": i + 1, "loss": losses[i], "wire_bytes": wire_bytes[i],
                 "steps_per_second": len(window) / elapsed, "train_seconds": total}
                for i in window]
  return records + [{"step": len(losses), "eval_loss": 1.0, "train_seconds": total}]


def _onebit_run(seconds_float32, seconds_one_bit):
  """Ten float32 steps, then ten 1-bit ones; the loss falls by 0.1 a step."""
  wire_bytes = [_FLOAT32] * 10 + [_ONE_BIT] * 10
  seconds = [seconds_float32] * 10 + [seconds_one_bit] * 10
  return _records([3.0 - 0.1 * i for i in range(20)], wire_bytes, seconds)


def test_first_step_at_a_smoothed_loss():
  records = _onebit_run(1.0, 0.5)
  smoothed = network_lm.smoothed_losses(records, window=4)
  assert min(smoothed) == 4 and max(smoothed) == 20
  assert smoothed[4] == pytest.approx(2.85)  # The mean of 3.0, 2.9, 2.8, 2.7.
  assert network_lm.first_step_at_or_below(records, 2.0, window=4) == 13
  assert network_lm.first_step_at_or_below(records, 0.0, window=4) is None


def test_seconds_until_a_step_sum_the_steps_after_the_first():
  records = _onebit_run(1.0, 0.5)
  assert network_lm.seconds_until(records, 14) == pytest.approx(9 * 1.0 + 4 * 0.5)
  windowed = _records([1.0] * 20, [0.0] * 20, [0.1 * (i + 1) for i in range(20)], log_every=5)
  first_step = windowed[0]["train_seconds"] / 5  # The first window's mean.
  ends = {r["step"]: r["train_seconds"] for r in windowed if r["step"] % 5 == 0}
  for step, train_seconds in ends.items():
    assert network_lm.seconds_until(windowed, step) == pytest.approx(train_seconds - first_step)


def test_steady_steps_are_those_after_the_switch():
  records = _onebit_run(1.0, 0.5)
  assert network_lm.steady_from(records) == 11
  assert network_lm.seconds_per_step(records) == 0.5
  assert network_lm.steady_from(_records([1.0] * 5, [_FLOAT32] * 5, [1.0] * 5)) == 2


def test_derived_seconds_time_each_step_as_its_kind():
  slow_first_step = [9.0] + [1.0] * 9 + [0.5] * 10
  records = _records([1.0] * 20, [_FLOAT32] * 10 + [_ONE_BIT] * 10, slow_first_step)
  # At another rate: step 1 is left out of the medians; a kind not seen is timed as the nearest.
  short = _records([1.0] * 6, [_FLOAT32] * 3 + [_ONE_BIT + 8.0] * 3, [7.0, 2.0, 2.0, 0.25,
                   0.25, 0.25])
  kinds = network_lm.seconds_by_kind(short)
  assert kinds == {_FLOAT32: 2.0, _ONE_BIT + 8.0: 0.25}
  assert network_lm.derived_seconds(records, 12, kinds) == pytest.approx(9 * 2.0 + 2 * 0.25)
  assert network_lm.derived_seconds(records, 12, network_lm.seconds_by_kind(records)) == (
      pytest.approx(9 * 1.0 + 2 * 0.5))


def _run(records, mode="fp32"):
  return {"flags": network_lm.MODES[mode][1], "records": network_lm.training_records(records),
          "summary": {"num_params": 1, "eval_loss": 1.0, "compile_seconds": 1.0,
                      "train_seconds": network_lm.seconds_until(records, 10 ** 6)}}


def test_summary_measures_at_the_full_rate_and_derives_at_the_others():
  steps = 20
  fp32 = _records([3.0 - 0.1 * i for i in range(steps)], [_FLOAT32] * steps, [1.0] * steps)
  # Twice as fast a step, the same losses: the target at the same step, in half the time.
  onebit = _onebit_run(1.0, 0.5)
  full = {"fp32": _run(fp32), "onebit_adam": _run(onebit)}
  short = {"fp32": _run(_records([1.0] * 6, [_FLOAT32] * 6, [4.0] * 6)),
           "onebit_adam": _run(_records([1.0] * 6, [_FLOAT32] * 3 + [_ONE_BIT] * 3,
                                        [4.0] * 3 + [1.0] * 3))}
  report = network_lm.summarize({"1 Gbit/s": full, "100 Mbit/s": short}, "1 Gbit/s", steps)
  assert report["target_loss"] == pytest.approx(3.0 - 0.1 * 14.5)
  fp32_entry, onebit_entry = report["modes"]["fp32"], report["modes"]["onebit_adam"]
  assert fp32_entry["step_to_target"] == onebit_entry["step_to_target"] == steps
  measured = onebit_entry["rates"]["1 Gbit/s"]
  assert measured["measured"] and measured["seconds_to_target"] == pytest.approx(14.0)
  assert measured["speedup_vs_fp32"] == pytest.approx(19.0 / 14.0)
  derived = onebit_entry["rates"]["100 Mbit/s"]
  assert not derived["measured"]
  assert derived["seconds_to_target"] == pytest.approx(9 * 4.0 + 10 * 1.0)
  assert derived["speedup_vs_fp32"] == pytest.approx(76.0 / 46.0)
  assert derived["speedup_vs_bf16"] is None
  assert "| 100 Mbit/s | onebit_adam |" in network_lm.table(report, 2)


def test_diloco_runs_longer_and_is_compared_with_the_free_link_floor():
  steps = 20
  fp32 = _records([3.0 - 0.1 * i for i in range(steps)], [_FLOAT32] * steps, [1.0] * steps)
  # DiLoCo: half the loss's fall a step, trained twice as long; a sync every 5th step.
  sent = [_ONE_BIT if (i + 1) % 5 == 0 else 0.0 for i in range(2 * steps)]
  diloco = _records([3.0 - 0.05 * i for i in range(2 * steps)], sent, [0.5] * (2 * steps))
  free = {"fp32": _run(_records([1.0] * 6, [_FLOAT32] * 6, [0.5] * 6)),
          "diloco": _run(_records([1.0] * 10, sent[:10], [0.25] * 10), "diloco")}
  report = network_lm.summarize(
      {"1 Gbit/s": {"fp32": _run(fp32), "diloco": _run(diloco, "diloco")}, "unthrottled": free},
      "1 Gbit/s", steps)
  entry = report["modes"]["diloco"]
  assert entry["steps"] == 2 * steps
  assert entry["smoothed_train_loss_at_fp32_steps"] == pytest.approx(3.0 - 0.05 * 14.5)
  assert entry["final_smoothed_train_loss"] == pytest.approx(3.0 - 0.05 * 34.5)
  # fp32's final smoothed loss is 3.0 - 0.1 * 14.5 = 1.55; DiLoCo's at step 35 3.0 - 0.05 * 29.5.
  assert entry["step_to_target"] == 35
  measured = entry["rates"]["1 Gbit/s"]
  assert measured["seconds_per_step"] == pytest.approx(0.5)  # The mean: its steps differ by round.
  assert measured["seconds_to_target"] == pytest.approx(34 * 0.5)
  assert measured["over_free_link"] == pytest.approx(2.0)
  assert measured["over_fp32_free_link"] == pytest.approx(17.0 / (19 * 0.5))
  rows = {(row["baseline"], row["rate"]): row for row in report["targets"]}
  assert not rows[("unthrottled", "1 Gbit/s")]["met"]  # 2x the floor, not 1.15x.
  assert rows[("fp32", "1 Gbit/s")]["ratio"] == pytest.approx(19.0 / 17.0)
  assert "| diloco | unthrottled | 0.000 | 0.250 |" in network_lm.table(report, 2)
