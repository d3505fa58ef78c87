"""Trains one configuration once per mode and compares held-out loss with bytes sent.

  python -m examples.lm.compare --workdir=DIR [--config=examples/lm/configs/small.py] \
      [--modes=fp32,bf16,qsgd4,qsgd8,qsgd4_ef,onebit] [--results=PREFIX]

A mode names a value of ``config.average`` or of ``config.optimizer``, or one
of each joined by ``+`` (``adamw+qsgd4``); a part ``field=value`` sets any
other config field (``fp32+fsdp_weights=fp32``, ``diloco+fp32+outer_split=True``).
The runs go one after the other, each into ``DIR/<mode>/`` (``metrics.jsonl``,
``summary.json``); the comparison into ``DIR/comparison.json``, ``DIR/comparison.md`` (a table: the
held-out loss and its difference from the ``fp32`` and ``bf16`` runs, bytes
sent, tokens a second) and ``DIR/comparison.png`` (held-out loss against steps
and against bytes sent). The ``fp32`` (``bf16``) run is the first whose mode
starts with ``fp32`` (``bf16``).

FSDP's comparison, float32, bfloat16, 8-bit weights with 4-bit gradients, and
4-bit both ways::

  python -m examples.lm.compare --workdir=DIR --config.parallelism=fsdp \
      --modes=fp32+fsdp_weights=fp32,bf16+fsdp_weights=bf16,qsgd4+fsdp_weights=int8,\
qsgd4+fsdp_weights=int4
"""

import json
import pathlib
import time

from absl import app, flags, logging
from ml_collections import config_flags

from examples.lm import devices

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Directory for the runs, the table and the plot.")
flags.DEFINE_list("modes", "fp32,bf16,qsgd4,qsgd8,qsgd4_ef,onebit",
                  "Modes to compare, in order: averages, optimizers, or optimizer+average.")
config_flags.DEFINE_config_file(
    "config", str(pathlib.Path(__file__).parent / "configs" / "small.py"),
    "Configuration to train with each mode.", lock_config=False,
)
flags.DEFINE_string("results", None, "Also write the table, JSON and plot to PREFIX.md, .json"
                    " and .png (e.g. benchmarks/results/lm_comparison).")
flags.DEFINE_bool("reuse_runs", False, "Read a mode's DIR/<mode>/summary.json and metrics.jsonl"
                  " if they exist instead of training it again (a comparison that was"
                  " interrupted, or runs of main.py with this config into DIR/<mode>).")
flags.mark_flags_as_required(["workdir"])

BASELINES = ("fp32", "bf16")
COLUMNS = ("| mode | held-out loss | vs fp32 | vs bf16 | final train loss | bytes/step "
           "| vs fp32 bytes | HLO bytes/step, least-most | tokens/s | train s |")


def apply_mode(config, mode: str, optimizers, averages) -> None:
  """Sets ``config.optimizer``, ``config.average`` and ``field=value`` parts from ``mode``."""
  for choice in mode.split("+"):
    field, is_setting, value = choice.partition("=")
    if is_setting:
      if field not in config or type(config[field]) not in (str, int, float, bool):
        raise ValueError(f"Mode {mode!r}: {field!r} is not a str, int, float or bool config "
                         "field.")
      if type(config[field]) is bool:
        if value not in ("True", "False"):
          raise ValueError(f"Mode {mode!r}: {field!r} is a bool: True or False, got {value!r}.")
        config[field] = value == "True"
      else:
        config[field] = type(config[field])(value)
    elif choice in optimizers:
      config.optimizer = choice
    elif choice in averages:
      config.average = choice
    else:
      raise ValueError(f"Mode {mode!r}: {choice!r} is neither an optimizer "
                       f"({', '.join(optimizers)}) nor an average ({', '.join(averages)}).")


def baselines(runs: list[dict]) -> dict[str, dict]:
  """The ``fp32`` and ``bf16`` runs: the first whose mode starts with that name."""
  found = {}
  for run in runs:
    name = run["mode"].split("+")[0]
    if name in BASELINES and name not in found:
      found[name] = run
  return found


def compared(runs: list[dict]) -> list[dict]:
  """Each run's summary with its mode and its held-out loss minus each baseline's."""
  found = baselines(runs)
  return [run | {f"eval_loss_minus_{name}": run["eval_loss"] - baseline["eval_loss"]
                 for name, baseline in found.items()} for run in runs]


def _summary(run_dir: pathlib.Path) -> dict | None:
  """With ``--reuse_runs``, a finished run's summary in ``run_dir``; else ``None`` (train it)."""
  path = run_dir / "summary.json"
  if not (FLAGS.reuse_runs and path.exists() and (run_dir / "metrics.jsonl").exists()):
    return None
  logging.warning("--reuse_runs: %s is read, not trained again", run_dir)
  return json.loads(path.read_text())


def bytes_per_step(run: dict) -> float:
  """What one device sends a step by the optimizer's account, else the HLO's: DiLoCo's mean
  over the run (across workers, nothing between syncs), any other's in the last step (from
  the HLO, a switched step's fewest: FSDP 1-bit Adam's after its freeze)."""
  if run.get("optimizer") == "diloco":
    return run["mean_wire_bytes_per_step"]
  wire = run["wire_bytes_per_step"]
  return hlo_bytes_range(run)[0] if wire is None else wire


def hlo_bytes_range(run: dict) -> tuple[float, float]:
  """The fewest and most bytes a step of the compiled program can send.

  ``qsgd_jax.wire_bytes_by_branch``'s ``least`` and ``most``: the lightest
  (heaviest) branch of every conditional, nested ones included, e.g. a
  compressed Adam's 1-bit step and its float32 warm-up. A run recorded
  before them reads its one figure, the sum of all branches, for both.
  """
  by_branch = run.get("hlo_wire_bytes_by_branch")
  if by_branch is None:
    return (run["hlo_wire_bytes_per_step"],) * 2
  return by_branch["least"], by_branch["most"]


def _hlo_cell(run: dict) -> str:
  least, most = hlo_bytes_range(run)
  return f"{least:,.0f}" if least == most else f"{least:,.0f}-{most:,.0f}"


def _mode_note(run: dict) -> str:
  """What the mode's cell adds: where a compressed Adam froze, DiLoCo's workers."""
  froze = run.get("freeze_step")
  if froze is not None:
    return f" (froze at {froze})"
  if run.get("optimizer") == "diloco":
    return f" ({run['diloco_workers']} workers, mean across them)"
  return ""


def table(runs: list[dict]) -> str:
  """A markdown table, one row a mode; bytes are what one device sends a step.

  "bytes/step" is what the last step sent by the optimizer's own account
  (:func:`qsgd_jax.compression_stats`; after a compressed Adam's freeze, its
  1-bit step), else the compiled step's HLO bytes (a switched step's fewest,
  its compressed branch: FSDP 1-bit Adam's after the freeze). "HLO bytes/step" is every
  collective of the compiled step, the fewest and the most a step sends: a
  switched program (a compressed Adam's warm-up and 1-bit steps, PowerSGD's
  exact and compressed steps) runs one branch of its switch a step. For
  DiLoCo "bytes/step" is the mean over the run of what a device sends across
  workers (its exchange of the outer gradient at each sync, zero between; the
  average inside a worker is left out), against data parallel's all-reduce
  over every device every step. "vs fp32 bytes" is the
  fp32 run's bytes a step over the row's, or without an fp32 run, a float32
  all-reduce of the gradients over the row's. A compressed Adam's mode says
  where it froze; DiLoCo's, its number of workers.
  """
  rows = [COLUMNS, "|" + "---|" * (COLUMNS.count("|") - 1)]
  fp32 = baselines(runs).get("fp32")
  for run in runs:
    fp32_bytes = (bytes_per_step(fp32) if fp32 is not None
                  else run["fp32_allreduce_bytes_per_step"])
    differences = [run.get(f"eval_loss_minus_{name}") for name in BASELINES]
    mode = run["mode"] + _mode_note(run)
    rows.append(
        f"| {mode} | {run['eval_loss']:.4f} "
        + "".join("| - " if d is None else f"| {d:+.4f} " for d in differences)
        + f"| {run['final_train_loss']:.4f} | {bytes_per_step(run):,.0f} "
        f"| {fp32_bytes / bytes_per_step(run):.1f}x "
        f"| {_hlo_cell(run)} | {run['tokens_per_second']:,.0f} "
        f"| {run['train_seconds']:.0f} |"
    )
  return "\n".join(rows) + "\n"


HYBRID_COLUMNS = ("| mode | held-out loss | vs fp32 | vs bf16 | across data, bytes/step | vs fp32 "
                  "| vs bf16 | inside a group, bytes/step | vs fp32 | params, bytes a device "
                  "| state, bytes a device |")


def across_data_bytes(run: dict) -> float:
  """What one device sends a step across the data axis (the compiled step's collectives whose
  groups span it): DiLoCo's mean over a round (a sync's exchange every ``sync_every`` steps,
  a metric's mean between), a compressed Adam's after its freeze (its fewest)."""
  least, most = run["hlo_across_data_bytes_least"], run["hlo_across_data_bytes_most"]
  if run.get("optimizer") == "diloco":
    return least + (most - least) * run["fragments"] / run["sync_every"]
  return least


def hybrid_table(runs: list[dict]) -> str:
  """A markdown table of runs on a mesh of data groups whose model is sharded (``hybrid``):
  bytes a step across the data axis and inside a group, and the bytes a device holds, each
  against the ``fp32`` run (the compiler's own step) and the ``bf16`` one."""
  rows = [HYBRID_COLUMNS, "|" + "---|" * (HYBRID_COLUMNS.count("|") - 1)]
  found = baselines(runs)

  def ratio(name: str, run: dict, of) -> str:
    return "-" if name not in found else f"{of(found[name]) / of(run):.1f}x"

  def inside(run):
    return run["hlo_inside_data_bytes_least"]

  for run in runs:
    differences = [run.get(f"eval_loss_minus_{name}") for name in BASELINES]
    rows.append(
        f"| {run['mode'] + _mode_note(run)} | {run['eval_loss']:.4f} "
        + "".join("| - " if d is None else f"| {d:+.4f} " for d in differences)
        + f"| {across_data_bytes(run):,.0f} | {ratio('fp32', run, across_data_bytes)} "
        f"| {ratio('bf16', run, across_data_bytes)} | {inside(run):,.0f} "
        f"| {ratio('fp32', run, inside)} | {run['param_bytes_per_device']:,.0f} "
        f"| {run['state_bytes_per_device']:,.0f} |")
  return "\n".join(rows) + "\n"


def bytes_sent(records: list[dict], steps: list[int], default: float) -> list[float]:
  """Bytes one device sent up to each of ``steps``, from the logged bytes a step.

  Each logged training record's ``wire_bytes`` stands for the steps since the
  previous record (a compressed Adam's bytes fall at its freeze); runs that
  log none send ``default`` every step.
  """
  logged = [(r["step"], r["wire_bytes"]) for r in records
            if "loss" in r and r.get("wire_bytes") is not None]
  totals, previous, sent = {}, 0, 0.0
  for step, wire in logged:
    sent += (step - previous) * wire
    totals[step], previous = sent, step
  return [totals.get(step, step * default) for step in steps]


def plot(workdir: pathlib.Path, runs: list[dict]) -> pathlib.Path:
  """Held-out loss against steps, and against megabytes sent by one device."""
  import matplotlib

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt

  figure, (steps_axes, bytes_axes) = plt.subplots(1, 2, figsize=(12, 4.5))
  for run in runs:
    records = [json.loads(line) for line in (workdir / run["mode"] / "metrics.jsonl").open()]
    evals = [r for r in records if "eval_loss" in r]
    steps = [r["step"] for r in evals]
    losses = [r["eval_loss"] for r in evals]
    steps_axes.plot(steps, losses, marker="o", label=run["mode"])
    megabytes = [sent / 1e6 for sent in bytes_sent(records, steps, bytes_per_step(run))]
    bytes_axes.plot(megabytes, losses, marker="o", label=run["mode"])
  steps_axes.set(xlabel="step", ylabel="held-out loss (nats/byte)")
  bytes_axes.set(xlabel="megabytes sent by one device",
                 ylabel="held-out loss (nats/byte)", xscale="log")
  for axes in (steps_axes, bytes_axes):
    axes.grid(alpha=0.3)
    axes.legend()
  figure.tight_layout()
  path = workdir / "comparison.png"
  figure.savefig(path, dpi=120)
  return path


def main(argv):
  if len(argv) > 1:
    raise app.UsageError("Too many command-line arguments.")
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # --verbosity=0 shows JAX's and orbax's INFO logs.
  devices.simulate_cpu_devices()
  import jax  # After the device flags.

  from examples.lm import train

  workdir = pathlib.Path(FLAGS.workdir)
  configs = []
  for mode in FLAGS.modes:  # Every mode checked before the first run.
    config = FLAGS.config.copy_and_resolve_references()
    apply_mode(config, mode, tuple(train.OPTIMIZERS), train.AVERAGES)
    config.checkpoint_every_steps = 0  # Every run starts afresh, whatever the workdir holds.
    configs.append(config)
  start = time.perf_counter()
  summaries = {mode: _summary(workdir / mode) for mode in FLAGS.modes}
  reused = [mode for mode, summary in summaries.items() if summary is not None]
  runs = [{"mode": mode, **(summaries[mode] or
                            train.train_and_evaluate(config, str(workdir / mode))),
           **({"diloco_workers": config.diloco_workers, "sync_every": config.sync_every,
               "fragments": config.fragments} if config.optimizer == "diloco" else {})}
          for mode, config in zip(FLAGS.modes, configs, strict=True)]
  wall = time.perf_counter() - start
  runs = compared(runs)
  config = FLAGS.config
  entropies = ", ".join(f"{runs[0][f'entropy_given_{order}_bytes']:.3f}" for order in range(3))
  header = (
      f"{config.num_layers} layers of width {config.width}, context {config.context_length}, "
      f"{runs[0]['num_params']:,} parameters; {config.parallelism} over {jax.device_count()} "
      f"{jax.default_backend()} devices, batch {config.batch_size} x {config.context_length} "
      f"bytes, {runs[0]['steps']} steps; {wall:.0f} s for "
      + ("all modes" if not reused else "the modes trained now") + " (compilation included)"
      + (f"; read from earlier runs of this config: {', '.join(reused)}" if reused else "")
      + ".\n\n"
      f"Held-out loss in nats a byte; the held-out text's entropy given 0, 1 and 2 bytes of "
      f"context: {entropies}. Bytes are what one device sends a step: the gradients' average "
      "as the optimizer reports it for the last step (a compressed Adam's after its freeze), "
      "and every collective of the compiled step (HLO: the metrics' means included; a "
      "switched step's fewest and most, its compressed and its float32 branch); \"vs fp32 "
      "bytes\" compares the former."
      + (" DiLoCo's bytes/step: the mean over the run of what a device sends across workers "
         "(its exchange of the outer gradient at each sync, nothing between; its worker's own "
         "average every step left out), against data parallel's all-reduce over all devices."
         if any(run.get("optimizer") == "diloco" for run in runs) else "")
      + "\n\n"
  )
  report = json.dumps({"config": config.to_dict(), "wall_seconds": wall, "runs": runs},
                      indent=2) + "\n"
  tables = table(runs)
  if all("hlo_across_data_bytes_least" in run for run in runs):
    tables += (
        "\nOn the mesh of data groups: bytes one device sends a step across the data axis "
        "(collectives whose groups span it: the slow links) and inside its group, read from "
        "the compiled step, against the fp32 run's (the compiler's own float32 step); bytes a "
        "device holds of the parameters and of the optimizer's state.\n\n"
        + hybrid_table(runs))
  (workdir / "comparison.md").write_text(header + tables)
  (workdir / "comparison.json").write_text(report)
  figure = plot(workdir, runs)
  if FLAGS.results:
    prefix = pathlib.Path(FLAGS.results)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".md").write_text(header + tables)
    prefix.with_suffix(".json").write_text(report)
    prefix.with_suffix(".png").write_bytes(figure.read_bytes())
  print(header + tables)


if __name__ == "__main__":
  app.run(main)
