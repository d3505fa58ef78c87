"""Part 6 of ``network.py``: does DiLoCo's exchange overlap the computation on real processes?

``qsgd_jax.diloco`` with ``delay=1`` takes a fragment's outer gradient at its
sync step ``s`` and averages it in step ``s + 1``, whose forward and backward
passes do not depend on the exchange: XLA may run them at the same time. With
``delay=0`` the exchange runs in step ``s`` after that step's inner update,
which it needs. Each delay runs twice: each step's program chosen on the
host (``qsgd_jax.diloco_events``; the example's default), the exchange at its
top level, and in one program of conditionals, the exchange under
``jax.lax.cond``. ``examples/lm`` on ``configs/network.py``, one worker a
process (2 processes of one CPU device each), Streaming DiLoCo with 2
fragments synced every 10 steps in turn (H = 20) and a float32 outer average
(a fragment's ring all-reduce sends 13 MB a node, 1.05 s at 100 Mbit/s, so
that what is hidden is far above the steps' noise), trains
``--overlap-steps`` steps with each of :data:`RUNS` at each rate of ``--overlap-rates``.

Each run is read by the position of its steps in the schedule (the records'
steps counted from 1; fragment ``p`` syncs at the steps ``10 (p + 1) + 20 k``):
a *sync* step takes an outer gradient (with ``delay=0`` also its exchange and
merge), an *exchange* step (``delay=1``: the step after a sync) averages it and
merges, every other step is *plain*. What the exchange costs a round is the
sum over the sync and exchange steps of their median less the plain steps'
median, within the run. The free-link run's cost is the outer step's own
computation; at a shaped rate the exchange adds its time on the wire, all of
it with ``delay=0``; with ``delay=1`` less by what the step's computation
hides: the difference, within the same kind of program, is what is hidden.

First, a probe (``network_overlap_worker.py``): one program of matmuls
alone, a float32 ``pmean`` of 13.2 MB alone, both with no dependency between
them, and both with the ``pmean`` under ``jax.lax.cond`` as DiLoCo's exchange
is; the median of 7 calls each, at each rate.
"""

import json
import pathlib
import statistics
import sys

import network_lm

SYNC_EVERY = 20
FRAGMENTS = 2
# (name, delay, each step's program chosen on the host).
RUNS = (("delay 0", 0, True), ("delay 1", 1, True), ("delay 0, one program", 0, False),
        ("delay 1, one program", 1, False))
# What a delay hides: (the run with it, the same kind of program without).
HIDDEN = (("delay 1", "delay 0"), ("delay 1, one program", "delay 0, one program"))
RATES = ("unthrottled", "100 Mbit/s")
STEPS = 6 * SYNC_EVERY // FRAGMENTS + 1  # Six exchanges and step 1.
FLAGS = ["--optimizer=diloco", "--average=fp32", f"--config.sync_every={SYNC_EVERY}",
         f"--config.fragments={FRAGMENTS}", "--config.outer_average=fp32"]


def add_arguments(parser) -> None:
  parser.add_argument("--overlap-rates", nargs="+", default=list(RATES),
                      help=f"part diloco_overlap's rates a node; default {RATES}")
  parser.add_argument("--overlap-steps", type=int, default=STEPS,
                      help=f"part diloco_overlap's steps a run; default {STEPS}")


def role(step: int, delay: int) -> str:
  """``sync``, ``exchange`` or ``plain``: what a step (counted from 1) does for the outer loop."""
  interval = SYNC_EVERY // FRAGMENTS
  if step % interval == 0:
    return "sync"
  if delay and step % interval == delay and step > interval:
    return "exchange"
  return "plain"


def costs(records: list[dict], delay: int) -> dict:
  """The median step of each role, and what the outer loop costs a fragment's round."""
  by_role: dict[str, list[float]] = {}
  for record in network_lm.training_records(records):
    if record["step"] >= network_lm.FIRST_TIMED_STEP:
      by_role.setdefault(role(record["step"], delay), []).append(1 / record["steps_per_second"])
  medians = {name: statistics.median(times) for name, times in by_role.items()}
  counts = {name: len(times) for name, times in by_role.items()}
  extra = sum(medians[name] - medians["plain"] for name in medians if name != "plain")
  sent = [r["wire_bytes"] for r in records if r.get("wire_bytes")]
  return {"median_seconds": medians, "steps": counts, "extra_seconds_a_round": extra,
          "wire_bytes_an_exchange": statistics.fmean(sent) if sent else 0.0}


def probe(launcher, work: pathlib.Path) -> dict:
  """``network_overlap_worker.py``'s median seconds of each program, on every process."""
  address, out = launcher.coordinator_address(), work / "probe.json"
  worker = str(pathlib.Path(__file__).resolve().parent / "network_overlap_worker.py")
  launcher.run(lambda i: [sys.executable, worker, address, str(launcher.num_processes), str(i),
                          str(out)], work / "logs")
  return json.loads(out.read_text())


def run(launcher, args, work: pathlib.Path, rates: dict, log) -> dict:
  """Probes, then trains each of :data:`RUNS` at each rate; returns each run's costs and what
  was hidden."""
  report = {"flags": FLAGS, "steps": args.overlap_steps, "rates": {}}
  for rate in args.overlap_rates if launcher.namespace else ("unthrottled",):
    if launcher.namespace:
      launcher.namespace.set_rate(rates[rate], launcher.num_processes)
    log(f"diloco overlap: the probe at {rate}")
    probed = probe(launcher, work / "diloco_overlap" / "probe" / rate.replace(" ", "_")
                   .replace("/", "_"))
    runs = {}
    for name, delay, on_host in RUNS:
      flags = [*FLAGS, f"--config.fragment_delay={delay}",
               f"--config.diloco_events_on_host={on_host}",
               f"--config.num_train_steps={args.overlap_steps}", "--config.log_every_steps=1",
               f"--config.eval_every_steps={args.overlap_steps}", "--config.num_eval_batches=1",
               f"--config.batch_size={launcher.num_processes}",
               f"--config.diloco_workers={launcher.num_processes}"]
      workdir = (work / "diloco_overlap" / rate.replace(" ", "_").replace("/", "_")
                 / name.replace(" ", "_").replace(",", ""))
      log(f"diloco overlap: {name} at {rate} ({args.overlap_steps} steps)")
      _, _, records = network_lm.launch_example(launcher, network_lm.CONFIG, flags, workdir)
      runs[name] = costs(records, delay) | {"flags": flags}
    bits_per_second = rates[rate]
    wire = (None if bits_per_second is None
            else runs["delay 0"]["wire_bytes_an_exchange"] * 8 / bits_per_second)
    hidden = {name: runs[undelayed]["extra_seconds_a_round"] - runs[name]["extra_seconds_a_round"]
              for name, undelayed in HIDDEN}
    report["rates"][rate] = {"probe": probed, "runs": runs, "wire_seconds_an_exchange": wire,
                             "hidden_seconds": hidden}
  return report


def table(report: dict) -> str:
  lines = [
      "", "The probe: process 0's median seconds of a program (7 calls), at each rate.", "",
      "| rate | matmuls alone | 13.2 MB pmean alone | both | both, the pmean under lax.cond |",
      "|---|---|---|---|---|",
  ]
  for rate, entry in report["rates"].items():
    seconds = entry["probe"]["seconds"]
    lines.append(f"| {rate} | {seconds['compute']:.3f} | {seconds['exchange']:.3f} "
                 f"| {seconds['both']:.3f} | {seconds['both_exchange_under_cond']:.3f} |")
  lines += [
      "", f"`examples/lm` on {network_lm.CONFIG}, a worker a process, Streaming DiLoCo: "
      f"{FRAGMENTS} fragments, H = {SYNC_EVERY}, float32 outer average, "
      f"{report['steps']} steps a run.", "",
      "| rate | run | plain step s | sync step s | exchange step s | outer loop's extra s a "
      "round | MB an exchange | its wire s |",
      "|---|---|---|---|---|---|---|---|",
  ]
  for rate, entry in report["rates"].items():
    for name, run_ in entry["runs"].items():
      medians = run_["median_seconds"]
      wire = entry["wire_seconds_an_exchange"]
      lines.append(
          f"| {rate} | {name} | {medians['plain']:.3f} | {medians['sync']:.3f} "
          f"| {_seconds(medians.get('exchange'))} "
          f"| {run_['extra_seconds_a_round']:.3f} | {run_['wire_bytes_an_exchange'] / 1e6:.2f} "
          f"| {_seconds(wire)} |")
  lines += ["", "| rate | run | hidden s a round (delay 0's extra less the run's, the same "
            "kind of program) |",
            "|---|---|---|"]
  for rate, entry in report["rates"].items():
    for name, hidden in entry["hidden_seconds"].items():
      lines.append(f"| {rate} | {name} | {hidden:+.3f} |")
  lines += [
      "", "A step's role by its place in the schedule: *sync* takes a fragment's outer gradient"
      " (with delay 0 also exchanges and merges it), *exchange* (delay 1) averages it and"
      " merges; every other step is *plain*. The extra seconds a round are the medians of the"
      " sync and exchange steps less the plain steps' median, within the run. Each step's"
      " program is chosen on the host (`qsgd_jax.diloco_events`) but in the runs named *one"
      " program*, whose exchange is under `jax.lax.cond`."]
  return "\n".join(lines) + "\n"


def _seconds(value: float | None) -> str:
  return "-" if value is None else f"{value:.3f}"
