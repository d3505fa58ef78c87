"""Part 4 of ``network.py``: time per step of the language model under FSDP, real processes.

``examples/lm/main.py --parallelism=fsdp --multihost`` on ``N`` processes of
one CPU device each, over the namespace's shaped loopback (``network.py``),
once a mode and rate: float32 FSDP (weights gathered and gradients
reduce-scattered in float32), bfloat16 FSDP, 8-bit weights with 4-bit
gradients, and 1-bit Adam under FSDP (8-bit weights; float32 gradients for
``freeze_step`` steps, then 1-bit). A step's time is the median over the
logging windows after the first (and, for 1-bit Adam, after the freeze) of the
window's seconds a step, compilation and evaluation left out; bytes are the
compiled step's collectives (``summary.json``'s ``hlo_wire_bytes_per_step``;
for 1-bit Adam both branches of its switch, of which a step runs one: the
1-bit step's are given apart).
"""

import pathlib
import statistics

import network_lm

CONFIG = "examples/lm/configs/small.py"
# name: (what travels, the example's flags).
MODES = {
    "fp32": ("float32 weights, float32 gradients",
             ["--average=fp32", "--config.fsdp_weights=fp32"]),
    "bf16": ("bfloat16 weights, bfloat16 gradients",
             ["--average=bf16", "--config.fsdp_weights=bf16"]),
    "int8_qsgd4": ("8-bit weights (NearestAbsMax), 4-bit QSGD gradients",
                   ["--average=qsgd4", "--config.fsdp_weights=int8"]),
    "onebit_adam": ("8-bit weights, 1-bit gradients after the freeze (1-bit Adam)",
                    ["--optimizer=onebit_adam", "--average=fp32", "--config.fsdp_weights=int8"]),
}
QUICK_MODES = ("fp32", "int8_qsgd4")
RATES = ("100 Mbit/s", "1 Gbit/s")
QUICK_RATES = ("100 Mbit/s",)
STEPS = 40
QUICK_STEPS = 20
LOG_EVERY = 5


def add_arguments(parser) -> None:
  parser.add_argument("--fsdp-modes", nargs="+", choices=tuple(MODES), default=None,
                      help=f"part lm_fsdp's modes; default {tuple(MODES)}")
  parser.add_argument("--fsdp-rates", nargs="+", default=None,
                      help=f"part lm_fsdp's rates a node; default {RATES}")
  parser.add_argument("--fsdp-steps", type=int, default=None,
                      help=f"part lm_fsdp's training steps a run; default {STEPS}")


def resolve_arguments(args) -> None:
  """The defaults of the part's arguments, shorter with ``--quick``."""
  args.fsdp_modes = tuple(args.fsdp_modes or (QUICK_MODES if args.quick else MODES))
  args.fsdp_rates = tuple(args.fsdp_rates or (QUICK_RATES if args.quick else RATES))
  args.fsdp_steps = args.fsdp_steps or (QUICK_STEPS if args.quick else STEPS)
  if args.fsdp_steps < 4 * LOG_EVERY:
    raise ValueError(f"--fsdp-steps must be at least {4 * LOG_EVERY}: the median is over "
                     f"windows of {LOG_EVERY} steps after the first and after the freeze.")


def freeze_step(num_steps: int) -> int:
  """1-bit Adam's float32 warm-up: the first quarter, in whole logging windows."""
  return max(LOG_EVERY, num_steps // 4 // LOG_EVERY * LOG_EVERY)


def seconds_per_step(records: list[dict], after_step: int) -> float:
  """The median of the logging windows' seconds a step, over windows after ``after_step``."""
  windows = {}
  for record in records:
    if "loss" in record and record["step"] > after_step:
      windows[(record["step"] - 1) // LOG_EVERY] = 1 / record["steps_per_second"]
  return statistics.median(windows.values())


def run(launcher, args, work: pathlib.Path, rates: dict, log) -> dict:
  """Trains the example once a mode and rate; returns each run's time a step and bytes."""
  steps = args.fsdp_steps
  freeze = freeze_step(steps)
  results = {}
  for rate in args.fsdp_rates:
    if launcher.namespace:
      launcher.namespace.set_rate(rates[rate], args.processes)
    elif rate != "unthrottled":
      log(f"part lm_fsdp: no namespace, so {rate} is not measured")
      continue
    results[rate] = {}
    for mode in args.fsdp_modes:
      workdir = work / "lm_fsdp" / rate.replace(" ", "_").replace("/", "_") / mode
      flags = [*MODES[mode][1], "--parallelism=fsdp", f"--config.num_train_steps={steps}",
               f"--config.freeze_step={freeze}", f"--config.log_every_steps={LOG_EVERY}",
               f"--config.eval_every_steps={steps}", "--config.num_eval_batches=1",
               "--config.checkpoint_every_steps=0"]
      log(f"lm_fsdp {mode} at {rate} ({args.processes} processes, {steps} steps)")
      launch_seconds, summary, records = network_lm.launch_example(launcher, CONFIG, flags,
                                                                   workdir)
      after = max(LOG_EVERY, freeze) if mode == "onebit_adam" else LOG_EVERY
      results[rate][mode] = {
          "seconds_per_step": seconds_per_step(records, after),
          "measured_after_step": after,
          "hlo_wire_bytes_per_step": summary["hlo_wire_bytes_per_step"],
          "hlo_wire_bytes_by_collective": summary["hlo_wire_bytes_by_collective"],
          "compile_seconds": summary["compile_seconds"],
          "launch_seconds": launch_seconds,
          "final_train_loss": summary["final_train_loss"],
          "num_params": summary["num_params"],
      }
    _add_onebit_bytes(results[rate])
  return {"config": CONFIG, "steps": steps, "freeze_step": freeze, "rates": results}


def _add_onebit_bytes(modes: dict) -> None:
  """The bytes of a 1-bit step. 1-bit Adam's HLO counts both branches of its switch; the
  warm-up's all-to-alls are the float32 reduce-scatter, the fp32 run's all-to-alls."""
  if "onebit_adam" not in modes or "fp32" not in modes:
    return
  onebit = modes["onebit_adam"]["hlo_wire_bytes_by_collective"]
  float32 = modes["fp32"]["hlo_wire_bytes_by_collective"]
  modes["onebit_adam"]["onebit_step_wire_bytes"] = (
      modes["onebit_adam"]["hlo_wire_bytes_per_step"] - float32.get("all-to-all", 0.0))
  modes["onebit_adam"]["warm_up_all_to_all_bytes"] = float32.get("all-to-all", 0.0)
  modes["onebit_adam"]["onebit_all_to_all_bytes"] = (
      onebit.get("all-to-all", 0.0) - float32.get("all-to-all", 0.0))


def table(report: dict, num_processes: int, rates: dict) -> str:
  lines = []
  for rate, modes in report["rates"].items():
    per_node = rates[rate]
    lines += [
        "", f"### {report['config']}, {num_processes} processes, {rate} a node, "
        f"{report['steps']} steps", "",
        "| mode | what travels | s/step | vs fp32 | vs bf16 | HLO MB/device/step "
        "| wire floor s/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, entry in modes.items():
      seconds = entry["seconds_per_step"]
      sent = entry.get("onebit_step_wire_bytes", entry["hlo_wire_bytes_per_step"])
      versus = [f"{modes[base]['seconds_per_step'] / seconds:.2f}x" if base in modes else "-"
                for base in ("fp32", "bf16")]
      floor = "-" if per_node is None else f"{8 * sent / per_node:.3f}"
      lines.append(f"| {mode} | {MODES[mode][0]} | {seconds:.3f} | {versus[0]} | {versus[1]} "
                   f"| {sent / 1e6:.3f} | {floor} |")
  lines += [
      "", f"A step's time is the median over the logging windows ({LOG_EVERY} steps) after the"
      f" first, and for onebit_adam after its freeze (step {report['freeze_step']}); its bytes"
      " are the 1-bit steps'. The wire floor is the bytes over the per-node rate."]
  return "\n".join(lines) + "\n"
