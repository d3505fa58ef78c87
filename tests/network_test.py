"""End to end: ``benchmarks/network.py`` launching 2 processes on a tiny tree.

One run measures the float32 ``pmean``, 4-bit QSGD and its collectives alone,
unthrottled and, where this machine lets the test create a network namespace,
at 100 Mbit/s a node.
Two more runs check that the namespace goes away when a launch times out and
when the launcher is told to stop.
"""

import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

_SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "network.py"
_spec = importlib.util.spec_from_file_location("benchmarks_network", _SCRIPT)
network = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(network)

_DENIED = network.namespace_permission()
_NO_NAMESPACE = f"cannot create a network namespace here: {_DENIED}"
_MODES = ("fp32_pmean", "qsgd4/two_phase", "qsgd4/two_phase/wire_only")
_LIMITED = "100 Mbit/s"


def _namespace_name(purpose: str) -> str:
  return f"qsgd_jax_test_{purpose}_{os.getpid()}"


def _namespaces() -> list[str]:
  listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
  return [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]


def _command(out: pathlib.Path, namespace: str, rates, *extra) -> list[str]:
  return [sys.executable, str(_SCRIPT), "--processes", "2", "--parts", "collectives",
          "--trees", "tiny", "--modes", *_MODES, "--rates", *rates, "--out", str(out),
          "--small-tree-repeats", "5", "--namespace", namespace, *extra]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  """The launcher's report, at 100 Mbit/s a node too where a namespace can be made."""
  out = tmp_path_factory.mktemp("network")
  namespace = _namespace_name("run")
  rates = ["unthrottled"] if _DENIED else [_LIMITED, "unthrottled"]
  completed = subprocess.run(_command(out, namespace, rates), capture_output=True, text=True,
                             timeout=240, check=False)
  assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-3000:]
  if not _DENIED:
    assert namespace not in _namespaces()
  return json.loads((out / "network_2proc.json").read_text())


@pytest.mark.slow
def test_unthrottled_run_averages_and_counts(report):
  tree = report["collectives"]["trees"]["tiny"]
  assert tree["parameters"] == 256 * 1024 + 1024
  # The mean of both processes' gradients, as process 0 received it: exact up to float32
  # rounding, and within 4-bit QSGD's noise (about 0.27 on normal data; a wrong mean is 1 or more).
  assert tree["modes"]["fp32_pmean"]["relative_error"] < 1e-6
  assert tree["modes"]["qsgd4/two_phase"]["relative_error"] < 0.5
  unthrottled = tree["rates"]["unthrottled"]["modes"]
  assert all(len(entry["calls_seconds"]) == 5 for entry in unthrottled.values())
  assert unthrottled["fp32_pmean"]["speedup_vs_fp32"] == 1.0
  fp32_bytes = tree["modes"]["fp32_pmean"]["hlo_bytes_sent"]
  # One float32 all-reduce of the tree between two devices: each sends half of it, twice.
  assert fp32_bytes == pytest.approx(4 * tree["parameters"])
  assert tree["modes"]["qsgd4/two_phase"]["hlo_bytes_sent"] < fp32_bytes / 6
  # The wire alone: the same collectives, byte for byte, and no mean to check.
  wire_only = tree["modes"]["qsgd4/two_phase/wire_only"]
  assert wire_only["collectives"] == tree["modes"]["qsgd4/two_phase"]["collectives"]
  assert "relative_error" not in wire_only


@pytest.mark.slow
@pytest.mark.skipif(bool(_DENIED), reason=_NO_NAMESPACE)
def test_limited_link_is_slower_by_the_bytes_over_the_rate(report):
  tree = report["collectives"]["trees"]["tiny"]
  limited = tree["rates"][_LIMITED]
  assert limited["link"]["qdisc"].startswith("qdisc tbf")
  # A bulk TCP transfer gets the aggregate rate of both nodes, 200 Mbit/s.
  assert limited["link"]["bytes_per_second"] == pytest.approx(2 * 100e6 / 8, rel=0.15)
  fp32 = limited["modes"]["fp32_pmean"]
  # 1 MB a device at 100 Mbit/s: 84 ms on the wire, against milliseconds unthrottled.
  assert fp32["wire_floor_seconds"] == pytest.approx(4 * tree["parameters"] / (100e6 / 8))
  assert 0.8 < fp32["time_vs_wire_floor"] < 2.0
  assert fp32["seconds"] > 4 * tree["rates"]["unthrottled"]["modes"]["fp32_pmean"]["seconds"]
  for mode in _MODES:  # The loopback carried what the HLO sends, and little more.
    entry = limited["modes"][mode]
    assert 0.9 < entry["link_bytes_sent"] / entry["hlo_bytes_sent"] < 1.2, mode


@pytest.mark.slow
@pytest.mark.skipif(bool(_DENIED), reason=_NO_NAMESPACE)
def test_namespace_is_deleted_when_a_launch_times_out(tmp_path):
  namespace = _namespace_name("timeout")
  completed = subprocess.run(_command(tmp_path, namespace, ["unthrottled"], "--timeout", "2"),
                             capture_output=True, text=True, timeout=60, check=False)
  assert completed.returncode != 0
  assert "still running after 2 s" in completed.stderr
  assert namespace not in _namespaces()


@pytest.mark.skipif(bool(_DENIED), reason=_NO_NAMESPACE)
def test_a_stop_signal_raised_where_python_ignores_it_is_raised_again(monkeypatch):
  # The logging module's fork handlers run while subprocess forks, and Python prints and
  # drops an exception raised in them: a SIGTERM arriving then must still stop the launch.
  monkeypatch.setattr(network, "_STOP_SIGNALS_RECEIVED", [])
  try:
    network._raise_on_signal(signal.SIGTERM, None)
  except KeyboardInterrupt:
    pass  # Dropped, as in a fork handler.
  with pytest.raises(KeyboardInterrupt, match=f"signal {int(signal.SIGTERM)}"):
    network._raise_if_stopped()


def test_namespace_is_deleted_when_the_launcher_is_terminated(tmp_path):
  namespace = _namespace_name("terminated")
  log = tmp_path / "launcher.log"
  with open(log, "wb") as output:
    launcher = subprocess.Popen(_command(tmp_path, namespace, ["unthrottled"]),
                                stdout=output, stderr=subprocess.STDOUT)
  try:
    deadline = time.monotonic() + 120  # The launcher imports JAX first: slow on a busy machine.
    while namespace not in _namespaces() and launcher.poll() is None:
      assert time.monotonic() < deadline, log.read_text()[-3000:]
      time.sleep(0.1)
    assert launcher.poll() is None, log.read_text()[-3000:]
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=60) != 0, log.read_text()[-3000:]
  finally:
    if launcher.poll() is None:
      launcher.kill()
      launcher.wait()
  assert namespace not in _namespaces(), log.read_text()[-3000:]
