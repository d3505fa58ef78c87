"""One process of ``network_diloco.py``'s probe: does a gloo collective run while independent
computation does, at top level and under ``jax.lax.cond``?

Usage: ``python network_overlap_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID OUT_JSON``;
process 0 writes the median seconds of each program.
"""

import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "processes"
REPEATS = 7
EXCHANGE_ELEMENTS = 3_300_000  # A float32 pmean of 13.2 MB, a DiLoCo fragment's here.


def compute(x, w):
  """Some 0.2 s of matmuls on a core here."""
  for _ in range(12):
    x = jnp.tanh(x @ w)
  return x


def exchange(g):
  return jax.lax.pmean(g, AXIS)  # The same on every process: out_specs P(AXIS) still holds.


def on_condition(x, g):
  """The exchange under ``lax.cond``, as DiLoCo's, on a predicate that is always true here
  and needs none of :func:`compute`."""
  return jax.lax.cond(jnp.sum(x[0, :1]) > -1.0,
                      lambda: jax.lax.pcast(exchange(g), AXIS, to="varying"), lambda: g)


PROGRAMS = {
    "compute": lambda x, w, g: (compute(x, w), g),
    "exchange": lambda x, w, g: (x, exchange(g)),
    "both": lambda x, w, g: (compute(x, w), exchange(g)),
    "both_exchange_under_cond": lambda x, w, g: (compute(x, w), on_condition(x, g)),
}


def main(address: str, num_processes: int, process_id: int, out: str) -> None:
  jax.distributed.initialize(address, num_processes, process_id)
  mesh = jax.make_mesh((num_processes,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))
  sharding = NamedSharding(mesh, P(AXIS))

  def put(shape):
    return jax.make_array_from_process_local_data(sharding, np.full(shape, 0.01, np.float32))

  x, w, g = put((512, 1024)), put((1024, 1024)), put((EXCHANGE_ELEMENTS,))
  seconds = {}
  for name, program in PROGRAMS.items():
    step = jax.jit(jax.shard_map(program, mesh=mesh, in_specs=(P(AXIS),) * 3,
                                 out_specs=(P(AXIS),) * 2))
    jax.block_until_ready(step(x, w, g))
    times = []
    for _ in range(REPEATS):
      start = time.perf_counter()
      jax.block_until_ready(step(x, w, g))
      times.append(time.perf_counter() - start)
    seconds[name] = statistics.median(times)
  if process_id == 0:
    with open(out, "w") as file:
      json.dump({"seconds": seconds, "exchange_bytes": 4 * EXCHANGE_ELEMENTS}, file)


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
