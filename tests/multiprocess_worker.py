"""One of the two processes of ``multiprocess_test.py``.

Each process owns 4 CPU devices (its parent sets ``XLA_FLAGS``); together they
run one ``pmap`` over all 8 global devices, each process passing its 4 local
rows, and each saves what its devices got.

Usage::

  python tests/multiprocess_worker.py PROCESS_ID PORT OUTPUT.npz
"""

import sys

import jax
import numpy as np

import qsgd_jax

NUM_PROCESSES = 2
AXIS = "batch"
COMPRESSOR = qsgd_jax.MinMax(bits=8, bucket_size=512)


def global_inputs(num_devices: int) -> dict[str, np.ndarray]:
  """Every device's gradient tree, stacked: ``[num_devices, size]`` a leaf."""
  rng = np.random.default_rng(0)
  return {
      "kernel": rng.normal(size=(num_devices, 10007)).astype(np.float32),
      "bias": rng.normal(size=(num_devices, 100)).astype(np.float32),
  }


def mean_of_both_methods(tree):
  """The mapped function: each method's mean, and where this device sits on the axis."""
  key = jax.random.key(0)
  out = {method: qsgd_jax.quantized_pmean(tree, AXIS, COMPRESSOR, key, method=method)
         for method in ("two_phase", "psum")}
  out["axis_index"] = jax.lax.axis_index(AXIS)
  out["axis_size"] = jax.lax.psum(1, AXIS)
  return out


def main(process_id: int, port: int, output: str) -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
      coordinator_address=f"127.0.0.1:{port}",
      num_processes=NUM_PROCESSES,
      process_id=process_id,
      initialization_timeout=60,
  )
  local = jax.local_device_count()
  rows = slice(process_id * local, (process_id + 1) * local)
  tree = jax.tree.map(lambda x: x[rows], global_inputs(jax.device_count()))
  out = jax.block_until_ready(jax.pmap(mean_of_both_methods, axis_name=AXIS)(tree))
  # A multi-process pmap's result spans both processes: keep this one's shards.
  local_rows = jax.tree.map(
      lambda x: np.stack([np.asarray(shard.data).reshape(x.shape[1:])
                          for shard in x.addressable_shards]),
      out,
  )
  flat = {jax.tree_util.keystr(path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(local_rows)[0]}
  np.savez(output, **flat)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
