"""DiLoCo on the language model: the sweep behind ``docs/guides/local_updates.md``.

  python benchmarks/diloco_sweep.py --workdir=runs/diloco_sweep [--reuse_runs] \
      [--reuse_results] [--results=benchmarks/results/lm_diloco]

Trains ``examples/lm/configs/small.py`` (2 layers of width 128, batch 32 of
64 bytes, 300 steps of AdamW) once per run of :data:`RUNS`, one after the
other, on 8 simulated CPU devices, each into ``DIR/<mode>/`` as
``examples/lm/compare.py`` would (a mode is compare's: ``diloco+fp32+
sync_every=50`` is ``--config.optimizer=diloco --config.average=fp32
--config.sync_every=50``); ``--reuse_runs`` reads a run's ``summary.json``
there instead of training it again (``python -m examples.lm.compare
--workdir=DIR --modes=MODE`` trains the same run), and ``--reuse_results``
takes it from the results written before if they trained the same config, so
that only the runs new to :data:`RUNS`, or changed, train. The bf16 data
parallel run is read again from ``lm_comparison.json`` each time. Every DiLoCo run averages
the gradients in float32 inside a worker (``fp32``) and is otherwise the
config's defaults but where its mode says: 2 workers of 4 devices, a sync every
20 steps, outer gradients in 4-bit QSGD with error feedback, outer SGD at
learning rate 1 without momentum. The global batch, the tokens and the
schedule are float32 data parallel's.

Writes ``PREFIX.json`` (each run's settings and summary, its held-out loss
minus float32 and bfloat16 data parallel's at the same number of steps, its
bytes a step and their ratios, the most one step sent: ``peak_wire_bytes_per_step``, its
held-out losses ``eval_curve`` and the step at which fp32 DP's curve reaches its final loss
``fp32_steps_to_this_loss``) and
``PREFIX.md`` (the table).

Bytes are what one device sends a step, on average over the run. For DiLoCo,
what crosses between workers: every device of a worker exchanges the whole
outer gradient with its counterparts in the other workers
(``qsgd_jax.compression_stats`` of its state, zero on a step without a sync:
the summary's ``mean_wire_bytes_per_step``), as its worker's other devices do,
or with ``outer_split=True`` its part of it; the float32 average inside a
worker, every step over the fast links, is reported apart with a split
exchange's gather (``mean_inner_wire_bytes_per_step``). For data parallel, every device's part
of the all-reduce over all 8 devices every step. Both count the same kind of
link: in a deployment where the workers are nodes joined by a slow network,
each device's bytes in either case cross it.
"""

import argparse
import itertools
import json
import pathlib
import sys
import time

_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))

from examples.lm import compare, devices  # noqa: E402
from examples.lm.configs import small  # noqa: E402

DILOCO = "diloco+fp32"  # 2 workers, H = 20, 4-bit outer gradients, outer SGD at lr 1.


def steps(count: int) -> str:
  """A mode's part for a run of ``count`` steps, the warm-up a tenth of them as in 300."""
  return f"+num_train_steps={count}+warmup_steps={count // 10}"


LONG = steps(1200)
H100 = steps(1205)
# (group, mode): what each run answers, the baselines first.
RUNS = (
    ("data parallel", "fp32"),
    ("data parallel", "fp32+seed=1"),
    *(("data parallel", "fp32" + steps(count)) for count in (1200, 2400, 4800)),
    ("outer optimizer", DILOCO),
    ("outer optimizer", DILOCO + "+outer_learning_rate=0.8"),
    ("outer optimizer", DILOCO + "+outer_learning_rate=1.4"),
    ("outer optimizer", DILOCO + "+outer_momentum=0.5"),
    ("outer optimizer", DILOCO + "+outer_momentum=0.7"),
    ("outer optimizer", DILOCO + "+outer_learning_rate=0.7+outer_momentum=0.9"),
    ("inner learning rate", DILOCO + "+learning_rate=0.004"),
    ("inner learning rate", DILOCO + "+learning_rate=0.01"),
    ("inner learning rate", DILOCO + "+outer_momentum=0.5+learning_rate=0.01"),
    ("seed", DILOCO + "+seed=1"),
    ("seed", DILOCO + "+outer_momentum=0.5+seed=1"),
    *(("steps", DILOCO + steps(count)) for count in (1200, 2400, 4800)),
    ("steps", DILOCO + "+outer_momentum=0.5" + LONG),
    ("steps", DILOCO + "+outer_learning_rate=0.7+outer_momentum=0.9" + LONG),
    ("steps", DILOCO + "+learning_rate=0.01" + LONG),
    ("steps", DILOCO + "+outer_average=sparseloco" + LONG),
    # 240 rounds: at 1.56% an element is sent about once in 64 of them.
    ("steps", DILOCO + "+outer_average=sparseloco" + steps(4800)),
    ("workers", DILOCO + "+diloco_workers=4"),
    ("workers", DILOCO + "+diloco_workers=8"),
    *(("sync every", f"{DILOCO}+sync_every={every}") for every in (1, 5, 10, 50, 100)),
    *(("outer average", f"{DILOCO}+outer_average={average}") for average in ("fp32", "bf16",
                                                                              "onebit")),
    ("outer average", DILOCO + "+outer_split=True"),  # Each of a worker's devices a quarter.
    # SparseLoCo: top-k of each worker's error feedback, 2-bit values, at Templar's density
    # (1.56%) and the paper's 512M runs' (3.1%).
    ("outer average", DILOCO + "+outer_average=sparseloco"),
    ("outer average", DILOCO + "+outer_average=sparseloco+sparseloco_density=0.03125"),
    ("outer average", DILOCO + "+outer_average=sparseloco+sparseloco_error_decay=1.0"),
    ("outer average",
     DILOCO + "+outer_average=sparseloco+sparseloco_aggregation=mean_over_workers"),
    *(("streaming", f"{DILOCO}+fragments=2+fragment_delay={delay}") for delay in (1, 2, 3, 5)),
    ("streaming", DILOCO + "+fragments=2+fragment_delay=5+fragment_alpha=0.5"),
    ("streaming", DILOCO + "+fragments=3+fragment_delay=2"),
    ("streaming", DILOCO + "+fragment_delay=5"),  # One fragment, its exchange overlapped.
    *(("streaming", f"{DILOCO}+sync_every=50+fragments=2+fragment_delay={delay}")
      for delay in (1, 5)),
    # The delay's cost against the spread between seeds (seed 0's rows above).
    ("streaming seeds", DILOCO + "+seed=2"),
    *(("streaming seeds", f"{DILOCO}+fragments=2+fragment_delay={delay}+seed={seed}")
      for seed in (1, 2) for delay in (1, 2, 5)),
    # Streaming DiLoCo's own setting: H = 100, delays of at most 5% of a round. The runs end 5
    # steps after the last sync, so that every fragment's last exchange is merged when they are
    # evaluated (at 1,200 the last fragment's is still in flight).
    ("streaming at H = 100", "fp32" + H100),
    *(("streaming at H = 100", f"{DILOCO}+sync_every=100{H100}+seed={seed}") for seed in (0, 1, 2)),
    *(("streaming at H = 100",
       f"{DILOCO}+sync_every=100+fragments=2+fragment_delay={delay}{H100}+seed={seed}")
      for seed in (0, 1, 2) for delay in (1, 2, 5)),
)
DATA_PARALLEL = ("fp32", "bf16")
SETTINGS = ("average", "diloco_workers", "sync_every", "outer_average", "outer_learning_rate",
            "outer_momentum", "outer_nesterov", "outer_split", "fragments", "fragment_delay",
            "fragment_alpha", "sparseloco_density", "sparseloco_error_decay",
            "sparseloco_aggregation",
            "learning_rate", "num_train_steps", "warmup_steps", "seed")
# Config fields that name the mode rather than the model and data: ignored when checking that
# lm_comparison.json's bf16 run trained the same config.
MODE_FIELDS = {"average", "optimizer", "checkpoint_every_steps"}


def configured(mode: str):
  """The sweep's config with ``mode`` applied (compare.py's rules)."""
  from examples.lm import train

  config = small.get_config()
  compare.apply_mode(config, mode, tuple(train.OPTIMIZERS), train.AVERAGES)
  config.checkpoint_every_steps = 0
  return config


def summary_of(mode: str, workdir: pathlib.Path, reuse_runs: bool) -> dict:
  """The run's summary: read with ``--reuse_runs`` if it is there, else trained now."""
  from examples.lm import train

  path = workdir / mode / "summary.json"
  if reuse_runs and path.exists():
    summary = json.loads(path.read_text())
  else:
    summary = train.train_and_evaluate(configured(mode), str(workdir / mode))
  records = [json.loads(line) for line in (workdir / mode / "metrics.jsonl").open()]
  sent = [r["wire_bytes"] for r in records if r.get("wire_bytes") is not None]
  # The most a step sent: a whole model's exchange, or with fragments, the largest one's.
  return summary | {"peak_wire_bytes_per_step": max(sent, default=None),
                    "eval_curve": [[r["step"], r["eval_loss"]] for r in records
                                   if "eval_loss" in r]}


def steps_to(curve: list[list[float]], loss: float) -> float | None:
  """The step at which a held-out loss ``curve`` first reaches ``loss`` (linear between its
  evaluations), or ``None`` if it never does (or does at its first)."""
  for (step, before), (next_step, after) in itertools.pairwise(curve):
    if before > loss >= after:
      return step + (next_step - step) * (before - loss) / (before - after)
  return None


def bytes_per_step(summary: dict) -> float:
  """What one device sends a step on average: DiLoCo's across workers, else every step's."""
  if summary["optimizer"] == "diloco":
    return summary["mean_wire_bytes_per_step"]
  return summary["wire_bytes_per_step"]


def bf16_from_comparison(path: pathlib.Path) -> dict | None:
  """lm_comparison.json's bf16 run, if it trained this sweep's config (its defaults)."""
  if not path.exists():
    return None
  comparison = json.loads(path.read_text())
  ours = small.get_config().to_dict()
  theirs = comparison["config"]
  if any(ours[k] != theirs[k] for k in theirs.keys() & ours.keys() - MODE_FIELDS):
    return None
  return next((r for r in comparison["runs"] if r["mode"] == "bf16"), None)


def stored_runs(path: pathlib.Path) -> dict[str, dict]:
  """The runs of an earlier sweep's ``PREFIX.json`` by mode: none if it is not there or
  trained another config than ``small.py``'s now (a field they share differs: every run then
  trains again)."""
  if not path.exists():
    return {}
  stored = json.loads(path.read_text())
  ours = small.get_config().to_dict()
  theirs = stored["config"]
  # A field added to the config since the runs is not compared: they trained before it was.
  changed = sorted(k for k in theirs.keys() & ours.keys() - MODE_FIELDS if ours[k] != theirs[k])
  if changed:
    print(f"{path} trained another config ({', '.join(changed)} differ): every run trains "
          "again.", file=sys.stderr)
    return {}
  return {run["mode"]: run for run in stored["runs"]}


def same_settings(stored: dict, settings: dict) -> bool:
  """Whether a stored run's settings are ``settings``: a setting it lacks (added to
  :data:`SETTINGS` since) counts as the config's default, which it trained with."""
  defaults = small.get_config()
  return all(stored.get(k, defaults.get(k)) == v for k, v in settings.items())


def rows(runs: list[dict]) -> list[dict]:
  """Each run with its gaps to fp32 and bf16 data parallel of the same length and bytes."""
  baselines = {(r["mode"].split("+")[0], r["steps"], r["settings"]["seed"]): r for r in runs
               if r["mode"].split("+")[0] in DATA_PARALLEL}
  out = []
  for run in runs:
    row = dict(run)
    row["bytes_per_step"] = bytes_per_step(run)
    for name in DATA_PARALLEL:
      baseline = baselines.get((name, run["steps"], run["settings"]["seed"]))
      row[f"eval_loss_minus_{name}"] = (None if baseline is None
                                        else run["eval_loss"] - baseline["eval_loss"])
      if name == "fp32":  # How many of fp32 DP's steps this run's final loss is worth.
        row["fp32_steps_to_this_loss"] = (None if baseline is None or not baseline.get(
            "eval_curve") else steps_to(baseline["eval_curve"], run["eval_loss"]))
      dp_bytes = next((b["wire_bytes_per_step"] for (kind, *_), b in baselines.items()
                       if kind == name), None)
      row[f"{name}_bytes_over_bytes"] = None if dp_bytes is None else dp_bytes / row[
          "bytes_per_step"]
    out.append(row)
  return out


def _outer(run: dict) -> str:
  settings = run["settings"]
  if settings["optimizer"] != "diloco":
    return "-"
  momentum = settings["outer_momentum"]
  kind = ("SGD" if not momentum else
          f"Nesterov {momentum:g}" if settings["outer_nesterov"] else f"momentum {momentum:g}")
  return f"{kind}, lr {settings['outer_learning_rate']:g}"


def _signed(value: float | None) -> str:
  return "-" if value is None else f"{value:+.3f}"


def table(runs: list[dict]) -> str:
  """The markdown table, one row a run."""
  lines = ["| group | mode | workers | H | outer average | outer optimizer | inner lr | steps "
           "| held-out loss | vs fp32 DP | vs bf16 DP | bytes/step | fewer than fp32 / bf16 DP |",
           "|---" * 13 + "|"]
  for run in runs:
    settings = run["settings"]
    diloco = settings["optimizer"] == "diloco"
    fragments = settings["fragments"]
    average = settings["outer_average"] + (", split" if settings["outer_split"] else "")
    if settings["outer_average"] == "sparseloco":
      average += (f" {settings['sparseloco_density']:.2%}, decay "
                  f"{settings['sparseloco_error_decay']:g}, {settings['sparseloco_aggregation']}")
    streaming = (f", {fragments} fragment{'s' if fragments > 1 else ''}, delay "
                 f"{settings['fragment_delay']}"
                 + (f", alpha {settings['fragment_alpha']:g}" if settings["fragment_alpha"] else "")
                 if diloco and (fragments > 1 or settings["fragment_delay"]) else "")
    ratios = " / ".join("-" if run[f"{b}_bytes_over_bytes"] is None
                        else f"{run[f'{b}_bytes_over_bytes']:,.1f}x" for b in DATA_PARALLEL)
    lines.append(
        f"| {run['group']} | `{run['mode']}` "
        f"| {settings['diloco_workers'] if diloco else '-'} "
        f"| {str(settings['sync_every']) + streaming if diloco else '-'} "
        f"| {average if diloco else '-'} | {_outer(run)} "
        f"| {settings['learning_rate']:g} | {run['steps']} | {run['eval_loss']:.4f} "
        f"| {_signed(run['eval_loss_minus_fp32'])} | {_signed(run['eval_loss_minus_bf16'])} "
        f"| {run['bytes_per_step']:,.0f} | {ratios} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", type=pathlib.Path, required=True,
                      help="directory for the runs, one a mode")
  parser.add_argument("--reuse_runs", action="store_true",
                      help="read a run's DIR/<mode>/summary.json if it exists")
  parser.add_argument("--reuse_results", action="store_true",
                      help="take a run from PREFIX.json (the results written before) if it "
                      "holds the mode with the same settings and config: only runs new to RUNS, "
                      "or changed, train")
  parser.add_argument("--results", type=pathlib.Path,
                      default=_ROOT / "benchmarks" / "results" / "lm_diloco",
                      help="write PREFIX.json and PREFIX.md")
  parser.add_argument("--lm_comparison", type=pathlib.Path,
                      default=_ROOT / "benchmarks" / "results" / "lm_comparison.json",
                      help="where the bf16 data-parallel run of 300 steps is read from "
                      "(compare.py's comparison of the same config) if the sweep has none")
  args = parser.parse_args(argv)
  devices.simulate_cpu_devices()
  import jax  # After the device flags.

  workdir = args.workdir
  for _, mode in RUNS:  # Every mode checked before the first run.
    configured(mode)
  stored = stored_runs(args.results.with_suffix(".json")) if args.reuse_results else {}
  start = time.perf_counter()
  runs = []
  for group, mode in RUNS:
    config = configured(mode)
    settings = {"optimizer": config.optimizer} | {k: config[k] for k in SETTINGS}
    run = stored.get(mode)
    if run is None or not same_settings(run["settings"], settings):
      run = summary_of(mode, workdir, args.reuse_runs)
    runs.append({"group": group, "mode": mode, "settings": settings} | {
        k: v for k, v in run.items() if k not in ("group", "mode", "settings")})
  bf16 = None
  if not any(r["mode"].split("+")[0] == "bf16" for r in runs):
    bf16 = bf16_from_comparison(args.lm_comparison)
    if bf16 is not None:
      runs.insert(1, {"group": "data parallel", "mode": "bf16",
                      "settings": {"optimizer": "adamw"} | {
                          k: small.get_config()[k] for k in SETTINGS} | {"average": "bf16"},
                      **{k: v for k, v in bf16.items() if not k.startswith("eval_loss_minus")}})
  runs = rows(runs)
  wall = time.perf_counter() - start
  trained = sum(r["train_seconds"] + r["compile_seconds"] for r in runs)
  config = small.get_config()
  command = "python benchmarks/diloco_sweep.py --workdir=runs/diloco_sweep"
  header = (
      f"`{command}` (the runs trained and compiled for {trained / 60:.0f} minutes in all on a "
      "shared 2-core machine): "
      f"`examples/lm/configs/small.py`, {config.num_layers} layers of width {config.width} "
      f"({runs[0]['num_params']:,} parameters), batch {config.batch_size} x "
      f"{config.context_length} bytes, AdamW (peak learning rate {config.learning_rate:g} "
      "unless the inner lr says, warm-up a tenth of the steps, cosine decay to a tenth), "
      f"{jax.device_count()} simulated {jax.default_backend()} devices, seed "
      f"{config.seed}.\n\n"
      "DiLoCo (`--config.optimizer=diloco`): the devices form `workers` workers of "
      f"{jax.device_count()} / workers devices, float32 gradient averaging inside a worker "
      "every step, and every H steps the outer gradients averaged across workers (the outer "
      "average) and applied by the outer optimizer. Held-out loss in nats a byte, at the "
      "end, against float32 and bfloat16 data parallel (DP) trained as long"
      + (" (bf16 DP: `lm_comparison.json`'s run of 300 steps)" if bf16 is not None else "")
      + ". Bytes/step: what one device sends on average over the run; for DiLoCo, across "
      "workers (each device of a worker exchanges the whole outer gradient at a sync, or with "
      "a split exchange its part of it, nothing between syncs), for DP, its part of the "
      "all-reduce over all devices every step.\n\n")
  prefix = args.results
  prefix.parent.mkdir(parents=True, exist_ok=True)
  prefix.with_suffix(".md").write_text(header + table(runs))
  prefix.with_suffix(".json").write_text(json.dumps(
      {"command": command, "config": config.to_dict(), "wall_seconds": wall,
       "bf16_from": args.lm_comparison.name if bf16 is not None else None, "runs": runs},
      indent=2) + "\n")
  print(header + table(runs))
  return 0


if __name__ == "__main__":
  sys.exit(main())
