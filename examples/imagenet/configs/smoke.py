"""A tiny ResNet for a few steps on digits: checks that everything runs, in under a minute."""

import ml_collections

from examples.imagenet.configs import digits as digits_lib


def get_config() -> ml_collections.ConfigDict:
  """Twenty steps of ResNet-1 with 4-bit QSGD."""
  config = digits_lib.get_config()
  config.model = "ResNet1"
  config.batch_size = 64
  config.warmup_epochs = 0.1
  config.min_compressed_size = 256  # So that the tiny model's kernels are quantized too.
  config.num_train_steps = 20
  config.eval_every_steps = 10
  config.log_every_steps = 5
  return config
