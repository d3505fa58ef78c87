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

  python benchmarks/cost_model.py [--throughput-json PATH] [--out DIR]
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
  args = parser.parse_args()

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
