"""PowerSGD against 4-bit QSGD and the float32 all-reduce: step time, bytes, and accuracy.

Two sections:

1. **step**: one gradient-averaging update on ResNet-50's gradient tree (161
   leaves, 25.6M floats; Flax layouts), on ``--step-devices`` simulated CPU
   devices (2 by default) under ``jax.shard_map``: ``jax.lax.pmean`` (the
   float32 all-reduce),
   ``qsgd_jax.qsgd("batch", bits=4)`` and ``qsgd_jax.powersgd("batch",
   rank=r)`` for each ``--ranks`` (timed after its warm-up, so the compressed
   step). Medians and fastest of ``--repeats`` calls, timed alternately so that
   all see the same background load, and the bytes one device sends (its
   ``CompressionStats``, which equal the compiled step's collectives). On
   simulated devices the collectives are memory copies: this is the compute a
   step adds, not a network's time.
2. **digits**: ``examples/imagenet`` with ``configs/digits_mlp.py`` (a 2.2M
   parameter MLP on scikit-learn's digits, 8 simulated devices) once for each
   of fp32, bf16, qsgd4 and powersgd (the config's ``powersgd_rank`` and
   ``powersgd_start_iter`` unless ``--digits-rank`` and
   ``--digits-start-iter`` say otherwise): evaluation accuracy and the bytes a
   device sends a step (its ``CompressionStats``: the compiled step's HLO
   also holds the warm-up branch's float32 all-reduce, which runs only in the
   first ``start_iter`` steps).

Usage::

  python benchmarks/powersgd.py --out benchmarks/results/
  python benchmarks/powersgd.py --sections step --repeats 5 --ranks 1,4
"""

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402  (the device count is set before JAX starts)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT / "benchmarks"))
sys.path.insert(0, str(_ROOT))
from collectives import resnet50_shapes  # noqa: E402

import qsgd_jax  # noqa: E402

AXIS = "batch"


def _log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def _pmean():
  """``jax.lax.pmean`` of the gradients as an optax transform: the float32 all-reduce."""
  return optax.GradientTransformation(
      lambda params: optax.EmptyState(),
      lambda updates, state, params=None: (jax.lax.pmean(updates, AXIS), state))


def _step_functions(transforms: dict, shapes: dict, mesh):
  """Per name: ``(step, state)``, ``step(grads, state) -> (mean, state)`` jitted over ``mesh``."""
  like = {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in shapes.items()}
  functions = {}
  for name, tx in transforms.items():
    specs = qsgd_jax.state_partition_specs(jax.eval_shape(tx.init, like), AXIS)
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
    step = jax.jit(jax.shard_map(
        lambda g, s, tx=tx: tx.update(jax.tree.map(lambda x: x[0], g), s), mesh=mesh,
        in_specs=(P(AXIS), specs), out_specs=(P(), specs)))
    functions[name] = (step, init(jax.tree.map(lambda s: jnp.zeros(s.shape), like)))
  return functions


def step_section(repeats: int, ranks: list[int], num_devices: int) -> dict:
  """Times each transform's update on ResNet-50's tree; bytes from its stats."""
  shapes = resnet50_shapes()
  mesh = jax.make_mesh((num_devices,), (AXIS,), devices=jax.devices()[:num_devices])
  rng = np.random.default_rng(0)
  grads = jax.device_put(
      {name: rng.normal(size=(num_devices, *shape)).astype(np.float32)
       for name, shape in shapes.items()}, NamedSharding(mesh, P(AXIS)))
  # PowerSGD's two warm-up steps run first: the steps timed are compressed.
  transforms = {"float32_pmean": _pmean(), "qsgd4": qsgd_jax.qsgd(AXIS, bits=4)}
  for rank in ranks:
    transforms[f"powersgd_rank{rank}"] = qsgd_jax.powersgd(AXIS, rank=rank, start_iter=2)
  functions = _step_functions(transforms, shapes, mesh)
  states, times = {}, {name: [] for name in functions}
  for name, (step, state) in functions.items():
    _log(f"compiling and warming {name}")
    for _ in range(3):
      _, state = jax.block_until_ready(step(grads, state))
    states[name] = state
  for _ in range(repeats):
    for name, (step, _) in functions.items():
      start = time.perf_counter()
      jax.block_until_ready(step(grads, states[name]))
      times[name].append(time.perf_counter() - start)
  float32_bytes = 2 * (num_devices - 1) / num_devices * 4 * sum(
      int(np.prod(shape)) for shape in shapes.values())
  results = {}
  for name in functions:
    stats = qsgd_jax.compression_stats(states[name])
    wire_bytes = float32_bytes if stats is None else float(stats.wire_bits) / 8
    results[name] = {
        "median_ms": 1e3 * statistics.median(times[name]),
        "fastest_ms": 1e3 * min(times[name]),
        "wire_bytes": wire_bytes,
        "compression_ratio": float32_bytes / wire_bytes,
    }
  baseline = results["float32_pmean"]["median_ms"]
  for entry in results.values():
    entry["time_vs_float32_pmean"] = entry["median_ms"] / baseline
  return {"tree": "resnet50", "devices": num_devices, "repeats": repeats, "steps": results}


def digits_section(rank: int | None, start_iter: int | None) -> dict:
  """The digits MLP trained once a mode; accuracy and bytes from each run's summary."""
  from examples.imagenet import train
  from examples.imagenet.configs import digits_mlp

  defaults = digits_mlp.get_config()
  rank = defaults.powersgd_rank if rank is None else rank
  start_iter = defaults.powersgd_start_iter if start_iter is None else start_iter
  summaries = {}
  with tempfile.TemporaryDirectory() as workdir:
    for mode in ("fp32", "bf16", "qsgd4", "powersgd"):
      _log(f"digits MLP, {mode}")
      config = digits_mlp.get_config()
      config.compression = mode
      config.powersgd_rank = rank
      config.powersgd_start_iter = start_iter
      config.checkpoint_every_steps = 0
      summary = train.train_and_evaluate(config, str(pathlib.Path(workdir) / mode))
      summaries[mode] = {key: summary[key] for key in (
          "steps", "eval_accuracy", "final_train_loss", "wire_bytes_per_step",
          "fp32_wire_bytes_per_step", "compression_ratio", "hlo_wire_bytes_per_step",
          "steps_per_second")}
  return {"config": "examples/imagenet/configs/digits_mlp.py", "devices": jax.device_count(),
          "powersgd_rank": rank, "powersgd_start_iter": start_iter, "modes": summaries}


def _markdown(results: dict) -> str:
  lines = [f"`{results['command']}`; load average at the start {results['load_average']}.", ""]
  if "step" in results:
    step = results["step"]
    lines += [f"ResNet-50's gradient tree, {step['devices']} simulated CPU devices, median of "
              f"{step['repeats']} calls:", "",
              "| transform | median ms | fastest ms | vs float32 | bytes/device | ratio |",
              "|---|---|---|---|---|---|"]
    for name, entry in step["steps"].items():
      lines.append(f"| {name} | {entry['median_ms']:.0f} | {entry['fastest_ms']:.0f} "
                   f"| {entry['time_vs_float32_pmean']:.2f}x | {entry['wire_bytes']:,.0f} "
                   f"| {entry['compression_ratio']:.1f}x |")
    lines.append("")
  if "digits" in results:
    digits = results["digits"]
    lines += [f"Digits MLP, {digits['devices']} devices; powersgd rank "
              f"{digits['powersgd_rank']} after {digits['powersgd_start_iter']} exact steps:", "",
              "| mode | eval accuracy | final train loss | bytes/step | vs fp32 |",
              "|---|---|---|---|---|"]
    for mode, summary in digits["modes"].items():
      lines.append(f"| {mode} | {summary['eval_accuracy']:.2%} "
                   f"| {summary['final_train_loss']:.4f} "
                   f"| {summary['wire_bytes_per_step']:,.0f} "
                   f"| {summary['compression_ratio']:.1f}x |")
  return "\n".join(lines) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sections", default="step,digits")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--ranks", default="1,4")
  parser.add_argument("--step-devices", type=int, default=2)
  parser.add_argument("--digits-rank", type=int, default=None)
  parser.add_argument("--digits-start-iter", type=int, default=None)
  parser.add_argument("--out", type=pathlib.Path, default=None,
                      help="Directory for powersgd.json and powersgd.md.")
  args = parser.parse_args()
  sections = args.sections.split(",")
  results = {"command": " ".join(["python", *sys.argv]),
              "load_average": [round(x, 1) for x in os.getloadavg()]}
  if "step" in sections:
    results["step"] = step_section(args.repeats, [int(r) for r in args.ranks.split(",")],
                                   args.step_devices)
  if "digits" in sections:
    results["digits"] = digits_section(args.digits_rank, args.digits_start_iter)
  text = _markdown(results)
  print(text)
  if args.out is not None:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "powersgd.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "powersgd.md").write_text(text)


if __name__ == "__main__":
  main()
