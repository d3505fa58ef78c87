"""A tiny model for a few steps: checks that everything runs, in seconds."""

import ml_collections

from examples.lm.configs import small as small_lib


def get_config() -> ml_collections.ConfigDict:
  """Six steps of a 1-layer, 32-wide model with a context of 16 bytes."""
  config = small_lib.get_config()
  config.train_bytes = 2**14
  config.eval_bytes = 2**12
  config.context_length = 16
  config.num_layers = 1
  config.width = 32
  config.num_heads = 2
  config.batch_size = 16
  config.num_train_steps = 6
  config.warmup_steps = 2
  config.freeze_step = "3"
  config.powersgd_start_iter = 2
  config.log_every_steps = 2
  config.eval_every_steps = 3
  config.num_eval_batches = 2
  config.checkpoint_every_steps = 4
  config.min_compressed_size = 256  # So that the tiny model's kernels are quantized too.
  return config
