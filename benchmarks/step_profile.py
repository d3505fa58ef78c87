"""Where a mode's training step spends its device time: the kernels of one step, by name.

Builds ``benchmarks/accelerator.py``'s one-device steps (a GPT-2-small-shaped
language model, each mode's optimizer with its collective over one device;
``diloco``, DiLoCo's step between syncs, through ``qsgd_jax.data_parallel``),
times each (median of ``--repeats`` samples of steps dispatched back to back, as a
training loop runs them; and, apart, one call dispatched and waited on, which adds the
host's work around a call that a loop hides), then runs ``--traced`` steps under
``jax.profiler.trace`` and reads the trace back with ``jax.profiler.ProfileData``:
every event that names an HLO instruction of the step's program (on a GPU
the kernels on the device's streams, on the CPU the thunks) is summed per
instruction and divided by the steps traced. Each instruction is shown with
the JAX operation it came from (its ``op_name`` metadata in the compiled HLO),
so a kernel reads as ``powersgd/.../qr`` rather than ``fusion.312``.

For each mode it prints the step's median time, the device time per step the
trace accounts for, and the instructions that take the most of it; then, for
each mode but AdamW, the operations whose time grew most over AdamW's step
(the same model and gradient: the difference is the mode's own work). The
whole record is written as JSON to ``--out``.

  python benchmarks/step_profile.py --modes powersgd zero_one_adam   # on the default device
  python benchmarks/step_profile.py --modes diloco                   # DiLoCo between syncs
  python benchmarks/step_profile.py --small                          # CPU-sized (seconds)
"""

import argparse
import collections
import glob
import importlib.util
import json
import os
import pathlib
import re
import sys
import tempfile

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("benchmarks_accelerator",
                                               _ROOT / "benchmarks" / "accelerator.py")
accelerator = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(accelerator)
qsgd_jax = accelerator.qsgd_jax

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*? ([\w\-]+)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# accelerator.py's modes, and DiLoCo's step between syncs.
MODES = (*accelerator.MODES, "diloco")
DILOCO_SYNC_EVERY = 1000
_KEPT_INSTRUCTIONS = 200  # The longest a mode's record keeps (a step has thousands).
# Instructions whose events enclose their bodies' (on the CPU): counted through those.
_CONTROL_FLOW = ("conditional", "while", "call")
_WRAPPERS = re.compile(r"\b(?:jit|pjit|jvp|transpose|shard_map|checkpoint|remat|vmap|"
                       r"custom_jvp_call|custom_vjp_call)\(([^()]*)\)")


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
  parser.add_argument("--small", action="store_true",
                      help="CPU-sized: a 1-layer 32-wide model")
  parser.add_argument("--batch", type=int, default=8, help="sequences a step")
  parser.add_argument("--repeats", type=int, default=5, help="timed steps")
  parser.add_argument("--traced", type=int, default=3, help="steps under the profiler")
  parser.add_argument("--top", type=int, default=15, help="instructions listed a mode")
  parser.add_argument("--out", type=pathlib.Path, default=None,
                      help="JSON record (default: benchmarks/results/<platform>/step_profile.json)")
  return parser.parse_args(argv)


def op_names(hlo_text: str) -> dict[str, str | None]:
  """Each instruction of a compiled program's text to its JAX operation, wrappers dropped.

  ``jit(step)/transpose(jvp(TransformerLM))/head/dot_general`` reads as
  ``step/TransformerLM/head/dot_general``; a conditional, loop or call maps
  to ``None``.
  """
  names = {}
  for line in hlo_text.splitlines():
    if (instruction := _INSTRUCTION.match(line)) is None:
      continue
    name, opcode = instruction.groups()
    op_name = _OP_NAME.search(line)
    names.setdefault(name, None if opcode in _CONTROL_FLOW else
                     _unwrapped(op_name.group(1)) if op_name else "")
  return names


def _unwrapped(op_name: str) -> str:
  """``op_name`` with every wrapper removed, nested ones too."""
  while (shorter := _WRAPPERS.sub(r"\1", op_name)) != op_name:
    op_name = shorter
  return op_name


def device_times(xspace_path: str, module_name: str) -> dict[str, float]:
  """Nanoseconds each HLO instruction of the program ``module_name`` ran, over a trace.

  Counts the events of the device planes (``/device:...``) when the trace has
  any, else those of the host's (the CPU's thunks): the host plane of a GPU
  trace names the same instructions when it launches them, which is not their
  time.
  """
  profile = jax.profiler.ProfileData.from_file(xspace_path)
  planes = [plane for plane in profile.planes if plane.name.startswith("/device:")]
  planes = planes or [plane for plane in profile.planes if plane.name.startswith("/host:CPU")]
  times = collections.Counter()
  for plane in planes:
    for line in plane.lines:
      for event in line.events:
        stats = dict(event.stats)
        if stats.get("hlo_module", "").split("(")[0] == module_name and "hlo_op" in stats:
          times[stats["hlo_op"]] += event.duration_ns
  return times


def diloco_step(params, loss_fn, tokens):
  """DiLoCo's plain step (AdamW inside, 4-bit outer gradients with error feedback), by
  ``qsgd_jax.data_parallel`` over one device, which lays out its per-device parameters; and
  the parameters (a copy a device) and state to start from. ``sync_every`` is far beyond
  the steps a profile takes, so none of them syncs: what is measured is the step that runs
  ``H - 1`` times in ``H``."""
  mesh = accelerator._one_device_mesh()
  axis = accelerator.AXIS
  tx = qsgd_jax.diloco(optax.adamw(1e-4), axis, sync_every=DILOCO_SYNC_EVERY,
                       average=qsgd_jax.qsgd(axis, bits=4, error_feedback=True))
  init, step, _ = qsgd_jax.data_parallel(loss_fn, tx, mesh, donate=True)
  copies = jax.device_put(jax.tree.map(lambda x: x[None], params),
                          NamedSharding(mesh, P(axis)))  # As the step returns them.
  return step, copies, init(params)


def profile_mode(name: str, step, params, state, tokens, repeats: int, traced: int) -> dict:
  """One mode's step, ``step(params, state, tokens) -> (params, state, ...)``: its median
  time, and its instructions' device time a step."""
  carry = [params, state]
  # The program that runs is the one whose instructions are named: no second compilation
  # (autotuning on a GPU may choose other kernels).
  compiled = step.lower(carry[0], carry[1], tokens).compile()

  def run():
    carry[0], carry[1] = compiled(carry[0], carry[1], tokens)[:2]
    return carry[0]

  # Its warm-up calls take the compressed Adams past their freeze, PowerSGD past its exact
  # steps, before the timed ones.
  seconds = accelerator._seconds(run, (), repeats, accelerator.STEP_SAMPLE_SECONDS)
  call_seconds = accelerator._seconds(run, (), repeats, sample_seconds=0.0)  # One call.
  names = op_names(compiled.as_text())
  module = compiled.as_text().split("\n", 1)[0].split()[1].rstrip(",")
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      for _ in range(traced):
        jax.block_until_ready(run())
    (xspace,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    times = device_times(xspace, module)
  per_step = {op: ns / traced / 1e6 for op, ns in times.items()
              if op not in names or names[op] is not None}
  by_operation = collections.Counter()
  for op, ms in per_step.items():
    by_operation[names.get(op) or op] += ms
  return {"mode": name, "step_ms": 1e3 * seconds, "call_ms": 1e3 * call_seconds,
          "traced_ms": sum(per_step.values()), "module": module,
          "instructions": [{"hlo_op": op, "ms": ms, "op_name": names.get(op) or ""}
                           for op, ms in sorted(per_step.items(),
                                                key=lambda kv: -kv[1])[:_KEPT_INSTRUCTIONS]],
          "operations": dict(by_operation.most_common())}


def growth(mode: dict, baseline: dict, top: int) -> list[tuple[str, float]]:
  """The operations whose device time a step grew most over ``baseline``'s."""
  deltas = {op: ms - baseline["operations"].get(op, 0.0) for op, ms in mode["operations"].items()}
  return sorted(deltas.items(), key=lambda kv: -kv[1])[:top]


def _short(op_name: str, width: int = 90) -> str:
  return op_name if len(op_name) <= width else "..." + op_name[-(width - 3):]


def main(argv=None) -> None:
  args = parse_args(argv)
  device = jax.devices()[0]
  batch = 2 if args.small else args.batch
  _, params, tokens, loss_fn = accelerator.language_model(args.small, batch)
  parameters = sum(leaf.size for leaf in jax.tree.leaves(params))

  record = {"jax": jax.__version__, "device": device.device_kind,
            "command": " ".join(["python", *sys.argv]),
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "parameters": parameters,
            "batch": batch, "modes": {}}
  print(f"{device.device_kind}, JAX {jax.__version__}, {parameters:,} parameters, batch {batch}")
  names = ["adamw"] + [name for name in args.modes if name != "adamw"]
  optimizers = accelerator.modes(parameters)
  for name in names:
    if name == "diloco":
      step = diloco_step(params, loss_fn, tokens)
    else:
      step = accelerator._one_device_step(optimizers[name][0], params, jax.grad(loss_fn))
    mode = profile_mode(name, *step, tokens, args.repeats, args.traced)
    record["modes"][name] = mode
    print(f"\n{name}: step {mode['step_ms']:.2f} ms (median of {args.repeats}), "
          f"one call waited on {mode['call_ms']:.2f} ms, "
          f"kernels {mode['traced_ms']:.2f} ms a step in the trace")
    for row in mode["instructions"][: args.top]:
      print(f"  {row['ms']:8.3f} ms  {row['hlo_op']:<28} {_short(row['op_name'])}")
  baseline = record["modes"]["adamw"]
  for name in names[1:]:
    mode = record["modes"][name]
    print(f"\n{name} over adamw: step {mode['step_ms'] - baseline['step_ms']:+.2f} ms, "
          f"kernels {mode['traced_ms'] - baseline['traced_ms']:+.2f} ms")
    for op, delta in growth(mode, baseline, args.top):
      print(f"  {delta:+8.3f} ms  {_short(op, 110)}")
  out = args.out or _ROOT / "benchmarks" / "results" / device.platform / (
      "step_profile_small.json" if args.small else "step_profile.json")
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(record, indent=1) + "\n")
  print(f"\nwrote {out}")


if __name__ == "__main__":
  main()
