"""A 6-layer, 384-wide byte-level transformer on the made-up language, 4-bit QSGD then AdamW."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """The default hyperparameters."""
  config = ml_collections.ConfigDict()

  # The text (examples/lm/grammar.py): the language, and the bytes of each split.
  config.text_seed = 0
  config.train_bytes = 16 * 2**20
  config.eval_bytes = 2**20
  config.context_length = 256

  config.num_layers = 6
  config.width = 384  # d_model.
  config.num_heads = 6
  config.dtype = "float32"  # Of the computation: float32 or bfloat16 (parameters stay float32).

  config.optimizer = "adamw"  # Or onebit_adam, zero_one_adam; see train.OPTIMIZERS.
  config.batch_size = 64  # Global, in sequences: split over every device of every process.
  config.num_train_steps = 5000
  config.learning_rate = 6e-4  # The peak, after a linear warm-up, then cosine decay.
  config.warmup_steps = 200
  config.final_learning_rate_fraction = 0.1  # Of the peak, at the last step.
  config.b1 = 0.9
  config.b2 = 0.95
  config.eps = 1e-8
  config.weight_decay = 0.1  # Kernels only: not biases, LayerNorm or embeddings.
  config.grad_clip_norm = 1.0  # Of the averaged gradient's global norm; 0: no clipping.

  # onebit_adam and zero_one_adam: float32 steps before the variance is frozen, or "auto"
  # (frozen once it has settled).
  config.freeze_step = "auto"

  # How the gradients are averaged before AdamW: fp32, bf16, qsgd4, qsgd8, qsgd4_ef, onebit,
  # powersgd.
  config.average = "qsgd4"
  config.bucket_size = 512  # Coordinates sharing a scale (QSGD, 1-bit SGD).
  config.min_compressed_size = 4096  # Smaller leaves (biases, LayerNorm) go in float32.
  config.powersgd_rank = 4  # powersgd: the rank of each weight matrix's factors.
  config.powersgd_start_iter = 10  # powersgd: exact float32 steps first.
  # powersgd: each kernel as its layer's input-to-output matrix ("layer": the qkv kernel
  # (width, 3, heads, head_width) as width x 3 width) or with its last axis alone as the
  # columns ("last_axis": qkv as 3 width x head_width, the view before qsgd_jax's matrix_view).
  config.powersgd_matrix_view = "layer"
  # qsgd*: every this many steps, the size Elias coding would give the payloads; 0: never.
  config.track_elias = 0
  config.parallelism = "shard_map"  # Or pmap, jit (qsgd_jax.data_parallel), fsdp, hybrid.
  # topk_ef: the fraction of each chunk of topk_chunk elements sent, values in topk_value_bits
  # (0: float32), what is not sent kept for the next step (examples/lm/sparse.py).
  config.topk_density = 0.01
  config.topk_chunk = 1024
  config.topk_value_bits = 0

  # demo (optimizer): DeMo's coefficients kept of each demo_chunk x demo_chunk block of each
  # kernel's DCT (demo.py's compression_topk, compression_chunk), its momentum's decay
  # (compression_decay), the values' dtype on the wire, and its decoupled weight decay (0 in
  # the paper's runs). Its learning rate is config.learning_rate's schedule.
  config.demo_chunk = 64
  config.demo_k = 16
  config.demo_decay = 0.999
  config.demo_value_dtype = "float32"
  config.demo_weight_decay = 0.0

  # diloco (examples/lm/diloco.py): the devices form this many workers, each training
  # data-parallel (config.average inside it) and syncing every sync_every steps: each fragment's
  # outer gradient averaged across workers as outer_average says (fp32, bf16, qsgd8_ef,
  # qsgd4_ef, qsgd2_ef, onebit), then outer SGD on the global parameters.
  config.diloco_workers = 2
  config.sync_every = 20
  config.outer_average = "qsgd4_ef"
  config.outer_learning_rate = 1.0
  config.outer_momentum = 0.0  # 0: plain SGD; else Nesterov (outer_nesterov) or heavy ball.
  config.outer_nesterov = True
  config.fragments = 1  # Streaming DiLoCo: fragments syncing in turn, sync_every // P apart.
  config.fragment_delay = 0  # Steps an exchange overlaps before its merge (below the interval).
  config.fragment_alpha = 0.0  # The merge's weight of the worker's own parameters.
  # Each of a worker's devices exchanges 1 / (devices a worker) of the outer gradient across
  # workers, then the worker gathers the parts (qsgd_jax.diloco's split_axis).
  config.outer_split = False
  # outer_average sparseloco: the fraction of each 64 x 64 block of each outer gradient sent
  # (Templar's 64 / 4096; the paper's 512M runs 128 / 4096), in 2 bits, and the error
  # feedback's decay (the paper's 0.95), and the average: each element over the workers that
  # sent it (mean_over_contributors, the code's) or over all (mean_over_workers, the paper's).
  config.sparseloco_density = 64 / 4096
  config.sparseloco_error_decay = 0.95
  config.sparseloco_aggregation = "mean_over_contributors"
  # Each step's program chosen on the host (qsgd_jax.diloco_events): a step between syncs has no
  # sync conditional and no collective, and an exchange may run beside the forward and backward
  # passes; False: one program of conditionals on the step count serves every step (the same
  # bits on the CPU).
  config.diloco_events_on_host = True
  # fsdp: how the weights travel in its gathers (fp32, bf16, int8, int4); the gradients'
  # reduce-scatter is config.average's (fp32, bf16, qsgd4 or qsgd8).
  config.fsdp_weights = "int8"
  # hybrid (examples/lm/hybrid.py): each data group's devices shard the model over an "fsdp" and
  # a "tensor" axis of these sizes, by logical axis rules as Flax lm1b's; the gradients (or
  # DiLoCo's outer gradients, a worker a group) are averaged over the data axis between groups.
  config.fsdp_devices = 2
  config.tensor_devices = 2

  config.log_every_steps = 50
  config.eval_every_steps = 500  # And at the end.
  config.num_eval_batches = -1  # When positive, evaluate on that many batches only.
  # Orbax checkpoints in workdir/checkpoints every this many steps and at the end; a run
  # resumes from the latest. 0 or less: no checkpoints, and no resuming.
  config.checkpoint_every_steps = 1000
  config.seed = 0  # Initialization, the order of the training windows, rounding.
  return config
