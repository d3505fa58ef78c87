"""ResNet-50 on ImageNet at 224 pixels, gradients averaged with 4-bit QSGD.

ImageNet must be prepared for TensorFlow Datasets in ``config.data_dir``
beforehand (see the README).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """The default hyperparameters."""
  config = ml_collections.ConfigDict()

  config.model = "ResNet50"
  config.half_precision = False

  config.dataset = "imagenet2012"
  config.data_dir = ml_collections.config_dict.placeholder(str)  # TFDS's default when unset.
  config.image_size = 224
  config.cache = False
  config.shuffle_buffer_size = 16 * 1024
  config.prefetch = 10

  config.batch_size = 1024  # Global: split over every device of every process.
  config.learning_rate = 0.1  # For a batch of 256, scaled linearly with batch_size.
  config.momentum = 0.9
  config.nesterov = True
  config.weight_decay = 1e-4
  config.warmup_epochs = 5.0
  config.num_epochs = 90.0
  config.num_train_steps = -1  # When positive, overrides num_epochs.

  config.steps_per_eval = -1  # When positive, evaluate on that many batches only.
  config.eval_every_steps = -1  # -1: once an epoch, and at the end.
  config.log_every_steps = 100
  # Orbax checkpoints in workdir/checkpoints every this many steps and at the end, each with a
  # manifest of checksums; a run resumes from the newest that passes verification, on any device
  # count. 0 or less: no checkpoints, and no resuming.
  config.checkpoint_every_steps = 1000
  # Resumed on another device count: start error-feedback residuals at zero instead of
  # redistributing them (qsgd_jax.resize_state).
  config.drop_residuals_when_resized = False
  # A non-finite training loss stops the run, with its step. A positive number: skip up to that
  # many such steps in a row (optax.apply_if_finite after the gradient averaging).
  config.skip_nonfinite_steps = 0

  # One of fp32, bf16, qsgd4, qsgd8, minmax8, onebit, powersgd, decentralized8, topk_ef, dgc.
  config.compression = "qsgd4"
  config.bucket_size = 512  # Coordinates sharing a scale (QSGD, 1-bit SGD).
  config.min_compressed_size = 4096  # Smaller leaves (biases, norms) go in float32.
  # qsgd4 and qsgd8: every this many steps, the size Elias coding would give the sent payloads
  # (it encodes them a second time, so it is not free); 0: never.
  config.track_elias = 0
  # powersgd: the rank of each kernel's factors, and the steps of exact float32 averaging
  # before it starts (PyTorch's default; it suggests about 10% of the steps).
  config.powersgd_rank = 4
  config.powersgd_start_iter = 1000
  # topk_ef (top-k with error feedback, then the SGD step) and dgc (Deep Gradient
  # Compression's momentum SGD): the fraction of each chunk of topk_chunk sent, and for topk_ef
  # the values' bits (0: float32) and the smallest leaf it sparsifies (0: every leaf; at a
  # density of 1% a float32 bias costs as much as a hundred times its size in sparse kernel).
  config.topk_density = 0.01
  config.topk_chunk = 512
  config.topk_value_bits = 4
  config.topk_min_compressed_size = 0
  # The warm-up: topk_ef's first steps averaged in float32, or the steps of each stage of
  # DGC's warm-up (densities 25%, 6.25%, 1.56%, ... above topk_density, the paper's).
  config.topk_warmup_steps = 0
  config.parallelism = "shard_map"  # Or pmap, or jit (qsgd_jax.data_parallel).
  config.seed = 0
  return config
