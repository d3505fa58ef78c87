"""Part 7 of ``network.py``: the language model on a hybrid mesh, its data axis over slow links.

``examples/lm/main.py --parallelism=hybrid --multihost`` on ``--lm-processes``
processes (2) of :data:`DEVICES_PER_PROCESS` CPU devices each, a node each
(``network_links.Nodes``): a ``("batch", "fsdp", "tensor")`` mesh of 2 x 2 x 2
whose data groups are the processes, the model sharded over ``fsdp`` and
``tensor`` by the example's logical axis rules inside each. Inside a process
its devices' collectives go over its node's own loopback, unshaped: the fast
links of a node. Across processes, over the data axis, they go over the
nodes' links to the switch, shaped: the slow link between nodes. Each run's
summary says which processes hold each data group's devices
(``data_group_processes``); ``jax.make_mesh`` gives each process a group of
its own.

The modes (:data:`MODES`): float32 AdamW as the compiler runs it (a plain
``jax.jit`` over the mesh, its float32 all-reduce of each device's shard
across the groups placed by XLA), the baseline; bfloat16 and 4-bit QSGD with
error feedback through ``qsgd_jax.data_parallel``, each device compressing
its own shard; 1-bit Adam, float32 until its freeze at step 40 and then each
device's shard's signs; and DiLoCo, a worker a data group, H = 20, its outer
gradients 4-bit QSGD with error feedback, for twice the steps.

Everything else is Part 5's (``network_lm.py``, whose machinery runs this
part): ``configs/network.py`` (6.6M parameters, one 64-byte sequence a data
group: a step much of which is its exchange), the whole run of every mode at
``--lm-rate`` (1 Gbit/s) a node, measured, and short runs at the other rates
(:data:`OTHER_RATES`: 100 Mbit/s, and the same processes on unshaped links,
the floor), from which the seconds to the float32 run's final smoothed
training loss are derived. The steps' arguments (``--lm-steps``,
``--lm-short-steps``, ``--lm-diloco-steps``, ``--lm-rate``) are Part 5's.
"""

import network_links
import network_lm

DEVICES_PER_PROCESS = 4
FSDP_DEVICES, TENSOR_DEVICES = 2, 2
FLAGS = ("--parallelism=hybrid", f"--config.fsdp_devices={FSDP_DEVICES}",
         f"--config.tensor_devices={TENSOR_DEVICES}")
# name: (what travels, the example's flags).
MODES = {
    "fp32": ("AdamW, float32 all-reduce placed by the compiler (jax.jit over the mesh)",
             ["--optimizer=adamw", "--average=fp32"]),
    "bf16": network_lm.MODES["bf16"],
    "qsgd4_ef": ("AdamW, 4-bit QSGD all-reduce with error feedback, each device its shard",
                 ["--optimizer=adamw", "--average=qsgd4_ef"]),
    "onebit_adam": network_lm.MODES["onebit_adam"],
    "diloco": (f"DiLoCo, a worker a data group, H = {network_lm.SYNC_EVERY}, 4-bit QSGD outer"
               " gradients with error feedback", network_lm.MODES["diloco"][1]),
}
QUICK_MODES = ("fp32", "qsgd4_ef")
OTHER_RATES = ("100 Mbit/s", network_lm.FREE_LINK)
QUICK_OTHER_RATES = ("100 Mbit/s",)
SLOW_RATE = "100 Mbit/s"
# Issue 44's targets, as network_lm.TARGETS: DiLoCo 5x sooner than float32 and at most 1.15x
# its own free-link run's seconds, 4-bit QSGD with error feedback 3x sooner, at 100 Mbit/s.
TARGETS = (("diloco", "fp32", SLOW_RATE, 5.0), ("diloco", network_lm.FREE_LINK, SLOW_RATE, 1.15),
           ("qsgd4_ef", "fp32", SLOW_RATE, 3.0))
# What the report keeps of each run's summary.json: the compiled step's bytes across the data
# axis and inside a group (the fewest and most a step sends), each device's memory, the groups.
SUMMARY_FIELDS = ("hlo_across_data_bytes_least", "hlo_across_data_bytes_most",
                  "hlo_inside_data_bytes_least", "hlo_inside_data_bytes_most",
                  "param_bytes_per_device", "state_bytes_per_device", "data_group_processes")


def add_arguments(parser) -> None:
  parser.add_argument("--hybrid-modes", nargs="+", choices=tuple(MODES), default=None,
                      help=f"part lm_hybrid's modes; default {tuple(MODES)}")
  parser.add_argument("--hybrid-rates", nargs="*", default=None,
                      help=f"part lm_hybrid's other rates a node, short runs; default "
                           f"{OTHER_RATES}")


def resolve_arguments(args, rates: dict) -> None:
  """The defaults of the part's arguments, fewer with ``--quick``."""
  args.hybrid_modes = tuple(args.hybrid_modes or (QUICK_MODES if args.quick else MODES))
  if args.hybrid_rates is None:
    args.hybrid_rates = QUICK_OTHER_RATES if args.quick else OTHER_RATES
  args.hybrid_rates = tuple(rate for rate in args.hybrid_rates if rate != args.lm_rate)
  for rate in args.hybrid_rates:
    if rate not in rates:
      raise ValueError(f"--hybrid-rates: {rate!r} is not one of {tuple(rates)}")


def part(args) -> network_lm.Part:
  """The part as ``args`` choose it, for ``network_lm.run``."""
  setup = (f"{args.lm_processes} processes of {DEVICES_PER_PROCESS} CPU devices, a node each: "
           f"a data group a process, the model sharded over its devices (fsdp {FSDP_DEVICES} x "
           f"tensor {TENSOR_DEVICES}, its node's own loopback), the data axis across the nodes' "
           "links (shaped). One sequence a data group a step.")
  return network_lm.Part(network_lm.CONFIG, {mode: MODES[mode] for mode in args.hybrid_modes},
                         TARGETS, args.hybrid_rates, FLAGS, setup, SUMMARY_FIELDS)


def link_description(denied: str | None) -> str:
  """How the part's processes were linked: nodes (``network_links.Nodes``), or why not."""
  if denied:
    return (f"No nodes: {denied}. Measured unthrottled only, every process on the host's"
            " loopback, its devices' collectives too.")
  return ("The links: a private network namespace a node (a process), each joined to a switch"
          " (a bridge in a namespace of its own) by a veth link of its own (MTU"
          f" {network_links.LOOPBACK_MTU}) that tc's token bucket filter limits to the per-node"
          " rate both ways; a node's own devices connect over its own loopback, unshaped. Not a"
          " real network: no propagation delay, no other traffic, and the links' copies, as the"
          " loopback's, run on the same cores as the processes.")


def table(report: dict, num_processes: int) -> str:
  """Part 5's tables, then what each mode's compiled step sends and holds on the mesh."""
  lines = [
      "", "What the compiled step sends a device, across the data axis (collectives whose groups"
      " span it: the nodes' links) and inside a data group (the node's loopback), the fewest"
      " and most a step; what a device holds; and the processes holding each data group's"
      " devices:", "",
      "| mode | MB across | vs fp32 | MB inside | param MB | state MB | groups' processes |",
      "|---|---|---|---|---|---|---|",
  ]
  fp32 = report["modes"].get("fp32", {}).get("summary", {}).get("hlo_across_data_bytes_most")
  for mode, entry in report["modes"].items():
    summary = entry["summary"]
    across, inside = (_bytes_range(summary[f"hlo_{where}_data_bytes_least"],
                                   summary[f"hlo_{where}_data_bytes_most"])
                      for where in ("across", "inside"))
    most = summary["hlo_across_data_bytes_most"]
    lines.append(
        f"| {mode} | {across} | {f'{fp32 / most:.1f}x fewer' if fp32 and most else '-'} "
        f"| {inside} | {summary['param_bytes_per_device'] / 1e6:.2f} "
        f"| {summary['state_bytes_per_device'] / 1e6:.2f} | {summary['data_group_processes']} |")
  lines += ["", "vs fp32 is against a step's most. DiLoCo's fewest is a step between syncs"
            " (nothing across), its most a sync; its bytes a step over a run are the first"
            " table's mean MB/step (a device's shard, as the optimizer counts them; the fp32"
            " run's all-reduce is the compiler's, which does not say)."]
  return ("\n" + report["link"] + "\n" + network_lm.table(report, num_processes)
          + "\n".join(lines) + "\n")


def _bytes_range(least: float, most: float) -> str:
  """Megabytes, ``least-most`` where they differ at the digits shown."""
  least_text, most_text = f"{least / 1e6:.3f}", f"{most / 1e6:.3f}"
  return least_text if least_text == most_text else f"{least_text}-{most_text}"
