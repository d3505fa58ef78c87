"""What an optimizer step of the compressed Adams computes, against AdamW's.

On the language model of ``examples/lm/configs/network.py`` (6.6M parameters,
30 leaves), over ``--devices`` simulated CPU devices (2 by default: one a core
here) under ``jax.pmap``, it times one jitted step, the update and
``optax.apply_updates``, on fixed random gradients, for:

* ``adamw_local``: ``optax.adamw`` on each device's own gradients, no
  average: the floor of every mode below;
* ``adamw_fp32``, ``adamw_bf16``: ``optax.adamw`` after ``jax.lax.pmean`` of
  the gradients in float32, or cast to bfloat16 and back;
* ``onebit_adam_warm_up``, ``onebit_adam_compressed``: ``qsgd_jax.onebit_adam``
  before its freeze (a float32 ``pmean``) and after it (the 1-bit exchange);
* ``zero_one_adam``: ``qsgd_jax.zero_one_adam`` past its variance freeze, every
  step synchronized (``local_step_clipper=1``): the 1-bit exchange;
* ``sign_exchange``: the 1-bit exchange alone, of the 30 leaves.

Timings are medians of ``--repeats`` calls, the modes timed in turn within each
round so that all see the same background load, each call waited on with
``jax.block_until_ready``. On simulated devices the collectives are memory
copies: this is the compute a step adds, which ``benchmarks/network.py`` puts
on a real link.

Usage::

  python benchmarks/compressed_adam_step.py --out benchmarks/results/
"""

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=2)
  parser.add_argument("--repeats", type=int, default=15)
  parser.add_argument("--out", type=pathlib.Path, default=None,
                      help="directory for compressed_adam_step.json")
  return parser.parse_args(argv)


def main(argv=None) -> None:
  args = parse_args(argv)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={args.devices}")
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
  import jax
  import jax.numpy as jnp
  import optax

  import qsgd_jax
  from examples.lm import train
  from examples.lm.configs import network
  from qsgd_jax._src.adam import sign_exchange

  n = args.devices
  params = train.initialized(jax.random.key(0), train.create_model(network.get_config()))
  leaves = jax.tree.leaves(params)
  replicated = jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), params)
  grads = jax.tree.map(lambda x: jax.random.normal(jax.random.key(1), x.shape, x.dtype),
                       replicated)

  def bf16_mean(g):
    return jax.tree.map(
        lambda x: jax.lax.pmean(x.astype(jnp.bfloat16), "batch").astype(x.dtype), g)

  adamw = optax.adamw(1e-3)
  modes = {
      "adamw_local": (adamw, None),
      "adamw_fp32": (adamw, lambda g: jax.lax.pmean(g, "batch")),
      "adamw_bf16": (adamw, bf16_mean),
      "onebit_adam_warm_up": (qsgd_jax.onebit_adam(1e-3, "batch", freeze_step=10**6), None),
      "onebit_adam_compressed": (qsgd_jax.onebit_adam(1e-3, "batch", freeze_step=1), None),
      "zero_one_adam": (qsgd_jax.zero_one_adam(1e-3, "batch", var_freeze_step=1,
                                               local_step_clipper=1), None),
  }

  def stepper(tx, average):
    def step(g, state, p):
      if average is not None:
        g = average(g)
      updates, state = tx.update(g, state, p)
      return optax.apply_updates(p, updates), state
    step = jax.pmap(step, axis_name="batch", donate_argnums=(1, 2))
    carry = [jax.tree.map(jnp.copy, replicated)]
    carry.append(jax.pmap(tx.init, axis_name="batch")(carry[0]))

    def run():
      carry[0], carry[1] = step(grads, carry[1], carry[0])
      return carry[0]
    return run

  runs = {name: stepper(tx, average) for name, (tx, average) in modes.items()}
  layout = sign_exchange.sign_layout([leaf.size for leaf in leaves], n)
  exchange = jax.pmap(lambda v, w, s: sign_exchange.exchange(v, w, s, layout, "batch"),
                      axis_name="batch")
  errors = (jnp.zeros((n, *layout.worker_error_shape().shape)),
            jnp.zeros((n, *layout.server_error_shape().shape)))
  runs["sign_exchange"] = lambda: exchange(jax.tree.leaves(grads), *errors)

  for run in runs.values():  # Compile, and take the compressed Adams past their first step.
    jax.block_until_ready(run())
    jax.block_until_ready(run())
  seconds = {name: [] for name in runs}
  for _ in range(args.repeats):
    for name, run in runs.items():
      start = time.perf_counter()
      jax.block_until_ready(run())
      seconds[name].append(time.perf_counter() - start)

  medians = {name: statistics.median(times) for name, times in seconds.items()}
  num_params = sum(leaf.size for leaf in leaves)
  print(f"{num_params:,} parameters in {len(leaves)} leaves, {n} simulated CPU devices;"
        f" {platform.machine()}, load average {os.getloadavg()[0]:.1f}\n")
  print("| step | median ms | ns a parameter | vs adamw_fp32 |\n|---|---|---|---|")
  for name, median in medians.items():
    print(f"| {name} | {1e3 * median:.1f} | {1e9 * median / num_params:.1f}"
          f" | {median / medians['adamw_fp32']:.2f}x |")
  if args.out:
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"devices": n, "parameters": num_params, "leaves": len(leaves),
              "repeats": args.repeats, "median_seconds": medians, "seconds": seconds,
              "load_average": os.getloadavg()[0]}
    path = args.out / "compressed_adam_step.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
  main()
