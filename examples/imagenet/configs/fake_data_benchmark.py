"""Throughput of ResNet-50 with 4-bit QSGD on fake ImageNet-shaped data."""

import ml_collections

from examples.imagenet.configs import default as default_lib


def get_config() -> ml_collections.ConfigDict:
  """A short run on one repeated random batch: steps_per_second is the result."""
  config = default_lib.get_config()
  config.dataset = "fake"
  config.num_train_steps = 100
  config.steps_per_eval = 10
  config.log_every_steps = 10
  return config
