"""``benchmarks/network_diloco.py``'s reading of a run: each step's role, what a round costs."""

import importlib.util
import pathlib
import sys

import pytest

_BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(_BENCHMARKS))  # network_diloco imports network_lm.
_spec = importlib.util.spec_from_file_location("benchmarks_network_diloco",
                                               _BENCHMARKS / "network_diloco.py")
network_diloco = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(network_diloco)


def test_roles_follow_the_schedule():
  # H = 20, 2 fragments: a fragment syncs every 10th step, counted from 1.
  assert [network_diloco.role(step, 0) for step in (9, 10, 11, 20)] == [
      "plain", "sync", "plain", "sync"]
  assert [network_diloco.role(step, 1) for step in (1, 10, 11, 12, 21)] == [
      "plain", "sync", "exchange", "plain", "exchange"]


def test_a_round_costs_its_steps_above_the_plain_median():
  seconds = {"plain": 1.0, "sync": 1.5, "exchange": 2.0}
  records = []
  for step in range(1, 42):
    kind = network_diloco.role(step, 1)
    records.append({"step": step, "loss": 1.0, "steps_per_second": 1 / seconds[kind],
                    "wire_bytes": 8.0 if kind == "exchange" else 0.0})
  cost = network_diloco.costs(records, 1)
  assert cost["median_seconds"] == seconds
  assert cost["steps"] == {"plain": 32, "sync": 4, "exchange": 4}  # Step 1 left out.
  assert cost["extra_seconds_a_round"] == pytest.approx(0.5 + 1.0)
  assert cost["wire_bytes_an_exchange"] == 8.0
