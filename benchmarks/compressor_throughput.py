"""Throughput of each compressor against a memory-bound elementwise pass.

For every compressor this times, on one device (JAX's default one, or the
platform ``--platform`` names), a jitted ``encode``, a jitted ``decode`` and a
jitted ``decode(encode(x))`` of one float32 array, and reports each as a ratio
to the time of ``x * 2 + 1`` over the same array: one fused read and write,
the floor a compressor that touches every element cannot beat by much.

It also reports encode and decode as memory traffic (bytes read plus bytes
written: the float32 array and the payload) in GB/s, and as a fraction of the
device's memory bandwidth: the datasheet figure for known accelerators (or
``--peak-gb-per-s``), and on a CPU the rate this run measures for
``x * 2 + 1``, since a CPU's attainable bandwidth depends on its cores.

It also reports the ratio for ``jax.random.uniform`` and for the package's
hash-based ``uniform_grid`` of the same size, since one uniform draw an
element is the bulk of a stochastic quantizer's arithmetic.

Timings are medians over repeated calls after a warm-up call, each call waited
on with ``jax.block_until_ready``. The floor is timed in a block before the
compressors and a block after them, and every ratio is against that one floor:
timed right after a compressor, a pass that allocates its output can pay for
the compressor's freed temporaries (the allocator hands memory back to the
system and faults it in again). Besides the median wall-clock time, the best
wall-clock time and the median CPU time of the process are recorded: on a
machine shared with other work they are the steadier figures. For one core,
run under ``taskset -c 0``.

Usage::

  python benchmarks/compressor_throughput.py --size 4194304 --out benchmarks/results/
  python benchmarks/compressor_throughput.py --platform gpu --size 268435456
"""

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import qsgd_jax
from qsgd_jax._src.compressors import rounding

COMPRESSORS = {
    "qsgd_4bit_bucket512_max": qsgd_jax.QSGD(bits=4, bucket_size=512, norm="max"),
    "qsgd_8bit_bucket512_max": qsgd_jax.QSGD(bits=8, bucket_size=512, norm="max"),
    "minmax_8bit": qsgd_jax.MinMax(bits=8),  # Buckets of 512, the default.
    "onebit_bucket512": qsgd_jax.OneBit(bucket_size=512),
    "cast_bfloat16": qsgd_jax.Cast(jnp.bfloat16),
    "identity": qsgd_jax.Identity(),
}


# The project's kernel targets: median wall-clock ratios to ``x * 2 + 1`` that
# these compressors' encode and decode(encode) should not exceed.
KERNEL_TARGETS = {"encode_decode": 2.0, "encode": 1.5}
TARGETED = ("qsgd_4bit_bucket512_max", "qsgd_8bit_bucket512_max", "minmax_8bit")


# Datasheet memory bandwidth in GB/s, by a prefix of ``device_kind``.
PEAK_MEMORY_GB_PER_S = {
    "NVIDIA H200": 4800,
    "NVIDIA H100 80GB HBM3": 3350,
    "NVIDIA H100 PCIe": 2000,
    "NVIDIA A100-SXM4-80GB": 2039,
    "NVIDIA A100-SXM4-40GB": 1555,
    "NVIDIA A100-PCIE-40GB": 1555,
    "NVIDIA A100 80GB PCIe": 1935,
    "NVIDIA L4": 300,
    "Tesla V100": 900,
    "TPU v4": 1200,
    "TPU v5 lite": 819,
    "TPU v5p": 2765,
    "TPU v6 lite": 1640,
}


def datasheet_bandwidth(device) -> float | None:
  """The device's memory bandwidth in GB/s from :data:`PEAK_MEMORY_GB_PER_S`, or None."""
  for prefix, gb_per_s in PEAK_MEMORY_GB_PER_S.items():
    if device.device_kind.startswith(prefix):
      return float(gb_per_s)
  return None


def _time_call(fn, args) -> tuple[float, float]:
  """Wall-clock and CPU seconds of one call, waited on."""
  wall, cpu = time.perf_counter(), time.process_time()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - wall, time.process_time() - cpu


def _timings(fn, args, repeats: int) -> tuple[list[float], list[float]]:
  """Wall-clock and CPU seconds of ``repeats`` calls of ``fn`` after a warm-up call."""
  jax.block_until_ready(fn(*args))
  calls = [_time_call(fn, args) for _ in range(repeats)]
  return [wall for wall, _ in calls], [cpu for _, cpu in calls]


def _figure(timings: tuple, floor_timings: tuple, nbytes: int, moved_bytes: int) -> dict:
  """Ratios to the floor, GB/s of the float32 array, and GB/s of all traffic."""
  (wall, cpu), (floor_wall, floor_cpu) = timings, floor_timings
  median = statistics.median
  return {
      "ms": 1e3 * median(wall),
      "ratio": median(wall) / median(floor_wall),
      "best_ratio": min(wall) / min(floor_wall),
      "cpu_ratio": median(cpu) / median(floor_cpu),
      "gb_per_s": nbytes / median(wall) / 1e9,
      "traffic_gb_per_s": moved_bytes / median(wall) / 1e9,
  }


def run(device, size: int, repeats: int) -> dict:
  """Times every compressor and the two random-number references on ``device``."""
  x = jax.device_put(jax.random.normal(jax.random.key(1), (size,), jnp.float32), device)
  key = jax.device_put(jax.random.key(0), device)
  nbytes = x.nbytes
  floor = jax.jit(lambda x: x * 2 + 1)

  floor_wall, floor_cpu = _timings(floor, (x,), repeats)
  timings = {}
  for name, compressor in COMPRESSORS.items():
    encode = jax.jit(compressor.encode)
    decode = jax.jit(compressor.decode)
    round_trip = jax.jit(lambda key, x, c=compressor: c.decode(c.encode(key, x)))
    payload = encode(key, x)
    timings[name] = {
        "encode_decode": _timings(round_trip, (key, x), repeats),
        "encode": _timings(encode, (key, x), repeats),
        "decode": _timings(decode, (payload,), repeats),
    }
  references = {
      "jax_random_uniform": jax.jit(lambda key: jax.random.uniform(key, (size,))),
      "rounding_uniform_grid": jax.jit(lambda key: rounding.uniform_grid(key, (size,))),
  }
  for name, fn in references.items():
    timings[name] = {"draw": _timings(fn, (key,), repeats)}
  wall, cpu = _timings(floor, (x,), repeats)
  floor_timings = (floor_wall + wall, floor_cpu + cpu)

  results = {}
  for name, parts in timings.items():
    if name in COMPRESSORS:
      payload_bytes = COMPRESSORS[name].wire_bits(x.shape) // 8
      moved = {"encode_decode": 2 * nbytes, "encode": nbytes + payload_bytes,
               "decode": payload_bytes + nbytes}
    else:
      moved = {"draw": nbytes}
    results[name] = {part: _figure(t, floor_timings, nbytes, moved[part])
                     for part, t in parts.items()}
    if name in COMPRESSORS:
      results[name]["wire_bits_per_element"] = 8 * payload_bytes / size
  seconds = statistics.median(floor_timings[0])
  results["floor_x_times_2_plus_1"] = {"ms": 1e3 * seconds, "gb_per_s": 2 * nbytes / seconds / 1e9}
  return results


def target_checks(results: dict) -> dict:
  """For each targeted compressor and part, its ratio, the target, and whether it is met."""
  return {
      name: {
          part: {"ratio": results[name][part]["ratio"], "target": target,
                 "met": results[name][part]["ratio"] <= target}
          for part, target in KERNEL_TARGETS.items()
      }
      for name in TARGETED
  }


def add_bandwidth_fractions(results: dict, peak_gb_per_s: float) -> None:
  """Adds each encode's and decode's traffic as a fraction of ``peak_gb_per_s``."""
  for name in COMPRESSORS:
    for part in ("encode", "decode"):
      figure = results[name][part]
      figure["fraction_of_peak"] = figure["traffic_gb_per_s"] / peak_gb_per_s


def _print_table(results: dict, peak: dict) -> None:
  floor = results["floor_x_times_2_plus_1"]
  print(f"floor x * 2 + 1: {floor['ms']:.3f} ms, {floor['gb_per_s']:.1f} GB/s read+write")
  print("ratios to the floor: median wall-clock / best wall-clock / median CPU time")
  parts = ("encode_decode", "encode", "decode")
  print(f"{'':<26}" + "".join(f"{part:>22}" for part in parts) + f"{'GB/s':>7}{'bits':>6}")
  for name in COMPRESSORS:
    figures = results[name]
    cells = "".join(_cell(figures[part]) for part in parts)
    print(
        f"{name:<26}{cells}{figures['encode_decode']['gb_per_s']:>7.2f}"
        f"{figures['wire_bits_per_element']:>6.2f}"
    )
  for name in ("jax_random_uniform", "rounding_uniform_grid"):
    print(f"{name:<26}{_cell(results[name]['draw'])}")
  print("\nkernel targets (median wall-clock ratio to the floor):")
  for name, parts in target_checks(results).items():
    cells = "".join(
        f"  {part} {check['ratio']:.2f} (target {check['target']:.1f}: "
        f"{'met' if check['met'] else 'missed'})"
        for part, check in parts.items()
    )
    print(f"{name:<26}{cells}")
  print(f"\nmemory traffic (float32 array + payload), against {peak['gb_per_s']:.0f} GB/s"
        f" ({peak['source']}):")
  print(f"{'':<26}{'encode GB/s':>12}{'of peak':>9}{'decode GB/s':>13}{'of peak':>9}")
  for name in COMPRESSORS:
    encode, decode = results[name]["encode"], results[name]["decode"]
    print(f"{name:<26}{encode['traffic_gb_per_s']:>12.1f}{encode['fraction_of_peak']:>9.0%}"
          f"{decode['traffic_gb_per_s']:>13.1f}{decode['fraction_of_peak']:>9.0%}")


def _cell(figure: dict) -> str:
  text = f"{figure['ratio']:.2f} / {figure['best_ratio']:.2f} / {figure['cpu_ratio']:.2f}"
  return f" {text}".rjust(22)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", type=int, default=4_194_304, help="elements of the array")
  parser.add_argument("--repeats", type=int, default=20, help="timed calls a measurement")
  parser.add_argument("--platform", choices=("cpu", "gpu", "tpu"), default=None,
                      help="where to run (default: JAX's default backend)")
  parser.add_argument("--peak-gb-per-s", type=float, default=None,
                      help="the device's memory bandwidth, for a device not in the table")
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
  args = parser.parse_args()

  device = jax.devices(args.platform)[0]
  results = run(device, args.size, args.repeats)
  datasheet = datasheet_bandwidth(device)
  if args.peak_gb_per_s is not None:
    peak = {"gb_per_s": args.peak_gb_per_s, "source": "--peak-gb-per-s"}
  elif device.platform == "cpu":
    peak = {"gb_per_s": results["floor_x_times_2_plus_1"]["gb_per_s"],
            "source": "x * 2 + 1 measured on this CPU"}
  elif datasheet is not None:
    peak = {"gb_per_s": datasheet, "source": f"{device.device_kind} datasheet"}
  else:
    peak = {"gb_per_s": results["floor_x_times_2_plus_1"]["gb_per_s"],
            "source": f"x * 2 + 1 measured ({device.device_kind} not in the table)"}
  add_bandwidth_fractions(results, peak["gb_per_s"])
  _print_table(results, peak)
  record = {
      "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
      "size": args.size,
      "repeats": args.repeats,
      "jax_version": jax.__version__,
      "device": str(device),
      "device_kind": device.device_kind,
      "peak_memory_bandwidth": peak,
      "processor": platform.processor() or platform.machine(),
      "cpus_allowed": len(os.sched_getaffinity(0)),
      "results": results,
      "kernel_targets": target_checks(results),
  }
  args.out.mkdir(parents=True, exist_ok=True)
  suffix = "" if device.platform == "cpu" else f"_{device.platform}"
  path = args.out / f"compressor_throughput_{args.size}{suffix}.json"
  path.write_text(json.dumps(record, indent=2) + "\n")
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
