"""Error feedback for 1-bit SGD, measured on scikit-learn's digits.

Trains the same small MLP (64 -> 128 -> 10, ReLU) data-parallel over eight
simulated CPU devices with ``jax.pmap``, averaging the gradients each step
with one of:

* ``float32``: ``jax.lax.pmean``, the reference;
* ``qsgd_4bit``: ``qsgd_jax.qsgd`` (4 bits, buckets of 512, max norm);
* ``onebit_none``, ``onebit_worker``, ``onebit_owner``, ``onebit_both``:
  ``qsgd_jax.onebit_sgd`` in buckets of 512 with ``error_feedback``
  ``False``, ``"worker"``, ``"owner"`` and ``"both"``;
* ``onebit_rows_worker``, ``onebit_rows_both``: one bucket a row
  (``bucket_size=None``, CNTK's per-column quantization), and
  ``onebit_rows_both_cntk``, which also quantizes each device's own piece:
  CNTK's aggregator with its defaults.

Both weight matrices (8192 and 1280 elements) are compressed
(``min_compressed_size=1024``); the biases travel in float32. After the
all-reduce comes SGD with momentum 0.9 (or Adam, ``--optimizer adam``).

The digits (1797 images, 8x8) are split once, stratified, into 1437 training
and 360 test images; each device holds 1/8 of the training set and draws its
own batches from it. A seed fixes the initial parameters and the batches,
so for a given seed every mode sees the same data in the same order. Each
seed's run is one jitted ``lax.scan`` over the steps inside ``jax.pmap``.
The table gives the mean and standard deviation over seeds of the final test
accuracy and of the final loss on the whole training set.

Usage::

  python benchmarks/error_feedback.py --seeds 5 --steps 300 --out benchmarks/results/
"""

import argparse
import json
import os
import pathlib
import platform
import statistics
import time

NUM_DEVICES = 8
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count={NUM_DEVICES}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (the device count is fixed before JAX starts)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import qsgd_jax  # noqa: E402

AXIS = "batch"
HIDDEN = 128
MIN_COMPRESSED_SIZE = 1024


def float32_pmean() -> optax.GradientTransformation:
  """The float32 reference: a plain ``pmean`` of the gradients."""
  return optax.GradientTransformation(
      lambda params: optax.EmptyState(),
      lambda updates, state, params=None: (jax.lax.pmean(updates, AXIS), state),
  )


MODES = {
    "float32": float32_pmean,
    "qsgd_4bit": lambda: qsgd_jax.qsgd(AXIS, min_compressed_size=MIN_COMPRESSED_SIZE),
    "onebit_none": lambda: qsgd_jax.onebit_sgd(
        AXIS, error_feedback=False, min_compressed_size=MIN_COMPRESSED_SIZE),
    "onebit_worker": lambda: qsgd_jax.onebit_sgd(
        AXIS, error_feedback="worker", min_compressed_size=MIN_COMPRESSED_SIZE),
    "onebit_owner": lambda: qsgd_jax.onebit_sgd(
        AXIS, error_feedback="owner", min_compressed_size=MIN_COMPRESSED_SIZE),
    "onebit_both": lambda: qsgd_jax.onebit_sgd(
        AXIS, error_feedback="both", min_compressed_size=MIN_COMPRESSED_SIZE),
    "onebit_rows_worker": lambda: qsgd_jax.onebit_sgd(
        AXIS, bucket_size=None, error_feedback="worker", min_compressed_size=MIN_COMPRESSED_SIZE),
    "onebit_rows_both": lambda: qsgd_jax.onebit_sgd(
        AXIS, bucket_size=None, error_feedback="both", min_compressed_size=MIN_COMPRESSED_SIZE),
    "onebit_rows_both_cntk": lambda: qsgd_jax.onebit_sgd(
        AXIS, bucket_size=None, error_feedback="both", exact_own_piece=False,
        min_compressed_size=MIN_COMPRESSED_SIZE),
}


def load_data(num_devices: int = NUM_DEVICES):
  """Training shards ``[devices, m, 64]``, ``[devices, m]`` and the test set."""
  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  x_train, x_test, y_train, y_test = train_test_split(
      x, y, test_size=360, stratify=y, random_state=0)
  per_device = len(x_train) // num_devices
  used = per_device * num_devices
  return (x_train[:used].reshape(num_devices, per_device, -1),
          y_train[:used].reshape(num_devices, per_device),
          x_test, y_test)


def init_params(key: jax.Array) -> dict:
  first, second = jax.random.split(key)
  return {
      "hidden": {"w": jax.random.normal(first, (64, HIDDEN)) * np.sqrt(2 / 64),
                 "b": jnp.zeros((HIDDEN,))},
      "out": {"w": jax.random.normal(second, (HIDDEN, 10)) * np.sqrt(1 / HIDDEN),
              "b": jnp.zeros((10,))},
  }


def logits(params: dict, x: jax.Array) -> jax.Array:
  hidden = jax.nn.relu(x @ params["hidden"]["w"] + params["hidden"]["b"])
  return hidden @ params["out"]["w"] + params["out"]["b"]


def loss(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y).mean()


def run_steps(tx, params, x, y, key, steps: int, batch_size: int):
  """Inside ``pmap``: ``steps`` steps of ``tx`` on batches this device draws from its data."""
  key = jax.random.fold_in(key, jax.lax.axis_index(AXIS))

  def step(carry, step_key):
    params, state = carry
    index = jax.random.randint(step_key, (batch_size,), 0, x.shape[0])
    grads = jax.grad(loss)(params, x[index], y[index])
    updates, state = tx.update(grads, state, params)
    return (optax.apply_updates(params, updates), state), None

  (params, _), _ = jax.lax.scan(step, (params, tx.init(params)), jax.random.split(key, steps))
  return params


def make_train(mode: str, steps: int, batch_size: int, optimizer: str, learning_rate: float):
  """A pmapped ``(params, x, y, key) -> params`` running ``steps`` steps."""
  inner = (optax.sgd(learning_rate, momentum=0.9) if optimizer == "sgd"
           else optax.adam(learning_rate))
  tx = optax.chain(MODES[mode](), inner)

  def train(params, x, y, key):
    return run_steps(tx, params, x, y, key, steps, batch_size)

  return jax.pmap(train, axis_name=AXIS)


def evaluate(params: dict, x_train, y_train, x_test, y_test) -> dict:
  """Test accuracy (%) and training loss of one device's copy of ``params``."""
  predicted = np.asarray(jnp.argmax(logits(params, x_test), axis=-1))
  return {
      "test_accuracy": 100.0 * float(np.mean(predicted == y_test)),
      "train_loss": float(loss(params, x_train.reshape(-1, 64), y_train.reshape(-1))),
  }


def run_mode(mode, seeds, steps, batch_size, optimizer, learning_rate, data) -> list[dict]:
  """One result a seed; checks that every device ends with the same parameters."""
  x_train, y_train, x_test, y_test = data
  train = make_train(mode, steps, batch_size, optimizer, learning_rate)
  results = []
  for seed in seeds:
    params = init_params(jax.random.key(seed))
    stacked = jax.tree.map(lambda v: jnp.broadcast_to(v, (NUM_DEVICES, *v.shape)), params)
    keys = jnp.broadcast_to(jax.random.key_data(jax.random.key(1000 + seed)), (NUM_DEVICES, 2))
    final = jax.block_until_ready(
        train(stacked, x_train, y_train, jax.random.wrap_key_data(keys)))
    final = jax.tree.map(np.asarray, final)
    if not all((leaf == leaf[0]).all() for leaf in jax.tree.leaves(final)):
      raise AssertionError(f"{mode}, seed {seed}: devices ended with different parameters.")
    first = jax.tree.map(lambda leaf: leaf[0], final)
    results.append({"seed": seed, **evaluate(first, x_train, y_train, x_test, y_test)})
  return results


def summarize(runs: list[dict]) -> dict:
  summary = {}
  for field in ("test_accuracy", "train_loss"):
    values = [run[field] for run in runs]
    summary[field] = {"mean": statistics.fmean(values),
                      "std": statistics.stdev(values) if len(values) > 1 else 0.0}
  return summary


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, default=5, help="seeds 0 .. seeds - 1")
  parser.add_argument("--steps", type=int, default=300, help="training steps a run")
  parser.add_argument("--batch-size", type=int, default=32, help="examples a device a step")
  parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                      help="after the all-reduce: SGD with momentum 0.9, or Adam")
  parser.add_argument("--learning-rate", type=float, default=None,
                      help="default 0.05 for sgd, 1e-3 for adam")
  parser.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES))
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
  args = parser.parse_args()
  learning_rate = args.learning_rate or (0.05 if args.optimizer == "sgd" else 1e-3)

  data = load_data()
  seeds = list(range(args.seeds))
  record = {
      "seeds": seeds, "steps": args.steps, "batch_size_per_device": args.batch_size,
      "devices": NUM_DEVICES, "optimizer": args.optimizer, "learning_rate": learning_rate,
      "model": f"MLP 64-{HIDDEN}-10 ReLU", "min_compressed_size": MIN_COMPRESSED_SIZE,
      "jax_version": jax.__version__, "optax_version": optax.__version__,
      "processor": platform.processor() or platform.machine(), "modes": {},
  }
  print(f"digits, {len(seeds)} seeds x {args.steps} steps, batch {args.batch_size} x "
        f"{NUM_DEVICES} devices, {args.optimizer} lr {learning_rate}")
  print(f"{'mode':<15}{'test accuracy %':>20}{'train loss':>20}{'seconds':>9}")
  for mode in args.modes:
    start = time.perf_counter()
    runs = run_mode(mode, seeds, args.steps, args.batch_size, args.optimizer, learning_rate,
                    data)
    seconds = time.perf_counter() - start
    summary = summarize(runs)
    record["modes"][mode] = {"runs": runs, **summary, "seconds": seconds}
    accuracy, train_loss = summary["test_accuracy"], summary["train_loss"]
    print(f"{mode:<15}{accuracy['mean']:>12.2f} ± {accuracy['std']:<5.2f}"
          f"{train_loss['mean']:>12.4f} ± {train_loss['std']:<6.4f}{seconds:>8.1f}")
  args.out.mkdir(parents=True, exist_ok=True)
  path = args.out / (f"error_feedback_{args.optimizer}_{len(seeds)}seeds_{args.steps}steps.json")
  path.write_text(json.dumps(record, indent=2) + "\n")
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
