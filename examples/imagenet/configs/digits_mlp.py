"""A 2.2M-parameter MLP on digits: a model whose float32 all-reduce outweighs its step.

``benchmarks/network.py`` trains it as several processes over a link limited
to 100 Mbit/s a node, to time each compression mode to an accuracy. Its
kernels (65,536 and 1,048,576 weights) are all quantized; BatchNorm's scales
and the classifier's bias go in float32.
"""

import ml_collections

from examples.imagenet.configs import digits as digits_lib


def get_config() -> ml_collections.ConfigDict:
  """The digits configuration with ``WideMLP`` instead of ResNet-8."""
  config = digits_lib.get_config()
  config.model = "WideMLP"
  config.learning_rate = 0.2
  config.weight_decay = 1e-4
  config.num_epochs = 8.0
  config.eval_every_steps = 11  # Once an epoch: 1,437 training digits, batch 128.
  config.log_every_steps = 11
  config.min_compressed_size = 4096
  config.bucket_size = 512
  return config
