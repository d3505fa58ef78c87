"""Bytes a step of the compressed Adams, before and after the freeze, on scikit-learn's digits.

Trains a small MLP (64 -> 256 -> 256 -> 10, ReLU) with ``qsgd_jax.data_parallel`` over
eight simulated CPU devices, once with each optimizer:

* ``adamw_fp32``: ``optax.adamw`` after a float32 average (``compressed_allreduce``
  with ``Identity``), the reference;
* ``adamw_qsgd4``: ``optax.adamw`` after a 4-bit QSGD average;
* ``onebit_adam``: ``qsgd_jax.onebit_adam``, float32 until ``--freeze-step``, then
  1-bit momentum;
* ``zero_one_adam``: ``qsgd_jax.zero_one_adam`` with ``var_freeze_step=--freeze-step``
  and ``local_step_clipper=1`` (every step synchronizes: one model).

All four use Adam's ``eps`` of ``--eps``, 1e-3 by default: with optax's and
DeepSpeed's 1e-8, 1-bit Adam diverges here within three steps of the freeze
(loss 0.09 at the freeze, 2e3 two steps later). Its update after the freeze
divides the 1-bit momentum by the frozen ``sqrt(v) + eps``, and
this MLP has thousands of weights whose gradient was exactly zero all through
the warm-up (ReLU units that never fire, pixels that are always blank): their
``v`` is 0, while sign compression gives every coordinate of a bucket the
bucket's magnitude, so they step by that magnitude over ``eps``.

Every step records what one device sent (``qsgd_jax.compression_stats``: the
optimizer's own account, from its payloads' static shapes) and the training
loss; the end of each run, the accuracy on 360 held-out digits. The bytes are
a property of the optimizer and the model, the same on every machine; the
losses are those of one seed.

Usage::

  python benchmarks/compressed_adam_bytes.py --out benchmarks/results/

writes ``compressed_adam_bytes.json``, which ``benchmarks/figures.py`` plots.
"""

import argparse
import json
import os
import pathlib
import platform
import sys
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
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import qsgd_jax  # noqa: E402

AXIS = "batch"
WIDTHS = (64, 256, 256, 10)
MIN_COMPRESSED_SIZE = 2048  # The three kernels (16,384, 65,536, 2,560); not the biases.


def optimizers(learning_rate: float, freeze_step: int, eps: float) -> dict:
  """Each optimizer of the comparison, by name."""
  options = dict(min_compressed_size=MIN_COMPRESSED_SIZE)
  return {
      "adamw_fp32": optax.chain(
          qsgd_jax.compressed_allreduce(qsgd_jax.Identity(), AXIS, **options),
          optax.adamw(learning_rate, eps=eps)),
      "adamw_qsgd4": optax.chain(qsgd_jax.qsgd(AXIS, **options),
                                 optax.adamw(learning_rate, eps=eps)),
      "onebit_adam": qsgd_jax.onebit_adam(learning_rate, AXIS, freeze_step=freeze_step,
                                          eps=eps, **options),
      "zero_one_adam": qsgd_jax.zero_one_adam(learning_rate, AXIS, var_freeze_step=freeze_step,
                                              eps=eps, local_step_clipper=1, **options),
  }


def init_params(seed: int) -> dict:
  keys = jax.random.split(jax.random.key(seed), len(WIDTHS) - 1)
  return {f"layer{i}": {"kernel": jax.random.normal(key, (n_in, n_out)) / np.sqrt(n_in),
                        "bias": jnp.zeros(n_out)}
          for i, (key, n_in, n_out) in enumerate(
              zip(keys, WIDTHS[:-1], WIDTHS[1:], strict=True))}


def logits_of(params, x):
  for i in range(len(WIDTHS) - 1):
    layer = params[f"layer{i}"]
    x = x @ layer["kernel"] + layer["bias"]
    if i < len(WIDTHS) - 2:
      x = jax.nn.relu(x)
  return x


def loss_fn(params, batch):
  x, y = batch
  return optax.softmax_cross_entropy_with_integer_labels(logits_of(params, x), y).mean()


def run(name: str, tx, data, args) -> dict:
  (x_train, y_train), (x_test, y_test) = data
  mesh = jax.make_mesh((jax.device_count(),), (AXIS,))
  init, step, _ = qsgd_jax.data_parallel(loss_fn, tx, mesh)
  params = jax.device_put(init_params(args.seed), NamedSharding(mesh, P()))
  opt_state = init(params)
  rng = np.random.default_rng(args.seed)
  records = []
  start = time.perf_counter()
  for t in range(args.steps):
    rows = rng.integers(0, len(y_train), args.batch_size)
    params, opt_state, loss = step(params, opt_state, (x_train[rows], y_train[rows]))
    stats = qsgd_jax.compression_stats(opt_state)
    records.append({"step": t, "loss": float(loss), "wire_bytes": float(stats.wire_bits) / 8,
                    "fp32_wire_bytes": float(stats.float32_bits) / 8})
  seconds = time.perf_counter() - start
  accuracy = float(jnp.mean(jnp.argmax(logits_of(params, x_test), -1) == y_test))
  print(f"{name:14s} bytes a step {records[0]['wire_bytes']:10,.0f} at first, "
        f"{records[-1]['wire_bytes']:10,.0f} at the end; final loss {records[-1]['loss']:.3f}, "
        f"held-out accuracy {accuracy:.2%} ({seconds:.0f} s)")
  return {"steps": records, "eval_accuracy": accuracy, "seconds": seconds}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--freeze-step", type=int, default=40)
  parser.add_argument("--batch-size", type=int, default=256, help="over all devices")
  parser.add_argument("--learning-rate", type=float, default=3e-3)
  parser.add_argument("--eps", type=float, default=1e-3, help="Adam's eps, for all four")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", type=pathlib.Path, default=None)
  args = parser.parse_args(argv)

  digits = load_digits()
  x_train, x_test, y_train, y_test = train_test_split(
      (digits.data / 16.0).astype(np.float32), digits.target, test_size=360,
      random_state=0, stratify=digits.target)
  data = ((x_train, y_train), (x_test, y_test))
  results = {name: run(name, tx, data, args)
             for name, tx in optimizers(args.learning_rate, args.freeze_step, args.eps).items()}
  report = {
      "command": "python benchmarks/compressed_adam_bytes.py "
                 + " ".join(argv if argv is not None else sys.argv[1:]),
      "devices": jax.device_count(), "widths": WIDTHS,
      "min_compressed_size": MIN_COMPRESSED_SIZE, "freeze_step": args.freeze_step, "eps": args.eps,
      "steps": args.steps, "batch_size": args.batch_size, "learning_rate": args.learning_rate,
      "seed": args.seed, "jax_version": jax.__version__, "processor": platform.machine(),
      "modes": results,
  }
  if args.out is not None:
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "compressed_adam_bytes.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
