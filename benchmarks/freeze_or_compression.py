"""Why 1-bit Adam falls behind on the network configuration: the freeze, the clipping, or the bits.

1-bit Adam differs from float32 AdamW in three ways at once: each device's
gradient is clipped before the average (AdamW clips the mean), the variance
is frozen after ``freeze_step`` updates, and the momentum is averaged in one
bit with error feedback. This trains ``examples/lm/configs/network.py`` (2
simulated devices, 6.6M parameters, 200 steps, the freeze at 40) with each
difference added in turn, and prints each run's held-out loss against
AdamW's:

* ``adamw``: float32 mean, then clipping and AdamW (the example's ``fp32``);
* ``adamw_local_clipping``: each device's gradient clipped, then the float32
  mean and AdamW;
* ``frozen_variance``: as above, with the variance frozen after the freeze
  step (``qsgd_jax.fsdp_onebit_adam`` on the float32 mean: 1-bit Adam's
  optimizer without its compression);
* ``onebit_adam``: ``qsgd_jax.onebit_adam``, the momentum averaged in 1 bit.

Usage::

  python benchmarks/freeze_or_compression.py --seeds 0 1 2 --out benchmarks/results/
  python benchmarks/freeze_or_compression.py --freeze-step 100   # a later freeze
"""

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2").strip()

import jax  # noqa: E402  (the device count is set before JAX starts)
import optax  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import qsgd_jax  # noqa: E402
from examples.lm import train  # noqa: E402
from examples.lm.configs import network  # noqa: E402

MODES = ("adamw", "adamw_local_clipping", "frozen_variance", "onebit_adam")


def adamw_local_clipping(config, learning_rate_fn):
  """Each device's gradient clipped, the float32 mean, AdamW."""
  return optax.chain(*train.local_clipping(config), train.gradient_averaging(config),
                     optax.adamw(learning_rate_fn, b1=config.b1, b2=config.b2, eps=config.eps,
                                 weight_decay=config.weight_decay,
                                 mask=train.weight_decay_mask))


def frozen_variance(config, learning_rate_fn):
  """1-bit Adam without its compression: local clipping, the float32 mean, Adam whose
  variance freezes (for the leaves 1-bit Adam compresses) after the freeze step."""
  return optax.chain(*train.local_clipping(config), train.gradient_averaging(config),
                     qsgd_jax.fsdp_onebit_adam(
                         learning_rate_fn, freeze_step=int(config.freeze_step), b1=config.b1,
                         b2=config.b2, eps=config.eps, weight_decay=config.weight_decay,
                         mask=train.weight_decay_mask,
                         min_compressed_size=config.min_compressed_size))


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, nargs="+", default=[0])
  parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
  parser.add_argument("--freeze-step", type=int, default=None,
                      help="the freeze step (network.py's is 40 of 200)")
  parser.add_argument("--out", type=pathlib.Path, default=None,
                      help="write freeze_or_compression[_freezeN].json here")
  return parser.parse_args(argv)


def main(argv=None) -> None:
  args = parse_args(argv)
  train.OPTIMIZERS.update(adamw_local_clipping=adamw_local_clipping,
                          frozen_variance=frozen_variance)
  losses = {mode: {} for mode in args.modes}
  start = time.perf_counter()
  for seed in args.seeds:
    for mode in args.modes:
      config = network.get_config()
      config.seed, config.average, config.optimizer = seed, "fp32", mode
      config.checkpoint_every_steps = 0
      if args.freeze_step is not None:
        config.freeze_step = str(args.freeze_step)
      with tempfile.TemporaryDirectory() as workdir:
        summary = train.train_and_evaluate(config, workdir)
      losses[mode][seed] = summary["eval_loss"]
      print(f"seed {seed} {mode}: held-out loss {summary['eval_loss']:.4f}", flush=True)
  print("\n| mode | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean minus adamw's |")
  print("|---|" + "---|" * (len(args.seeds) + 1))
  for mode in args.modes:
    row = [losses[mode][s] for s in args.seeds]
    gaps = [losses[mode][s] - losses["adamw"][s] for s in args.seeds] if "adamw" in losses else []
    gap = f"{sum(gaps) / len(gaps):+.3f}" if gaps else "-"
    print(f"| {mode} | " + " | ".join(f"{x:.4f}" for x in row) + f" | {gap} |")
  if args.out is not None:
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.freeze_step is None else f"_freeze{args.freeze_step}"
    (args.out / f"freeze_or_compression{suffix}.json").write_text(json.dumps(
        {"config": "examples/lm/configs/network.py", "devices": jax.device_count(),
         "freeze_step": args.freeze_step or network.get_config().freeze_step,
         "seeds": args.seeds, "held_out_loss": losses,
         "seconds": time.perf_counter() - start}, indent=1) + "\n")


if __name__ == "__main__":
  main()
