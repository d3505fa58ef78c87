"""``benchmarks/network.py``'s Part 7: the nodes' links, and what the part makes of its runs.

Where this machine lets the test create network namespaces: a bulk TCP
transfer between two nodes of ``network_links.Nodes`` runs at the per-node
rate and one inside a node does not; and two processes of 2 CPU devices, one
a node, started by the benchmark's launcher, send a psum over a process's own
devices on its loopback and one across processes over the link.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import types

import pytest

_BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
  spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", _BENCHMARKS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


network = _load("network")  # Puts benchmarks/ on sys.path: its siblings import as themselves.
import network_hybrid  # noqa: E402
import network_links  # noqa: E402
import network_lm  # noqa: E402

_DENIED = network_links.namespace_permission(("ip", "tc", "unshare"))
_NO_NAMESPACE = f"cannot create network namespaces here: {_DENIED}"
_WORKER = pathlib.Path(__file__).resolve().parent / "network_nodes_worker.py"
_RATE = 100e6
_SLOW, _FREE, _FULL = "100 Mbit/s", "unthrottled", "1 Gbit/s"

# A bulk TCP transfer: ``receive ADDRESS`` or ``send ADDRESS`` (prints bits a second).
_BULK = """
import socket, sys, time
role, address, size = sys.argv[1], sys.argv[2], 5 * 2**20
if role == "receive":
  with socket.create_server((address, 24999)) as server:
    connection, _ = server.accept()
    received = 0
    while received < size:
      received += len(connection.recv(1 << 20))
    connection.sendall(b"k")
else:
  for _ in range(100):
    try:
      connection = socket.create_connection((address, 24999))
      break
    except ConnectionRefusedError:
      time.sleep(0.05)
  start = time.perf_counter()
  connection.sendall(bytes(size))
  connection.recv(1)
  print(size * 8 / (time.perf_counter() - start))
"""


def _transfer(nodes, sender: int, receiver: int) -> float:
  """Bits a second of a bulk transfer from node ``sender`` to node ``receiver``'s address."""
  address = nodes.addresses[receiver]
  listening = subprocess.Popen(nodes.prefix(receiver) + [sys.executable, "-c", _BULK, "receive",
                                                         address])
  try:
    sent = subprocess.run(nodes.prefix(sender) + [sys.executable, "-c", _BULK, "send", address],
                          capture_output=True, text=True, timeout=60, check=True)
  finally:
    listening.wait(timeout=60)
  return float(sent.stdout)


@pytest.mark.skipif(bool(_DENIED), reason=_NO_NAMESPACE)
def test_nodes_are_limited_between_them_and_free_inside_and_then_deleted():
  name = f"qsgd_jax_test_nodes_{os.getpid()}"
  with network_links.Nodes(name, 2) as nodes:
    nodes.set_rate(_RATE, 2)
    named = subprocess.run(nodes.prefix(1) + ["hostname"], capture_output=True, text=True,
                           check=True)
    assert named.stdout.strip() == nodes.addresses[1]  # What gloo binds in node 1.
    between = _transfer(nodes, 1, 0)
    inside = _transfer(nodes, 0, 0)
    nodes.set_rate(None, 2)
    freed = _transfer(nodes, 1, 0)
  # Limited: never above the rate; below it by as much as a loaded machine's threads lag.
  assert 0.5 * _RATE <= between <= 1.15 * _RATE
  assert inside > 5 * _RATE and freed > 5 * _RATE
  assert not nodes.exists()


@pytest.mark.skipif(bool(_DENIED), reason=_NO_NAMESPACE)
def test_a_process_own_devices_talk_on_its_loopback_and_processes_over_the_link(tmp_path):
  with network_links.Nodes(f"qsgd_jax_test_gloo_{os.getpid()}", 2) as nodes:
    launcher = network.Launcher(nodes, 2, timeout=240, devices_per_process=2)
    address = launcher.coordinator_address()
    launcher.run(lambda i: [sys.executable, str(_WORKER), address, str(i),
                            str(tmp_path / "process")], tmp_path / "logs")
  for process_id in range(2):
    measured = json.loads((tmp_path / f"process{process_id}.json").read_text())
    assert measured["row_processes"] == [[0], [1]]  # jax.make_mesh: a process a row.
    sent = measured["link_tx_bytes"]
    # Across processes: each of a node's 2 devices sends its 1 MiB once (a ring of 2).
    assert sent["nodes"] >= 2 * 2**20
    assert sent["local"] < 2**16  # Inside a process: nothing but the coordinator's messages.


def _records(losses, wire_bytes, seconds):
  records, total = [], 0.0
  for step, (loss, sent, elapsed) in enumerate(zip(losses, wire_bytes, seconds, strict=True)):
    total += elapsed
    records.append({"step": step + 1, "loss": loss, "steps_per_second": 1 / elapsed,
                    "train_seconds": total} | ({} if sent is None else {"wire_bytes": sent}))
  return records


def _run(part, mode, records, summary_fields):
  return {"flags": part.modes[mode][1], "records": records,
          "summary": {"num_params": 1, "eval_loss": 1.0, "compile_seconds": 1.0,
                      "train_seconds": network_lm.seconds_until(records, 10**6),
                      **summary_fields}}


def _part():
  args = types.SimpleNamespace(lm_processes=2, hybrid_modes=("fp32", "qsgd4_ef", "diloco"),
                               hybrid_rates=network_hybrid.OTHER_RATES)
  return network_hybrid.part(args)


def test_every_mode_runs_on_the_hybrid_mesh_a_data_group_a_process():
  part = _part()
  for mode in part.modes:
    flags = network_lm._flags(part, mode, 40, False, 2)
    assert {"--parallelism=hybrid", "--config.fsdp_devices=2", "--config.tensor_devices=2",
            "--config.batch_size=2"} <= set(flags), mode  # One sequence a data group.
  assert "--config.diloco_workers=2" in network_lm._flags(part, "diloco", 40, False, 2)
  assert network_hybrid.FSDP_DEVICES * network_hybrid.TENSOR_DEVICES == (
      network_hybrid.DEVICES_PER_PROCESS)


def _layout(across_least: float, across_most: float) -> dict:
  return {"hlo_across_data_bytes_least": across_least, "hlo_across_data_bytes_most": across_most,
          "hlo_inside_data_bytes_least": 2e6, "hlo_inside_data_bytes_most": 2e6,
          "param_bytes_per_device": 6e6, "state_bytes_per_device": 12e6,
          "data_group_processes": [[0], [1]]}


def test_targets_at_100_mbits_against_float32_and_the_free_link():
  part, steps = _part(), 20
  losses = [3.0 - 0.1 * i for i in range(steps)]
  # fp32 reports no bytes (the compiler's all-reduce); DiLoCo's loss falls half as fast a step
  # and it trains twice as long, a sync every 5 steps; qsgd4_ef learns as fp32 does.
  diloco_losses = [3.0 - 0.05 * i for i in range(2 * steps)]
  syncs = [1e5 if (i + 1) % 5 == 0 else 0.0 for i in range(2 * steps)]

  def runs(fp32_seconds, qsgd_seconds, diloco_seconds, count):
    return {
        "fp32": _run(part, "fp32", _records(losses[:count], [None] * count,
                                            [fp32_seconds] * count), _layout(8e6, 8e6)),
        "qsgd4_ef": _run(part, "qsgd4_ef", _records(losses[:count], [1e5] * count,
                                                    [qsgd_seconds] * count), _layout(1e6, 1e6)),
        "diloco": _run(part, "diloco", _records(diloco_losses[:2 * count], syncs[:2 * count],
                                                [diloco_seconds] * (2 * count)),
                       _layout(0.0, 1e6))}

  report = network_lm.summarize({_FULL: runs(1.0, 0.5, 0.5, steps), _SLOW: runs(4.0, 1.0, 0.25, 6),
                                 _FREE: runs(0.5, 0.5, 0.25, 6)}, _FULL, steps, part)
  # fp32's final smoothed loss, 3.0 - 0.1 * 14.5, DiLoCo's smoothed loss reaches at step 35.
  assert report["modes"]["diloco"]["step_to_target"] == 35
  rows = {(row["mode"], row["baseline"]): row for row in report["targets"]}
  assert all(row["rate"] == _SLOW for row in rows.values())
  # Derived at 100 Mbit/s: steps 2 to 20 at 4.0 s for fp32 and 1.0 s for qsgd4_ef, steps 2 to
  # 35 at 0.25 s for DiLoCo, which its free-link steps take too.
  assert rows[("qsgd4_ef", "fp32")]["ratio"] == pytest.approx(4.0)
  assert rows[("qsgd4_ef", "fp32")]["met"]
  assert rows[("diloco", "fp32")]["ratio"] == pytest.approx(19 * 4.0 / (34 * 0.25))
  assert rows[("diloco", "fp32")]["met"]
  assert rows[("diloco", _FREE)]["ratio"] == pytest.approx(1.0)
  assert report["modes"]["fp32"]["mean_wire_bytes_per_step"] is None
  report["link"] = network_hybrid.link_description(None)
  text = network_hybrid.table(report, 2)
  assert "2 processes of 4 CPU devices" in text
  assert "| qsgd4_ef | 1.000 | 8.0x fewer | 2.000 | 6.00 | 12.00 | [[0], [1]] |" in text
  assert "| diloco | 0.000-1.000 | 8.0x fewer |" in text


@pytest.mark.skipif(bool(_DENIED), reason=_NO_NAMESPACE)
def test_the_nodes_are_deleted_when_a_launch_fails(tmp_path):
  nodes = network_links.Nodes(f"qsgd_jax_test_fail_{os.getpid()}", 2)
  with pytest.raises(network.LaunchError, match="exited with code 3"), nodes:
    network.Launcher(nodes, 2, timeout=60).run(
        lambda i: [sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path / "logs")
  assert not nodes.exists()
