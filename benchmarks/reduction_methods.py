"""Error of the mean against bytes on the wire, for each quantized reduction method.

Each of ``n`` simulated CPU devices holds its own gradient (a shared
heavy-tailed signal plus per-device noise of the same size, Student-t with 3
degrees of freedom, scaled per 4096-element block, as ``variance.py``'s); each
method averages them, and the table gives the relative error of the result,
``sqrt(E||mean_hat - mean||^2) / ||mean||`` over ``--keys`` keys, next to the
bits a device sends a coordinate (from the reduction plan, which the HLO tests
pin):

* ``two_phase``: all-to-all of pieces, each owner's sum re-quantized and
  gathered (two quantizations; the owner's own piece exact);
* ``two_phase, own piece quantized``: CNTK's default;
* ``psum``: shared scales, one integer psum (one rounding, at most 4x fewer
  bytes);
* ``all_gather``: the QSGD paper's Algorithm 1 (one quantization, ``n - 1``
  payloads).

Usage::

  python benchmarks/reduction_methods.py --out benchmarks/results/
"""

import argparse
import json
import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402  (the device count is set before JAX starts)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import qsgd_jax  # noqa: E402
from qsgd_jax._src import wire  # noqa: E402
from qsgd_jax._src.collectives import plan as plan_lib  # noqa: E402

AXIS = "batch"
COMPRESSORS = {"QSGD 4-bit": qsgd_jax.QSGD(bits=4), "QSGD 8-bit": qsgd_jax.QSGD(bits=8),
               "MinMax 8-bit": qsgd_jax.MinMax(bits=8)}
# name: (method, exact_own_piece)
METHODS = {"two_phase": ("two_phase", True),
           "two_phase, own piece quantized": ("two_phase", False),
           "psum": ("psum", True),
           "all_gather": ("all_gather", True)}


def _gradients(num_devices: int, size: int) -> np.ndarray:
  rng = np.random.default_rng(0)
  scales = np.repeat(np.exp(rng.normal(size=-(-size // 4096))), 4096)[:size]
  signal = rng.standard_t(3.0, size=size)
  noise = rng.standard_t(3.0, size=(num_devices, size))
  return ((signal + noise) * scales).astype(np.float32)


def measure(num_devices: int, size: int, num_keys: int) -> list[dict]:
  x = _gradients(num_devices, size)
  exact = x.astype(np.float64).mean(axis=0)
  keys = jax.random.split(jax.random.key(0), num_keys)
  float32_bits = wire.float32_allreduce_bits(size, num_devices)
  rows = []
  for compressor_name, compressor in COMPRESSORS.items():
    for method_name, (method, exact_own_piece) in METHODS.items():
      def means(x, keys, compressor=compressor, method=method, exact=exact_own_piece):
        return jax.vmap(lambda key: qsgd_jax.quantized_pmean(
            x, AXIS, compressor, key, method=method, exact_own_piece=exact,
            min_compressed_size=0))(keys)

      samples = jax.pmap(means, axis_name=AXIS, in_axes=(0, None),
                         devices=jax.devices()[:num_devices])(x, keys)[0]
      error = np.sqrt(np.mean(np.sum((np.asarray(samples, np.float64) - exact) ** 2, axis=1)))
      planned = plan_lib.make_plan(jax.ShapeDtypeStruct((size,), jnp.float32), AXIS,
                                   compressor, method=method, min_compressed_size=0,
                                   axis_sizes={AXIS: num_devices})
      rows.append({"devices": num_devices, "compressor": compressor_name,
                   "method": method_name,
                   "relative_error": float(error / np.linalg.norm(exact)),
                   "bits_a_coordinate": planned.wire_bits / size,
                   "less_than_float32": float32_bits / planned.wire_bits})
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--size", type=int, default=262_144, help="coordinates a gradient")
  parser.add_argument("--keys", type=int, default=16, help="draws a method")
  parser.add_argument("--devices", type=int, nargs="+", default=[4, 8])
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
  options = parser.parse_args()
  rows = []
  for n in options.devices:
    rows += measure(n, options.size, options.keys)
  print(f"Error of the mean against bits on the wire, {options.size:,} coordinates, "
        f"{options.keys} keys:")
  print(f"  {'n':>2s} {'compressor':13s} {'method':31s} {'rel. error':>10s} "
        f"{'bits/coord':>10s} {'vs fp32':>8s}")
  for row in rows:
    print(f"  {row['devices']:2d} {row['compressor']:13s} {row['method']:31s} "
          f"{row['relative_error']:10.4f} {row['bits_a_coordinate']:10.2f} "
          f"{row['less_than_float32']:7.2f}x")
  options.out.mkdir(parents=True, exist_ok=True)
  path = options.out / "reduction_methods.json"
  path.write_text(json.dumps({"size": options.size, "keys": options.keys, "rows": rows},
                             indent=2) + "\n")
  print(f"Wrote {path}")


if __name__ == "__main__":
  main()
