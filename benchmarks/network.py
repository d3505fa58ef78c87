"""Does compression make training faster? Real processes over a rate-limited link.

``N`` processes (``--processes``, default 4), one CPU device each, form one
``jax.distributed`` cluster whose collectives go over gloo (TCP) on
127.0.0.1, inside a private network namespace made for the run. The
namespace's loopback is the link: ``tc``'s token bucket filter (tbf) limits it
to ``N`` times the per-node rate. All ``N`` processes send through that one
loopback, so it carries in aggregate what ``N`` links of the per-node rate
carry, as a switch with one such link a node would; a node's traffic is not
capped on its own (one busy node may take more than its share). The namespace
is deleted at the end, also when a run fails or is interrupted, and a stale
one of the same name is deleted first. Without the permission to create it
(root: ``CAP_SYS_ADMIN`` and ``CAP_NET_ADMIN``) the processes run on the
host's loopback, unthrottled, and the bytes on it are not counted.

**The link's settings.** The namespace's loopback gets an MTU of 9,000
bytes (jumbo Ethernet frames) instead of 64 KiB. tbf drops every packet larger
than its bucket (``burst``): with 64 KiB packets a bucket of 64 KiB stalled
TCP here on retransmission timeouts, and a bucket of several 64 KiB packets
lets a whole small message through at once, faster than the rate. With 9,000
bytes (tbf cuts the loopback's larger segments to the MTU), ``burst`` is the
larger of 32 KiB and 1 ms of the aggregate rate: at most 1 ms (or 32 KiB)
ahead of the rate after an idle spell, and enough tokens a timer tick for
tbf to keep up with fast rates. ``latency``, how long a packet may wait in
tbf's queue before it is dropped, is 50 ms: with 10 ms six parallel TCP flows
lost packets here. A bulk TCP transfer reached 95-99% of rates from
200 Mbit/s to 4 Gbit/s here; every run measures it again at every rate and
prints it, and a rate the loopback itself cannot carry (its copies run on
the same cores) is flagged.

**Part 1, collectives** (``network_worker.py``). The gradient average of
real trees (ResNet-50's, GPT-2 small's at a quarter of its width, and the
digits example's ResNet-8) for every mode of ``network_worker.MODES``, at
100 Mbit/s, 1 Gbit/s and 10 Gbit/s a node and unthrottled: the median over
``--repeats`` calls (``--small-tree-repeats`` on ResNet-8, whose calls take
milliseconds) after a warm-up call, each call's time the slowest process's.
The float32 baselines are ``jax.lax.pmean`` of the tree, which XLA's CPU
runtime sends as one gloo all-reduce a leaf, and the same of the tree
concatenated into one vector (``fp32_pmean/fused``), one call.
``qsgd4/two_phase/wire_only`` runs the collectives of ``qsgd4/two_phase``
alone, the same bytes with no encoding or decoding: the two rows' difference
is what the compression's compute adds to the time. Beside each
time: the speedups over both; the bytes one device sends by the compiled HLO
(:func:`qsgd_jax.wire_bytes`, ring accounting) and that figure over the
per-node rate, the mode's wire floor; and the bytes that crossed the loopback
(its ``tx_bytes`` counter read inside the namespace, less the bytes of the
barriers around each call, divided by ``N``). A latency probe (a float32
``pmean`` of 1 and of 65 leaves of 256 elements) measures what a gloo call
costs at every rate.

**Part 2, time to accuracy.** The Flax example itself
(``examples/imagenet/main.py --multihost``), ``N`` processes at 100 Mbit/s a
node, on ``configs/digits_mlp.py``: a 2.2M-parameter MLP on digits whose
float32 all-reduce takes several times its compute. fp32, qsgd4, onebit and
decentralized8: training seconds to a target accuracy and to fp32's final
accuracy, the final accuracy, and a plot of accuracy against training seconds.

**Part 4, the language model under FSDP** (``network_fsdp.py``,
``--parts lm_fsdp``): ``examples/lm`` with ``--parallelism=fsdp`` on ``N``
processes at 100 Mbit/s and 1 Gbit/s a node: the time a training step takes
with float32, bfloat16 and compressed gathers and reduce-scatters, and 1-bit
Adam under FSDP.

**Part 5, the language model data-parallel, to float32's final loss**
(``network_lm.py``, ``--parts lm``): ``examples/lm`` on
``configs/network.py``, whose float32 all-reduce is 0.21 s on the wire of a
0.48 s step at 1 Gbit/s, on ``--lm-processes`` processes (2, one a core) with AdamW on
float32, bfloat16 and PowerSGD averages, 1-bit Adam and 0/1 Adam (their
freeze at a fifth of the run). Every mode trains the whole run at 1 Gbit/s a
node: the training seconds until its smoothed training loss reaches the
float32 run's final one, measured; at 10 Gbit/s and 100 Mbit/s short runs
time each kind of step, and the seconds to that loss are derived from the
1 Gbit/s run's steps. The modes ``diloco`` and ``diloco_streaming``
(``--lm-modes``) train DiLoCo, each process a worker, for twice the steps
(``--lm-diloco-steps``), and are compared with their own free-link run
(``--lm-rates unthrottled``), the floor.

**Part 6, does DiLoCo's exchange overlap the computation?**
(``network_diloco.py``, ``--parts diloco_overlap``): a probe of whether a gloo
collective runs beside independent matmuls, at top level and under
``lax.cond``, then Streaming DiLoCo on the language model with its exchange a
step after its outer gradient (``fragment_delay=1``) against in the same step
(0), each step's program chosen on the host and in one program of
conditionals; free and at 100 Mbit/s.

**Part 7, the language model on a hybrid mesh** (``network_hybrid.py``,
``--parts lm_hybrid``): ``examples/lm --parallelism=hybrid`` on
``--lm-processes`` processes (2) of 4 CPU devices each, a node each
(``network_links.Nodes``: a namespace a process, joined to a switch by a link
of its own, which tbf shapes; a process's own devices talk over its own
loopback, unshaped). The model is sharded over fsdp x tensor inside each
process, the data axis runs across the nodes' links. Part 5's procedure on
float32 (the compiler's own step), bfloat16, 4-bit QSGD with error feedback
and DiLoCo: seconds to float32's final loss at 1 Gbit/s a node (measured),
100 Mbit/s and on free links (derived), against issue 44's targets.

**Part 3, the cost model.** ``cost_model.network_predictions`` predicts every
time of Part 1 from the bytes, the link rate, the latency probe and this
machine's kernel rates (``compressor_throughput.py``'s JSON), and prints the
predictions beside the measurements with what each refinement corrects.

Results go to ``--out`` (``network_{N}proc[_quick].json`` and ``.md``, and
``network_time_to_accuracy_{N}proc[_quick].png``; ``network_{N}proc[_quick]_lm_fsdp``
for Part 4 alone, ``network_{N}proc[_quick]_lm`` for Part 5 alone,
``network_{N}proc[_quick]_diloco_overlap`` for Part 6 alone,
``network_{N}proc[_quick]_lm_hybrid`` for Part 7 alone; ``--suffix`` for
another name).

Usage (as root)::

  python benchmarks/network.py                   # every part, 4 processes (Part 5: 2)
  python benchmarks/network.py --quick           # small trees, few modes
  python benchmarks/network.py --processes 8 --parts collectives
  python benchmarks/network.py --processes 2 --parts lm_fsdp
  python benchmarks/network.py --parts lm        # Part 5: 2 processes, 23 minutes here
  python benchmarks/network.py --parts lm --lm-modes fp32 bf16 diloco diloco_streaming \
      --lm-rates unthrottled "100 Mbit/s" --suffix _lm_diloco   # DiLoCo: 26 minutes
  python benchmarks/network.py --parts diloco_overlap           # Part 6: 8 minutes
  python benchmarks/network.py --parts lm_hybrid                # Part 7: 2 processes of 4 devices
"""

import argparse
import contextlib
import ctypes
import itertools
import json
import math
import os
import pathlib
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

_HERE = pathlib.Path(__file__).resolve().parent
_ROOT = _HERE.parent
# This checkout's library (not an installed one) and the sibling scripts, as the processes get.
sys.path[:0] = [str(_ROOT), str(_HERE)]

import cost_model  # noqa: E402
import network_diloco  # noqa: E402
import network_fsdp  # noqa: E402
import network_hybrid  # noqa: E402
import network_lm  # noqa: E402
import network_worker  # noqa: E402
from network_links import (  # noqa: E402
    LOOPBACK_MTU,
    NAMESPACE,
    STOP_SIGNALS,
    Namespace,
    Nodes,
    namespace_permission,
    tbf_command,
)

PARTS = ("collectives", "training", "cost_model", "lm_fsdp", "lm", "diloco_overlap", "lm_hybrid")
# The parts whose figures go in files of their own when they run alone.
LM_PARTS = ("lm_fsdp", "lm", "diloco_overlap", "lm_hybrid")
# (name, bits a second a node); None is an unshaped loopback.
RATES = {
    "100 Mbit/s": 100e6,
    "1 Gbit/s": 1e9,
    "10 Gbit/s": 10e9,
    "unthrottled": None,
}
TREES = ("resnet50", "gpt2_small_quarter_width", "resnet8_digits")
QUICK_TREES = ("resnet50_quarter_width",)
# Not the ring: MinMax's encode of 161 leaves of many shapes takes minutes to compile.
QUICK_MODES = ("fp32_pmean", "fp32_pmean/fused", "qsgd4/two_phase", "onebit/two_phase")
QUICK_RATES = ("100 Mbit/s", "unthrottled")
PMEAN, FUSED = "fp32_pmean", "fp32_pmean/fused"
TRAINING_MODES = ("fp32", "qsgd4", "onebit", "decentralized8")
TRAINING_CONFIG = "examples/imagenet/configs/digits_mlp.py"
TRAINING_RATE = "100 Mbit/s"
FIRST_PORT = 23456
# Issue 14's targets: (tree, rate, mode, least speedup over fp32).
TARGETS = (
    ("resnet50", "1 Gbit/s", "qsgd4/two_phase", 4.0),
    ("resnet50", "1 Gbit/s", "onebit/two_phase", 6.0),
    ("resnet50", "100 Mbit/s", "qsgd4/two_phase", 6.5),
    ("resnet50", "100 Mbit/s", "onebit/two_phase", 15.0),
)


class LaunchError(RuntimeError):
  """A process of a launch failed or ran out of time."""


def _free_port() -> int:
  with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    return probe.getsockname()[1]


def _die_with_parent() -> None:
  """In the child before exec: SIGKILL it if the launcher dies (prctl PR_SET_PDEATHSIG)."""
  ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def _child_environment(devices_per_process: int) -> dict[str, str]:
  flags = [flag for flag in os.environ.get("XLA_FLAGS", "").split()
           if not flag.startswith("--xla_force_host_platform_device_count")]
  flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
  path = os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))
  return dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu", PYTHONPATH=path)


class Launcher:
  """Starts ``N`` processes of one program, of ``devices_per_process`` CPU devices each, in the
  namespace (:class:`~network_links.Namespace`) or nodes (:class:`~network_links.Nodes`) if
  there are some."""

  def __init__(self, namespace: Namespace | Nodes | None, num_processes: int, timeout: float,
               devices_per_process: int = 1):
    self.namespace = namespace
    self.num_processes = num_processes
    self.timeout = timeout
    self.devices_per_process = devices_per_process
    self._ports = itertools.count(FIRST_PORT + 1)

  def with_processes(self, num_processes: int) -> "Launcher":
    """A launcher of ``num_processes`` processes in the same namespace, drawing the same ports."""
    launcher = Launcher(self.namespace, num_processes, self.timeout)
    launcher._ports = self._ports
    return launcher

  def coordinator_address(self) -> str:
    """A fresh port each launch: in the namespace nothing else listens."""
    if self.namespace is None:
      return f"127.0.0.1:{_free_port()}"
    return f"{self.namespace.coordinator_host}:{next(self._ports)}"

  def run(self, command_for, logs: pathlib.Path) -> float:
    """Runs ``command_for(process_id)`` for every process; returns the wall-clock seconds.

    Raises:
      LaunchError: if a process exits with an error or the launch outlasts
        the timeout; the message holds the end of that process's log.
    """
    logs.mkdir(parents=True, exist_ok=True)
    processes = []
    start = time.perf_counter()
    try:
      for process_id in range(self.num_processes):
        with open(logs / f"process{process_id}.log", "wb") as log:
          prefix = self.namespace.prefix(process_id) if self.namespace else []
          processes.append(subprocess.Popen(
              prefix + command_for(process_id), stdout=log, stderr=subprocess.STDOUT,
              env=_child_environment(self.devices_per_process), cwd=_ROOT,
              start_new_session=True, preexec_fn=_die_with_parent))
      # The first process to fail ends the launch: the others would wait for it.
      while True:
        _raise_if_stopped()
        failed = next((i for i, p in enumerate(processes) if p.poll()), None)
        if failed is not None:
          raise LaunchError(f"process {failed} exited with code {processes[failed].returncode}:\n"
                            + _tail(logs / f"process{failed}.log"))
        running = [i for i, p in enumerate(processes) if p.poll() is None]
        if not running:
          break
        if time.perf_counter() - start > self.timeout:
          raise LaunchError(f"process {running[0]} still running after {self.timeout:.0f} s:\n"
                            + _tail(logs / f"process{running[0]}.log"))
        time.sleep(0.2)
    finally:
      for process in processes:
        if process.poll() is None:
          os.killpg(process.pid, signal.SIGKILL)
          process.wait()
    return time.perf_counter() - start


def _tail(path: pathlib.Path, characters: int = 4000) -> str:
  lines = [line for line in path.read_text(errors="replace").splitlines()
           if line.strip() and not line.startswith("    @")]
  return "\n".join(lines)[-characters:]


def _log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


# Part 1 ---------------------------------------------------------------------


def run_collectives(launcher: Launcher, args, work: pathlib.Path) -> dict:
  """Launches the workers once, for every tree, rate and mode; returns their combined report."""
  rates = [{"name": name, "bits_per_second_per_node": RATES[name],
            "command": tbf_command(RATES[name], args.processes)}
           for name in args.rates] if launcher.namespace else [
               {"name": "unthrottled", "bits_per_second_per_node": None, "command": None}]
  plan = {
      "coordinator_address": launcher.coordinator_address(),
      "num_processes": args.processes,
      "trees": list(args.trees),
      "modes": list(args.modes),
      "rates": rates,
      "repeats": args.repeats,
      "small_tree_repeats": args.small_tree_repeats,
      "count_bytes": launcher.namespace is not None,
      "failure_timeout": args.failure_timeout,
      "output_dir": str(work),
  }
  work.mkdir(parents=True, exist_ok=True)
  plan_path = work / "plan.json"
  plan_path.write_text(json.dumps(plan, indent=2))
  worker = str(_HERE / "network_worker.py")
  seconds = launcher.run(lambda i: [sys.executable, worker, str(plan_path), str(i)],
                         work / "logs")
  reports = [json.loads((work / f"process{i}.json").read_text()) for i in range(args.processes)]
  return combine(reports, rates, args.processes) | {"seconds": seconds}


def combine(reports: list[dict], rates: list[dict], num_processes: int) -> dict:
  """One figure a (tree, rate, mode) from every process's measurements.

  A call's time is the slowest process's; the time reported is the median
  over calls. Bytes on the link a device a call: the loopback counter's rise
  over a call, less the median rise over windows with no call (the barriers
  and the coordinator's messages), divided by the processes.
  """
  trees = {}
  for tree_name, tree in reports[0]["trees"].items():
    by_rate = {}
    for rate in rates:
      measured = tree["rates"][rate["name"]]
      per_node = rate["bits_per_second_per_node"]
      # Unshaped, a node's rate is its share of what a bulk TCP transfer reached.
      per_node_bytes = (per_node / 8 if per_node is not None
                        else measured["link"]["bytes_per_second"] / num_processes)
      empty = [b for b in measured["barrier_tx_bytes"] if b is not None]
      barrier_bytes = statistics.median(empty) if empty else None
      modes = {}
      for mode_name, mode in tree["modes"].items():
        calls = [max(report["trees"][tree_name]["rates"][rate["name"]]["modes"][mode_name]
                     ["seconds"][call] for report in reports)
                 for call in range(len(measured["modes"][mode_name]["seconds"]))]
        sent = [b for b in measured["modes"][mode_name]["tx_bytes"] if b is not None]
        seconds = statistics.median(calls)
        floor = mode["hlo_bytes_sent"] / per_node_bytes
        modes[mode_name] = {
            "seconds": seconds,
            "calls_seconds": calls,
            "hlo_bytes_sent": mode["hlo_bytes_sent"],
            "link_bytes_sent": ((statistics.median(sent) - barrier_bytes) / num_processes
                                if sent else None),
            "gloo_calls": mode["gloo_calls"],
            "wire_floor_seconds": floor,
            "time_vs_wire_floor": seconds / floor,
        }
      for baseline, key in ((PMEAN, "speedup_vs_fp32"), (FUSED, "speedup_vs_fused_fp32")):
        if baseline in modes:
          for entry in modes.values():
            entry[key] = modes[baseline]["seconds"] / entry["seconds"]
      by_rate[rate["name"]] = {"bits_per_second_per_node": per_node, "link": measured["link"],
                               "barrier_bytes": barrier_bytes,
                               **_latency(measured, per_node_bytes, num_processes),
                               "modes": modes}
    trees[tree_name] = {
        "parameters": tree["parameters"], "leaves": tree["leaves"],
        "min_compressed_size": tree["min_compressed_size"],
        "modes": {name: {key: value for key, value in mode.items() if key != "hlo_collectives"}
                  | {"collectives": _collective_summary(mode["hlo_collectives"])}
                  for name, mode in tree["modes"].items()},
        "rates": by_rate,
    }
  return {"trees": trees}


def _latency(measured: dict, per_node_bytes: float, num_processes: int) -> dict:
  """The latency probe's figures (process 0's medians): a one-call program, one more call."""
  probe = {int(n): statistics.median(t) for n, t in measured["latency_probe_seconds"].items()}
  fewest, most = min(probe), max(probe)
  # Less the time the extra leaves' bytes take on the link (a ring all-reduce of each).
  ring_share = 2 * (num_processes - 1) / num_processes
  extra_bytes = (most - fewest) * 4 * network_worker.PROBE_LEAF_SIZE * ring_share
  call = (probe[most] - probe[fewest] - extra_bytes / per_node_bytes) / (most - fewest)
  return {"one_call_program_seconds": probe[fewest], "gloo_call_seconds": max(0.0, call)}


def _collective_summary(collectives: list[dict]) -> dict[str, dict]:
  summary: dict[str, dict] = {}
  for collective in collectives:
    entry = summary.setdefault(collective["kind"], {"count": 0, "bytes_sent": 0.0})
    entry["count"] += 1
    entry["bytes_sent"] += collective["bytes_sent"]
  return summary


def _megabytes(value: float | None) -> str:
  return "-" if value is None else f"{value / 1e6:.3f}"


def _number(value: float | None, spec: str) -> str:
  return "-" if value is None else format(value, spec)


def _ratio(value: float | None) -> str:
  return "-" if value is None else f"{value:.2f}x"


def collectives_tables(report: dict, num_processes: int) -> str:
  lines = []
  for tree_name, tree in report["trees"].items():
    for rate_name, rate in tree["rates"].items():
      bulk = rate["link"]["bytes_per_second"] * 8
      per_node = rate["bits_per_second_per_node"]
      shaping = (f"the shared loopback limited to {num_processes} x {rate_name} ="
                 f" {num_processes * per_node / 1e9:g} Gbit/s" if per_node
                 else "the loopback unshaped")
      measured = (f"; a bulk TCP transfer reached {bulk / 1e9:.2f} Gbit/s on it; one more gloo"
                  f" call costs {1e3 * rate['gloo_call_seconds']:.2f} ms")
      if per_node and bulk < 0.9 * num_processes * per_node:
        measured += ("; the loopback cannot carry this rate here, so these times are bounded by"
                     " its own copies on the shared cores, not by tc")
      lines += [
          "",
          f"### {tree_name} ({tree['parameters']:,} parameters, {tree['leaves']} leaves),"
          f" {num_processes} processes, {rate_name} a node",
          "",
          f"({shaping}{measured}.)",
          "",
          "| mode | median s | vs fp32 | vs fused fp32 | HLO MB/device | wire floor s"
          " | time/floor | link MB/device | link/HLO |",
          "|---|---|---|---|---|---|---|---|---|",
      ]
      for mode_name, entry in rate["modes"].items():
        link_bytes, hlo_bytes = entry["link_bytes_sent"], entry["hlo_bytes_sent"]
        cells = [
            mode_name, f"{entry['seconds']:.3f}", _ratio(entry.get("speedup_vs_fp32")),
            _ratio(entry.get("speedup_vs_fused_fp32")),
            _megabytes(hlo_bytes), f"{entry['wire_floor_seconds']:.3f}",
            f"{entry['time_vs_wire_floor']:.2f}", _megabytes(link_bytes),
            _number(None if link_bytes is None else link_bytes / hlo_bytes, ".2f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def targets_table(report: dict, num_processes: int) -> str:
  """Issue 14's targets, where this run measured them, against both float32 baselines."""
  lines = ["", "### Targets (issue 14: 4 processes, ResNet-50's tree)", ""]
  if num_processes != 4 or "resnet50" not in report["trees"]:
    lines.append("(not measured: they need --processes 4 and the resnet50 tree)")
    return "\n".join(lines) + "\n"
  rates = report["trees"]["resnet50"]["rates"]
  lines += ["| rate | mode | speedup over fp32 pmean | target | met | over fused fp32 |",
            "|---|---|---|---|---|---|"]
  for _, rate, mode, target in TARGETS:
    if rate in rates and mode in rates[rate]["modes"]:
      entry = rates[rate]["modes"][mode]
      speedup = entry["speedup_vs_fp32"]
      lines.append(f"| {rate} | {mode} | {speedup:.2f}x | >= {target:g}x"
                   f" | {'yes' if speedup >= target else 'no'}"
                   f" | {_ratio(entry.get('speedup_vs_fused_fp32'))} |")
  if "unthrottled" in rates:
    modes = rates["unthrottled"]["modes"]
    compressed = [name for name in modes
                  if not name.startswith(PMEAN) and not name.endswith("/wire_only")]
    slower = [name for name in compressed if modes[name]["speedup_vs_fp32"] < 1.0]
    slower_fused = [name for name in compressed
                    if modes[name].get("speedup_vs_fused_fp32", math.inf) < 1.0]
    lines.append(f"| unthrottled | every compressed mode | slower: {', '.join(slower) or 'none'}"
                 f" | none slower | {'no' if slower else 'yes'}"
                 f" | slower: {', '.join(slower_fused) or 'none'} |")
  lines += ["", "The targets are stated against `jax.lax.pmean` of the tree, which XLA's CPU"
            " runtime sends as one gloo all-reduce a leaf; `fp32_pmean/fused` sends the same"
            " bytes as one vector, one call, as Horovod's tensor fusion or DDP's buckets would."]
  return "\n".join(lines) + "\n"


COLLECTIVES_NOTES = """
How to read the bytes. "HLO MB/device" is what the compiled program's
collectives send by ring accounting (an all-reduce of R bytes sends
2 (n - 1) / n R, an all-gather or all-to-all (n - 1) / n R, a collective
permute R). "link MB/device" is what crossed the namespace's loopback during
the call (lo's tx_bytes, read inside the namespace, less what the barriers
around a call send, measured over windows without a call), divided by the
processes. XLA's CPU collectives on gloo send what the accounting says: the
all-reduce is gloo's ring algorithm (a reduce-scatter and an all-gather
around the ring, once an operand), the all-gather gloo's ring all-gather, the
all-to-all one send to each peer, the collective permute one send a target.
The link carries a little more: a TCP/IP header of 66 bytes on every segment
(tbf cuts them to the 9,000-byte MTU; unshaped, the loopback passes segments
of up to 64 KiB) and the acknowledgements, and the coordinator's heartbeats.
"""


# Part 2 ---------------------------------------------------------------------


def run_training(launcher: Launcher, args, work: pathlib.Path) -> dict:
  """Trains the example once a mode at the training rate; returns each mode's curve."""
  if launcher.namespace:
    launcher.namespace.set_rate(RATES[args.training_rate], args.processes)
  results = {}
  for mode in args.training_modes:
    workdir = work / "training" / mode
    address = launcher.coordinator_address()
    overrides = [f"--config.compression={mode}"] + [f"--config.{o}" for o in args.config_override]

    def command(process_id, workdir=workdir, address=address, overrides=overrides):
      return [sys.executable, "-m", "examples.imagenet.main", f"--config={TRAINING_CONFIG}",
              *overrides, f"--workdir={workdir}", "--multihost",
              f"--coordinator_address={address}", f"--num_processes={args.processes}",
              f"--process_id={process_id}", f"--failure_timeout={args.failure_timeout}"]

    _log(f"training {mode} ({TRAINING_CONFIG}, {args.processes} processes)")
    seconds = launcher.run(command, workdir / "logs")
    summary = json.loads((workdir / "summary.json").read_text())
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").open()]
    evals = [r for r in records if "eval_accuracy" in r]
    results[mode] = {
        "launch_seconds": seconds,
        "summary": summary,
        "curve": [{"step": r["step"], "train_seconds": r["train_seconds"],
                   "wall_seconds": r["wall_seconds"], "eval_accuracy": r["eval_accuracy"],
                   "eval_loss": r["eval_loss"]}
                  for r in evals],
    }
  _add_time_to_accuracy(results, args.target_accuracy)
  return {"rate": args.training_rate if launcher.namespace else "unthrottled",
          "config": TRAINING_CONFIG, "target_accuracy": args.target_accuracy, "modes": results}


def _first_time(curve: list[dict], accuracy: float) -> float | None:
  return next((r["train_seconds"] for r in curve if r["eval_accuracy"] >= accuracy), None)


def _add_time_to_accuracy(results: dict, target: float) -> None:
  fp32_final = results["fp32"]["curve"][-1]["eval_accuracy"] if "fp32" in results else None
  for result in results.values():
    result["seconds_to_target"] = _first_time(result["curve"], target)
    if fp32_final is not None:
      result["seconds_to_fp32_final_accuracy"] = _first_time(result["curve"], fp32_final)


def _seconds(value: float | None) -> str:
  return "not reached" if value is None else f"{value:.1f}"


def training_table(training: dict) -> str:
  modes = training["modes"]
  fp32 = modes.get("fp32")
  lines = [
      "", f"### Time to accuracy: {training['config']}, {training['rate']} a node", "",
      f"| mode | final eval accuracy | training s to {training['target_accuracy']:.0%}"
      " | training s to fp32's final accuracy | vs fp32 | training s | steps/s"
      " | bytes a device a step |",
      "|---|---|---|---|---|---|---|---|",
  ]
  for mode, result in modes.items():
    summary = result["summary"]
    to_fp32 = result.get("seconds_to_fp32_final_accuracy")
    speedup = (fp32["seconds_to_fp32_final_accuracy"] / to_fp32
               if fp32 and to_fp32 and fp32.get("seconds_to_fp32_final_accuracy") else None)
    lines.append(
        f"| {mode} | {summary['eval_accuracy']:.2%} | {_seconds(result['seconds_to_target'])}"
        f" | {_seconds(to_fp32)} | {'-' if speedup is None else f'{speedup:.1f}x'}"
        f" | {summary['train_seconds']:.1f} | {summary['steps_per_second']:.2f}"
        f" | {summary['wire_bytes_per_step']:,.0f} |")
  lines += ["", "Training seconds leave out compilation and the evaluations"
            + (" (decentralized8's evaluation averages the models with a float32 all-reduce)."
               if "decentralized8" in modes else "."),
            "The example's fp32 averages the gradients through the library with the Identity"
            " compressor: float32 on the wire, the leaves concatenated into a few gloo calls,"
            " like Part 1's fused baseline."]
  return "\n".join(lines) + "\n"


def plot_training(training: dict, path: pathlib.Path, num_processes: int) -> None:
  import matplotlib

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt

  figure, axes = plt.subplots(figsize=(7, 4.5))
  for mode, result in training["modes"].items():
    curve = result["curve"]
    axes.plot([r["train_seconds"] for r in curve], [r["eval_accuracy"] for r in curve],
              marker="o", markersize=3, label=mode)
  axes.axhline(training["target_accuracy"], color="gray", linestyle=":", linewidth=1)
  axes.set(xlabel="training seconds (wall clock, evaluations left out)", ylabel="eval accuracy",
           title=f"{pathlib.Path(training['config']).stem}, {num_processes} processes,"
                 f" {training['rate']} a node")
  axes.grid(alpha=0.3)
  axes.legend()
  figure.tight_layout()
  figure.savefig(path, dpi=120)
  plt.close(figure)


# The whole run --------------------------------------------------------------


# The stop signals received: a signal's KeyboardInterrupt raised where Python ignores
# exceptions (the logging module's fork handlers, as subprocess forks) is lost, and the launch
# loop raises it again from here.
_STOP_SIGNALS_RECEIVED: list[int] = []


def _raise_on_signal(signum, frame):
  _STOP_SIGNALS_RECEIVED.append(signum)
  raise KeyboardInterrupt(f"signal {signum}")


def _raise_if_stopped() -> None:
  if _STOP_SIGNALS_RECEIVED:
    raise KeyboardInterrupt(f"signal {_STOP_SIGNALS_RECEIVED[0]}")


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--processes", type=int, default=4, choices=(2, 4, 8))
  parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
  parser.add_argument("--quick", action="store_true",
                      help=f"trees {QUICK_TREES}, modes {QUICK_MODES}, rates {QUICK_RATES},"
                           " and a shorter training")
  parser.add_argument("--trees", nargs="+", choices=tuple(network_worker.TREES), default=None,
                      help=f"default {TREES}")
  parser.add_argument("--modes", nargs="+", choices=tuple(network_worker.MODES), default=None,
                      help="default: every mode of network_worker.MODES")
  parser.add_argument("--rates", nargs="+", choices=tuple(RATES), default=None,
                      help=f"per node; default {tuple(RATES)}")
  parser.add_argument("--repeats", type=int, default=3, help="timed calls a mode, after a warm-up")
  parser.add_argument("--small-tree-repeats", type=int, default=11,
                      help="timed calls a mode on a tree of under a million parameters")
  parser.add_argument("--training-modes", nargs="+", default=list(TRAINING_MODES))
  parser.add_argument("--training-rate", choices=tuple(RATES), default=TRAINING_RATE,
                      help="the link rate of Part 2 (benchmarks/figures.py plots each file's)")
  parser.add_argument("--target-accuracy", type=float, default=0.9)
  parser.add_argument("--config-override", nargs="*", default=[],
                      help="more training config settings, e.g. num_epochs=2")
  parser.add_argument("--namespace", default=NAMESPACE,
                      help="the network namespace's name (deleted first if it exists)")
  parser.add_argument("--timeout", type=float, default=1800, help="seconds a launch may take")
  parser.add_argument("--failure-timeout", type=float, default=10.0,
                      help="seconds without a heartbeat after which a process counts as lost"
                           " and the others end (qsgd_jax.initialize_distributed)")
  parser.add_argument("--out", type=pathlib.Path, default=_HERE / "results")
  parser.add_argument("--suffix", default=None,
                      help="the results' names end network_{N}proc{SUFFIX}.json and .md (default"
                           " from --quick and --parts, e.g. _lm for --parts lm)")
  parser.add_argument("--throughput-json", type=pathlib.Path, default=None,
                      help="compressor_throughput.py's output, for the cost model (default:"
                           " the one in --out for 4,194,304 elements, else 1,048,576)")
  network_fsdp.add_arguments(parser)
  network_lm.add_arguments(parser)
  network_diloco.add_arguments(parser)
  network_hybrid.add_arguments(parser)
  args = parser.parse_args(argv)
  for rate in args.fsdp_rates or ():
    if rate not in RATES:
      parser.error(f"--fsdp-rates: {rate!r} is not one of {tuple(RATES)}")
  network_fsdp.resolve_arguments(args)
  try:
    network_lm.resolve_arguments(args, RATES)
    network_hybrid.resolve_arguments(args, RATES)
  except ValueError as error:
    parser.error(str(error))
  for rate in args.overlap_rates:
    if rate not in RATES:
      parser.error(f"--overlap-rates: {rate!r} is not one of {tuple(RATES)}")
  if set(args.parts) <= {"lm", "diloco_overlap", "lm_hybrid"}:  # The header and the files'
    # names count the part's processes.
    args.processes = args.lm_processes
  args.trees = tuple(args.trees or (QUICK_TREES if args.quick else TREES))
  args.modes = tuple(args.modes or (QUICK_MODES if args.quick else network_worker.MODES))
  args.rates = tuple(args.rates or (QUICK_RATES if args.quick else tuple(RATES)))
  if args.quick:  # fp32 and qsgd4 (unless given), two epochs.
    args.training_modes = args.training_modes[:2]
    args.config_override = ["num_epochs=2", *args.config_override]
  return args


def _header(args, argv, denied: str | None) -> str:
  lines = [
      "# Real processes over a rate-limited link", "", f"`{_command(argv)}`", "",
      f"{args.processes} processes, {_devices(args)} each, jax.distributed with gloo over TCP,"
      f" sharing this machine's {os.cpu_count()} cores"
      f" ({platform.processor() or platform.machine()}, load average"
      f" {os.getloadavg()[0]:.1f} at the start).", "",
      f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r} in every process"
      + (": XLA's temporary buffers on transparent huge pages." if _hugetlb() else
         ": XLA's temporary buffers faulted in 4 KiB at a time, every call."), "",
  ]
  if os.environ.get("XLA_FLAGS"):
    lines += [f"XLA_FLAGS={os.environ['XLA_FLAGS']!r} in every process (its device count set to"
              " the part's).", ""]
  if denied:
    lines.append(f"No network namespace: {denied}. Measuring unthrottled only, on the host's"
                 " loopback, without counting its bytes (other traffic shares it).")
  elif args.parts != ["lm_hybrid"]:  # Whose section describes its links.
    lines.append(f"The link: a private network namespace whose loopback (MTU {LOOPBACK_MTU}) all"
                 f" {args.processes} processes share, limited by tc's token bucket filter to"
                 f" {args.processes} x the per-node rate. That is what a switch with one link of"
                 " that rate a node carries in aggregate, but no node is held to its own link's"
                 " rate, and the loopback is not a switch: no propagation delay, no other"
                 " traffic, and its copies run on the same cores as the processes.")
  return "\n".join(lines) + "\n"


def _devices(args) -> str:
  if args.parts == ["lm_hybrid"]:
    return f"{network_hybrid.DEVICES_PER_PROCESS} CPU devices"
  hybrid = f" (Part 7's: {network_hybrid.DEVICES_PER_PROCESS})" if "lm_hybrid" in args.parts else ""
  return "one CPU device" + hybrid


def _hugetlb() -> bool:
  """Whether glibc's malloc is asked for transparent huge pages (inherited by the processes)."""
  return "glibc.malloc.hugetlb=1" in os.environ.get("GLIBC_TUNABLES", "")


def _section(title: str, text: str) -> str:
  section = f"\n## {title}\n{text}"
  print(section, flush=True)
  return section


def main(argv=None) -> None:
  args = parse_args(argv)
  for signum in STOP_SIGNALS[1:]:  # SIGINT raises KeyboardInterrupt already.
    signal.signal(signum, _raise_on_signal)
  alone = len(args.parts) == 1 and args.parts[0] in LM_PARTS  # A part run by itself.
  suffix = f"{args.processes}proc" + (("_quick" if args.quick else "")
                                      + ("_hugetlb" if _hugetlb() else "")
                                      + (f"_{args.parts[0]}" if alone else "")
                                      if args.suffix is None else args.suffix)
  args.out.mkdir(parents=True, exist_ok=True)
  denied = namespace_permission()
  # Part 7 runs in nodes of its own (network_links.Nodes), not in the shared loopback.
  loopback = not denied and args.parts != ["lm_hybrid"]
  sections = [_header(args, argv, denied)]
  print(sections[0], flush=True)
  report = {"command": _command(argv), "processes": args.processes, "cpu_count": os.cpu_count(),
            "load_average_at_start": os.getloadavg(),
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "namespace": args.namespace if loopback else None, "no_namespace_because": denied}
  started = time.perf_counter()
  work = pathlib.Path(tempfile.mkdtemp(prefix="qsgd_jax_network_"))
  _log(f"each process's log, the plans and the raw measurements go to {work}")
  with contextlib.ExitStack() as stack:
    namespace = stack.enter_context(Namespace(args.namespace)) if loopback else None
    launcher = Launcher(namespace, args.processes, args.timeout)
    if "collectives" in args.parts:
      _log(f"Part 1: {args.trees}, {len(args.modes)} modes, rates"
           f" {args.rates if namespace else ('unthrottled',)}")
      report["collectives"] = run_collectives(launcher, args, work / "collectives")
      sections.append(_section(
          "Part 1: gradient averaging",
          collectives_tables(report["collectives"], args.processes) + COLLECTIVES_NOTES
          + targets_table(report["collectives"], args.processes)))
    if "training" in args.parts:
      _log(f"Part 2: {args.training_modes} at {args.training_rate} a node")
      report["training"] = run_training(launcher, args, work)
      plot = args.out / f"network_time_to_accuracy_{suffix}.png"
      plot_training(report["training"], plot, args.processes)
      sections.append(_section(
          "Part 2: time to accuracy",
          training_table(report["training"]) + f"\n![time to accuracy]({plot.name})\n"))
    if "lm_fsdp" in args.parts:
      _log(f"Part 4: {args.fsdp_modes} at {args.fsdp_rates} a node")
      report["lm_fsdp"] = network_fsdp.run(launcher, args, work, RATES, _log)
      sections.append(_section(
          "Part 4: the language model under FSDP",
          network_fsdp.table(report["lm_fsdp"], args.processes, RATES)))
    if "lm" in args.parts:
      _log(f"Part 5: {args.lm_modes}, {args.lm_steps} steps at {args.lm_rate} a node,"
           f" {args.lm_short_steps} at {args.lm_rates}")
      report["lm"] = network_lm.run(launcher.with_processes(args.lm_processes), args, work,
                                    RATES, _log, network_lm.data_parallel(args))
      sections.append(_section(
          "Part 5: the language model, data-parallel, to float32's final loss",
          network_lm.table(report["lm"], args.lm_processes)))
    if "diloco_overlap" in args.parts:
      _log(f"Part 6: DiLoCo's exchange, runs {[run[0] for run in network_diloco.RUNS]}, at"
           f" {args.overlap_rates}")
      report["diloco_overlap"] = network_diloco.run(
          launcher.with_processes(args.lm_processes), args, work, RATES, _log)
      sections.append(_section(
          "Part 6: does DiLoCo's exchange overlap the computation?",
          network_diloco.table(report["diloco_overlap"])))
    if "lm_hybrid" in args.parts:
      _log(f"Part 7: {args.hybrid_modes} on a hybrid mesh, {args.lm_steps} steps at"
           f" {args.lm_rate} a node, {args.lm_short_steps} at {args.hybrid_rates}")
      report["lm_hybrid"] = run_hybrid(args, work / "lm_hybrid")
      sections.append(_section(
          "Part 7: the language model on a hybrid mesh, to float32's final loss",
          network_hybrid.table(report["lm_hybrid"], args.lm_processes)))
  if namespace is not None and namespace.exists():
    raise RuntimeError(f"network namespace {namespace.name} still exists after the run")
  if "cost_model" in args.parts and "collectives" in report:
    rows = cost_model.network_predictions(report["collectives"], _throughput(args),
                                          args.processes, os.cpu_count())
    report["cost_model"] = rows
    sections.append(_section("Part 3: the cost model against the measurement",
                             cost_model.network_markdown(rows)))
  report["seconds"] = time.perf_counter() - started
  report["load_average_at_end"] = os.getloadavg()
  sections.append(_section("The run", f"\n{report['seconds']:.0f} s; load average"
                           f" {report['load_average_at_end'][0]:.1f} at the end (over the last"
                           f" 15 minutes: {report['load_average_at_end'][2]:.1f}).\n"))
  (args.out / f"network_{suffix}.json").write_text(json.dumps(report, indent=2) + "\n")
  (args.out / f"network_{suffix}.md").write_text("\n".join(sections))
  print(f"wrote {args.out / f'network_{suffix}.json'} and .md ({report['seconds']:.0f} s)")


def run_hybrid(args, work: pathlib.Path) -> dict:
  """Part 7 in nodes of its own, made and deleted here (on the host's loopback without them)."""
  denied = namespace_permission(("ip", "tc", "unshare"))
  nodes = Nodes(f"{args.namespace}_hybrid", args.lm_processes)
  with contextlib.nullcontext() if denied else nodes:
    launcher = Launcher(None if denied else nodes, args.lm_processes, args.timeout,
                        network_hybrid.DEVICES_PER_PROCESS)
    report = network_lm.run(launcher, args, work, RATES, _log, network_hybrid.part(args))
  if not denied and nodes.exists():
    raise RuntimeError(f"network namespaces {nodes.name}_* still exist after the run")
  return report | {"nodes": None if denied else nodes.name, "no_nodes_because": denied,
                   "link": network_hybrid.link_description(denied)}


def _throughput(args) -> dict:
  candidates = [args.throughput_json] if args.throughput_json else [
      args.out / "compressor_throughput_4194304.json",
      args.out / "compressor_throughput_1048576.json",
      _HERE / "results" / "compressor_throughput_4194304.json"]
  for path in candidates:
    if path is not None and path.exists():
      return json.loads(path.read_text())
  raise FileNotFoundError(f"no kernel rates in {candidates}: run compressor_throughput.py first")


def _command(argv) -> str:
  return " ".join(["python benchmarks/network.py", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
  main()
