"""Trains one configuration once per compression mode and compares accuracy with bytes sent.

  python -m examples.imagenet.compare --workdir=DIR [--config=examples/imagenet/configs/digits.py]

Each mode's run goes to ``DIR/<mode>/`` (``metrics.jsonl``, ``summary.json``);
the comparison to ``DIR/comparison.md`` (a table) and ``DIR/comparison.png``
(training loss against steps; evaluation accuracy against bytes sent).
"""

import json
import pathlib
import time

from absl import app, flags
from ml_collections import config_flags

from examples.imagenet import devices

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Directory for the runs, the table and the plot.")
flags.DEFINE_list(
    "modes", "fp32,bf16,qsgd4,qsgd8,minmax8,onebit,decentralized8",
    "Values of config.compression to compare, in order.",
)
config_flags.DEFINE_config_file(
    "config", str(pathlib.Path(__file__).parent / "configs" / "digits.py"),
    "Configuration to train with each mode.", lock_config=False,
)
flags.mark_flags_as_required(["workdir"])

COLUMNS = (
    "| mode | eval accuracy | final train loss | bytes/step | vs fp32 | Elias bytes/step "
    "| HLO bytes/step | train s | steps/s |"
)


def table(summaries: list[dict]) -> str:
  """A markdown table, one row a mode; bytes are what one device sends a step."""
  rows = [COLUMNS, "|" + "---|" * (COLUMNS.count("|") - 1)]
  for summary in summaries:
    elias = summary["elias_wire_bytes_per_step"]
    rows.append(
        f"| {summary['compression']} | {summary['eval_accuracy']:.2%} "
        f"| {summary['final_train_loss']:.4f} | {summary['wire_bytes_per_step']:,.0f} "
        f"| {summary['compression_ratio']:.1f}x "
        f"| {'-' if elias is None else f'{elias:,.0f}'} "
        f"| {summary['hlo_wire_bytes_per_step']:,.0f} "
        f"| {summary['train_seconds']:.0f} | {summary['steps_per_second']:.1f} |"
    )
  return "\n".join(rows) + "\n"


def plot(workdir: pathlib.Path, summaries: list[dict]) -> pathlib.Path:
  """Training loss against steps, and evaluation accuracy against megabytes sent."""
  import matplotlib

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt

  figure, (loss_axes, accuracy_axes) = plt.subplots(1, 2, figsize=(12, 4.5))
  for summary in summaries:
    mode = summary["compression"]
    records = [json.loads(line) for line in (workdir / mode / "metrics.jsonl").open()]
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
  import jax  # After the device flags.

  from examples.imagenet import train

  workdir = pathlib.Path(FLAGS.workdir)
  start = time.perf_counter()
  summaries = []
  for mode in FLAGS.modes:
    config = FLAGS.config.copy_and_resolve_references()
    config.compression = mode
    config.checkpoint_every_steps = 0  # Every run starts afresh, whatever the workdir holds.
    summaries.append(train.train_and_evaluate(config, str(workdir / mode)))
  wall = time.perf_counter() - start
  config = FLAGS.config
  header = (
      f"{config.model} on {config.dataset}, {config.parallelism} over "
      f"{jax.device_count()} {jax.default_backend()} devices, batch {config.batch_size}, "
      f"{summaries[0]['steps']} steps; {wall:.0f} s for all modes (compilation included).\n\n"
      "Bytes are what one device sends for the gradients each step (HLO: every collective "
      "of the compiled step, BatchNorm statistics and metrics included).\n\n"
  )
  (workdir / "comparison.md").write_text(header + table(summaries))
  plot(workdir, summaries)
  print(header + table(summaries))


if __name__ == "__main__":
  app.run(main)
