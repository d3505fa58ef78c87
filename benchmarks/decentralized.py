"""Bagua's deterministic quantizer against stochastic min-max, in decentralized SGD on digits.

``error_feedback.py``'s MLP and data on 8 simulated CPU devices in a ring,
trained with ``qsgd_jax.low_precision_decentralized`` (SGD with momentum 0.9
as each worker's local step), the exchanged model differences quantized by:

* ``bagua8``: the default, ``NearestZeroAlignedMinMax(bits=8)``: Bagua's
  quantizer, rounding to nearest on a zero-aligned grid (biased, half the
  mean squared error);
* ``minmax8``: ``MinMax(bits=8, bucket_size=None)``: unbiased stochastic
  rounding, one range a Bagua bucket like Bagua's;
* ``bagua4``, ``minmax4``: the same at 4 bits, where rounding matters more;

against ``allreduce``, data-parallel SGD with a float32 ``pmean``. The table
gives the mean and standard deviation over seeds of the test accuracy of the
workers' averaged model, the training loss, and the consensus distance (how
far the workers' models are from their average, relative to its norm).

Usage::

  python benchmarks/decentralized.py --seeds 5 --steps 300 --out benchmarks/results/
"""

import argparse
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from error_feedback import (  # noqa: E402  (sets 8 devices before JAX picks a backend)
  AXIS,
  NUM_DEVICES,
  evaluate,
  float32_pmean,
  init_params,
  load_data,
  run_steps,
)

import qsgd_jax  # noqa: E402

MODES = {
    "allreduce": None,
    "bagua8": qsgd_jax.NearestZeroAlignedMinMax(bits=8),
    "minmax8": qsgd_jax.MinMax(bits=8, bucket_size=None),
    "bagua4": qsgd_jax.NearestZeroAlignedMinMax(bits=4),
    "minmax4": qsgd_jax.MinMax(bits=4, bucket_size=None),
}


def make_train(mode: str, steps: int, batch_size: int, learning_rate: float):
  """A pmapped ``(params, x, y, key) -> (averaged params, relative consensus distance)``."""
  local_step = optax.sgd(learning_rate, momentum=0.9)
  if MODES[mode] is None:
    tx = optax.chain(float32_pmean(), local_step)
  else:
    tx = qsgd_jax.low_precision_decentralized(local_step, AXIS, compressor=MODES[mode])

  def train(params, x, y, key):
    params = run_steps(tx, params, x, y, key, steps, batch_size)
    average = qsgd_jax.averaged_params(params, AXIS)
    norm = jnp.sqrt(sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(average)))
    return average, qsgd_jax.consensus_distance(params, AXIS) / norm

  return jax.pmap(train, axis_name=AXIS)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, default=5)
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch-size", type=int, default=32, help="examples a device a step")
  parser.add_argument("--learning-rate", type=float, default=0.05)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
  options = parser.parse_args()
  x_train, y_train, x_test, y_test = load_data()
  record = {"seeds": options.seeds, "steps": options.steps, "devices": NUM_DEVICES,
            "batch_size_per_device": options.batch_size,
            "learning_rate": options.learning_rate, "modes": {}}
  print(f"digits, ring of {NUM_DEVICES}, {options.seeds} seeds x {options.steps} steps, "
        f"SGD momentum 0.9, lr {options.learning_rate}")
  print(f"{'mode':<10}{'test accuracy %':>20}{'train loss':>20}{'consensus':>20}{'seconds':>9}")
  for mode in MODES:
    start = time.perf_counter()
    train = make_train(mode, options.steps, options.batch_size, options.learning_rate)
    runs = []
    for seed in range(options.seeds):
      params = jax.tree.map(lambda v: jnp.broadcast_to(v, (NUM_DEVICES, *v.shape)),
                            init_params(jax.random.key(seed)))
      keys = jax.random.wrap_key_data(jnp.broadcast_to(
          jax.random.key_data(jax.random.key(1000 + seed)), (NUM_DEVICES, 2)))
      average, distance = jax.block_until_ready(train(params, x_train, y_train, keys))
      first = jax.tree.map(lambda leaf: np.asarray(leaf[0]), average)
      runs.append({"seed": seed, **evaluate(first, x_train, y_train, x_test, y_test),
                   "consensus_distance": float(distance[0])})
    summary = {field: {"mean": statistics.fmean(r[field] for r in runs),
                       "std": statistics.stdev(r[field] for r in runs) if len(runs) > 1 else 0.0}
               for field in ("test_accuracy", "train_loss", "consensus_distance")}
    record["modes"][mode] = {"runs": runs, **summary, "seconds": time.perf_counter() - start}
    print(f"{mode:<10}" + "".join(
        f"{summary[f]['mean']:>12.4g} ± {summary[f]['std']:<5.2g}"
        for f in ("test_accuracy", "train_loss", "consensus_distance"))
        + f"{record['modes'][mode]['seconds']:>8.1f}")
  options.out.mkdir(parents=True, exist_ok=True)
  path = options.out / f"decentralized_{options.seeds}seeds_{options.steps}steps.json"
  path.write_text(json.dumps(record, indent=2) + "\n")
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
