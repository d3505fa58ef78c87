"""A 2-layer, 512-wide model fed one sequence a device: a step much of which is its exchange.

The configuration of ``benchmarks/network.py``'s data-parallel language-model
part (``--parts lm``), on 2 processes of one CPU core each over a link of
1 Gbit/s a node. A float32 ring all-reduce of the 6.6M parameters sends
``2 (n - 1) / n * 4 * 6.6M`` = 26.4 MB a node (n = 2): 211 ms at 1 Gbit/s,
2.1 s at 100 Mbit/s. A device's forward and backward pass compute about
``6 * 6.6M * 64`` = 2.5 GFLOP on its 64 bytes, and AdamW's update reads and
writes some 200 MB of parameters, moments and gradients: 70-140 ms on one
core here, alone in a process (the less with the other core idle). A wider
model or a longer batch adds computation as fast as bytes; a smaller batch a
device would leave the per-parameter work (AdamW's update, the compressed
optimizers' encoding) as the floor the compressed exchanges cannot go under.

Measured on the link (``benchmarks/results/network_2proc_lm.md``), a float32
step takes 0.48 s at 1 Gbit/s and 2.3 s at 100 Mbit/s: at 1 Gbit/s the
exchange's 211 ms are under half the step, more of it than estimated being
computation (the process's own, and gloo's copies on the same cores).

The learning rate and clipping are ``small.py``'s (clipping at 1.0 keeps
float32 AdamW from diverging at 6e-3); 2 sequences a step make the training
loss noisy, so compare it smoothed over several steps.
"""

import ml_collections

from examples.lm.configs import small as small_lib


def get_config() -> ml_collections.ConfigDict:
  """200 steps of a 2-layer, 512-wide model on 2 sequences of 64 bytes a step."""
  config = small_lib.get_config()
  config.num_layers = 2
  config.width = 512
  config.num_heads = 8
  config.batch_size = 2  # One window a device, with 2 processes of one device each.
  config.num_train_steps = 200
  config.warmup_steps = 20
  config.freeze_step = "40"  # A fifth of training, as small.py's.
  config.log_every_steps = 5
  config.eval_every_steps = 200
  config.num_eval_batches = 4
  config.checkpoint_every_steps = 0
  return config
