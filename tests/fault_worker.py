"""One process of ``distributed_test.py``: compressed averaging steps until told to stop.

The processes join one run through :func:`qsgd_jax.initialize_distributed`,
one CPU device each, and take ``qsgd`` steps with error feedback on a small
tree. After its first steps each writes ``READY_DIR/process{ID}``, so that the
test knows when to kill one; after ``MAX_SECONDS`` each ends on its own.

Usage::

  python tests/fault_worker.py PROCESS_ID NUM_PROCESSES PORT FAILURE_TIMEOUT READY_DIR
"""

import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import optax

import qsgd_jax

AXIS = "batch"
MAX_SECONDS = 120
READY_AFTER_STEPS = 3


def main(process_id: int, num_processes: int, port: int, failure_timeout: float,
         ready_dir: str) -> None:
  with qsgd_jax.initialize_distributed(f"127.0.0.1:{port}", num_processes, process_id,
                                       failure_timeout=failure_timeout,
                                       initialization_timeout=60):
    tx = optax.chain(qsgd_jax.qsgd(AXIS, error_feedback=True), optax.sgd(0.1))
    local = jax.local_device_count()
    params = jnp.zeros((local, 8192))
    state = jax.pmap(tx.init, axis_name=AXIS)(params)

    def step(params, state, seed):
      grads = jax.random.normal(jax.random.fold_in(jax.random.key(seed),
                                                   jax.lax.axis_index(AXIS)), params.shape)
      updates, state = tx.update(grads, state)
      return optax.apply_updates(params, updates), state

    step = jax.pmap(step, axis_name=AXIS, in_axes=(0, 0, None))
    start, seed = time.monotonic(), 0
    while time.monotonic() - start < MAX_SECONDS:
      params, state = jax.block_until_ready(step(params, state, seed))
      seed += 1
      if seed == READY_AFTER_STEPS:
        (pathlib.Path(ready_dir) / f"process{process_id}").touch()
      time.sleep(0.01)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
