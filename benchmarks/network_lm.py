"""Part 5 of ``network.py``: the language model, data-parallel, to float32's final loss.

``examples/lm/main.py --multihost`` on ``--lm-processes`` processes (2 by
default: one a core here) of one CPU device each, over the namespace's shaped
loopback (``network.py``), on ``configs/network.py``: a model whose float32
gradient all-reduce is 0.21 s on the wire of its 0.48 s step at 1 Gbit/s a
node, and most of its 2.3 s step at 100 Mbit/s.
Seven optimizers (:data:`DEFAULT_MODES`: AdamW over a float32, bfloat16,
PowerSGD or top-k all-reduce, 1-bit Adam, 0/1 Adam and DeMo) train it from
the same seeds on the same batches;
``diloco``, ``diloco_streaming`` and ``sparseloco`` train DiLoCo on them, each
process a worker (:data:`DILOCO_MODES`, run when ``--lm-modes`` names them),
for ``--lm-diloco-steps`` (twice as many: its loss a step is worse), and are
also compared with their own run on a free link (``--lm-rates unthrottled``,
the floor), the issue's target.

Every mode trains the whole run (``--lm-steps``) at ``--lm-rate`` (1 Gbit/s),
every step logged. Its training loss smoothed over :data:`SMOOTHING` steps
(a trailing mean), against its training seconds (compilation, evaluation and
step 1, whose first run sets up gloo's connections, left out), gives the
seconds it takes to reach the float32 run's final smoothed loss. A step's
loss does not depend on the link, so at the other rates (``--lm-rates``) each
mode trains ``--lm-short-steps`` steps only, half of them before its switch
to compression, to time each kind of step it takes; its seconds to the
target there are derived: the steps the full run took to reach it, each timed
as a step of its kind at that rate. A kind of step is what it sends (the
records' ``wire_bytes``, what the step really sent: the compressed Adams send
float32 before their freeze and one bit after, 0/1 Adam float32 variance
steps among its 1-bit ones before the freeze, PowerSGD float32 for its first
``powersgd_start_iter`` steps). The same derivation from
the full run's own step times is given beside its measurement, as a check.

The machinery (:func:`run`, :func:`summarize`, :func:`table`) runs whatever
:class:`Part` it is given: Part 7 (``network_hybrid.py``) is another.
"""

import json
import pathlib
import statistics
import sys
from typing import NamedTuple

CONFIG = "examples/lm/configs/network.py"
SYNC_EVERY = 20  # DiLoCo's H in MODES.
# name: (what travels, the example's flags).
MODES = {
    "fp32": ("AdamW, float32 all-reduce", ["--optimizer=adamw", "--average=fp32"]),
    "bf16": ("AdamW, bfloat16 all-reduce", ["--optimizer=adamw", "--average=bf16"]),
    "onebit_adam": ("1-bit Adam: float32 until the freeze, then 1-bit momenta",
                    ["--optimizer=onebit_adam"]),
    "zero_one_adam": ("0/1 Adam: 1-bit, and float32 variance steps until the freeze",
                      ["--optimizer=zero_one_adam"]),
    "powersgd": ("AdamW, PowerSGD all-reduce (rank 4)",
                 ["--optimizer=adamw", "--average=powersgd"]),
    "topk_ef": ("AdamW, top-k all-gather (1% of each chunk of 1,024) with error feedback",
                ["--optimizer=adamw", "--average=topk_ef"]),
    "demo": ("DeMo: 24 DCT components of each 64 x 64 block of the momentum, bfloat16 values",
             ["--optimizer=demo", "--config.learning_rate=0.003", "--config.demo_decay=0.99",
              "--config.demo_k=24", "--config.demo_value_dtype=bfloat16"]),
    "diloco": (f"DiLoCo, a worker a process, H = {SYNC_EVERY}, 4-bit QSGD outer gradients with"
               " error feedback",
               ["--optimizer=diloco", "--average=fp32", f"--config.sync_every={SYNC_EVERY}",
                "--config.outer_average=qsgd4_ef"]),
    "diloco_streaming": ("Streaming DiLoCo as diloco, 2 fragments, each exchange a step in flight",
                         ["--optimizer=diloco", "--average=fp32",
                          f"--config.sync_every={SYNC_EVERY}", "--config.outer_average=qsgd4_ef",
                          "--config.fragments=2", "--config.fragment_delay=1"]),
    "sparseloco": ("DiLoCo as diloco, SparseLoCo's outer average: top-k (1.56% of each block) "
                   "of each worker's error feedback, 2-bit values, all-gathered",
                   ["--optimizer=diloco", "--average=fp32", f"--config.sync_every={SYNC_EVERY}",
                    "--config.outer_average=sparseloco"]),
}


def is_diloco(flags: list[str]) -> bool:
  """Whether a mode's flags train DiLoCo: its steps differ by round, and it trains longer."""
  return "--optimizer=diloco" in flags


DILOCO_MODES = tuple(mode for mode, (_, flags) in MODES.items() if is_diloco(flags))
# Part 5's modes unless --lm-modes says: DiLoCo's (twice the steps) are asked for by name.
DEFAULT_MODES = tuple(mode for mode in MODES if mode not in DILOCO_MODES)
QUICK_MODES = ("fp32", "onebit_adam")
RATE = "1 Gbit/s"
OTHER_RATES = ("10 Gbit/s", "100 Mbit/s")
QUICK_OTHER_RATES = ("10 Gbit/s",)
STEPS = 200
QUICK_STEPS = 40
SHORT_STEPS = 16
# A DiLoCo mode's short run: three rounds of H = 20 (six exchanges streaming) and step 1.
DILOCO_SHORT_STEPS = 3 * SYNC_EVERY + 1
# A DiLoCo mode's full run, in full runs of the others: its loss a step is worse, so it trains
# longer to show where it crosses float32's final loss (its schedule stretched to its steps).
DILOCO_STEPS_FACTOR = 2
QUICK_SHORT_STEPS = 10
SMOOTHING = 10  # Steps in the trailing mean of the training loss.
FIRST_TIMED_STEP = 2  # Step 1's first run sets up gloo's connections: not timed, as compiling.
PROCESSES = 2
FREE_LINK = "unthrottled"  # The floor: the same processes on an unshaped loopback.
# The issues' targets: (mode, baseline, rate, least speedup in seconds to fp32's loss); a
# baseline of FREE_LINK is the mode's own free-link run, and the figure its seconds over that
# run's, at most ``least`` (issue 34: the communication hidden).
TARGETS = (("onebit_adam", "fp32", RATE, 3.0), ("onebit_adam", "bf16", RATE, 1.5),
           ("diloco", FREE_LINK, RATE, 1.15), ("diloco", "fp32", RATE, 1.5),
           ("diloco", "fp32", "100 Mbit/s", 5.0))


class Part(NamedTuple):
  """What a part trains, how, and what it is held to: Part 5's (:data:`DATA_PARALLEL`) or
  another's run by the same machinery (``network_hybrid.py``).

  Attributes:
    config: the example's configuration file.
    modes: name to (what travels, the example's flags): the modes to train, in order.
    targets: ``(mode, baseline, rate, bound)``, as :data:`TARGETS`.
    other_rates: the rates a node of the short runs, beside the full runs' ``--lm-rate``.
    flags: more of the example's flags, for every mode.
    setup: a sentence on the processes and the mesh, for the report ("": Part 5's).
    summary_fields: the fields of a run's ``summary.json`` that the report keeps a mode.
  """

  config: str
  modes: dict[str, tuple[str, list[str]]]
  targets: tuple[tuple[str, str, str, float], ...]
  other_rates: tuple[str, ...] = ()
  flags: tuple[str, ...] = ()
  setup: str = ""
  summary_fields: tuple[str, ...] = ()


DATA_PARALLEL = Part(CONFIG, MODES, TARGETS, OTHER_RATES)


def add_arguments(parser) -> None:
  parser.add_argument("--lm-modes", nargs="+", choices=tuple(MODES), default=None,
                      help=f"part lm's modes; default {DEFAULT_MODES}")
  parser.add_argument("--lm-rate", default=RATE,
                      help="part lm's rate a node for the full runs, the loss curves")
  parser.add_argument("--lm-rates", nargs="*", default=None,
                      help=f"part lm's other rates a node, short runs; default {OTHER_RATES}")
  parser.add_argument("--lm-steps", type=int, default=None,
                      help=f"part lm's steps a full run; default {STEPS}")
  parser.add_argument("--lm-short-steps", type=int, default=None,
                      help=f"part lm's steps a short run; default {SHORT_STEPS} (DiLoCo's at "
                           f"least {DILOCO_SHORT_STEPS})")
  parser.add_argument("--lm-diloco-steps", type=int, default=None,
                      help=f"part lm's steps of a DiLoCo mode's full run; default "
                           f"{DILOCO_STEPS_FACTOR}x --lm-steps")
  parser.add_argument("--lm-processes", type=int, default=PROCESSES,
                      help="part lm's processes, one sequence of the batch each")


def resolve_arguments(args, rates: dict) -> None:
  """The defaults of the part's arguments, shorter with ``--quick``."""
  args.lm_modes = tuple(args.lm_modes or (QUICK_MODES if args.quick else DEFAULT_MODES))
  if args.lm_rates is None:
    args.lm_rates = QUICK_OTHER_RATES if args.quick else OTHER_RATES
  args.lm_rates = tuple(rate for rate in args.lm_rates if rate != args.lm_rate)
  for rate in (args.lm_rate, *args.lm_rates):
    if rate not in rates:
      raise ValueError(f"part lm: rate {rate!r} is not one of {tuple(rates)}")
  args.lm_steps = args.lm_steps or (QUICK_STEPS if args.quick else STEPS)
  args.lm_short_steps = args.lm_short_steps or (QUICK_SHORT_STEPS if args.quick else SHORT_STEPS)
  args.lm_diloco_steps = args.lm_diloco_steps or DILOCO_STEPS_FACTOR * args.lm_steps
  if min(args.lm_steps, args.lm_diloco_steps) < 2 * SMOOTHING or args.lm_short_steps < 6:
    raise ValueError(f"--lm-steps must be at least {2 * SMOOTHING} and --lm-short-steps at "
                     "least 6: the loss is smoothed, and a short run times two kinds of step.")


def data_parallel(args) -> Part:
  """Part 5 as ``args`` choose it: its modes and other rates."""
  return DATA_PARALLEL._replace(modes={mode: MODES[mode] for mode in args.lm_modes},
                                other_rates=args.lm_rates)


def launch_example(launcher, config: str, flags: list[str], workdir: pathlib.Path):
  """Trains ``examples/lm`` on every process; returns the launch's seconds, summary, records."""
  address = launcher.coordinator_address()

  def command(process_id):
    return [sys.executable, "-m", "examples.lm.main", f"--config={config}", *flags,
            f"--workdir={workdir}", "--multihost", f"--coordinator_address={address}",
            f"--num_processes={launcher.num_processes}", f"--process_id={process_id}"]

  seconds = launcher.run(command, workdir / "logs")
  summary = json.loads((workdir / "summary.json").read_text())
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").open()]
  return seconds, summary, records


# What the records say -------------------------------------------------------


def training_records(records: list[dict]) -> list[dict]:
  """The training steps' records (not the evaluations'), in order of step."""
  return sorted((r for r in records if "loss" in r), key=lambda r: r["step"])


def smoothed_losses(records: list[dict], window: int = SMOOTHING) -> dict[int, float]:
  """Each step's trailing mean of the training loss over ``window`` steps, from step ``window``."""
  losses = [r["loss"] for r in training_records(records)]
  steps = [r["step"] for r in training_records(records)]
  return {steps[i]: statistics.fmean(losses[i + 1 - window:i + 1])
          for i in range(window - 1, len(losses))}


def first_step_at_or_below(records: list[dict], loss: float,
                           window: int = SMOOTHING) -> int | None:
  """The first step whose smoothed loss is ``loss`` or less; ``None`` if none is."""
  return next((step for step, smoothed in smoothed_losses(records, window).items()
               if smoothed <= loss), None)


def seconds_until(records: list[dict], step: int) -> float:
  """Training seconds from the end of step 1 to the end of ``step``: the steps' times summed.

  A record's time is its logging window's mean (``1 / steps_per_second``).
  Step 1 is left out, as compilation is: its first run also sets up gloo's
  connections for each collective (seconds, for PowerSGD's and 0/1 Adam's).
  """
  return sum(1 / r["steps_per_second"] for r in training_records(records)
             if FIRST_TIMED_STEP <= r["step"] <= step)


def steady_from(records: list[dict]) -> int:
  """The first step from which every step sends what the last does (step 2 at the earliest)."""
  steps = training_records(records)
  last = steps[-1].get("wire_bytes")
  changed = [r["step"] for r in steps if r.get("wire_bytes") != last]
  return max(FIRST_TIMED_STEP, changed[-1] + 1 if changed else 1)


def seconds_per_step(records: list[dict]) -> float:
  """The median step time from :func:`steady_from` on."""
  first = steady_from(records)
  return statistics.median(1 / r["steps_per_second"] for r in training_records(records)
                           if r["step"] >= first)


def mean_seconds_per_step(records: list[dict]) -> float:
  """The mean step time, step 1 left out: DiLoCo's, whose syncs come every H steps."""
  return statistics.fmean(1 / r["steps_per_second"] for r in training_records(records)
                          if r["step"] >= FIRST_TIMED_STEP)


def seconds_by_kind(records: list[dict]) -> dict[float | None, float]:
  """The median time of a step by what it sends (``wire_bytes``), step 1 left out."""
  kinds: dict[float | None, list[float]] = {}
  for record in training_records(records)[FIRST_TIMED_STEP - 1:]:
    kinds.setdefault(record.get("wire_bytes"), []).append(1 / record["steps_per_second"])
  return {sent: statistics.median(times) for sent, times in kinds.items()}


def derived_seconds(records: list[dict], step: int, kinds: dict[float | None, float]) -> float:
  """:func:`seconds_until` ``step``, each of ``records``' steps timed as its kind in ``kinds``.

  A kind ``kinds`` lacks is timed as the one whose bytes are nearest.
  """
  def time_of(sent):
    if sent in kinds:
      return kinds[sent]
    return kinds[min(kinds, key=lambda known: abs((known or 0.0) - (sent or 0.0)))]

  return sum(time_of(r.get("wire_bytes")) for r in training_records(records)
             if FIRST_TIMED_STEP <= r["step"] <= step)


# The runs -------------------------------------------------------------------


def _flags(part: Part, mode: str, num_steps: int, short: bool, num_processes: int) -> list[str]:
  # A fifth of a full run before the compressed Adams' freeze; half of a short run, so that it
  # times both kinds of step (PowerSGD's float32 start too).
  switch = num_steps // 2 if short else num_steps // 5
  flags = [*part.modes[mode][1], *part.flags, f"--config.num_train_steps={num_steps}",
           f"--config.freeze_step={switch}", "--config.log_every_steps=1",
           f"--config.eval_every_steps={num_steps}", f"--config.batch_size={num_processes}"]
  if is_diloco(part.modes[mode][1]):  # A worker a process.
    flags.append(f"--config.diloco_workers={num_processes}")
  return flags + ([f"--config.powersgd_start_iter={switch}"] if short else [])


def _steps(diloco: bool, num_steps: int, short: bool, args) -> int:
  """A run's steps: DiLoCo's full runs longer, its short ones over several rounds."""
  if not diloco:
    return num_steps
  return max(num_steps, DILOCO_SHORT_STEPS) if short else args.lm_diloco_steps


def run(launcher, args, work: pathlib.Path, rates: dict, log, part: Part) -> dict:
  """Trains every mode of ``part`` fully at ``--lm-rate`` and shortly at its other rates;
  returns the part's report."""
  full_rate = args.lm_rate if launcher.namespace else FREE_LINK
  plan = [(full_rate, args.lm_steps, False)]
  if launcher.namespace:
    plan += [(rate, args.lm_short_steps, True) for rate in part.other_rates]
  else:
    log(f"no namespace, so {args.lm_rate} and {part.other_rates} are not measured")
  runs = {}
  for rate, num_steps, short in plan:
    if launcher.namespace:
      launcher.namespace.set_rate(rates[rate], launcher.num_processes)
    runs[rate] = {}
    for mode, (_, mode_flags) in part.modes.items():
      workdir = work / "lm" / rate.replace(" ", "_").replace("/", "_") / mode
      steps = _steps(is_diloco(mode_flags), num_steps, short, args)
      flags = _flags(part, mode, steps, short, launcher.num_processes)
      log(f"lm {mode} at {rate} ({launcher.num_processes} processes, {steps} steps)")
      launch_seconds, summary, records = launch_example(launcher, part.config, flags, workdir)
      runs[rate][mode] = {"flags": flags, "launch_seconds": launch_seconds, "summary": summary,
                          "records": training_records(records)}
  return summarize(runs, full_rate, args.lm_steps, part)


def summarize(runs: dict, full_rate: str, num_steps: int, part: Part = DATA_PARALLEL) -> dict:
  """Per mode: the full run's figures and time to fp32's loss, measured and derived by rate."""
  full = runs[full_rate]
  target = smoothed_losses(full["fp32"]["records"])[num_steps] if "fp32" in full else None
  modes = {}
  for mode, run_ in full.items():
    records, summary = run_["records"], run_["summary"]
    smoothed = smoothed_losses(records)
    final = smoothed[max(smoothed)]  # A DiLoCo mode may train longer than num_steps.
    step = None if target is None else first_step_at_or_below(records, target)
    steady = steady_from(records)
    sent = [r["wire_bytes"] for r in records if r.get("wire_bytes") is not None]
    modes[mode] = {
        "what_travels": part.modes[mode][0],
        "flags": run_["flags"],
        "num_params": summary["num_params"],
        "steps": max(smoothed),
        "final_smoothed_train_loss": final,
        "smoothed_train_loss_at_fp32_steps": smoothed.get(num_steps),
        "gap_to_target": None if target is None else final - target,
        "eval_loss": summary["eval_loss"],
        "steady_from_step": steady,
        "wire_bytes_per_step": records[-1].get("wire_bytes"),
        # None where the step does not say (the compiler's own all-reduce).
        "mean_wire_bytes_per_step": statistics.fmean(sent) if sent else None,
        "compile_seconds": summary["compile_seconds"],
        "train_seconds": summary["train_seconds"],
        "step_to_target": step,
        "summary": {field: summary.get(field) for field in part.summary_fields},
        "curve": [{"step": r["step"], "loss": r["loss"], "train_seconds": r["train_seconds"],
                   "wire_bytes": r.get("wire_bytes")} for r in records],
        "rates": {},
    }
    for rate, by_mode in runs.items():
      if mode not in by_mode:
        continue
      kinds = seconds_by_kind(by_mode[mode]["records"])
      measured = rate == full_rate
      seconds = None if step is None else (
          seconds_until(records, step) if measured else derived_seconds(records, step, kinds))
      modes[mode]["rates"][rate] = {
          "measured": measured,
          "steps": len(by_mode[mode]["records"]),
          # DiLoCo's steps differ by round, not by phase: the mean over the run.
          "seconds_per_step": (mean_seconds_per_step if is_diloco(run_["flags"])
                               else seconds_per_step)(by_mode[mode]["records"]),
          "seconds_by_wire_bytes": [{"wire_bytes": sent, "seconds": time}
                                    for sent, time in kinds.items()],
          "seconds_to_target": seconds,
          "derived_seconds_to_target": (None if step is None
                                        else derived_seconds(records, step, kinds)),
      }
  for mode_name, mode in modes.items():
    for rate, entry in mode["rates"].items():
      for baseline in ("fp32", "bf16"):
        base = modes.get(baseline, {}).get("rates", {}).get(rate, {}).get("seconds_to_target")
        mine = entry["seconds_to_target"]
        entry[f"speedup_vs_{baseline}"] = base / mine if base and mine else None
      for key, baseline in (("over_free_link", mode_name), ("over_fp32_free_link", "fp32")):
        base = modes.get(baseline, {}).get("rates", {}).get(FREE_LINK, {}).get(
            "seconds_to_target")
        mine = entry["seconds_to_target"]
        entry[key] = mine / base if base and mine else None
  return {"config": part.config, "setup": part.setup, "steps": num_steps, "smoothing": SMOOTHING,
          "full_rate": full_rate, "target_loss": target, "modes": modes,
          "targets": targets(modes, full_rate, part.targets)}


def targets(modes: dict, full_rate: str, bounds=TARGETS) -> list[dict]:
  """The issues' targets (``bounds``), met or not: how much sooner than each baseline, or for
  a :data:`FREE_LINK` baseline how much later than the mode's own free-link run."""
  rows = []
  for mode, baseline, rate, bound in bounds:
    rates = modes.get(mode, {}).get("rates", {})
    if rate not in rates or full_rate != RATE:
      continue
    if baseline == FREE_LINK:
      ratio = rates[rate]["over_free_link"]
      met = ratio is not None and ratio <= bound
    elif baseline in modes:
      ratio = rates[rate][f"speedup_vs_{baseline}"]
      met = ratio is not None and ratio >= bound
    else:
      continue
    rows.append({"mode": mode, "baseline": baseline, "rate": rate, "ratio": ratio,
                 "bound": f"{'at most' if baseline == FREE_LINK else 'at least'} {bound:.2f}x",
                 "met": met})
  return rows


# The report -----------------------------------------------------------------


def _ratio(value: float | None) -> str:
  return "-" if value is None else f"{value:.2f}x"


def table(report: dict, num_processes: int) -> str:
  modes, full_rate = report["modes"], report["full_rate"]
  target = report["target_loss"]
  lines = [
      "", f"### {report['config']}, {num_processes} processes, {full_rate} a node, "
      f"{report['steps']} steps (measured)", "",
      *([report["setup"], ""] if report.get("setup") else []),
      f"Target: fp32's final training loss, {target:.4f} nats a byte (mean of its last "
      f"{report['smoothing']} steps)." if target is not None else "No fp32 run: no target.", "",
      "| mode | what travels | steps | s/step | MB/step sent | mean MB/step | final loss "
      "| step at target | training s to target | vs fp32 | vs bf16 |",
      "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for mode, entry in modes.items():
    rate = entry["rates"][full_rate]
    reached = entry["step_to_target"] is not None
    sent = entry["wire_bytes_per_step"]
    lines.append(
        f"| {mode} | {entry['what_travels']} | {entry['steps']} | {rate['seconds_per_step']:.3f} "
        f"| {_megabytes(sent)} | {_megabytes(entry['mean_wire_bytes_per_step'])} "
        f"| {entry['final_smoothed_train_loss']:.4f} "
        f"| {entry['step_to_target'] if reached else 'not reached'} "
        f"| {_seconds(rate['seconds_to_target']) if reached else _gap(entry)} "
        f"| {_ratio(rate['speedup_vs_fp32'])} | {_ratio(rate['speedup_vs_bf16'])} |")
  other_rates = [rate for rate in next(iter(modes.values()))["rates"] if rate != full_rate]
  lines += [
      "", "s/step is the median step time from the first step that sends what the last does"
      " (after the compressed Adams' freeze, PowerSGD's float32 start); MB/step sent is then,"
      " the mean over the run. Training seconds leave out compilation, evaluation and step 1"
      " (whose first run sets up gloo's connections). DiLoCo's s/step is the mean over its run"
      " (a sync every H steps), and it trains longer than fp32 (its learning-rate schedule"
      " stretched over its steps) to show where it reaches fp32's final loss.", "",
      f"### Seconds to the target by rate: {full_rate} measured, the others derived", "",
      "| rate | mode | s/step (measured) | training s to target | derived from step times "
      f"| vs fp32 | vs bf16 | over its {FREE_LINK} | over fp32's {FREE_LINK} |",
      "|---|---|---|---|---|---|---|---|---|",
  ]
  for rate in [full_rate, *other_rates]:
    for mode, entry in modes.items():
      figures = entry["rates"][rate]
      seconds = figures["seconds_to_target"]
      kind = "measured" if figures["measured"] else "derived"
      lines.append(
          f"| {rate} | {mode} | {figures['seconds_per_step']:.3f} ({figures['steps']} steps) "
          f"| {'not reached' if seconds is None else f'{seconds:.1f} ({kind})'} "
          f"| {_seconds(figures['derived_seconds_to_target'])} "
          f"| {_ratio(figures['speedup_vs_fp32'])} | {_ratio(figures['speedup_vs_bf16'])} "
          f"| {_ratio(figures['over_free_link'])} | {_ratio(figures['over_fp32_free_link'])} |")
  lines += [
      "", f"Derived: the {full_rate} run's steps up to the target, each timed as the median step"
      " of its kind (what it sends) in that rate's short run. At the measured rate the derived"
      " column checks the derivation against the measurement."]
  lines += _kinds_table(modes)
  if report["targets"]:
    lines += ["", "Targets: seconds to the target, a baseline's over the mode's (a speedup);"
              f" against {FREE_LINK}, the mode's over its own free-link run's.", "",
              "| target | ratio | target ratio | met |", "|---|---|---|---|"]
    for row in report["targets"]:
      lines.append(f"| {row['mode']} vs {row['baseline']} at {row['rate']} "
                   f"| {_ratio(row['ratio'])} | {row['bound']} "
                   f"| {'yes' if row['met'] else 'no'} |")
  return "\n".join(lines) + "\n"


def _kinds_table(modes: dict) -> list[str]:
  """DiLoCo's steps by what they send: the steps between syncs (0 bytes) and the exchanges."""
  rows = [(mode, rate, kind) for mode, entry in modes.items() if is_diloco(entry["flags"])
          for rate, figures in entry["rates"].items() for kind in figures["seconds_by_wire_bytes"]]
  if not rows:
    return []
  lines = ["", "DiLoCo's steps by what they send across workers (the median step of each kind,"
           " step 1 left out):", "", "| mode | rate | MB sent | s/step |", "|---|---|---|---|"]
  for mode, rate, kind in rows:
    lines.append(f"| {mode} | {rate} | {_megabytes(kind['wire_bytes'])} | {kind['seconds']:.3f} |")
  return lines


def _megabytes(value: float | None) -> str:
  return "-" if value is None else f"{value / 1e6:.3f}"


def _gap(entry: dict) -> str:
  gap = entry["gap_to_target"]
  return "not reached" if gap is None else f"not reached (final {gap:+.4f})"


def _seconds(value: float | None) -> str:
  return "-" if value is None else f"{value:.1f}"
