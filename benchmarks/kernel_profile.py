"""The kernels XLA generates for each compressor's encode and decode, for a profiler to read.

Compiles ``encode`` and ``decode`` of each compressor for one float32 array,
prints how many kernels (fusions and library calls) each compiled program
launches, then runs each once more after a warm-up. Under NVIDIA's Nsight
Compute the second runs are the ones to read::

  ncu --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\\
sm__throughput.avg.pct_of_peak_sustained_elapsed --csv \\
      python benchmarks/kernel_profile.py --size 67108864 > kernels.csv

A kernel near its memory bandwidth (``dram__throughput``) and far from its
compute (``sm__throughput``) is memory-bound: only fewer bytes make it faster.
One busy computing and moving little is compute-bound.

  python benchmarks/kernel_profile.py --platform cpu --size 4194304
"""

import argparse
import re

import jax

import qsgd_jax

COMPRESSORS = {
    "qsgd_4bit": qsgd_jax.QSGD(bits=4),
    "qsgd_8bit": qsgd_jax.QSGD(bits=8),
    "minmax_8bit": qsgd_jax.MinMax(bits=8),
    "onebit": qsgd_jax.OneBit(),
}
_KERNEL = re.compile(r"^\s*(?:ROOT\s+)?%\S+ = \S+ (fusion|custom-call|sort|reduce|scatter)\(",
                     re.MULTILINE)


def kernels(compiled) -> int:
  """Kernels the entry computation launches: its fusions and library calls."""
  text = compiled.as_text()
  entry = text[text.find("ENTRY"):]
  return len(_KERNEL.findall(entry[: entry.find("\n}")]))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--size", type=int, default=67_108_864)
  parser.add_argument("--platform", choices=("cpu", "gpu", "tpu"), default=None)
  options = parser.parse_args()
  device = jax.devices(options.platform)[0] if options.platform else jax.devices()[0]
  x = jax.device_put(jax.random.normal(jax.random.key(0), (options.size,)), device)
  key = jax.device_put(jax.random.key(1), device)
  print(f"{device.device_kind}, {options.size:,} float32")
  for name, compressor in COMPRESSORS.items():
    encode = jax.jit(compressor.encode).lower(key, x).compile()
    payload = jax.block_until_ready(encode(key, x))
    decode = jax.jit(compressor.decode).lower(payload).compile()
    jax.block_until_ready(decode(payload))
    print(f"{name}: encode launches {kernels(encode)} kernels, decode {kernels(decode)}")
    jax.block_until_ready(decode(encode(key, x)))  # The runs a profiler reads.


if __name__ == "__main__":
  main()
