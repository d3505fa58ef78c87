"""Bytes on the wire and step time of quantized_pmean against a float32 pmean.

Three measurements on 8 simulated CPU devices, each variant reduced under
``jax.shard_map`` over one axis:

1. **Wire bytes** per device, read from the compiled HLO with
   :func:`qsgd_jax.wire_bytes`, for a float32 ``pmean`` and for every
   compressor and method, with the ratio to the float32 ``pmean``, on two
   gradient trees: ResNet-50's (161 leaves, 25,557,032 parameters: conv
   kernels ``(k, k, c_in, c_out)``, BatchNorm scales and biases, the
   2048 x 1000 classifier and its bias) and GPT-2 small's (148 leaves,
   124,439,808 parameters: token and position embeddings, 12 blocks of
   attention and MLP kernels and biases and LayerNorms, the output head tied
   to the token embedding). ``--small`` divides every width by 4. And a tree
   of 40 leaves of 5,000 floats, where padding each leaf to whole pieces
   would cost most (padding is paid once a tree: 7.7x at 4 bits).
2. **Step time**: the median over ``--repeats`` calls, each waited on with
   ``jax.block_until_ready``, of each variant and of the float32 ``pmean``,
   timed alternately so both see the same background load, with the relative
   error of the result against the exact mean of normal inputs; on ResNet-50
   and on GPT-2 small at a quarter of its width (``--small``: both at a
   quarter of their width).
3. **min_compressed_size**: wire bytes, compile time and step time of 4-bit
   QSGD (two phases) on ResNet-50 for several thresholds.

On simulated devices the step time measures the encoding and decoding work
and the copies, not a network: the devices share this machine's memory.
Each executable is compiled once and reused.

Usage::

  python benchmarks/collectives.py --out benchmarks/results/
  python benchmarks/collectives.py --small
  python benchmarks/collectives.py --sections threshold --repeats 11
"""

import argparse
import inspect
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

import jax  # noqa: E402  (the platform and device count are set before JAX starts)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import qsgd_jax  # noqa: E402

AXIS = "batch"
NUM_DEVICES = 8
THRESHOLDS = (0, 1024, 4096, 16384, 65536)
THRESHOLD_VARIANT = "qsgd4/two_phase"
SECTIONS = ("wire", "timing", "threshold")

# name: (compressor, method); None is a plain float32 jax.lax.pmean.
VARIANTS = {
    "float32_pmean": (None, None),
    "cast_bf16/two_phase": (qsgd_jax.Cast(jnp.bfloat16), "two_phase"),
    "qsgd2/two_phase": (qsgd_jax.QSGD(bits=2), "two_phase"),
    "qsgd2/psum": (qsgd_jax.QSGD(bits=2), "psum"),
    "qsgd4/two_phase": (qsgd_jax.QSGD(bits=4), "two_phase"),
    "qsgd4/psum": (qsgd_jax.QSGD(bits=4), "psum"),
    "qsgd4/all_gather": (qsgd_jax.QSGD(bits=4), "all_gather"),
    "qsgd8/two_phase": (qsgd_jax.QSGD(bits=8), "two_phase"),
    "qsgd8/psum": (qsgd_jax.QSGD(bits=8), "psum"),
    "minmax8/two_phase": (qsgd_jax.MinMax(bits=8), "two_phase"),
    "minmax8/psum": (qsgd_jax.MinMax(bits=8), "psum"),
    "onebit/two_phase": (qsgd_jax.OneBit(), "two_phase"),
}


def resnet50_shapes(width_divisor: int = 1) -> dict[str, tuple[int, ...]]:
  """ResNet-50's parameter shapes, every width divided by ``width_divisor``."""
  stem = 64 // width_divisor
  shapes = {"stem/conv": (7, 7, 3, stem), "stem/bn_scale": (stem,), "stem/bn_bias": (stem,)}
  channels = stem
  for stage, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512), strict=True)):
    width //= width_divisor
    for block in range(blocks):
      prefix = f"stage{stage}/block{block}"
      convs = [(1, channels, width), (3, width, width), (1, width, 4 * width)]
      if block == 0:
        convs.append((1, channels, 4 * width))  # the projection shortcut
      for i, (k, c_in, c_out) in enumerate(convs):
        shapes[f"{prefix}/conv{i}"] = (k, k, c_in, c_out)
        shapes[f"{prefix}/bn{i}_scale"] = (c_out,)
        shapes[f"{prefix}/bn{i}_bias"] = (c_out,)
      channels = 4 * width
  shapes["dense/kernel"] = (channels, 1000)
  shapes["dense/bias"] = (1000,)
  return shapes


def gpt2_small_shapes(width_divisor: int = 1) -> dict[str, tuple[int, ...]]:
  """GPT-2 small's parameter shapes (Radford et al. 2019), the width divided by ``width_divisor``.

  A 50,257-token vocabulary, 1,024 positions, 12 blocks of width 768 (the
  MLP 4x wider), LayerNorm scales and biases; the output head shares the
  token embedding, so it has no leaf of its own.
  """
  width = 768 // width_divisor
  shapes = {"wte": (50257, width), "wpe": (1024, width)}
  for block in range(12):
    prefix = f"h{block}"
    shapes.update({
        f"{prefix}/ln_1/scale": (width,), f"{prefix}/ln_1/bias": (width,),
        f"{prefix}/attn/qkv/kernel": (width, 3 * width), f"{prefix}/attn/qkv/bias": (3 * width,),
        f"{prefix}/attn/proj/kernel": (width, width), f"{prefix}/attn/proj/bias": (width,),
        f"{prefix}/ln_2/scale": (width,), f"{prefix}/ln_2/bias": (width,),
        f"{prefix}/mlp/fc/kernel": (width, 4 * width), f"{prefix}/mlp/fc/bias": (4 * width,),
        f"{prefix}/mlp/proj/kernel": (4 * width, width), f"{prefix}/mlp/proj/bias": (width,),
    })
  shapes.update({"ln_f/scale": (width,), "ln_f/bias": (width,)})
  return shapes


def _default_threshold() -> int:
  """The library's default ``min_compressed_size``, read from its signature."""
  return inspect.signature(qsgd_jax.quantized_pmean).parameters["min_compressed_size"].default


def _log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


class Bench:
  """Compiles each (tree, variant, threshold) once and keeps the executable."""

  def __init__(self):
    self.mesh = jax.make_mesh((NUM_DEVICES,), (AXIS,))
    self.sharding = NamedSharding(self.mesh, P(AXIS))
    self._compiled = {}

  def _function(self, variant: str, min_compressed_size: int):
    compressor, method = VARIANTS[variant]
    key = jax.random.key(0)

    def reduce(tree):
      tree = jax.tree.map(lambda x: x[0], tree)
      if compressor is None:
        return jax.lax.pmean(tree, AXIS)
      return qsgd_jax.quantized_pmean(tree, AXIS, compressor, key, method=method,
                                      min_compressed_size=min_compressed_size)

    return jax.jit(jax.shard_map(reduce, mesh=self.mesh, in_specs=P(AXIS), out_specs=P()))

  def compiled(self, tree_name: str, shapes, variant: str, min_compressed_size: int):
    """``(executable, seconds to trace and compile)``, cached."""
    if VARIANTS[variant][0] is None:
      min_compressed_size = 0  # a plain pmean has no threshold
    cache_key = (tree_name, variant, min_compressed_size)
    if cache_key not in self._compiled:
      abstract = {name: jax.ShapeDtypeStruct((NUM_DEVICES, *shape), jnp.float32,
                                             sharding=self.sharding)
                  for name, shape in shapes.items()}
      start = time.perf_counter()
      executable = self._function(variant, min_compressed_size).lower(abstract).compile()
      seconds = time.perf_counter() - start
      _log(f"  compiled {tree_name} {variant} min_compressed_size={min_compressed_size}"
           f" in {seconds:.1f} s")
      self._compiled[cache_key] = (executable, seconds)
    return self._compiled[cache_key]

  def wire(self, tree_name: str, shapes, variant: str, min_compressed_size: int) -> dict:
    executable, seconds = self.compiled(tree_name, shapes, variant, min_compressed_size)
    text = executable.as_text()
    return {
        "bytes_sent": qsgd_jax.wire_bytes(text),
        "compile_seconds": seconds,
        "collectives": [
            {"kind": c.kind, "result_type": c.result_type[:80], "group_size": c.group_size,
             "bytes_sent": c.bytes_sent}
            for c in qsgd_jax.collectives_in_hlo(text)
        ],
    }

  def inputs(self, shapes, seed: int = 0):
    rng = np.random.default_rng(seed)
    host = {name: rng.standard_normal((NUM_DEVICES, *shape), dtype=np.float32)
            for name, shape in shapes.items()}
    return host, jax.device_put(host, self.sharding)

  def time_against_pmean(self, tree_name, shapes, variant, min_compressed_size, tree,
                         repeats: int) -> tuple[dict, object]:
    """Median and fastest seconds of the variant and of the float32 pmean, and its result.

    Under background load the fastest call is the steadier estimate of the
    work itself; the median is what a training loop would see.
    """
    candidate, _ = self.compiled(tree_name, shapes, variant, min_compressed_size)
    baseline, _ = self.compiled(tree_name, shapes, "float32_pmean", 0)
    result = jax.block_until_ready(candidate(tree))
    jax.block_until_ready(baseline(tree))
    times, baseline_times = [], []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(candidate(tree))
      times.append(time.perf_counter() - start)
      start = time.perf_counter()
      jax.block_until_ready(baseline(tree))
      baseline_times.append(time.perf_counter() - start)
    entry = {
        "median_seconds": statistics.median(times),
        "fastest_seconds": min(times),
        "float32_pmean_median_seconds": statistics.median(baseline_times),
        "float32_pmean_fastest_seconds": min(baseline_times),
    }
    entry["time_vs_float32_pmean"] = (
        entry["median_seconds"] / entry["float32_pmean_median_seconds"])
    entry["fastest_vs_float32_pmean"] = (
        entry["fastest_seconds"] / entry["float32_pmean_fastest_seconds"])
    return entry, result


def _relative_error(result, host) -> float:
  squared_error = squared_norm = 0.0
  for name, x in host.items():
    exact = x.astype(np.float64).mean(axis=0)
    squared_error += float(np.sum((np.asarray(result[name], np.float64) - exact) ** 2))
    squared_norm += float(np.sum(exact**2))
  return math.sqrt(squared_error / squared_norm)


def _leaf_counts(shapes, min_compressed_size: int) -> dict[str, int]:
  sizes = [math.prod(s) for s in shapes.values()]
  compressed = [s for s in sizes if s >= min_compressed_size]
  return {"compressed_leaves": len(compressed),
          "full_precision_leaves": len(sizes) - len(compressed),
          "full_precision_parameters": sum(sizes) - sum(compressed)}


def wire_section(bench: Bench, tree_name: str, shapes) -> dict:
  _log(f"wire bytes, {tree_name}:")
  report = {name: bench.wire(tree_name, shapes, name, _default_threshold())
            for name in VARIANTS}
  plain = report["float32_pmean"]["bytes_sent"]
  print(f"\nWire bytes a device sends, {tree_name} ({sum(map(math.prod, shapes.values())):,}"
        f" parameters, {len(shapes)} leaves), from the compiled HLO:")
  print(f"  {'variant':22s} {'bytes':>14s} {'vs fp32 pmean':>14s} {'collectives':>12s}")
  for name, entry in report.items():
    entry["ratio_vs_float32_pmean"] = plain / entry["bytes_sent"]
    print(f"  {name:22s} {entry['bytes_sent']:14,.0f} {entry['ratio_vs_float32_pmean']:13.2f}x"
          f" {len(entry['collectives']):12d}")
  return report


def timing_section(bench: Bench, tree_name: str, shapes, repeats: int) -> dict:
  _log(f"step time, {tree_name}:")
  host, tree = bench.inputs(shapes)
  report = {}
  for name in VARIANTS:
    if name == "float32_pmean":
      continue
    entry, result = bench.time_against_pmean(
        tree_name, shapes, name, _default_threshold(), tree, repeats)
    entry["relative_error"] = _relative_error(result, host)
    report[name] = entry
  print(f"\nStep time, {tree_name} ({sum(map(math.prod, shapes.values())):,} parameters),"
        f" {repeats} calls each, 8 simulated CPU devices (times the float32 pmean's):")
  print(f"  {'variant':22s} {'median s':>9s} {'fp32 pmean':>11s} {'ratio':>7s}"
        f" {'fastest':>8s} {'rel. error':>11s}")
  for name, entry in report.items():
    print(f"  {name:22s} {entry['median_seconds']:9.4f}"
          f" {entry['float32_pmean_median_seconds']:11.4f}"
          f" {entry['time_vs_float32_pmean']:6.2f}x {entry['fastest_vs_float32_pmean']:7.2f}x"
          f" {entry['relative_error']:11.2e}")
  return report


def threshold_section(bench: Bench, tree_name: str, shapes, repeats: int) -> dict:
  _log(f"min_compressed_size, {tree_name}:")
  host, tree = bench.inputs(shapes)
  plain = bench.wire(tree_name, shapes, "float32_pmean", 0)["bytes_sent"]
  report = {}
  for threshold in THRESHOLDS:
    entry = bench.wire(tree_name, shapes, THRESHOLD_VARIANT, threshold)
    del entry["collectives"]
    timing, result = bench.time_against_pmean(
        tree_name, shapes, THRESHOLD_VARIANT, threshold, tree, repeats)
    entry.update(_leaf_counts(shapes, threshold), **timing)
    entry.update(ratio_vs_float32_pmean=plain / entry["bytes_sent"],
                 relative_error=_relative_error(result, host))
    report[str(threshold)] = entry
  print(f"\nmin_compressed_size, {THRESHOLD_VARIANT}, {tree_name}:")
  print(f"  {'threshold':>9s} {'compressed':>10s} {'fp32 params':>11s} {'bytes':>12s}"
        f" {'vs fp32':>8s} {'compile s':>9s} {'median s':>9s} {'vs fp32':>8s}"
        f" {'fastest s':>9s} {'vs fp32':>8s}")
  for threshold, entry in report.items():
    print(f"  {threshold:>9s} {entry['compressed_leaves']:10d}"
          f" {entry['full_precision_parameters']:11,d} {entry['bytes_sent']:12,.0f}"
          f" {entry['ratio_vs_float32_pmean']:7.2f}x {entry['compile_seconds']:9.1f}"
          f" {entry['median_seconds']:9.3f} {entry['time_vs_float32_pmean']:7.2f}x"
          f" {entry['fastest_seconds']:9.3f} {entry['fastest_vs_float32_pmean']:7.2f}x")
  return report


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--small", action="store_true",
                      help="every tree at a quarter of its width (quick)")
  parser.add_argument("--repeats", type=int, default=5, help="timed calls a variant")
  parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                      help="which measurements to run (default: all)")
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
  args = parser.parse_args()

  bench = Bench()
  quarter = {"resnet50_quarter_width": resnet50_shapes(4),
             "gpt2_small_quarter_width": gpt2_small_shapes(4)}
  if args.small:
    wire_trees = timing_trees = quarter
  else:
    wire_trees = {"resnet50": resnet50_shapes(), "gpt2_small": gpt2_small_shapes()}
    timing_trees = {"resnet50": wire_trees["resnet50"],
                    "gpt2_small_quarter_width": quarter["gpt2_small_quarter_width"]}
  threshold_tree = next(iter(wire_trees.items()))
  wire_trees["forty_leaves_of_5000"] = {f"layer{i}": (5000,) for i in range(40)}
  started = time.perf_counter()
  report = {
      "jax": jax.__version__,
      "platform": platform.platform(),
      "cpu_count": os.cpu_count(),
      "load_average_at_start": os.getloadavg(),
      "devices": NUM_DEVICES,
      "default_min_compressed_size": _default_threshold(),
      "repeats": args.repeats,
  }
  if "wire" in args.sections:
    report["wire"] = {name: wire_section(bench, name, shapes)
                      for name, shapes in wire_trees.items()}
  if "timing" in args.sections:
    report["timing"] = {name: timing_section(bench, name, shapes, args.repeats)
                        for name, shapes in timing_trees.items()}
  if "threshold" in args.sections:
    report["min_compressed_size"] = {
        threshold_tree[0]: threshold_section(bench, *threshold_tree, args.repeats)}
  report["load_average_at_end"] = os.getloadavg()
  report["seconds"] = time.perf_counter() - started
  args.out.mkdir(parents=True, exist_ok=True)
  name = "_".join(["collectives", *(["small"] if args.small else []),
                   *([] if len(args.sections) == len(SECTIONS) else args.sections)])
  path = args.out / f"{name}.json"
  path.write_text(json.dumps(report, indent=2))
  print(f"\nwrote {path} ({report['seconds']:.0f} s)")


if __name__ == "__main__":
  main()
