"""Every family measured on one device of whatever platform JAX sees: kernels, steps, cost model.

One command for a machine with an accelerator (it runs on a CPU too, at the
small sizes of ``--small``, which is how the test suite runs it). On JAX's
default device it measures, and writes as JSON and a markdown table to
``benchmarks/results/<platform>/accelerator.{json,md}``:

1. **Kernels against the copy.** A copy kernel (``x * 2 + 1``: one read and
   one write) gives the device's attainable bandwidth. Each compressor's
   encode, decode and encode+decode, timed alone, as memory traffic (the
   float32 array read or written, the payload written or read; encode+decode
   counts both) in GB/s, and as a fraction of the copy's and of the
   datasheet's bandwidth (``--peak-gb-per-s``, or ``compressor_throughput``'s
   table by device kind: H100 SXM 3.35 TB/s, H200 4.8 TB/s). On a GPU the
   fused Pallas kernels (``qsgd_jax/_src/pallas_kernels.py``) are timed beside
   the XLA path, as ``..._pallas`` rows.
2. **The 1-bit exchange's kernels** at the example LM's and GPT-2 small's
   parameter counts: packing the signs of a float32 vector, unpacking 8 rows
   into ``+-scale``, and a server's sum of 8 workers' scaled signs plus its
   error (``sign_exchange``'s ``served``). **PowerSGD's per-step compute**
   (its update on one device, the collectives their one-device identities) on
   the LM's and GPT-2 small's gradient trees.
3. **Step overhead on a GPT-2-small-sized transformer**: the example LM
   (``examples/lm/models.py``) at GPT-2 small's 12 layers of width 768, 12
   heads, 1,024 positions (86M parameters: its byte vocabulary has no 38.6M
   token embedding), one jitted training step (forward, backward, the
   optimizer) for AdamW, 1-bit Adam and 0/1 Adam past their freezes, PowerSGD
   (rank 4) and QSGD 4-bit before AdamW; under ``jax.shard_map`` over a mesh of
   this one device, so every collective is its one-device identity and the
   time beyond AdamW's is the mode's own computation. QSGD quantizes its own
   piece too (``exact_own_piece=False``): with one device the two-phase
   method then encodes and decodes everything twice, the work of the smallest
   mesh.
4. **The cost model** (``benchmarks/cost_model.py``): the break-even link
   rate of each mode (below it, the mode's step beats AdamW's float32
   all-reduce) and the projected step at 10, 100 and 400 Gbit/s a node, for 8
   and 64 devices: the one-device step plus the ring's wire time.

Each kernel is timed as the median of 10 samples, a sample enough calls
dispatched back to back to last a millisecond (a 0.04 ms kernel timed one
call at a time would time the host's dispatch and wait instead). A Pallas
kernel that fails to lower on the device is a row with its error; the XLA
rows are measured still.

It prints the table and the issue's targets: encode+decode of QSGD 4-bit and
1-bit, and the exchange's pack and unpack, at >= 60% of the copy's bandwidth;
each mode's step at most 10% above AdamW's.

``--check`` runs, on the default device and on the CPU, small programs of the
test suite's families (QSGD's encode and decode, the fused kernels, the
two-phase ``quantized_pmean``, the 1-bit exchange, 1-bit Adam, 0/1 Adam,
PowerSGD) and compares the results bit for bit where the arithmetic is the
same on both (integer hashing, elementwise float operations), and within a
tolerance where a float sum or a matrix product may add in another order.

Sized for 5 minutes on one H100: the copy and compressors at 64M and 256M
float32 (1 GiB; some 40 small programs compiled, 10 timed calls each, about
a second of kernels), the exchange at 124M, PowerSGD on 124M parameters, and
five GPT-2-small steps of 8 sequences of 1,024 bytes (compiling each takes
most of the time: some 20 s each), 5 timed calls each.

  python benchmarks/accelerator.py                  # on the default device
  python benchmarks/accelerator.py --check          # results against the CPU
  python benchmarks/accelerator.py --small          # a CPU-sized run (seconds)
"""

import argparse
import importlib.util
import json
import math
import os
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))

import qsgd_jax  # noqa: E402
from examples.lm import models  # noqa: E402
from qsgd_jax._src.adam import sign_exchange  # noqa: E402
from qsgd_jax._src.compressors import packing, pallas_kernels  # noqa: E402

AXIS = "batch"
COMPRESSORS = {
    "qsgd_4bit": qsgd_jax.QSGD(bits=4, bucket_size=512),
    "qsgd_8bit": qsgd_jax.QSGD(bits=8, bucket_size=512),
    "minmax_8bit": qsgd_jax.MinMax(bits=8),
    "onebit": qsgd_jax.OneBit(bucket_size=512),
}
TARGET_FRACTION_OF_COPY = 0.6
TARGET_STEP_OVERHEAD = 0.10
# A training step is timed over steps dispatched back to back for about this long (at most
# 100 of them), as a training loop runs them; one call waited on would add the host's
# dispatch and wait to its time.
STEP_SAMPLE_SECONDS = 0.25
LINK_GBIT_PER_S = (10, 100, 400)
DEVICE_COUNTS = (8, 64)
LINK_LATENCY = 10e-6  # Seconds a message, an InfiniBand or RoCE hop.
WORKERS = 8  # Rows a server sums in the exchange's sum.
MODES = ("adamw", "onebit_adam", "zero_one_adam", "powersgd", "qsgd_4bit")
POWERSGD_START = 2  # PowerSGD's exact steps first (the fewest it allows with error feedback).


def _load(name):
  spec = importlib.util.spec_from_file_location(f"benchmarks_{name}",
                                                _ROOT / "benchmarks" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--small", action="store_true",
                      help="CPU-sized: 64K floats, a 1-layer 32-wide model (for tests)")
  parser.add_argument("--sizes", type=int, nargs="+", default=None,
                      help="float32 elements of the kernel benchmarks (default 64M 256M)")
  parser.add_argument("--repeats", type=int, default=10, help="timed calls a kernel")
  parser.add_argument("--step-repeats", type=int, default=5, help="timed calls a step")
  parser.add_argument("--batch", type=int, default=8, help="sequences a step")
  parser.add_argument("--peak-gb-per-s", type=float, default=None,
                      help="datasheet bandwidth, for a device not in the table")
  parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                      help="the steps to time (AdamW's always)")
  parser.add_argument("--check", action="store_true",
                      help="compare results with the CPU's instead of timing")
  parser.add_argument("--out", type=pathlib.Path, default=None,
                      help="default: benchmarks/results/<platform>[/small]")
  return parser.parse_args(argv)


def _seconds(fn, args, repeats: int, sample_seconds: float = 1e-3) -> float:
  """Median seconds a call: ``repeats`` samples after a warm-up, each of as many calls
  dispatched back to back (then waited on) as one waited-on call's time says will last
  ``sample_seconds`` (at least 1, at most 100), so that a call is timed without the host's
  dispatch and wait around every one: as a training loop runs steps, the host dispatching
  the next while the device computes this one. ``sample_seconds=0`` times one call at a
  time."""
  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  calls = min(100, max(1, math.ceil(sample_seconds / (time.perf_counter() - start))))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls - 1):
      fn(*args)
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - start) / calls)
  return statistics.median(times)


def _rate(traffic_bytes: float, seconds: float, copy_gb_per_s: float, peak) -> dict:
  gb_per_s = traffic_bytes / seconds / 1e9
  return {"ms": 1e3 * seconds, "gb_per_s": gb_per_s, "of_copy": gb_per_s / copy_gb_per_s,
          "of_datasheet": None if peak is None else gb_per_s / peak}


def _measured(name: str, measure) -> dict:
  """``measure()``'s row; for a fused kernel (``..._pallas``) that Pallas could not lower or
  run here, a row with the error, so that the XLA rows go on."""
  try:
    return measure()
  except Exception as error:  # noqa: BLE001  (only the fused kernels' failures are rows)
    if not name.endswith("_pallas"):
      raise
    return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}


def _fused_compressor(compressor):
  """The compressor's encode and decode through the fused kernels, if it has them here."""
  if jax.default_backend() != "gpu" or not isinstance(compressor, qsgd_jax.QSGD):
    return None
  return (lambda key, x: compressor._encode_fused(key, x, interpret=False),
          lambda payload: compressor._decode_fused(payload, interpret=False))


def kernels(size: int, repeats: int, peak) -> dict:
  """The copy, then each compressor's encode, decode and both, at ``size`` float32."""
  x = jax.random.normal(jax.random.key(1), (size,), jnp.float32)
  key = jax.random.key(0)
  nbytes = x.nbytes
  copy_seconds = _seconds(jax.jit(lambda x: x * 2 + 1), (x,), repeats)
  copy_gb_per_s = 2 * nbytes / copy_seconds / 1e9
  out = {"copy": {"ms": 1e3 * copy_seconds, "gb_per_s": copy_gb_per_s,
                  "of_datasheet": None if peak is None else copy_gb_per_s / peak}}
  for name, compressor in COMPRESSORS.items():
    variants = {name: (compressor.encode, compressor.decode)}
    fused = _fused_compressor(compressor)
    if fused is not None:
      variants[f"{name}_pallas"] = fused
    payload_bytes = compressor.wire_bits(x.shape) / 8
    for label, (encode, decode) in variants.items():
      encode, decode = jax.jit(encode), jax.jit(decode)
      round_trip = jax.jit(lambda key, x, e=encode, d=decode: d(e(key, x)))

      def measure(encode=encode, decode=decode, round_trip=round_trip,
                  payload_bytes=payload_bytes):
        payload = encode(key, x)
        return {
            "encode": _rate(nbytes + payload_bytes, _seconds(encode, (key, x), repeats),
                            copy_gb_per_s, peak),
            "decode": _rate(payload_bytes + nbytes, _seconds(decode, (payload,), repeats),
                            copy_gb_per_s, peak),
            "encode_decode": _rate(2 * (nbytes + payload_bytes),
                                   _seconds(round_trip, (key, x), repeats), copy_gb_per_s,
                                   peak),
        }

      out[label] = _measured(label, measure)
  return out


def exchange_kernels(parameters: int, repeats: int, copy_gb_per_s: float, peak) -> dict:
  """The 1-bit exchange's pack, unpack and server sum for ``parameters`` elements."""
  n = parameters // (32 * WORKERS) * 32 * WORKERS  # Whole words in every row.
  chunk = n // WORKERS
  x = jax.random.normal(jax.random.key(2), (n,), jnp.float32)
  words = jax.jit(lambda x: packing.pack((x >= 0).astype(jnp.uint32), 1))(x)
  rows = words.reshape(WORKERS, chunk // 32)
  scales = jnp.linspace(0.5, 1.5, WORKERS, dtype=jnp.float32)
  server_error = jnp.zeros((chunk,), jnp.float32)

  def unpack(rows, scales):
    return sign_exchange._scaled_rows(rows, scales, chunk)

  def served(rows, scales, error):
    signs = sign_exchange._unpacked_rows(rows, chunk)
    weighted = [signs[k] * scales[k] * np.float32(1 / WORKERS) for k in range(WORKERS)]
    total = weighted[0]
    for row in weighted[1:]:
      total = total + row
    return total + error

  variants = {
      "pack": (lambda x: packing.pack((x >= 0).astype(jnp.uint32), 1), (x,), 4 * n + n / 8),
      "unpack": (unpack, (rows, scales), n / 8 + 4 * n),
      "sum": (served, (rows, scales, server_error), n / 8 + 8 * chunk),
  }
  if jax.default_backend() == "gpu":
    variants["pack_pallas"] = (lambda x: pallas_kernels.sign_pack(x, interpret=False), (x,),
                               4 * n + n / 8)
    variants["unpack_pallas"] = (
        lambda rows, scales: pallas_kernels.sign_unpack_rows(rows, scales, interpret=False),
        (rows, scales), n / 8 + 4 * n)
  return {name: _measured(name, lambda fn=fn, args=args, traffic=traffic: _rate(
      traffic, _seconds(jax.jit(fn), args, repeats), copy_gb_per_s, peak))
          for name, (fn, args, traffic) in variants.items()}


def _one_device_mesh():
  """A mesh of the device programs run on now: ``jax.default_device``'s, else the first.

  ``--check`` runs each program under ``jax.default_device`` of the accelerator,
  then of the CPU: a mesh of ``jax.devices()[:1]`` would put both runs on the
  accelerator."""
  return jax.make_mesh((1,), (AXIS,), devices=[_default_device()])


def _default_device() -> jax.Device:
  """``jax.default_device``'s device (given as a device or a platform), else the first."""
  device = jax.config.jax_default_device
  if device is None:
    return jax.devices()[0]
  return jax.devices(device)[0] if isinstance(device, str) else device


def _one_device_step(tx, params, gradient_fn):
  """A jitted ``(params, state, batch) -> (params, state)`` step of ``tx`` under ``shard_map``
  over this one device, the gradients ``gradient_fn(params, batch)`` taken per device; and
  the parameters and state to start from."""
  mesh = _one_device_mesh()
  specs = qsgd_jax.state_partition_specs(jax.eval_shape(tx.init, params), AXIS)
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

  def step(params, state, batch):
    grads = gradient_fn(qsgd_jax.as_varying(params, AXIS), batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P()),
                               out_specs=(P(), specs)), donate_argnums=(0, 1))
  return step, jax.tree.map(jnp.copy, params), state


def powersgd_step(shapes: dict, repeats: int) -> dict:
  """Seconds of PowerSGD's update (rank 4, compressing) on a tree of ``shapes``, one device."""
  mesh = _one_device_mesh()
  tx = qsgd_jax.powersgd(AXIS, rank=4, start_iter=POWERSGD_START)
  grads = {name: jax.random.normal(jax.random.key(i), shape, jnp.float32)
           for i, (name, shape) in enumerate(shapes.items())}
  specs = qsgd_jax.state_partition_specs(jax.eval_shape(tx.init, grads), AXIS)
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(grads)

  def update(grads, state):
    return tx.update(qsgd_jax.as_varying(grads, AXIS), state)

  step = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(P(), specs), out_specs=(P(), specs)))
  for _ in range(POWERSGD_START):  # Past the exact steps.
    _, state = step(grads, state)
  seconds = _seconds(step, (grads, state), repeats)
  parameters = sum(math.prod(shape) for shape in shapes.values())
  return {"ms": 1e3 * seconds, "parameters": parameters,
          "ns_a_parameter": 1e9 * seconds / parameters}


def _model(small: bool) -> models.TransformerLM:
  if small:
    return models.TransformerLM(num_layers=1, width=32, num_heads=2, context_length=32)
  return models.TransformerLM(num_layers=12, width=768, num_heads=12, context_length=1024)


def modes(parameters: int) -> dict:
  """Each mode's optimizer: ``(transform, bytes a coordinate on the wire)``."""
  adamw = optax.adamw(1e-4)
  qsgd4 = qsgd_jax.QSGD(bits=4)
  return {
      "adamw": (optax.chain(qsgd_jax.compressed_allreduce(qsgd_jax.Identity(), AXIS,
                                                          axis_size=1), adamw), 4.0),
      "onebit_adam": (qsgd_jax.onebit_adam(1e-4, AXIS, freeze_step=1, axis_size=1), 1 / 8),
      "zero_one_adam": (qsgd_jax.zero_one_adam(1e-4, AXIS, var_freeze_step=1,
                                               local_step_clipper=1, axis_size=1), 1 / 8),
      "powersgd": (optax.chain(qsgd_jax.powersgd(AXIS, rank=4, start_iter=POWERSGD_START),
                                adamw), None),
      "qsgd_4bit": (optax.chain(qsgd_jax.qsgd(AXIS, bits=4, exact_own_piece=False,
                                                      axis_size=1), adamw),
                    qsgd4.wire_bits((parameters,)) / 8 / parameters),
  }


def powersgd_bytes_per_coordinate(params, rank: int = 4) -> float:
  """Bytes a coordinate PowerSGD sends: ``(n + m) r`` floats a compressed matrix, the rest whole."""
  total, sent = 0, 0.0
  for leaf in jax.tree.leaves(params):
    total += leaf.size
    if leaf.ndim >= 2:
      rows, columns = math.prod(leaf.shape[:-1]), leaf.shape[-1]
      r = min(rows, columns, rank)
      if (rows + columns) * r * 2.0 < rows * columns:
        sent += 4 * (rows + columns) * r
        continue
    sent += 4 * leaf.size
  return sent / total


def language_model(small: bool, batch: int):
  """``(model, params, tokens, loss_fn)``: the steps' transformer, its parameters, a batch
  of ``batch`` random sequences and ``loss_fn(params, tokens)``, next-byte cross-entropy."""
  model = _model(small)
  tokens = jax.random.randint(jax.random.key(0), (batch, model.context_length + 1), 0,
                              models.VOCAB_SIZE)
  params = jax.jit(model.init)(jax.random.key(1), tokens[:1, :-1])["params"]

  def loss_fn(params, tokens):
    logits = model.apply({"params": params}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  return model, params, tokens, loss_fn


def steps(small: bool, batch: int, repeats: int, names=MODES) -> dict:
  """Each mode's training step on one device, and its overhead over AdamW's."""
  model, params, tokens, loss_fn = language_model(small, batch)
  length = model.context_length
  parameters = sum(leaf.size for leaf in jax.tree.leaves(params))
  out = {"parameters": parameters, "layers": model.num_layers, "width": model.width,
         "batch": batch, "length": length, "modes": {}}
  for name, (tx, wire_bytes) in modes(parameters).items():
    if name != "adamw" and name not in names:
      continue
    step, *carry = _one_device_step(tx, params, jax.grad(loss_fn))

    def run(step=step, carry=carry):
      carry[0], carry[1] = step(carry[0], carry[1], tokens)
      return carry[0]

    start = time.perf_counter()
    jax.block_until_ready(run())  # Compiles; the compressed Adams pass their freeze.
    jax.block_until_ready(run())  # PowerSGD past its exact steps.
    compile_seconds = time.perf_counter() - start
    seconds = _seconds(lambda: run(), (), repeats, STEP_SAMPLE_SECONDS)
    if wire_bytes is None:
      wire_bytes = powersgd_bytes_per_coordinate(params)
    out["modes"][name] = {"ms": 1e3 * seconds, "compile_s": compile_seconds,
                          "wire_bytes_a_coordinate": wire_bytes}
  adamw = out["modes"]["adamw"]["ms"]
  for row in out["modes"].values():
    row["overhead"] = row["ms"] / adamw - 1
  return out


def cost_model_rows(step_report: dict, kernel_report: dict) -> dict:
  """Break-even link rates and projected steps, from the measured steps and kernels."""
  cost_model = _load("cost_model")
  parameters = step_report["parameters"]
  adamw_seconds = step_report["modes"]["adamw"]["ms"] / 1e3
  out = {"steps": {}, "kernels": {}}
  for name, row in step_report["modes"].items():
    seconds = row["ms"] / 1e3
    method = cost_model.Method(name, row["wire_bytes_a_coordinate"], math.inf, math.inf)
    extra = max(seconds - adamw_seconds, 0.0)
    entry = {"break_even_gb_per_s": {}, "projected_ms": {}}
    for devices in DEVICE_COUNTS:
      share = 2 * (devices - 1) / devices
      saved = share * (4 - method.bytes_per_coordinate) * parameters
      entry["break_even_gb_per_s"][str(devices)] = (
          None if name == "adamw" else math.inf if extra == 0 else saved / extra / 1e9)
      for gbit in LINK_GBIT_PER_S:
        link = cost_model.Link(f"{gbit} Gbit/s", gbit * 1e9 / 8, LINK_LATENCY)
        wire = cost_model.allreduce_seconds(method, link, devices, parameters)
        entry["projected_ms"][f"{devices}x{gbit}"] = 1e3 * (seconds + wire)
    out["steps"][name] = entry
  # The compressors alone, with the cost model's own kernel accounting.
  size = max(kernel_report, key=int)
  for label, bits in (("qsgd_4bit", 4 + 32 / 512), ("onebit", 1 + 64 / 512)):
    for variant in (label, f"{label}_pallas"):
      if "encode" not in kernel_report[size].get(variant, {}):
        continue
      row = kernel_report[size][variant]
      method = cost_model.Method(variant, bits / 8, int(size) / (row["encode"]["ms"] / 1e3),
                                 int(size) / (row["decode"]["ms"] / 1e3))
      out["kernels"][variant] = {str(devices): cost_model.crossover_bandwidth(method, devices) / 1e9
                                 for devices in DEVICE_COUNTS}
  return out


def targets(record: dict) -> list[dict]:
  """The issue's targets, each with its figure and whether it is met."""
  rows = []
  size = max(record["kernels"], key=int)
  kernel = record["kernels"][size]
  for name in ("qsgd_4bit", "qsgd_4bit_pallas", "onebit"):
    if "encode_decode" in kernel.get(name, {}):
      figure = kernel[name]["encode_decode"]["of_copy"]
      rows.append({"what": f"{name} encode+decode, of the copy's bandwidth ({size} float32)",
                   "figure": figure, "target": f">= {TARGET_FRACTION_OF_COPY:.0%}",
                   "met": figure >= TARGET_FRACTION_OF_COPY})
  for model, parts in record["exchange"].items():
    for part in ("pack", "unpack", "pack_pallas", "unpack_pallas"):
      if "of_copy" in parts.get(part, {}):
        figure = parts[part]["of_copy"]
        rows.append({"what": f"exchange {part}, of the copy's bandwidth ({model})",
                     "figure": figure, "target": f">= {TARGET_FRACTION_OF_COPY:.0%}",
                     "met": figure >= TARGET_FRACTION_OF_COPY})
  for name, row in record["steps"]["modes"].items():
    if name != "adamw":
      rows.append({"what": f"{name} step over AdamW's", "figure": row["overhead"],
                   "target": f"<= {TARGET_STEP_OVERHEAD:.0%}",
                   "met": row["overhead"] <= TARGET_STEP_OVERHEAD})
  return rows


def _percent(value) -> str:
  return "-" if value is None else f"{value:.0%}"


def markdown(record: dict) -> str:
  device = record["device"]
  lines = [f"Device: {device['kind']} ({device['platform']}), JAX {record['jax']}; datasheet"
           f" {device['datasheet_gb_per_s'] or '-'} GB/s.", ""]
  lines += ["| size | kernel | encode GB/s (of copy, of datasheet) | decode | encode+decode |",
            "|---|---|---|---|---|"]
  for size, rows in record["kernels"].items():
    copy = rows["copy"]
    lines.append(f"| {int(size):,} | copy `x * 2 + 1` | {copy['gb_per_s']:.1f} (100%,"
                 f" {_percent(copy['of_datasheet'])}) | | |")
    for name, row in rows.items():
      if name == "copy":
        continue
      if "error" in row:
        lines.append(f"| {int(size):,} | {name} | failed: {row['error']} | | |")
        continue
      cells = [f"{row[part]['gb_per_s']:.1f} ({_percent(row[part]['of_copy'])},"
               f" {_percent(row[part]['of_datasheet'])})"
               for part in ("encode", "decode", "encode_decode")]
      lines.append(f"| {int(size):,} | {name} | " + " | ".join(cells) + " |")
  lines += ["", "| 1-bit exchange | kernel | ms | GB/s | of copy |", "|---|---|---|---|---|"]
  for model, parts in record["exchange"].items():
    for part, row in parts.items():
      if "error" in row:
        lines.append(f"| {model} | {part} | failed: {row['error']} | | |")
        continue
      lines.append(f"| {model} | {part} | {row['ms']:.3f} | {row['gb_per_s']:.1f} |"
                   f" {_percent(row['of_copy'])} |")
  lines += ["", "| PowerSGD update (rank 4), one device | parameters | ms | ns a parameter |",
            "|---|---|---|---|"]
  for model, row in record["powersgd"].items():
    lines.append(f"| {model} | {row['parameters']:,} | {row['ms']:.2f} |"
                 f" {row['ns_a_parameter']:.2f} |")
  report = record["steps"]
  lines += ["", f"Training step, {report['layers']} layers of width {report['width']},"
            f" {report['parameters']:,} parameters, {report['batch']} x {report['length']}"
            " bytes, one device:", ""]
  header = " | ".join(f"{d} dev. @ {g} Gbit/s" for d in DEVICE_COUNTS for g in LINK_GBIT_PER_S)
  lines += [f"| mode | step ms | over AdamW | wire bytes/coord. | break-even GB/s (8, 64 dev.)"
            f" | {header} |", "|---" * (5 + len(DEVICE_COUNTS) * len(LINK_GBIT_PER_S)) + "|"]
  for name, row in report["modes"].items():
    model = record["cost_model"]["steps"][name]
    even = ", ".join("-" if v is None else f"{v:.1f}"
                     for v in model["break_even_gb_per_s"].values())
    projected = " | ".join(f"{v:.1f}" for v in model["projected_ms"].values())
    lines.append(f"| {name} | {row['ms']:.1f} | {row['overhead']:+.1%} |"
                 f" {row['wire_bytes_a_coordinate']:.3f} | {even} | {projected} |")
  if record["cost_model"]["kernels"]:
    lines += ["", "Break-even link rate of the compressors alone (cost_model.py's kernel"
              " accounting), GB/s a device: " + "; ".join(
                  f"{name} {', '.join(f'{v:.0f}' for v in rates.values())} (8, 64 devices)"
                  for name, rates in record["cost_model"]["kernels"].items())]
  lines += ["", "| target | figure | goal | met |", "|---|---|---|---|"]
  for row in record["targets"]:
    lines.append(f"| {row['what']} | {row['figure']:.1%} | {row['target']} |"
                 f" {'yes' if row['met'] else 'no'} |")
  return "\n".join(lines) + "\n"


def _progress(record: dict, section: str, start: float) -> None:
  """One finished section as a line of JSON: a run cut short still leaves its figures."""
  print(f"[{time.perf_counter() - start:.0f} s] {section}:"
        f" {json.dumps(record[section], default=str)}", flush=True)


def run_benchmark(args) -> dict:
  start = time.perf_counter()
  device = jax.devices()[0]
  throughput = _load("compressor_throughput")
  peak = args.peak_gb_per_s or throughput.datasheet_bandwidth(device)
  sizes = args.sizes or ([1 << 16] if args.small else [1 << 26, 1 << 28])
  record = {"jax": jax.__version__, "command": " ".join(["python", *sys.argv]),
            "device": {"kind": device.device_kind, "platform": device.platform,
                       "datasheet_gb_per_s": peak}}
  record["kernels"] = {str(size): kernels(size, args.repeats, peak) for size in sizes}
  _progress(record, "kernels", start)
  copy_gb_per_s = record["kernels"][str(max(sizes))]["copy"]["gb_per_s"]
  # Imported here: collectives.py sets JAX_PLATFORMS and XLA_FLAGS if unset, which this
  # process, its backend started, no longer reads.
  gpt2_shapes = _load("collectives").gpt2_small_shapes(32 if args.small else 1)
  # examples/lm/configs/default.py's model.
  lm_model = models.TransformerLM(num_layers=6, width=384, num_heads=6, context_length=256)
  lm_shapes = {jax.tree_util.keystr(path): leaf.shape for path, leaf in
               jax.tree_util.tree_leaves_with_path(jax.eval_shape(
                   lm_model.init, jax.random.key(0),
                   jnp.zeros((1, lm_model.context_length), jnp.int32))["params"])}
  gpt2_name = "GPT-2 small" + (", width / 32" if args.small else "")
  trees = {gpt2_name: gpt2_shapes} if args.small else {"example LM": lm_shapes,
                                                        gpt2_name: gpt2_shapes}
  record["exchange"] = {
      name: exchange_kernels(sum(math.prod(s) for s in shapes.values()), args.repeats,
                             copy_gb_per_s, peak) for name, shapes in trees.items()}
  _progress(record, "exchange", start)
  record["powersgd"] = {name: powersgd_step(shapes, args.repeats)
                        for name, shapes in trees.items()}
  _progress(record, "powersgd", start)
  record["steps"] = steps(args.small, 2 if args.small else args.batch, args.step_repeats,
                          args.modes)
  _progress(record, "steps", start)
  record["cost_model"] = cost_model_rows(record["steps"], record["kernels"])
  record["targets"] = targets(record)
  return record


# --check: the same small programs on the default device and on the CPU.


def _platform() -> str:
  """The platform programs run on now: ``jax.default_device``'s, else the default backend."""
  return _default_device().platform


def _check_programs() -> dict:
  """Each check's function of no arguments (it makes its own inputs) and whether it is exact."""
  size = 8192 * 4 + 1000
  x = np.random.default_rng(0).normal(size=size).astype(np.float32)
  q4 = qsgd_jax.QSGD(bits=4)

  def qsgd_encode():
    payload = q4.encode(jax.random.key(1), jnp.asarray(x))
    return payload.packed, payload.scales

  def qsgd_decode():
    return q4.decode(q4.encode(jax.random.key(1), jnp.asarray(x)))

  def qsgd_fused():
    interpret = _platform() != "gpu"
    payload = q4._encode_fused(jax.random.key(1), jnp.asarray(x), interpret=interpret)
    return payload.packed, payload.scales, q4._decode_fused(payload, interpret=interpret)

  def sign_kernels():
    interpret = _platform() != "gpu"
    words = pallas_kernels.sign_pack(jnp.asarray(x), interpret=interpret)
    rows = words[: 8 * 128].reshape(8, 128)
    return words, pallas_kernels.sign_unpack_rows(rows, jnp.arange(8.0), interpret=interpret)

  tree = {"w": jnp.asarray(x[: 96 * 128].reshape(96, 128)), "b": jnp.asarray(x[:128])}

  def on_mesh(fn, *trees):
    mesh = _one_device_mesh()
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P()))(*trees)

  def quantized_pmean():
    return on_mesh(lambda t: qsgd_jax.quantized_pmean(qsgd_jax.as_varying(t, AXIS), AXIS, q4,
                                                      jax.random.key(2),
                                                      min_compressed_size=1024), tree)

  def exchange():
    layout = sign_exchange.sign_layout([x.size, 100], 1)
    out = sign_exchange.exchange([jnp.asarray(x), jnp.asarray(x[:100])],
                                 jnp.zeros(layout.worker_error_shape().shape),
                                 jnp.zeros(layout.width), layout, None)
    return out.vectors, out.worker_error, out.server_error

  def optimizer(tx, steps=3):
    def run():
      step, params, state = _one_device_step(
          tx, tree, lambda p, i: jax.tree.map(lambda leaf: jnp.sin(leaf * i), p))
      for i in range(steps):
        params, state = step(params, state, jnp.float32(i + 1))
      return params
    return run

  return {
      "qsgd_4bit_encode": (qsgd_encode, True),
      "qsgd_4bit_decode": (qsgd_decode, True),
      "qsgd_4bit_fused_kernels": (qsgd_fused, True),
      "sign_pack_unpack_kernels": (sign_kernels, True),
      "quantized_pmean_two_phase": (quantized_pmean, True),
      "sign_exchange": (exchange, False),
      "onebit_adam": (optimizer(qsgd_jax.onebit_adam(1e-2, AXIS, freeze_step=1,
                                                     min_compressed_size=1024, axis_size=1)),
                      False),
      "zero_one_adam": (optimizer(qsgd_jax.zero_one_adam(
          1e-2, AXIS, var_freeze_step=1, local_step_clipper=1, min_compressed_size=1024,
          axis_size=1)), False),
      "powersgd": (optimizer(optax.chain(qsgd_jax.powersgd(AXIS, rank=2, start_iter=POWERSGD_START),
                                         optax.sgd(1e-2))), False),
      # Rank 4: LAPACK's QR on the CPU, Gram-Schmidt twice elsewhere (low_rank.orthogonalize).
      "powersgd_rank4": (optimizer(optax.chain(
          qsgd_jax.powersgd(AXIS, rank=4, start_iter=POWERSGD_START), optax.sgd(1e-2))), False),
  }


def run_check() -> dict:
  """Every check on the default device and on the CPU: equal bits, or the largest difference."""
  cpu = jax.devices("cpu")[0]
  results = {}
  for name, (program, exact) in _check_programs().items():
    outputs = {}
    for label, device in (("default", jax.devices()[0]), ("cpu", cpu)):
      with jax.default_device(device), jax.default_matmul_precision("highest"):
        try:
          outputs[label] = [np.asarray(leaf) for leaf in jax.tree.leaves(program())]
        except Exception as error:  # noqa: BLE001  (reported, and the other checks go on)
          outputs[label] = f"{type(error).__name__}: {str(error)[:300]}"
    if any(isinstance(value, str) for value in outputs.values()):
      results[name] = {"passed": False, "error": {
          label: value if isinstance(value, str) else "ran" for label, value in outputs.items()}}
      continue
    same_bits = all(a.shape == b.shape and a.tobytes() == b.tobytes()
                    for a, b in zip(outputs["default"], outputs["cpu"], strict=True))
    worst = max(float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)),
                             initial=0.0))
                for a, b in zip(outputs["default"], outputs["cpu"], strict=True))
    results[name] = {"exact_expected": exact, "same_bits": same_bits, "max_abs_difference": worst,
                     "passed": same_bits if exact else worst <= 1e-4}
  return results


def main(argv=None) -> None:
  args = parse_args(argv)
  device = jax.devices()[0]
  out = args.out or _ROOT / "benchmarks" / "results" / device.platform
  if args.small and args.out is None:
    out = out / "small"
  out.mkdir(parents=True, exist_ok=True)
  print(f"{device.device_kind} ({device.platform}), JAX {jax.__version__},"
        f" QSGD_JAX_PALLAS={os.environ.get('QSGD_JAX_PALLAS', 'off')}", flush=True)
  if args.check:
    results = run_check()
    for name, row in results.items():
      detail = row.get("error") or (f"same bits: {row['same_bits']}, largest difference"
                                    f" {row['max_abs_difference']:.3g}")
      print(f"{'PASS' if row['passed'] else 'FAIL'} {name}: {detail}")
    path = out / "accelerator_check.json"
    path.write_text(json.dumps({"device": device.device_kind, "jax": jax.__version__,
                                "checks": results}, indent=1) + "\n")
    print(f"wrote {path}")
    if not all(row["passed"] for row in results.values()):
      sys.exit("some checks failed")
    return
  start = time.perf_counter()
  record = run_benchmark(args)
  record["seconds"] = time.perf_counter() - start
  text = markdown(record)
  print(text)
  (out / "accelerator.json").write_text(json.dumps(record, indent=1) + "\n")
  (out / "accelerator.md").write_text(text)
  print(f"wrote {out / 'accelerator.json'} and accelerator.md ({record['seconds']:.0f} s)")


if __name__ == "__main__":
  main()
