"""One process of ``benchmarks/network.py``'s collectives measurement (its Part 1).

``network.py`` starts ``N`` of these, one CPU device each, inside its network
namespace. They join one ``jax.distributed`` cluster over gloo on 127.0.0.1
and, for every gradient tree of the plan, compile each mode of :data:`MODES`
once and call it once (the warm-up; process 0 checks the result against the
exact mean). Then for every link rate of the plan, process 0 applies the
rate's queueing discipline to the namespace's loopback and times one bulk TCP
transfer over it while the others wait, all run the latency probe, and each
mode's call is timed and the bytes that crossed the loopback counted.

Every timed call runs between two barriers: after the first, process 0 reads
the loopback's transmit counter; each process times its own call; after the
second, process 0 reads the counter again. The modes take turns call by
call, so that slow drifts of the machine's load fall on all of them alike.
The barriers' own bytes are measured the same way around an empty window and
reported, so that ``network.py`` can take them off.

Usage (``network.py`` writes the plan)::

  python benchmarks/network_worker.py PLAN.json PROCESS_ID
"""

import json
import math
import pathlib
import re
import socket
import subprocess
import sys
import threading
import time
from typing import NamedTuple

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax
from collectives import gpt2_small_shapes, resnet50_shapes
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qsgd_jax
from qsgd_jax._src.collectives import plan as plan_lib

AXIS = "batch"
LOOPBACK_TX_BYTES = pathlib.Path("/sys/class/net/lo/statistics/tx_bytes")
EMPTY_WINDOWS = 5
# The latency probe: a float32 pmean of 1 and of 65 leaves of 256 elements (a small
# BatchNorm's size). XLA's CPU all-reduce of a tuple calls gloo once a leaf, so the
# difference over 64 leaves is 64 calls' latency (and their few bytes).
PROBE_LEAVES = (1, 65)
PROBE_LEAF_SIZE = 256
PROBE_CALLS = 5
# A tree under this many parameters takes milliseconds a call, more at the mercy of the
# scheduler: it gets the plan's "small_tree_repeats" calls instead of its "repeats".
SMALL_TREE_PARAMETERS = 1_000_000


class Mode(NamedTuple):
  """How one row of the benchmark averages a gradient tree over the processes.

  Attributes:
    compressor: what goes on the wire; ``None`` for float32.
    method: ``"pmean"``: ``jax.lax.pmean`` of the tree, which XLA's CPU
      runtime sends as one gloo all-reduce a leaf; ``"fused_pmean"``: the
      same of the tree concatenated into one vector, one call (tensor fusion,
      as Horovod and DDP's buckets do); a ``method=`` of
      :func:`qsgd_jax.quantized_pmean` (``"two_phase"``, ``"psum"``,
      ``"all_gather"``); or
      ``"ring"``: one step of :func:`qsgd_jax.low_precision_decentralized`,
      which sends the compressed model difference to both ring neighbours
      instead of averaging; or a method with ``"/wire_only"`` after it
      (``"two_phase/wire_only"``): the collectives that method issues, arrays
      of their shapes and types, and none of its compute, so that the
      difference in time is the compute's.
  """

  compressor: qsgd_jax.Compressor | None
  method: str

  @property
  def wire_only(self) -> bool:
    return self.method.endswith("/wire_only")


# One line a mode: a new method of quantized_pmean is one more line.
MODES = {
    "fp32_pmean": Mode(None, "pmean"),
    "fp32_pmean/fused": Mode(None, "fused_pmean"),
    "bf16/two_phase": Mode(qsgd_jax.Cast(jnp.bfloat16), "two_phase"),
    "qsgd2/two_phase": Mode(qsgd_jax.QSGD(bits=2), "two_phase"),
    "qsgd2/psum": Mode(qsgd_jax.QSGD(bits=2), "psum"),
    "qsgd4/two_phase": Mode(qsgd_jax.QSGD(bits=4), "two_phase"),
    "qsgd4/two_phase/wire_only": Mode(qsgd_jax.QSGD(bits=4), "two_phase/wire_only"),
    "qsgd4/psum": Mode(qsgd_jax.QSGD(bits=4), "psum"),
    "qsgd4/all_gather": Mode(qsgd_jax.QSGD(bits=4), "all_gather"),
    "qsgd8/two_phase": Mode(qsgd_jax.QSGD(bits=8), "two_phase"),
    "qsgd8/psum": Mode(qsgd_jax.QSGD(bits=8), "psum"),
    "minmax8/two_phase": Mode(qsgd_jax.MinMax(bits=8), "two_phase"),
    "onebit/two_phase": Mode(qsgd_jax.OneBit(), "two_phase"),
    "decentralized8/ring": Mode(qsgd_jax.NearestZeroAlignedMinMax(bits=8), "ring"),
}


def resnet8_digits_shapes() -> dict[str, tuple[int, ...]]:
  """The parameter shapes of the example's digits model (``ResNet8``, 8x8x1 images)."""
  from examples.imagenet import models

  model = models.ResNet8(num_classes=10, axis_name=None)
  variables = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 8, 8, 1)))
  return {jax.tree_util.keystr(path): leaf.shape
          for path, leaf in jax.tree_util.tree_flatten_with_path(variables["params"])[0]}


def tiny_shapes() -> dict[str, tuple[int, ...]]:
  """Two leaves, one compressed and one not: the launcher's end-to-end test."""
  return {"kernel": (256, 1024), "bias": (1024,)}


# name: (parameter shapes, min_compressed_size). ResNet-8's kernels are small:
# like configs/digits.py, compress every kernel of 2,048 weights or more.
TREES = {
    "resnet50": (resnet50_shapes, 4096),
    "gpt2_small_quarter_width": (lambda: gpt2_small_shapes(4), 4096),
    "resnet50_quarter_width": (lambda: resnet50_shapes(4), 4096),
    "resnet8_digits": (resnet8_digits_shapes, 2048),
    "tiny": (tiny_shapes, 4096),
}


def step_function(mode: Mode, min_compressed_size: int):
  """One device's ``(grads, params) -> outputs`` and the outputs' partition spec."""
  if mode.method == "pmean":
    return (lambda grads, params: jax.lax.pmean(grads, AXIS)), P()
  if mode.method == "fused_pmean":

    def fused(grads, params):
      vector, unravel = jax.flatten_util.ravel_pytree(grads)
      return unravel(jax.lax.pmean(vector, AXIS))

    return fused, P()
  if mode.method == "ring":
    optimizer = qsgd_jax.low_precision_decentralized(
        optax.sgd(0.1), AXIS, compressor=mode.compressor, key=0)

    def exchange(grads, params):
      updates, state = optimizer.update(grads, optimizer.init(params), params)
      # The replicas hold what the neighbours sent: returned, so that it is sent.
      out = (updates, state.left_replica, state.right_replica)
      return jax.tree.map(lambda x: x[None], out)

    return exchange, P(AXIS)

  if mode.wire_only:
    return _wire_only(mode.compressor, mode.method.removesuffix("/wire_only"),
                      min_compressed_size), P(AXIS)

  def average(grads, params):
    return qsgd_jax.quantized_pmean(grads, AXIS, mode.compressor, jax.random.key(0),
                                    method=mode.method, min_compressed_size=min_compressed_size)

  return average, P()


def _wire_only(compressor: qsgd_jax.Compressor, method: str, min_compressed_size: int):
  """The collectives of ``quantized_pmean(..., method=method)``, with none of its compute.

  Each collective of the reduction's plan (:attr:`ReductionPlan.collectives`,
  which the tests hold to the compiled program's) runs on an array of its
  shape and type, filled with one element of the gradient so that XLA cannot
  fold it away. The output is one element of each result.
  """

  def send(grads, params):
    del params
    planned = plan_lib.make_plan(grads, AXIS, compressor, method=method,
                                 min_compressed_size=min_compressed_size).collectives
    fill = jax.tree.leaves(grads)[0].reshape(-1)[0]
    firsts = []
    for collective in planned:
      kind, shape, dtype = collective.kind, collective.shape, collective.dtype
      if kind == "all-reduce":
        result = jax.lax.psum(jnp.full(shape, fill, dtype), AXIS)
      elif kind == "all-to-all":
        result = jax.lax.all_to_all(jnp.full(shape, fill, dtype), AXIS, 0, 0, tiled=False)
      elif kind == "all-gather":
        result = jax.lax.all_gather(jnp.full(shape[1:], fill, dtype), AXIS, tiled=False)
      else:
        raise ValueError(f"wire_only: no {kind} here (method {method!r}).")
      firsts.append(result.reshape(-1)[0].astype(jnp.float32))
    return jnp.stack(firsts)[None]

  return send


def compile_mode(mesh, mode: Mode, min_compressed_size: int, abstract):
  """The compiled executable of ``mode`` on global inputs shaped like ``abstract``."""
  per_device, out_specs = step_function(mode, min_compressed_size)

  def step(grads, params):
    grads, params = jax.tree.map(lambda x: x[0], (grads, params))
    return per_device(grads, params)

  mapped = jax.shard_map(step, mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=out_specs)
  return jax.jit(mapped).lower(abstract, abstract).compile()


def compile_latency_probe(mesh, sharding, num_leaves: int):
  """A float32 ``pmean`` of ``num_leaves`` leaves of ``PROBE_LEAF_SIZE`` elements, compiled."""
  abstract = [jax.ShapeDtypeStruct((mesh.size, PROBE_LEAF_SIZE), jnp.float32, sharding=sharding)
              for _ in range(num_leaves)]
  mapped = jax.shard_map(lambda leaves: jax.lax.pmean(leaves, AXIS), mesh=mesh,
                         in_specs=P(AXIS), out_specs=P())
  return jax.jit(mapped).lower(abstract).compile()


def gloo_calls(collectives) -> int:
  """Calls into gloo: an all-reduce calls it once an operand, any other collective once."""
  return sum(len(re.findall(r"[a-z]+[0-9]*\[", c.result_type)) if c.kind == "all-reduce" else 1
             for c in collectives)


def local_tree(shapes, seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in shapes.items()}


def exact_mean(shapes, num_processes: int) -> dict[str, np.ndarray]:
  """The mean of every process's gradients (each process's seed is its index)."""
  total = {name: np.zeros(shape, np.float64) for name, shape in shapes.items()}
  for process in range(num_processes):
    for name, x in local_tree(shapes, process).items():
      total[name] += x
  return {name: x / num_processes for name, x in total.items()}


def relative_error(result, exact) -> float:
  squared_error = squared_norm = 0.0
  for name, x in exact.items():
    local = np.asarray(result[name].addressable_data(0), np.float64)
    squared_error += float(np.sum((local - x) ** 2))
    squared_norm += float(np.sum(x**2))
  return math.sqrt(squared_error / squared_norm)


class Worker:
  """This process's part of the measurement."""

  def __init__(self, plan: dict, process_id: int):
    self.plan = plan
    self.process_id = process_id
    self.mesh = jax.make_mesh((jax.device_count(),), (AXIS,),
                              axis_types=(jax.sharding.AxisType.Explicit,))
    self.sharding = NamedSharding(self.mesh, P(AXIS))
    self.barriers = 0
    self.probes = {n: compile_latency_probe(self.mesh, self.sharding, n) for n in PROBE_LEAVES}
    self.probe_inputs = {
        n: [jax.make_array_from_process_local_data(
                self.sharding, np.full((1, PROBE_LEAF_SIZE), leaf, np.float32))
            for leaf in range(n)]
        for n in PROBE_LEAVES}

  def barrier(self) -> None:
    self.barriers += 1
    multihost_utils.sync_global_devices(f"barrier{self.barriers}")

  def tx_bytes(self) -> int | None:
    """The loopback's transmit counter, read by process 0 only."""
    if self.process_id or not self.plan["count_bytes"]:
      return None
    return int(LOOPBACK_TX_BYTES.read_text())

  def set_rate(self, rate: dict) -> dict:
    """Process 0 applies the rate's queueing discipline, then measures the link, alone.

    Returns:
      On process 0, the ``tc qdisc show`` line of the loopback and the bytes a
      second of one bulk TCP stream over it; elsewhere an empty dict.
    """
    self.barrier()
    link = {}
    if self.process_id == 0:
      if rate["command"]:
        # Removing a limit that is not there fails harmlessly: do not check.
        subprocess.run(rate["command"], capture_output=True, check=False)
        link["qdisc"] = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True,
                                       text=True, check=True).stdout.strip()
      link["bytes_per_second"] = bulk_transfer_rate()
    self.barrier()
    return link

  def window(self, call) -> tuple[float, int | None]:
    """Seconds this process spent in ``call`` and the loopback bytes around it."""
    self.barrier()
    before = self.tx_bytes()
    start = time.perf_counter()
    jax.block_until_ready(call())
    seconds = time.perf_counter() - start
    self.barrier()
    after = self.tx_bytes()
    return seconds, None if before is None else after - before

  def global_tree(self, local: dict[str, np.ndarray]):
    return {name: jax.make_array_from_process_local_data(self.sharding, x[None])
            for name, x in local.items()}

  def measure_tree(self, tree_name: str) -> dict:
    shapes_fn, min_compressed_size = TREES[tree_name]
    shapes = shapes_fn()
    num_processes = jax.process_count()
    grads = self.global_tree(local_tree(shapes, self.process_id))
    params = self.global_tree(local_tree(shapes, num_processes + self.process_id))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            grads)
    record = {"parameters": sum(math.prod(s) for s in shapes.values()), "leaves": len(shapes),
              "min_compressed_size": min_compressed_size, "modes": {}}
    compiled = {}
    for name in self.plan["modes"]:
      start = time.perf_counter()
      compiled[name] = compile_mode(self.mesh, MODES[name], min_compressed_size, abstract)
      collectives = qsgd_jax.collectives_in_hlo(compiled[name].as_text())
      record["modes"][name] = {
          "compile_seconds": time.perf_counter() - start,
          "hlo_bytes_sent": sum(c.bytes_sent for c in collectives),
          "gloo_calls": gloo_calls(collectives),
          "hlo_collectives": [{"kind": c.kind, "group_size": c.group_size,
                               "bytes_sent": c.bytes_sent} for c in collectives],
      }
      _log(self.process_id, f"{tree_name} {name}: compiled in "
           f"{record['modes'][name]['compile_seconds']:.1f} s")
    exact = exact_mean(shapes, num_processes) if self.process_id == 0 else None

    for name, executable in compiled.items():  # The warm-up call, and the result's error.
      result = jax.block_until_ready(executable(grads, params))
      if exact is not None and MODES[name].method != "ring" and not MODES[name].wire_only:
        record["modes"][name]["relative_error"] = relative_error(result, exact)
      del result

    record["rates"] = {}
    for rate in self.plan["rates"]:
      link = self.set_rate(rate)
      empty = [self.window(lambda: None) for _ in range(EMPTY_WINDOWS)]
      probes = {str(n): [self.window(lambda n=n: self.probes[n](self.probe_inputs[n]))[0]
                         for _ in range(PROBE_CALLS)] for n in PROBE_LEAVES}
      by_mode = {name: {"seconds": [], "tx_bytes": []} for name in compiled}
      small = record["parameters"] < SMALL_TREE_PARAMETERS
      for _ in range(self.plan["small_tree_repeats" if small else "repeats"]):
        for name, executable in compiled.items():
          seconds, sent = self.window(lambda e=executable: e(grads, params))
          by_mode[name]["seconds"].append(seconds)
          by_mode[name]["tx_bytes"].append(sent)
      record["rates"][rate["name"]] = {
          "link": link, "barrier_tx_bytes": [sent for _, sent in empty],
          "latency_probe_seconds": probes, "modes": by_mode}
      _log(self.process_id, f"{tree_name} at {rate['name']}: " + ", ".join(
          f"{name} {np.median(m['seconds']):.3f} s" for name, m in by_mode.items()))
    return record

  def run(self) -> dict:
    return {"process_id": self.process_id,
            "trees": {name: self.measure_tree(name) for name in self.plan["trees"]}}


def bulk_transfer_rate(seconds: float = 0.5, transfers: int = 3) -> float:
  """Bytes a second that one TCP stream carries over 127.0.0.1, at the receiver: the fastest
  of ``transfers`` streams of ``seconds`` each: a stream slowed by the machine's other work
  undercounts the link, and none carries more than the rate and tbf's bucket allow."""
  return max(_one_transfer_rate(seconds) for _ in range(transfers))


def _one_transfer_rate(seconds: float) -> float:
  received = []
  with socket.create_server(("127.0.0.1", 0)) as server:

    def receive():
      connection, _ = server.accept()
      with connection:
        total, start = 0, None
        while chunk := connection.recv(1 << 20):
          start = start or time.perf_counter()
          total += len(chunk)
        received.append(total / (time.perf_counter() - start))

    receiver = threading.Thread(target=receive)
    receiver.start()
    chunk = bytes(1 << 20)
    with socket.create_connection(server.getsockname()) as sender:
      end = time.perf_counter() + seconds
      while time.perf_counter() < end:
        sender.sendall(chunk)
    receiver.join()
  return received[0]


def _log(process_id: int, message: str) -> None:
  if process_id == 0:
    print(message, file=sys.stderr, flush=True)


def main(plan_path: str, process_id: int) -> None:
  plan = json.loads(pathlib.Path(plan_path).read_text())
  # A lost process ends the others within the failure timeout, not JAX's 100 s.
  with qsgd_jax.initialize_distributed(
      plan["coordinator_address"], plan["num_processes"], process_id,
      failure_timeout=plan["failure_timeout"], initialization_timeout=120):
    if jax.local_device_count() != 1:
      raise RuntimeError(f"expected one CPU device a process, got {jax.local_device_count()}: "
                         "set XLA_FLAGS=--xla_force_host_platform_device_count=1.")
    report = Worker(plan, process_id).run()
    output = pathlib.Path(plan["output_dir"]) / f"process{process_id}.json"
    output.write_text(json.dumps(report) + "\n")
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]))
