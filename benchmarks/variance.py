"""Bits a coordinate against variance, for every compressor on the same gradient.

For a gradient ``v`` and each method, the normalized error
``E||Q(v) - v||^2 / ||v||^2`` over many keys and the wire bits a coordinate
(``wire_bits / n``; for QSGD also the size under the paper's Elias code).
The gradient is heavy-tailed, like real ones: Student-t with 3 degrees of
freedom, scaled per layer-sized block.

  python benchmarks/variance.py [--size N] [--keys K] [--out DIR]
"""

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import qsgd_jax


def _gradient(size: int) -> jax.Array:
  """A heavy-tailed vector with per-block scales, float32[size]."""
  key_values, key_scales = jax.random.split(jax.random.key(42))
  values = jax.random.t(key_values, 3.0, (size,))
  blocks = -(-size // 4096)
  scales = jnp.exp(jax.random.normal(key_scales, (blocks,)))
  return values * jnp.repeat(scales, 4096)[:size]


def _methods():
  methods = {"fp32": qsgd_jax.Identity(), "bf16": qsgd_jax.Cast(jnp.bfloat16)}
  for bits in (2, 4, 8):
    for norm in ("max", "l2"):
      for bucket in (128, 512, 4096, None):
        name = f"qsgd{bits}-{norm}-b{bucket or 'all'}"
        methods[name] = qsgd_jax.QSGD(bits=bits, norm=norm, bucket_size=bucket)
  methods["minmax8-ball"] = qsgd_jax.MinMax(bits=8, bucket_size=None)
  methods["minmax8-b512"] = qsgd_jax.MinMax(bits=8, bucket_size=512)
  methods["minmax4-b512"] = qsgd_jax.MinMax(bits=4, bucket_size=512)
  methods["onebit-b512"] = qsgd_jax.OneBit(bucket_size=512)
  return methods


def measure(size: int, num_keys: int) -> list[dict]:
  v = _gradient(size)
  norm2 = float(jnp.sum(v * v))
  keys = jax.random.split(jax.random.key(0), num_keys)
  rows = []
  for name, compressor in _methods().items():

    # Encode and decode compile apart, as on the wire where a collective sits
    # between them: in one program XLA may drop a float32 -> bf16 -> float32
    # round trip as excess precision.
    payloads = jax.jit(jax.vmap(compressor.encode, in_axes=(0, None)))(keys, v)

    def error_and_elias(payload, v, compressor=compressor):
      error = jnp.sum((compressor.decode(payload) - v) ** 2)
      if isinstance(compressor, qsgd_jax.QSGD):
        return error, compressor.elias_bits(payload).smaller.astype(jnp.float32)
      return error, jnp.float32(jnp.nan)

    errors, elias = jax.jit(jax.vmap(error_and_elias, in_axes=(0, None)))(payloads, v)
    rows.append({
        "method": name,
        "bits_per_coordinate": compressor.wire_bits(v.shape) / size,
        "elias_bits_per_coordinate": float(jnp.mean(elias)) / size,
        "normalized_variance": float(jnp.mean(errors)) / norm2,
        "unbiased": compressor.unbiased,
    })
  return rows


def plot(rows: list[dict], path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(8, 5.5))
  families = {"qsgd": "tab:blue", "minmax": "tab:green", "onebit": "tab:red", "bf16": "tab:purple"}
  for row in rows:
    if row["normalized_variance"] <= 0:
      continue
    family = next((f for f in families if row["method"].startswith(f)), None)
    marker = "o" if "-max-" in row["method"] or family != "qsgd" else "s"
    ax.scatter(row["bits_per_coordinate"], row["normalized_variance"],
               color=families.get(family, "gray"), marker=marker, s=28)
    ax.annotate(row["method"], (row["bits_per_coordinate"], row["normalized_variance"]),
                fontsize=6, xytext=(3, 2), textcoords="offset points")
    if np.isfinite(row["elias_bits_per_coordinate"]):
      ax.scatter(row["elias_bits_per_coordinate"], row["normalized_variance"],
                 facecolors="none", edgecolors="tab:blue", marker=marker, s=28)
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("bits per coordinate on the wire (hollow: QSGD levels under Elias coding)")
  ax.set_ylabel("E||Q(v) - v||^2 / ||v||^2")
  ax.set_title("Bits against variance (circles: max norm, squares: L2 norm)")
  ax.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=130)
  plt.close(fig)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", type=int, default=1 << 20)
  parser.add_argument("--keys", type=int, default=32)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
  args = parser.parse_args()
  rows = measure(args.size, args.keys)
  print(f"{'method':<20} {'bits/coord':>10} {'elias':>8} {'variance':>12}")
  for row in sorted(rows, key=lambda r: r["bits_per_coordinate"]):
    print(f"{row['method']:<20} {row['bits_per_coordinate']:>10.3f} "
          f"{row['elias_bits_per_coordinate']:>8.3f} {row['normalized_variance']:>12.3e}")
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "variance.json").write_text(
      json.dumps({"size": args.size, "keys": args.keys, "rows": rows}, indent=2))
  plot(rows, args.out / "variance.png")
  print(f"wrote {args.out / 'variance.json'} and {args.out / 'variance.png'}")


if __name__ == "__main__":
  main()
