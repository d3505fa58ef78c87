"""Trains a byte-level transformer language model whose gradient average is compressed.

  python -m examples.lm.main --config=examples/lm/configs/small.py --workdir=DIR \
      [--average=qsgd4] [--optimizer=adamw] [--parallelism=shard_map|pmap|jit|fsdp]

``--optimizer``, ``--average`` and ``--parallelism`` set the config fields of
the same name (as ``--config.average=...`` does). Without accelerators, JAX is
given eight simulated CPU devices (unless ``XLA_FLAGS`` already sets their
number). With ``--multihost``, or in a cluster JAX recognizes
(``JAX_COORDINATOR_ADDRESS``, SLURM, Open MPI, ...), every process calls
``jax.distributed.initialize`` first and feeds its own devices; CPU devices
then communicate over gloo.
"""

import os

from absl import app, flags, logging
from ml_collections import config_flags

from examples.lm import devices

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Directory for metrics.jsonl, summary.json, checkpoints.")
flags.DEFINE_string("optimizer", None, "Overrides config.optimizer (adamw, onebit_adam).")
flags.DEFINE_string("average", None,
                    "Overrides config.average (fp32, bf16, qsgd4, qsgd8, qsgd4_ef, onebit).")
flags.DEFINE_string("parallelism", None,
                    "Overrides config.parallelism (pmap, shard_map, jit, fsdp).")
flags.DEFINE_bool("multihost", False, "Call jax.distributed.initialize (one process per host).")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (with --multihost).")
flags.DEFINE_integer("num_processes", None, "Number of processes (with --multihost).")
flags.DEFINE_integer("process_id", None, "This process's index (with --multihost).")
config_flags.DEFINE_config_file("config", None, "Training configuration file.", lock_config=True)
flags.mark_flags_as_required(["config", "workdir"])

OVERRIDES = ("optimizer", "average", "parallelism")


def in_multiprocess_cluster() -> bool:
  """Whether the environment describes several processes that JAX can connect."""
  if "JAX_COORDINATOR_ADDRESS" in os.environ:
    return True
  process_counts = (os.environ.get(name, "1") for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"))
  return any(int(count) > 1 for count in process_counts)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError("Too many command-line arguments.")
  if not FLAGS["verbosity"].present:
    # Orbax logs every step of every save at INFO; --verbosity=0 shows them.
    logging.set_verbosity(logging.WARNING)
  devices.simulate_cpu_devices()
  import jax  # After the device flags.

  from examples.lm import train

  config = FLAGS.config
  for field in OVERRIDES:
    if FLAGS[field].value is not None:
      config[field] = FLAGS[field].value
  if FLAGS.multihost or in_multiprocess_cluster():
    # CPU devices of different processes reach each other over gloo's TCP collectives.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=FLAGS.coordinator_address,
        num_processes=FLAGS.num_processes,
        process_id=FLAGS.process_id,
    )
  logging.log(logging.WARNING if jax.process_count() > 1 else logging.INFO,
              "Process %d of %d, with %d of the %d %s devices.", jax.process_index(),
               jax.process_count(), jax.local_device_count(), jax.device_count(),
               jax.default_backend())
  train.train_and_evaluate(config, FLAGS.workdir)


if __name__ == "__main__":
  app.run(main)
