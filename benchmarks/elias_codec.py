"""The Elias codec of QSGD levels: throughput, and bits a coordinate against other sizes.

Throughput: ``qsgd_jax.elias.encode`` and ``decode`` of one vector of 4-bit
QSGD levels (``s = 7``, max-norm scaling, standard Gaussian input, so most
levels are small and nonzero), ``max_level = 7``. Each is jitted, called once
to warm up, then timed over repeated calls waited on with
``jax.block_until_ready``; the median wall-clock time and the median CPU time
of the process are reported (the CPU time is the steadier figure on a shared
machine). For one core, run under ``taskset -c 0`` with
``XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"``.

Sizes, in bits a coordinate, of Q_s of a Gaussian vector for several ``s``
with L2 (the paper's) and max scaling:

* ``sparse`` and ``dense``: the two Elias codes (``encoded_bits``, equal to
  what ``encode`` writes), norm included;
* ``entropy``: the empirical entropy of the level values, the least any code
  that writes one level at a time can spend, norm excluded;
* ``fixed``: the library's packed fixed-width code,
  ``ceil(log2(2 s + 1))`` bits a coordinate plus the 32-bit norm;
* ``theorem_3_2``: the paper's bound on the expected sparse size, with its
  ``o(1)`` taken as 0 (L2 scaling only);
* ``corollary_3_3``: the paper's 2.8 bits a coordinate at ``s = sqrt(n)``.

Writes ``elias_codec.json`` and ``elias_codec.png`` into ``--out``.

Usage::

  python benchmarks/elias_codec.py --size 1000000 --out benchmarks/results/
"""

import argparse
import json
import math
import os
import pathlib
import platform
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (the platform is chosen before JAX starts)
import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from qsgd_jax import elias  # noqa: E402

_VARIANTS = ("sparse", "dense")
_THROUGHPUT_LEVELS = 7  # 4-bit codes: levels in [-7, 7]


def qsgd_levels(key: jax.Array, n: int, s: int, scaling: str) -> jax.Array:
  """QSGD's Q_s levels ``sgn(v_i) s xi_i`` of a standard Gaussian vector."""
  vector_key, rounding_key = jax.random.split(key)
  v = jax.random.normal(vector_key, (n,))
  scale = jnp.linalg.norm(v) if scaling == "l2" else jnp.max(jnp.abs(v))
  scaled = s * jnp.abs(v) / scale
  low = jnp.floor(scaled)
  up = jax.random.uniform(rounding_key, (n,)) < scaled - low
  return (jnp.sign(v) * (low + up)).astype(jnp.int32)


def _medians(fn, args, repeats: int) -> dict[str, float]:
  """Median wall-clock and CPU seconds of ``repeats`` calls after a warm-up call."""
  jax.block_until_ready(fn(*args))
  wall, cpu = [], []
  for _ in range(repeats):
    wall_start, cpu_start = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(*args))
    wall.append(time.perf_counter() - wall_start)
    cpu.append(time.process_time() - cpu_start)
  return {"wall_s": statistics.median(wall), "cpu_s": statistics.median(cpu)}


def throughput(n: int, repeats: int) -> dict[str, dict]:
  levels = qsgd_levels(jax.random.key(0), n, _THROUGHPUT_LEVELS, "max")
  results = {}
  for variant in _VARIANTS:
    encode = jax.jit(lambda levels, variant=variant: elias.encode(
        levels, 1.0, variant=variant, max_level=_THROUGHPUT_LEVELS))
    decode = jax.jit(lambda words, num_bits, variant=variant: elias.decode(
        words, num_bits, n, variant=variant, max_level=_THROUGHPUT_LEVELS))
    words, num_bits = encode(levels)
    decoded, _ = decode(words, num_bits)
    if not bool(jnp.array_equal(decoded, levels)):
      raise AssertionError(f"{variant} round trip failed")
    results[variant] = {
        "bits_per_coordinate": int(num_bits) / n,
        "encode": _medians(encode, (levels,), repeats),
        "decode": _medians(decode, (words, num_bits), repeats),
    }
  return results


def entropy(levels: jax.Array) -> float:
  """Empirical entropy of the level values, in bits a coordinate."""
  _, counts = jnp.unique(levels, return_counts=True)
  p = counts / levels.size
  return float(-jnp.sum(p * jnp.log2(p)))


def theorem_3_2_bound(n: int, s: int) -> float:
  """Theorem 3.2's bound on the expected sparse size in bits, o(1) taken as 0."""
  support = s * (s + math.sqrt(n))
  return (3 + 1.5 * math.log2(2 * (s * s + n) / support)) * support + 32


def sizes(n: int) -> list[dict]:
  rows = []
  root = math.isqrt(n)
  for scaling in ("l2", "max"):
    for s in (1, 2, 4, 8, 16, root):
      levels = qsgd_levels(jax.random.key(s), n, s, scaling)
      row = {"scaling": scaling, "s": s}
      for variant in _VARIANTS:
        row[variant] = int(elias.encoded_bits(levels, variant=variant)) / n
      row["entropy"] = entropy(levels)
      row["fixed"] = math.ceil(math.log2(2 * s + 1)) + 32 / n
      row["theorem_3_2"] = theorem_3_2_bound(n, s) / n if scaling == "l2" else None
      row["corollary_3_3"] = 2.8 if s == root and scaling == "l2" else None
      row["nonzero_fraction"] = float(jnp.mean(levels != 0))
      rows.append(row)
  return rows


def plot(rows: list[dict], n: int, path: pathlib.Path) -> None:
  figure, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
  for axis, scaling in zip(axes, ("l2", "max"), strict=True):
    chosen = [row for row in rows if row["scaling"] == scaling]
    s = [row["s"] for row in chosen]
    for column, style in (("fixed", "s-"), ("dense", "o-"), ("sparse", "o-"),
                          ("entropy", "^--"), ("theorem_3_2", "k:")):
      values = [row[column] for row in chosen]
      if all(value is not None for value in values):
        axis.plot(s, values, style, label=column)
    if scaling == "l2":
      axis.plot([s[-1]], [2.8], "k*", markersize=10, label="corollary 3.3 (2.8)")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log", base=2)
    axis.set_xlabel("levels s")
    axis.set_title(f"Q_s of a Gaussian vector, {scaling} scaling, n = {n}")
    axis.grid(True, which="both", alpha=0.3)
  axes[0].set_ylabel("bits a coordinate")
  axes[0].legend(fontsize=8)
  figure.tight_layout()
  figure.savefig(path, dpi=120)
  plt.close(figure)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", type=int, default=1_000_000, help="coordinates")
  parser.add_argument("--repeats", type=int, default=7, help="timed calls a figure")
  parser.add_argument("--out", type=pathlib.Path,
                      default=pathlib.Path(__file__).resolve().parent / "results")
  args = parser.parse_args()
  args.out.mkdir(parents=True, exist_ok=True)
  n = args.size

  speed = throughput(n, args.repeats)
  print(f"Elias codec of {n} QSGD levels (s = {_THROUGHPUT_LEVELS}, max scaling), "
        "M coordinates/s from the median wall (CPU) time")
  for variant, result in speed.items():
    figures = [f"{n / result[op][clock] / 1e6:.1f}" for op in ("encode", "decode")
               for clock in ("wall_s", "cpu_s")]
    print(f"  {variant:6s} {result['bits_per_coordinate']:.3f} bits/coord   "
          f"encode {figures[0]} ({figures[1]})   decode {figures[2]} ({figures[3]})")

  rows = sizes(n)
  print(f"\nBits a coordinate of Q_s of a Gaussian vector, n = {n}")
  header = ("scaling", "s", "sparse", "dense", "entropy", "fixed", "thm 3.2", "cor 3.3")
  print("  " + "".join(f"{name:>9s}" for name in header))
  for row in rows:
    cells = [row["scaling"], str(row["s"])] + [
        "-" if row[column] is None else f"{row[column]:.3f}"
        for column in ("sparse", "dense", "entropy", "fixed", "theorem_3_2", "corollary_3_3")]
    print("  " + "".join(f"{cell:>9s}" for cell in cells))

  plot(rows, n, args.out / "elias_codec.png")
  record = {
      "size": n,
      "throughput_levels": _THROUGHPUT_LEVELS,
      "throughput": speed,
      "bits_per_coordinate": rows,
      "device": str(jax.devices()[0]),
      "machine": platform.processor() or platform.machine(),
      "cpu_affinity": sorted(os.sched_getaffinity(0)),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "jax": jax.__version__,
  }
  (args.out / "elias_codec.json").write_text(json.dumps(record, indent=2) + "\n")
  print(f"\nwrote {args.out / 'elias_codec.json'} and {args.out / 'elias_codec.png'}")


if __name__ == "__main__":
  main()
