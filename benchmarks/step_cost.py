"""What the compressed step itself costs: the transform against its reduction, stage by stage.

Two measurements on ResNet-50's gradient tree (161 leaves, 25.6M floats),
4-bit QSGD, the two-phase method, ``--devices`` simulated CPU devices (2 by
default: one a core here) under ``jax.shard_map``:

1. **The default step's overhead.** ``qsgd_jax.qsgd("batch")``'s update with
   its defaults, and with ``track_elias=True`` (Elias sizes every step),
   against the bare ``qsgd_jax.quantized_pmean`` it wraps: medians of
   ``--repeats`` calls, timed alternately so that all see the same background
   load, and their ratios. The target is a default step within 1.05x of the
   reduction.
2. **The reduction, stage by stage**: each stage of the two-phase
   ``quantized_pmean`` compiled and timed alone on the inputs it really gets
   (the encode, which reads the leaves where they lie; the payloads to
   ``uint32`` rows; the all-to-all; the decode of the received pieces; their
   sum; the re-encode of the owned sums; the all-gather; the decode of every
   owner's sums; the blocks back into leaves), next to the whole reduction.
   The target is a whole reduction within 1.3x of the encodes and decodes it
   performs. Stages compiled alone write out what the whole program keeps
   fused, so the whole program's own largest kernels are listed too, from a
   ``jax.profiler`` trace of it.

On simulated devices the collectives are memory copies, not a network: this
measures the compute a step adds, which ``benchmarks/network.py`` puts on a
real link.

It also counts the minor page faults of a whole reduction: XLA on CPU takes
a call's temporary buffers from ``malloc``, which maps large ones fresh from
the kernel each call, so every 4 KiB page of them faults when first written.
With glibc 2.35 or later, ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` asks for
transparent huge pages there instead (the kernel's
``/sys/kernel/mm/transparent_hugepage/enabled`` must not be ``never``); the
result file then ends in ``_hugetlb``.

Usage::

  python benchmarks/step_cost.py --out benchmarks/results/
  GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python benchmarks/step_cost.py --out benchmarks/results/
  python benchmarks/step_cost.py --repeats 5 --width-divisor 4
"""

import argparse
import collections
import gzip
import json
import os
import pathlib
import re
import resource
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _devices_from_argv(default: int = 2) -> int:
  for i, arg in enumerate(sys.argv):
    if arg == "--devices" and i + 1 < len(sys.argv):
      return int(sys.argv[i + 1])
    if arg.startswith("--devices="):
      return int(arg.split("=", 1)[1])
  return default


if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={_devices_from_argv()}"
                             ).strip()

import jax  # noqa: E402  (the device count is set before JAX starts)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from collectives import resnet50_shapes  # noqa: E402

import qsgd_jax  # noqa: E402
from qsgd_jax._src import axes, serialize  # noqa: E402
from qsgd_jax._src.collectives import exchange, layout  # noqa: E402
from qsgd_jax._src.collectives import plan as plan_lib  # noqa: E402

AXIS = "batch"
COMPRESSOR = qsgd_jax.QSGD(bits=4)
KEY = jax.random.key(0)


def _minor_faults_per_call(f, args, calls: int) -> float:
  """Minor page faults of this process a call of ``f``: its fresh buffers' pages, touched."""
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  for _ in range(calls):
    jax.block_until_ready(f(*args))
  return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


# Trace events of the runtime around the kernels, not kernels themselves.
_RUNTIME_EVENTS = ("ThunkExecutor", "Wait", "Rendezvous", "InvokeRendezvous", "PjitFunction",
                   "ParseArguments", "Handle inputs",
                   "CommonPjRt", "[", "$")


def _kernel_times(f, args, calls: int, top: int = 10) -> list[tuple[str, float]]:
  """The compiled program's largest kernels: ms a call, all devices' together, from a trace.

  ``jax.profiler`` records each thunk XLA's CPU runtime runs (a fusion, a copy,
  a collective); names differing only in a numeric suffix are added together.
  """
  with tempfile.TemporaryDirectory() as directory:
    jax.profiler.start_trace(directory)
    for _ in range(calls):
      jax.block_until_ready(f(*args))
    jax.profiler.stop_trace()
    (path,) = pathlib.Path(directory).rglob("*.trace.json.gz")
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
  totals = collections.Counter()
  for event in events:
    if event.get("ph") == "X" and not event["name"].startswith(_RUNTIME_EVENTS):
      totals[re.sub(r"\.\d+$", "", event["name"])] += event["dur"] / 1e3 / calls
  return totals.most_common(top)


def _median_seconds(functions: dict, args: dict, repeats: int) -> dict[str, float]:
  """Median wall time of each compiled function, called in turn ``repeats`` times."""
  times = {name: [] for name in functions}
  for name, f in functions.items():  # Warm-up.
    jax.block_until_ready(f(*args[name]))
  for _ in range(repeats):
    for name, f in functions.items():
      start = time.perf_counter()
      jax.block_until_ready(f(*args[name]))
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(t) for name, t in times.items()}


class Setup:
  """The mesh, the gradient tree on it, and the compiled functions over it."""

  def __init__(self, width_divisor: int):
    self.mesh = jax.make_mesh((jax.device_count(),), (AXIS,))
    self.n = jax.device_count()
    shapes = resnet50_shapes(width_divisor)
    rng = np.random.default_rng(0)
    self.tree = {name: jax.device_put(
        rng.normal(size=(self.n, *shape)).astype(np.float32),
        NamedSharding(self.mesh, P(AXIS))) for name, shape in shapes.items()}
    self.one_device = {name: jax.ShapeDtypeStruct(shape, jnp.float32)
                       for name, shape in shapes.items()}
    self.plan = plan_lib.make_plan(self.one_device, AXIS, COMPRESSOR,
                                   axis_sizes={AXIS: self.n})

  def mapped(self, f, in_specs, out_specs):
    return jax.jit(jax.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs))

  def on_mesh(self, per_device):
    """Compiles ``per_device`` under shard_map; its outputs stay per device (varying)."""
    def run(*args):
      out = per_device(*args)
      return jax.tree.map(lambda x: axes.as_varying(x, AXIS)[None], out)
    return self.mapped(run, P(AXIS), P(AXIS))


def overhead(setup: Setup, repeats: int) -> dict:
  """The transform's update with its defaults, and with Elias sizes, against the bare pmean."""
  transforms = {"qsgd_default": qsgd_jax.qsgd(AXIS),
                "qsgd_track_elias": qsgd_jax.qsgd(AXIS, track_elias=True)}
  functions, args = {}, {}
  bare = setup.mapped(
      lambda t: qsgd_jax.quantized_pmean(jax.tree.map(lambda x: x[0], t), AXIS, COMPRESSOR,
                                         KEY), P(AXIS), P())
  functions["quantized_pmean"], args["quantized_pmean"] = bare, (setup.tree,)
  for name, tx in transforms.items():
    specs = qsgd_jax.state_partition_specs(jax.eval_shape(tx.init, setup.one_device), AXIS)
    state = setup.mapped(tx.init, P(), specs)(
        jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), setup.one_device))

    def update(tree, state, tx=tx):
      return tx.update(jax.tree.map(lambda x: x[0], tree), state)

    functions[name] = setup.mapped(update, (P(AXIS), specs), (P(), specs))
    args[name] = (setup.tree, state)
  seconds = _median_seconds(functions, args, repeats)
  return {name: {"seconds": t, "ratio_to_quantized_pmean": t / seconds["quantized_pmean"]}
          for name, t in seconds.items()}


def stages(setup: Setup, repeats: int) -> dict:
  """Each stage of the two-phase quantized_pmean, compiled and timed alone."""
  plan, n = setup.plan, setup.n
  compressor = plan.compressor
  first = lambda t: jax.tree.map(lambda x: x[0], t)  # noqa: E731

  def encode(tree):
    leaves = jax.tree.leaves(first(tree))
    return exchange.encode_block_parts(
        compressor, KEY, layout.block_parts(plan, layout.segment_parts(plan, leaves))).payloads

  def to_rows(payloads):
    return jnp.concatenate([exchange.device_rows(p, n) for p in first(payloads)], axis=1)

  def all_to_all(rows):
    return jax.lax.all_to_all(rows[0], AXIS, 0, 0, tiled=False)

  def decode_received(words):
    return exchange.decode_rows(plan, words[0])

  def sum_pieces(decoded):
    return [exchange.sum_rows(d) / n for d in first(decoded)]

  def re_encode(owned):
    return jnp.concatenate([jax.vmap(serialize.to_words)(p).reshape(-1)
                            for p in exchange.encode_blocks(compressor, KEY, first(owned))])

  def all_gather(mine):
    return jax.lax.all_gather(mine[0], AXIS, tiled=False)

  def decode_gathered(words):
    return exchange.decode_blocks(compressor, exchange.payload_rows(plan, words[0]),
                                  batch_dims=2)

  def to_leaves(gathered):
    return layout.segment_leaves(plan, layout.split(plan, [jnp.swapaxes(g, 0, 1)
                                                           for g in first(gathered)]))

  pipeline = [("encode", encode), ("serialize", to_rows),
              ("all-to-all", all_to_all), ("decode received", decode_received),
              ("sum", sum_pieces), ("re-encode", re_encode), ("all-gather", all_gather),
              ("decode gathered", decode_gathered), ("to leaves", to_leaves)]
  functions, args, value = {}, {}, setup.tree
  for name, stage in pipeline:
    functions[name] = setup.on_mesh(stage)
    args[name] = (value,)
    value = jax.block_until_ready(functions[name](value))
  functions["whole quantized_pmean"] = setup.mapped(
      lambda t: qsgd_jax.quantized_pmean(first(t), AXIS, COMPRESSOR, KEY), P(AXIS), P())
  args["whole quantized_pmean"] = (setup.tree,)
  seconds = _median_seconds(functions, args, repeats)
  faults = _minor_faults_per_call(functions["whole quantized_pmean"],
                                  args["whole quantized_pmean"], repeats)
  kernels = _kernel_times(functions["whole quantized_pmean"], args["whole quantized_pmean"],
                         repeats)
  codec = sum(seconds[name] for name in ("encode", "decode received", "re-encode",
                                         "decode gathered"))
  return {"seconds": seconds, "encodes_and_decodes_seconds": codec,
          "whole_over_encodes_and_decodes": seconds["whole quantized_pmean"] / codec,
          "whole_minor_page_faults_per_call": faults,
          "whole_largest_kernels_ms_per_call": kernels}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--devices", type=int, default=2, help="simulated CPU devices")
  parser.add_argument("--repeats", type=int, default=7, help="timed calls a function")
  parser.add_argument("--width-divisor", type=int, default=1,
                      help="divide ResNet-50's widths by this (4: a quick run)")
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
  options = parser.parse_args()
  setup = Setup(options.width_divisor)
  print(f"ResNet-50 tree / {options.width_divisor}, QSGD 4-bit two-phase, {setup.n} simulated "
        f"CPU devices; medians of {options.repeats}.")
  tunables = os.environ.get("GLIBC_TUNABLES", "")
  hugetlb = "glibc.malloc.hugetlb=1" in tunables  # As benchmarks/network.py tells it.
  print(f"GLIBC_TUNABLES={tunables!r}: XLA's temporary buffers are "
        + ("backed by transparent huge pages where the kernel allows." if hugetlb
           else "faulted in 4 KiB at a time, every call (see the README)."))
  record = {"devices": setup.n, "width_divisor": options.width_divisor,
            "repeats": options.repeats, "jax": jax.__version__, "glibc_tunables": tunables}
  record["overhead"] = overhead(setup, options.repeats)
  print("\nThe default step against the reduction it wraps (target <= 1.05x):")
  for name, row in record["overhead"].items():
    print(f"  {name:22s} {1e3 * row['seconds']:9.1f} ms  {row['ratio_to_quantized_pmean']:.2f}x")
  record["stages"] = stages(setup, options.repeats)
  print("\nquantized_pmean stage by stage (each compiled alone):")
  for name, t in record["stages"]["seconds"].items():
    print(f"  {name:22s} {1e3 * t:9.1f} ms")
  print(f"  whole / (encodes + decodes) = "
        f"{record['stages']['whole_over_encodes_and_decodes']:.2f}x (target <= 1.3x)")
  print(f"  minor page faults a whole call: "
        f"{record['stages']['whole_minor_page_faults_per_call']:,.0f}")
  print(f"\nThe whole quantized_pmean's largest kernels (jax.profiler; ms a call, its"
        f" {setup.n} devices' together):")
  for name, ms in record["stages"]["whole_largest_kernels_ms_per_call"]:
    print(f"  {name:40s} {ms:9.1f} ms")
  options.out.mkdir(parents=True, exist_ok=True)
  suffix = "_hugetlb" if hugetlb else ""
  path = options.out / f"step_cost_{setup.n}devices_div{options.width_divisor}{suffix}.json"
  path.write_text(json.dumps(record, indent=2) + "\n")
  print(f"\nWrote {path}")


if __name__ == "__main__":
  main()
