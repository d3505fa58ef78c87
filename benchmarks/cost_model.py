"""An alpha-beta model of all-reduce time: where quantized all-reduce wins, and where it loses.

With ``p`` devices, a link of latency ``alpha`` (s) and bandwidth ``beta``
(bytes/s a device), and a gradient of ``N`` coordinates:

* float32 ring all-reduce: ``2 (p - 1) alpha + 2 (p - 1) / p * 4 N / beta``;
* bf16: the same with 2 bytes a coordinate, plus casting ``N`` values each way;
* two-phase quantized (``qsgd_jax.quantized_pmean``): an all-to-all and an
  all-gather of ``c`` bytes a coordinate, ``2 (p - 1) alpha + 2 (p - 1) / p *
  c N / beta``, plus the kernels: encode ``N (1 + 1/p)`` coordinates (all
  pieces, then the owned sum) and decode ``2 N`` (the ``p`` received pieces,
  then every gathered sum), at the measured or assumed throughputs.

The latency terms match, so compression wins exactly when the bytes it saves
cost more link time than its kernels take: when ``beta`` is below the
crossover ``beta* = 2 (p - 1) / p * (4 - c) / t``, with ``t`` the kernel
seconds a coordinate. Above it (fast NVLink, or slow kernels) it loses.

Link figures are round public numbers, effective per device; kernel speeds
are either measured here (``benchmarks/compressor_throughput.py`` on this
CPU) or assumed for an H100 at 60% of its 3.35 TB/s memory bandwidth (the
throughput goal) and at 10% (slow kernels); the GPU figures were not measured
in this project, which had no GPU.

``network_predictions`` checks the model against real processes:
``benchmarks/network.py`` measures the gradient average of N processes over a
loopback rate-limited by ``tc``, and this module predicts each of its times
(its Part 3). ``--network-json`` prints that comparison again from a saved
run.

  python benchmarks/cost_model.py [--throughput-json PATH] [--out DIR]
  python benchmarks/cost_model.py --network-json benchmarks/results/network_4proc.json
"""

import argparse
import dataclasses
import json
import pathlib


@dataclasses.dataclass(frozen=True)
class Link:
  name: str
  bandwidth: float  # bytes/s a device, effective.
  latency: float  # seconds a message.


LINKS = (
    Link("NVLink4 (H100 SXM)", 370e9, 3e-6),
    Link("PCIe Gen5 x16", 50e9, 5e-6),
    Link("InfiniBand NDR 400 Gb/s", 45e9, 8e-6),
    Link("100 GbE (RoCE)", 11e9, 20e-6),
    Link("TPU DCN (~50 Gb/s a chip)", 6e9, 50e-6),
)


@dataclasses.dataclass(frozen=True)
class Method:
  name: str
  bytes_per_coordinate: float
  encode_rate: float  # coordinates/s; inf where there is no kernel.
  decode_rate: float


MODELS = {"ResNet-50": 25_557_032, "GPT-2 small": 124_439_808}
_H100_BANDWIDTH = 3.35e12
# (name, wire bits a coordinate with its scales, key in compressor_throughput.json)
_COMPRESSED = (
    ("qsgd 4-bit", 4 + 32 / 512, "qsgd_4bit_bucket512_max"),
    ("qsgd 8-bit", 8 + 32 / 512, "qsgd_8bit_bucket512_max"),
    ("minmax 8-bit", 8.0, "minmax_8bit"),
    ("1-bit", 1 + 64 / 512, "onebit_bucket512"),
)


def _assumed_gpu_rate(bits: float, efficiency: float) -> float:
  """Coordinates/s at a fraction of H100 bandwidth: read 4 bytes, write bits/8 (or back)."""
  return efficiency * _H100_BANDWIDTH / (4 + bits / 8)


def assumed_gpu_methods(efficiency: float) -> list[Method]:
  """The methods with H100 kernels at ``efficiency`` of its memory bandwidth."""
  out = [Method("fp32", 4.0, float("inf"), float("inf"))]
  out.append(Method("bf16", 2.0, *(2 * (_assumed_gpu_rate(16, efficiency),))))
  out += [Method(name, bits / 8, *(2 * (_assumed_gpu_rate(bits, efficiency),)))
          for name, bits, _ in _COMPRESSED]
  return out


def measured_methods(throughput: dict) -> list[Method]:
  """The methods with kernel rates from ``compressor_throughput.py``'s JSON."""
  out = [Method("fp32", 4.0, float("inf"), float("inf"))]
  size = throughput["size"]
  results = throughput["results"]

  def rate(key, part):
    return size / (results[key][part]["ms"] / 1e3)

  out.append(Method("bf16", 2.0, rate("cast_bfloat16", "encode"), rate("cast_bfloat16", "decode")))
  out += [Method(name, bits / 8, rate(key, "encode"), rate(key, "decode"))
          for name, bits, key in _COMPRESSED]
  return out


def kernel_seconds_per_coordinate(method: Method, devices: int) -> float:
  if method.name == "fp32":
    return 0.0
  if method.name == "bf16":
    return 1 / method.encode_rate + 1 / method.decode_rate
  return (1 + 1 / devices) / method.encode_rate + 2 / method.decode_rate


def allreduce_seconds(method: Method, link: Link, devices: int, coordinates: int) -> float:
  share = 2 * (devices - 1) / devices
  wire = 2 * (devices - 1) * link.latency + share * method.bytes_per_coordinate * coordinates / (
      link.bandwidth)
  return wire + kernel_seconds_per_coordinate(method, devices) * coordinates


def crossover_bandwidth(method: Method, devices: int) -> float:
  """Link bandwidth (bytes/s) below which ``method`` beats a float32 all-reduce."""
  kernel = kernel_seconds_per_coordinate(method, devices)
  if kernel == 0.0:
    return float("inf")
  return 2 * (devices - 1) / devices * (4 - method.bytes_per_coordinate) / kernel


def predictions(method_list: list[Method], devices: int) -> list[dict]:
  rows = []
  for model, coordinates in MODELS.items():
    for link in LINKS:
      fp32 = allreduce_seconds(method_list[0], link, devices, coordinates)
      for method in method_list:
        seconds = allreduce_seconds(method, link, devices, coordinates)
        rows.append({
            "model": model, "link": link.name, "devices": devices, "method": method.name,
            "milliseconds": 1e3 * seconds, "speedup_vs_fp32": fp32 / seconds,
        })
  return rows


# Part 3 of network.py: the model against real processes over a rate-limited link.

# The compressor_throughput.json kernel that times each mode's compressor. There is
# no 2-bit kernel there: 2-bit QSGD is timed by the 4-bit one, which does the same work.
NETWORK_KERNELS = {
    "bf16": "cast_bfloat16",
    "qsgd2": "qsgd_4bit_bucket512_max",
    "qsgd4": "qsgd_4bit_bucket512_max",
    "qsgd8": "qsgd_8bit_bucket512_max",
    "minmax8": "minmax_8bit",
    "onebit": "onebit_bucket512",
    "decentralized8": "minmax_8bit",
}
TOLERANCE = 0.25


def network_kernel_seconds(mode: str, coordinates: int, devices: int, throughput: dict) -> float:
  """One-core seconds of the encodes and decodes one device runs in a call of ``mode``.

  ``mode`` is ``compressor/method`` as in ``network_worker.MODES``. Two-phase
  encodes its ``p`` pieces and its owned sum (``N (1 + 1/p)`` coordinates) and
  decodes the ``p`` received pieces and the gathered sums (``2 N``); the
  shared-scale psum encodes and decodes ``N`` once each; the all-gather
  method encodes ``N`` once and decodes all ``p`` gathered payloads; the ring
  encodes its difference once and decodes its own and both neighbours'
  (``3 N``). A ``/wire_only`` mode runs none.
  """
  compressor, _, method = mode.partition("/")
  # A float32 pmean runs no kernel of ours, nor do a method's collectives alone.
  if compressor not in NETWORK_KERNELS or method.endswith("/wire_only"):
    return 0.0
  results, size = throughput["results"][NETWORK_KERNELS[compressor]], throughput["size"]
  encode = results["encode"]["ms"] / 1e3 / size
  decode = results["decode"]["ms"] / 1e3 / size
  per_coordinate = {"two_phase": (1 + 1 / devices) * encode + 2 * decode,
                    "psum": encode + decode,
                    "all_gather": encode + devices * decode,
                    "ring": encode + 3 * decode}
  if method not in per_coordinate:
    raise ValueError(f"network_kernel_seconds: no kernel count for method {method!r} of mode"
                     f" {mode!r}; add it to per_coordinate (one of {tuple(per_coordinate)}).")
  return per_coordinate[method] * coordinates


def _latency(entry: dict, rate: dict) -> float:
  """A program's fixed cost (the one-leaf probe's call) and the latency of its other gloo calls."""
  return (rate["one_call_program_seconds"]
          + max(0, entry["gloo_calls"] - 1) * rate["gloo_call_seconds"])


def network_predictions(report: dict, throughput: dict, devices: int, cores: int) -> list[dict]:
  """Each measured time of ``network.py``'s Part 1, predicted three ways.

  * ``alpha_beta``: this module's model as it stood, latency left out: the
    HLO's bytes over the nominal per-node rate, plus the kernels at their
    one-core rates.
  * ``refined``: the bytes counted on the link over the rate a bulk TCP
    transfer reached on it (the loopback's own speed caps the fast rates),
    the kernels slowed by the ``devices / cores`` processes a core, and the
    latency probe's figures: what a program with one gloo call costs, and
    one more call's latency for each further call the program makes.
  * ``calibrated``: the refined model with the kernels' time replaced by
    the compute the unthrottled measurement of the same mode shows (its
    time less its link time and latency there): the kernels and the rest of
    the library's work, taken to be the same at every rate. The unthrottled
    rows are its calibration, not predictions.

  Args:
    report: ``network.py``'s ``collectives`` report.
    throughput: ``compressor_throughput.py``'s JSON (one-core kernel rates).
    devices: processes, one device each.
    cores: the machine's cores, shared by the processes.

  Returns:
    One dict a (tree, rate, mode): the measurement, each prediction and its
    relative error, and the terms of the refined model.
  """
  sharing = max(1.0, devices / cores)
  rows = []
  for tree_name, tree in report["trees"].items():
    calibration = tree["rates"].get("unthrottled")
    for rate_name, rate in tree["rates"].items():
      bulk = rate["link"]["bytes_per_second"] / devices  # A node's share of what TCP reached.
      nominal = bulk if rate["bits_per_second_per_node"] is None else (
          rate["bits_per_second_per_node"] / 8)
      effective = min(nominal, bulk)
      for mode, entry in rate["modes"].items():
        kernels = network_kernel_seconds(mode, tree["parameters"], devices, throughput)
        link_bytes = entry["link_bytes_sent"] or entry["hlo_bytes_sent"]
        terms = {"link": link_bytes / effective, "kernels": kernels * sharing,
                 "latency": _latency(entry, rate)}
        row = {
            "tree": tree_name, "rate": rate_name, "mode": mode, "measured": entry["seconds"],
            "alpha_beta": entry["hlo_bytes_sent"] / nominal + kernels,
            "refined": sum(terms.values()), "terms": terms,
            "hlo_bytes": entry["hlo_bytes_sent"], "link_bytes": link_bytes,
            "nominal_bytes_per_second": nominal, "effective_bytes_per_second": effective,
            "gloo_calls": entry["gloo_calls"], "gloo_call_seconds": rate["gloo_call_seconds"],
            "one_call_program_seconds": rate["one_call_program_seconds"], "sharing": sharing,
        }
        if calibration is not None and rate_name != "unthrottled":
          reference = calibration["modes"][mode]
          reference_link = ((reference["link_bytes_sent"] or reference["hlo_bytes_sent"])
                            / (calibration["link"]["bytes_per_second"] / devices))
          compute = max(0.0, reference["seconds"] - reference_link
                        - _latency(reference, calibration))
          row["compute_measured"] = compute
          row["calibrated"] = terms["link"] + terms["latency"] + compute
        for model in ("alpha_beta", "refined", "calibrated"):
          if model in row:
            row[f"{model}_error"] = row[model] / row["measured"] - 1
        rows.append(row)
  return rows


def network_markdown(rows: list[dict]) -> str:
  """The predictions beside the measurements, and what the simpler models got wrong."""
  models = ("alpha_beta", "refined", "calibrated")
  lines = ["Predicted seconds, and the error against the measured median (** beyond"
           f" {TOLERANCE:.0%}):", "",
           "| tree | rate | mode | measured | alpha-beta | refined | calibrated"
           " | link + kernels + latency (refined) |",
           "|---|---|---|---|---|---|---|---|"]
  for row in rows:
    cells = [row["tree"], row["rate"], row["mode"], f"{row['measured']:.3f}"]
    for model in models:
      if model not in row:
        cells.append("(calibration)" if model == "calibrated" else "-")
        continue
      error = row[f"{model}_error"]
      mark = "**" if abs(error) > TOLERANCE else ""
      cells.append(f"{mark}{row[model]:.3f} ({error:+.0%}){mark}")
    terms = row["terms"]
    cells.append(f"{terms['link']:.3f} + {terms['kernels']:.3f} + {terms['latency']:.3f}")
    lines.append("| " + " | ".join(cells) + " |")
  lines += ["", "Rows within the tolerance, of those predicted:", ""]
  for model in models:
    errors = [abs(row[f"{model}_error"]) for row in rows if f"{model}_error" in row]
    within = sum(error <= TOLERANCE for error in errors)
    lines.append(f"- {model}: {within} of {len(errors)}; median error"
                 f" {sorted(errors)[len(errors) // 2]:.0%}" if errors else f"- {model}: none")
  lines += ["", *_network_diagnosis(rows)]
  return "\n".join(lines) + "\n"


def _median(values: list[float]) -> float:
  values = sorted(values)
  return values[len(values) // 2]


def _network_diagnosis(rows: list[dict]) -> list[str]:
  """What each refinement corrects, in this run's figures."""
  out = ["What the alpha-beta model gets wrong, and what the refinements add:", ""]
  capped: dict[str, list[float]] = {}
  for row in rows:
    if row["effective_bytes_per_second"] < 0.9 * row["nominal_bytes_per_second"]:
      capped.setdefault(row["rate"], []).append(8e-9 * row["effective_bytes_per_second"])
  if capped:
    rates = ", ".join(f"{rate} (it reached {min(g):.2f} to {max(g):.2f} Gbit/s a node)"
                      for rate, g in capped.items())
    out.append(f"- Link rate: at {rates} the loopback itself, its copies running on the shared"
               " cores, carried less than tc allows; the refined model takes the rate a bulk TCP"
               " transfer reached.")
  ratios = [row["link_bytes"] / row["hlo_bytes"] for row in rows if row["hlo_bytes"]]
  out.append(f"- Bytes: the loopback carried {_median(ratios):.3f}x the HLO's ring accounting"
             f" (median; from {min(ratios):.3f}x to {max(ratios):.3f}x, the extremes on calls of"
             " tens of kilobytes, where headers, acknowledgements and the barriers' own bytes"
             " weigh most). Bytes are not what the model misses.")
  probes = {}
  for row in rows:
    probes.setdefault(row["rate"], (row["one_call_program_seconds"], row["gloo_call_seconds"]))
  worst = max(rows, key=lambda row: row["terms"]["latency"])
  out.append("- Latency: a program with one gloo call took "
             + ", ".join(f"{1e3 * program:.1f} ms and each further call {1e3 * call:.2f} ms at"
                         f" {rate}" for rate, (program, call) in probes.items())
             + " (the probe). XLA's CPU all-reduce of a tuple calls gloo once an operand:"
             f" {worst['mode']} on {worst['tree']} makes {worst['gloo_calls']} calls,"
             f" {worst['terms']['latency']:.3f} s at {worst['rate']}.")
  out.append(f"- CPU sharing: {rows[0]['sharing']:g} processes a core, so every kernel runs that"
             " much slower than on the one core compressor_throughput.py measured it on.")
  by_mode: dict[str, list[float]] = {}
  for row in rows:
    if row.get("compute_measured") is not None and row["terms"]["kernels"]:
      by_mode.setdefault(row["mode"], []).append(row["compute_measured"] / row["terms"]["kernels"])
  if by_mode:
    factors = ", ".join(f"{mode} {_median(f):.1f}x" for mode, f in by_mode.items())
    out.append("- Compute beyond the kernels: measured unthrottled, the compressed modes spend"
               f" these multiples of their kernels' time, CPU sharing included: {factors}. The"
               " library's step does more than encode and decode (padding, grouping, copies, the"
               " float32 psum of small leaves), and gloo's copies take the same cores; the"
               " calibrated model takes the compute from that measurement.")
  return out


def _markdown(rows: list[dict], method_list: list[Method], devices: int, title: str) -> str:
  names = [m.name for m in method_list]
  lines = [f"### {title} ({devices} devices): all-reduce ms (speedup over fp32)", "",
           "| model | link | " + " | ".join(names) + " |",
           "| --- | --- | " + " | ".join("---" for _ in names) + " |"]
  for model in MODELS:
    for link in LINKS:
      cells = []
      for name in names:
        row = next(r for r in rows
                   if r["model"] == model and r["link"] == link.name and r["method"] == name)
        cells.append(f"{row['milliseconds']:.2f} ({row['speedup_vs_fp32']:.2f}x)")
      lines.append(f"| {model} | {link.name} | " + " | ".join(cells) + " |")
  lines += ["", "Crossover: compression wins below these link bandwidths (GB/s a device):", "",
            "| method | crossover GB/s |", "| --- | --- |"]
  for method in method_list[1:]:
    lines.append(f"| {method.name} | {crossover_bandwidth(method, devices) / 1e9:.1f} |")
  return "\n".join(lines) + "\n"


def _plot(method_lists: dict[str, list[Method]], devices: int, path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  bandwidths = np.logspace(9, 12, 60)
  fig, axes = plt.subplots(1, len(method_lists), figsize=(6 * len(method_lists), 4.5),
                           squeeze=False)
  for ax, (title, method_list) in zip(axes[0], method_lists.items(), strict=True):
    for method in method_list:
      times = [allreduce_seconds(method, Link("", b, 5e-6), devices, MODELS["ResNet-50"])
               for b in bandwidths]
      ax.loglog(bandwidths / 1e9, np.array(times) * 1e3, label=method.name)
    for link in LINKS:
      ax.axvline(link.bandwidth / 1e9, color="gray", alpha=0.3)
      ax.text(link.bandwidth / 1e9, ax.get_ylim()[1], link.name.split(" (")[0], rotation=90,
              fontsize=6, va="top")
    ax.set_xlabel("link bandwidth, GB/s a device")
    ax.set_ylabel("ResNet-50 all-reduce, ms")
    ax.set_title(f"{title}, {devices} devices")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=130)
  plt.close(fig)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--throughput-json", type=pathlib.Path,
                      default=pathlib.Path("benchmarks/results/compressor_throughput_4194304.json"),
                      help="output of compressor_throughput.py (measured kernel rates)")
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
  parser.add_argument("--network-json", type=pathlib.Path, default=None,
                      help="a network.py report: print its measurements against the model, only")
  args = parser.parse_args()

  if args.network_json is not None:
    network = json.loads(args.network_json.read_text())
    rows = network_predictions(network["collectives"], json.loads(args.throughput_json.read_text()),
                               network["processes"], network["cpu_count"])
    print(network_markdown(rows))
    return

  method_lists = {
      "H100 kernels at 60% of memory bandwidth (assumed)": assumed_gpu_methods(0.6),
      "H100 kernels at 10% of memory bandwidth (assumed, slow)": assumed_gpu_methods(0.1),
  }
  if args.throughput_json.exists():
    measured = json.loads(args.throughput_json.read_text())
    kind = measured.get("device_kind", "cpu")
    title = "CPU kernels measured here" if kind == "cpu" else f"{kind} kernels measured"
    method_lists[title] = measured_methods(measured)
  else:
    print(f"({args.throughput_json} not found: run compressor_throughput.py for measured rates)")

  args.out.mkdir(parents=True, exist_ok=True)
  report, record = [], {}
  for title, method_list in method_lists.items():
    rows = predictions(method_list, args.devices)
    record[title] = {
        "methods": [dataclasses.asdict(m) for m in method_list],
        "predictions": rows,
        "crossover_gb_per_s": {m.name: crossover_bandwidth(m, args.devices) / 1e9
                               for m in method_list[1:]},
    }
    report.append(_markdown(rows, method_list, args.devices, title))
  text = "\n".join(report)
  print(text)
  (args.out / "cost_model.md").write_text(text)
  (args.out / "cost_model.json").write_text(json.dumps(record, indent=2) + "\n")
  _plot(method_lists, args.devices, args.out / "cost_model.png")
  print(f"wrote {args.out / 'cost_model.md'}, cost_model.json and cost_model.png")


if __name__ == "__main__":
  main()
