"""Trains one configuration once per compression mode and seed; compares accuracy with bytes sent.

  python -m examples.imagenet.compare --workdir=DIR [--config=examples/imagenet/configs/digits.py]
      [--seeds=0,1,2] [--results=benchmarks/results/digits_comparison]

Each run goes to ``DIR/<mode>/`` (``DIR/<mode>/seed<k>/`` with several seeds:
``metrics.jsonl``, ``summary.json``); the comparison to ``DIR/comparison.md``
(a table), ``DIR/comparison.json`` (every run's summary, and each mode's
accuracy over the seeds) and ``DIR/comparison.png`` (training loss against
steps; evaluation accuracy against bytes sent), and, with ``--results=PREFIX``,
to ``PREFIX.md``, ``PREFIX.json`` and ``PREFIX.png`` as well.

A run's accuracy on the 360 held-out digits moves by a digit or two (0.28% each)
with the seed, and with the CPU: XLA compiles float32 sums for the
processor's vector width, so another CPU adds in another order and ends
elsewhere. Compare modes by the spread over seeds (``--seeds=0,1,2``), not by
one run.
"""

import json
import pathlib
import platform
import shutil
import statistics
import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

from examples.imagenet import devices

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Directory for the runs, the table and the plot.")
flags.DEFINE_list(
    "modes", "fp32,bf16,qsgd4,qsgd8,minmax8,onebit,decentralized8",
    "Values of config.compression to compare, in order.",
)
flags.DEFINE_list("seeds", None, "Values of config.seed to run each mode with (default: the"
                  " config's own).")
flags.DEFINE_string("results", None, "Also write the table, JSON and plot to PREFIX.md, .json"
                    " and .png (e.g. benchmarks/results/digits_comparison).")
config_flags.DEFINE_config_file(
    "config", str(pathlib.Path(__file__).parent / "configs" / "digits.py"),
    "Configuration to train with each mode.", lock_config=False,
)
flags.mark_flags_as_required(["workdir"])

COLUMNS = (
    "| mode | eval accuracy | final train loss | bytes/step | vs fp32 | Elias bytes/step "
    "| HLO bytes/step, least-most | train s | steps/s |"
)


def accuracy_over_seeds(runs: list[dict]) -> dict:
  """``mean``, ``min``, ``max`` and ``std`` (0 for one run) of the runs' eval accuracy."""
  values = [run["eval_accuracy"] for run in runs]
  return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
          "std": statistics.stdev(values) if len(values) > 1 else 0.0, "runs": len(values)}


def _accuracy(runs: list[dict]) -> str:
  spread = accuracy_over_seeds(runs)
  if spread["runs"] == 1:
    return f"{spread['mean']:.2%}"
  return f"{spread['mean']:.2%} ({spread['min']:.2%}-{spread['max']:.2%})"


def hlo_bytes_range(summary: dict) -> tuple[float, float]:
  """The fewest and most bytes a step of the compiled program sends (the lightest and heaviest
  branch of its conditionals: top-k's step and its float32 warm-up); a run recorded before
  them reads its one figure, every branch added, for both."""
  if "hlo_wire_bytes_least" not in summary:
    return (summary["hlo_wire_bytes_per_step"],) * 2
  return summary["hlo_wire_bytes_least"], summary["hlo_wire_bytes_most"]


def hlo_bytes_cell(summary: dict) -> str:
  least, most = hlo_bytes_range(summary)
  return f"{least:,.0f}" if least == most else f"{least:,.0f}-{most:,.0f}"


def table(modes: dict[str, list[dict]]) -> str:
  """A markdown table, one row a mode (its first seed's run, the accuracy over every seed)."""
  rows = [COLUMNS, "|" + "---|" * (COLUMNS.count("|") - 1)]
  for runs in modes.values():
    summary = runs[0]
    elias = summary["elias_wire_bytes_per_step"]
    rows.append(
        f"| {summary['compression']} | {_accuracy(runs)} "
        f"| {summary['final_train_loss']:.4f} | {summary['wire_bytes_per_step']:,.0f} "
        f"| {summary['compression_ratio']:.1f}x "
        f"| {'-' if elias is None else f'{elias:,.0f}'} "
        f"| {hlo_bytes_cell(summary)} "
        f"| {summary['train_seconds']:.0f} | {summary['steps_per_second']:.1f} |"
    )
  return "\n".join(rows) + "\n"


def plot(workdir: pathlib.Path, summaries: list[dict]) -> pathlib.Path:
  """Training loss against steps, and evaluation accuracy against megabytes sent.

  ``summaries`` are one run a mode, each with its ``workdir`` (its metrics).
  """
  import matplotlib

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt

  figure, (loss_axes, accuracy_axes) = plt.subplots(1, 2, figsize=(12, 4.5))
  for summary in summaries:
    mode = summary["compression"]
    records = [json.loads(line)
               for line in (pathlib.Path(summary["workdir"]) / "metrics.jsonl").open()]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_accuracy" in r]
    loss_axes.plot([r["step"] for r in train], _smoothed([r["loss"] for r in train]), label=mode)
    megabytes = [r["step"] * summary["wire_bytes_per_step"] / 1e6 for r in evals]
    accuracy_axes.plot(megabytes, [r["eval_accuracy"] for r in evals], marker="o", label=mode)
  loss_axes.set(xlabel="step", ylabel="training loss (mean of 10 steps)", yscale="log")
  accuracy_axes.set(xlabel="megabytes sent by one device (gradients)", ylabel="eval accuracy",
                    xscale="log")
  for axes in (loss_axes, accuracy_axes):
    axes.grid(alpha=0.3)
    axes.legend()
  figure.tight_layout()
  path = workdir / "comparison.png"
  figure.savefig(path, dpi=120)
  return path


def _smoothed(values: list[float], window: int = 10) -> list[float]:
  """The mean of each value and the ``window - 1`` before it (fewer at the start)."""
  means = []
  for end in range(1, len(values) + 1):
    recent = values[max(0, end - window) : end]
    means.append(sum(recent) / len(recent))
  return means


def main(argv):
  if len(argv) > 1:
    raise app.UsageError("Too many command-line arguments.")
  devices.simulate_cpu_devices()
  devices.quiet_backend_probe()
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # --verbosity=0 shows each run's INFO lines.
  import jax  # After the device flags.

  from examples.imagenet import train

  workdir = pathlib.Path(FLAGS.workdir)
  seeds = [int(seed) for seed in FLAGS.seeds] if FLAGS.seeds else [FLAGS.config.seed]
  start = time.perf_counter()
  modes = {}
  for mode in FLAGS.modes:
    modes[mode] = []
    for seed in seeds:
      config = FLAGS.config.copy_and_resolve_references()
      config.compression, config.seed = mode, seed
      config.checkpoint_every_steps = 0  # Every run starts afresh, whatever the workdir holds.
      run_dir = workdir / mode / (f"seed{seed}" if len(seeds) > 1 else "")
      summary = train.train_and_evaluate(config, str(run_dir))
      modes[mode].append({**summary, "seed": seed, "workdir": str(run_dir)})
  wall = time.perf_counter() - start
  config = FLAGS.config
  first = next(iter(modes.values()))[0]
  seeds_said = (f"seed {seeds[0]}" if len(seeds) == 1 else
                f"seeds {', '.join(map(str, seeds))} (accuracy: mean, then the range)")
  header = (
      f"{config.model} on {config.dataset}, {config.parallelism} over "
      f"{jax.device_count()} {jax.default_backend()} devices, batch {config.batch_size}, "
      f"{first['steps']} steps, {seeds_said}; {wall:.0f} s for all runs (compilation "
      "included).\n\n"
      "Bytes are what one device sends for the gradients each step (HLO: every collective "
      "of the compiled step, BatchNorm statistics and metrics included).\n\n"
  )
  if config.dataset == "digits":
    header += (f"One held-out digit is {1 / 360:.2%}: a run's accuracy moves by a digit or two "
               "with the seed and the CPU, so compare modes over several seeds "
               "(--seeds=0,1,2).\n\n")
  report = {
      "command": "python -m examples.imagenet.compare " + " ".join(sys.argv[1:]),
      "config": config.to_dict(), "devices": jax.device_count(),
      "platform": jax.default_backend(), "processor": platform.processor() or platform.machine(),
      "jax_version": jax.__version__, "seeds": seeds, "wall_seconds": wall,
      "modes": {mode: {"eval_accuracy": accuracy_over_seeds(runs), "runs": runs}
                for mode, runs in modes.items()},
  }
  (workdir / "comparison.md").write_text(header + table(modes))
  (workdir / "comparison.json").write_text(json.dumps(report, indent=1) + "\n")
  plot(workdir, [runs[0] for runs in modes.values()])
  if FLAGS.results:
    prefix = pathlib.Path(FLAGS.results)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    for suffix in (".md", ".json", ".png"):
      shutil.copyfile(workdir / f"comparison{suffix}", prefix.with_suffix(suffix))
  print(header + table(modes))


if __name__ == "__main__":
  app.run(main)
