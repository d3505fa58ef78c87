"""A process of ``tests/network_hybrid_test.py``: what a psum sends over its node's link.

  python tests/network_nodes_worker.py COORDINATOR_ADDRESS PROCESS_ID OUT_PREFIX

Two processes of 2 CPU devices each (``benchmarks/network.py``'s launcher sets
the count), each in a node of ``network_links.Nodes``. A ``(2, 2)`` mesh of
``("nodes", "local")`` from ``jax.make_mesh``; a float32 ``psum`` of 1 MiB a
device over each axis. Writes ``OUT_PREFIX{PROCESS_ID}.json``: the processes
of each row of the mesh and the bytes the node's link sent during each psum
(its ``tx_bytes``, read inside the node's namespace).
"""

import json
import pathlib
import sys
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

LINK_TX_BYTES = pathlib.Path("/sys/class/net/uplink/statistics/tx_bytes")
ELEMENTS = 2**18  # 1 MiB of float32 a device.


def _settled_tx_bytes(wait_seconds: float = 0.05, at_most: int = 40) -> int:
  """The link's ``tx_bytes`` once it stops growing: a psum is done on this process when it has
  received its peer's last chunk, and its own last one may still be leaving."""
  now = int(LINK_TX_BYTES.read_text())
  for _ in range(at_most):
    time.sleep(wait_seconds)
    now, before = int(LINK_TX_BYTES.read_text()), now
    if now == before:
      break
  return now


def main(address: str, process_id: int, out_prefix: str) -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=address, num_processes=2,
                             process_id=process_id)
  mesh = jax.make_mesh((2, 2), ("nodes", "local"))
  every_device = P(("nodes", "local"))
  values = jax.make_array_from_callback(
      (4 * ELEMENTS,), NamedSharding(mesh, every_device),
      lambda index: np.ones(ELEMENTS, np.float32))
  sent = {}
  for axis in ("local", "nodes"):
    summed = jax.jit(jax.shard_map(lambda x, axis=axis: jax.lax.psum(x, axis), mesh=mesh,
                                   in_specs=every_device, out_specs=every_device))
    jax.block_until_ready(summed(values))  # Compiled, and gloo's connections made.
    before = int(LINK_TX_BYTES.read_text())
    result = jax.block_until_ready(summed(values))
    sent[axis] = _settled_tx_bytes() - before
    assert float(result.addressable_data(0)[0]) == 2.0
  rows = [sorted({device.process_index for device in row}) for row in mesh.devices]
  pathlib.Path(f"{out_prefix}{process_id}.json").write_text(
      json.dumps({"row_processes": rows, "link_tx_bytes": sent}))
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
