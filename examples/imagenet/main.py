"""Trains a ResNet with quantized gradient all-reduce.

  python -m examples.imagenet.main --config=examples/imagenet/configs/digits.py --workdir=DIR

Without accelerators, JAX is given eight simulated CPU devices (unless
``XLA_FLAGS`` already sets their number). With ``--multihost``, or in a cluster
JAX recognizes (``JAX_COORDINATOR_ADDRESS``, SLURM, Open MPI, ...), every
process starts with ``qsgd_jax.initialize_distributed`` and feeds its own
devices; CPU devices then communicate over gloo. When a process is lost, the
others end within ``--failure_timeout`` seconds (and two heartbeats) with
status 75 and one line naming it; started again, the run resumes from its last
good checkpoint.

Errors of the run itself end it with status 1 and one line: a non-finite loss
(with the step), or a workdir whose checkpoints all fail verification.
"""

import contextlib
import os

from absl import app, flags, logging
from ml_collections import config_flags

from examples.imagenet import devices

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Directory for metrics.jsonl and summary.json.")
flags.DEFINE_bool("multihost", False,
                  "Start with qsgd_jax.initialize_distributed (one process per host).")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (with --multihost).")
flags.DEFINE_integer("num_processes", None, "Number of processes (with --multihost).")
flags.DEFINE_integer("process_id", None, "This process's index (with --multihost).")
flags.DEFINE_float("failure_timeout", 10.0,
                   "With --multihost: seconds without a heartbeat after which a process counts as"
                   " lost and the others end (qsgd_jax.initialize_distributed).")
config_flags.DEFINE_config_file("config", None, "Training configuration file.", lock_config=True)
flags.mark_flags_as_required(["config", "workdir"])



def in_multiprocess_cluster() -> bool:
  """Whether the environment describes several processes that JAX can connect."""
  if "JAX_COORDINATOR_ADDRESS" in os.environ:
    return True
  process_counts = (os.environ.get(name, "1") for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"))
  return any(int(count) > 1 for count in process_counts)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError("Too many command-line arguments.")
  devices.simulate_cpu_devices()
  devices.quiet_backend_probe()
  import jax  # After the device flags.

  import qsgd_jax
  from examples.imagenet import train

  run = contextlib.nullcontext()
  if FLAGS.multihost or in_multiprocess_cluster():
    run = qsgd_jax.initialize_distributed(
        FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
        failure_timeout=FLAGS.failure_timeout)
  with run:
    logging.info("Process %d of %d, with %d of the %d %s devices.", jax.process_index(),
                 jax.process_count(), jax.local_device_count(), jax.device_count(),
                 jax.default_backend())
    try:
      train.train_and_evaluate(FLAGS.config, FLAGS.workdir)
    except train.RunError as error:  # One line, no traceback: what happened and what to do.
      raise SystemExit(str(error)) from None


if __name__ == "__main__":
  app.run(main)
