"""PowerSGD's orthogonalization at GPT-2 small's factors: QR against Gram-Schmidt.

For every group of GPT-2 small's PowerSGD plan at rank 4 (its P factors,
batches of up to 12 matrices of up to 27,648 x 4, then its Q factors), times
each way of orthonormalizing the columns on the default device and measures
how orthonormal the result is (the largest entry of ``|Q^T Q - I|``) and how
far its columns reach out of float64 QR's span ``E`` (the largest entry of
``Q - E E^T Q``). The factors are nearly rank one, as a gradient's are
(one shared column plus noise of 1e-3). ``qsgd_jax``'s
``low_rank.orthogonalize`` takes LAPACK's QR one matrix at a time on the CPU
and Gram-Schmidt twice elsewhere (``qsgd_jax/_src/low_rank.py`` says why).

  python benchmarks/orthogonalize.py            # on the default device (benchmarks/results/
                                                # orthogonalize.{json,txt}, or results/<gpu|tpu>/)
  python benchmarks/orthogonalize.py --small    # GPT-2 small's shapes / 32 (seconds, any CPU)
"""

import argparse
import importlib.util
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))

from qsgd_jax._src.powersgd import low_rank  # noqa: E402

_spec = importlib.util.spec_from_file_location("benchmarks_accelerator",
                                               _ROOT / "benchmarks" / "accelerator.py")
accelerator = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(accelerator)

WAYS = {
    # Not on the CPU: jaxlib's batched LAPACK QR deadlocks there on a small host (it waits on
    # the thread pool its own thread belongs to; low_rank.orthogonalize says more).
    "qr_batched": lambda m: jnp.linalg.qr(m, mode="reduced")[0],
    "qr_one_at_a_time": lambda m: jax.lax.map(lambda x: jnp.linalg.qr(x, mode="reduced")[0], m),
    "gram_schmidt_once": lambda m: low_rank._gram_schmidt(m, 0.0),
    "gram_schmidt_twice": low_rank.gram_schmidt_twice,
}


def factors(small: bool) -> dict[str, list[tuple[int, int, int]]]:
  """The shapes of GPT-2 small's P and Q factors, one a group of its rank-4 PowerSGD plan."""
  model = accelerator._model(small)
  params = jax.eval_shape(model.init, jax.random.key(0),
                          jnp.zeros((1, model.context_length), jnp.int32))["params"]
  plan = low_rank.make_plan(params, 4, 2.0)
  return {"P": [g.p_shape for g in plan.groups], "Q": [g.q_shape for g in plan.groups]}


def measure(shapes, repeats: int, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  matrices = [jnp.asarray(rng.standard_normal((b, n, 1)) + 1e-3 * rng.standard_normal((b, n, r)),
                          jnp.float32) for b, n, r in shapes]
  exact = [np.linalg.qr(np.asarray(m, np.float64), mode="reduced")[0] for m in matrices]
  out = {}
  for name, way in WAYS.items():
    if name == "qr_batched" and jax.default_backend() == "cpu":
      continue
    run = jax.jit(lambda ms, way=way: [way(m) for m in ms])
    qs = [np.asarray(q, np.float64) for q in jax.block_until_ready(run(matrices))]
    out[name] = {
        "ms": 1e3 * accelerator._seconds(run, (matrices,), repeats),
        "orthonormality": max(float(np.abs(np.einsum("bnr,bns->brs", q, q) - np.eye(4)).max())
                              for q in qs),
        "outside_float64_span": max(
            float(np.abs(q - np.einsum("bnr,brs->bns", e, np.einsum("bnr,bns->brs", e, q))).max())
            for q, e in zip(qs, exact, strict=True)),
    }
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--small", action="store_true")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--out", type=pathlib.Path, default=None)
  args = parser.parse_args(argv)
  device = jax.devices()[0]
  record = {"device": device.device_kind, "jax": jax.__version__,
            "command": " ".join(["python", *sys.argv]), "factors": {}}
  lines = [f"{device.device_kind}, JAX {jax.__version__}: ms for all of a step's factors, "
           "largest |Q^T Q - I|, largest entry of Q outside float64 QR's span"]
  for which, shapes in factors(args.small).items():
    record["factors"][which] = {"shapes": shapes, "ways": measure(shapes, args.repeats)}
    lines.append(f"{which} factors {shapes}:")
    for name, row in record["factors"][which]["ways"].items():
      lines.append(f"  {name:<20} {row['ms']:8.3f} ms  {row['orthonormality']:.1e}  "
                   f"{row['outside_float64_span']:.1e}")
  text = "\n".join(lines) + "\n"
  print(text, end="")
  folder = _ROOT / "benchmarks" / "results"
  if device.platform != "cpu":
    folder /= device.platform
  out = args.out or folder / ("orthogonalize_small.json" if args.small else "orthogonalize.json")
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(record, indent=1) + "\n")
  out.with_suffix(".txt").write_text(text)


if __name__ == "__main__":
  main()
