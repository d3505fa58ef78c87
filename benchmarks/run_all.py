"""Runs the benchmark suite and writes ``SUMMARY.md`` beside the JSON and PNG results.

Each script also runs alone; this runs them in turn (each in its own process,
so each sets up JAX its own way), keeps what each printed, and writes a
markdown summary with the command that reproduces every section. The kernel
throughputs are measured on one core (``taskset -c 0`` and single-threaded
XLA, where ``taskset`` exists), so they do not depend on the machine's size.

With ``--platform gpu`` (or ``tpu``) the compressor throughput runs on the
accelerator instead, on a 1 GiB array (larger than any cache), and reports
encode and decode traffic as a fraction of the device's memory bandwidth; the
cost model then predicts with those measured rates. The collectives and the
error-feedback study need 8 devices and stay on simulated CPU devices. The
network benchmark runs 4 CPU processes over gloo; it needs root to create the
network namespace whose loopback it rate-limits, and without it measures
unthrottled only. Its cost model uses the CPU kernel
rates of ``--out`` (or of ``benchmarks/results``).

  python benchmarks/run_all.py                   # the full sizes, for the record
  python benchmarks/run_all.py --quick           # small sizes, a quick look
  python benchmarks/run_all.py --platform gpu    # kernels on the accelerator
"""

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import time

_HERE = pathlib.Path(__file__).resolve().parent

# (title, script, on one core, arguments at full size, arguments for --quick);
# "{out}" is the output folder, "{platform}" the --platform, "{size}" the
# throughput's array size at full size and "{suffix}" its JSON's name suffix.
SUITE = (
    ("Compressor throughput (one host core)", "compressor_throughput.py", True,
     ["--size", "{size}", "--platform", "{platform}"],
     ["--size", "1048576", "--repeats", "5", "--platform", "{platform}"]),
    ("Elias codec: throughput and bits a coordinate (one CPU core)", "elias_codec.py", True,
     ["--size", "1000000"], ["--size", "100000"]),
    ("Statistical quality: bits against variance", "variance.py", False,
     ["--size", "1048576", "--keys", "32"], ["--size", "65536", "--keys", "8"]),
    ("Wire bytes from the HLO and step times (8 simulated CPU devices)", "collectives.py", False,
     [], ["--small"]),
    ("The compressed step's own cost, stage by stage (2 simulated CPU devices)",
     "step_cost.py", False, [], ["--width-divisor", "4", "--repeats", "3"]),
    ("Error feedback for 1-bit SGD on digits", "error_feedback.py", False, [],
     ["--seeds", "2", "--steps", "100"]),
    ("Decentralized SGD on digits: Bagua's quantizer against stochastic min-max",
     "decentralized.py", False, [], ["--seeds", "2", "--steps", "100"]),
    ("Compressed Adam on digits: bytes a step before and after the freeze",
     "compressed_adam_bytes.py", False, [], ["--steps", "60", "--freeze-step", "20"]),
    ("Compressed Adam: what a step computes against AdamW (2 simulated CPU devices)",
     "compressed_adam_step.py", False, [], ["--repeats", "3"]),
    ("Compressed Adam on a small batch: the freeze, the clipping or the bits (2 simulated CPU "
     "devices)", "freeze_or_compression.py", False, ["--seeds", "0", "1", "2"],
     ["--modes", "adamw", "frozen_variance"]),
    ("PowerSGD's orthogonalization at GPT-2 small's factors: QR against Gram-Schmidt",
     "orthogonalize.py", False, ["--out", "{out}/orthogonalize.json"],
     ["--small", "--repeats", "2", "--out", "{out}/orthogonalize.json"]),
    ("Error of the mean against bytes, by reduction method", "reduction_methods.py", False,
     [], ["--size", "65536", "--keys", "4"]),
    ("Alpha-beta cost model", "cost_model.py", False,
     ["--throughput-json", "{out}/compressor_throughput_{size}{suffix}.json"],
     ["--throughput-json", "{out}/compressor_throughput_1048576{suffix}.json"]),
    ("Real processes over a rate-limited link (gloo, a network namespace shaped by tc)",
     "network.py", False, [], ["--quick"]),
)
# With --platform gpu or tpu, also every family on the accelerator (its kernels, steps and
# cost model, in benchmarks/results/<platform>/accelerator.md).
ACCELERATOR = ("Every family on the accelerator: kernels, the 1-bit exchange, PowerSGD, steps",
               "accelerator.py", False, [], ["--small"])
ONE_CORE_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small sizes")
  parser.add_argument("--platform", choices=("cpu", "gpu", "tpu"), default="cpu",
                      help="where the compressor throughput runs (default: cpu)")
  parser.add_argument("--out", type=pathlib.Path, default=None,
                      help="default: benchmarks/results[/PLATFORM][/quick]")
  args = parser.parse_args()
  if args.out is None:
    args.out = _HERE / "results"
    if args.platform != "cpu":
      args.out /= args.platform
    if args.quick:
      args.out /= "quick"
  args.out.mkdir(parents=True, exist_ok=True)
  environment = dict(os.environ)
  environment["PYTHONPATH"] = os.pathsep.join(
      filter(None, [str(_HERE.parent), environment.get("PYTHONPATH")]))

  on_cpu = args.platform == "cpu"
  fields = {"platform": args.platform, "size": 4_194_304 if on_cpu else 268_435_456,
            "suffix": "" if on_cpu else f"_{args.platform}"}
  options = (" --quick" if args.quick else "") + ("" if on_cpu else f" --platform {args.platform}")
  sections = ["# Benchmark results", "", f"Made by `python benchmarks/run_all.py{options}`.", ""]
  failed = []
  shown_out = os.path.relpath(args.out, _HERE.parent)
  pin = bool(shutil.which("taskset"))
  for title, script, one_core, full, quick in SUITE + (() if on_cpu else (ACCELERATOR,)):
    arguments = quick if args.quick else full
    command = [sys.executable, str(_HERE / script),
               *(a.format(out=args.out, **fields) for a in arguments), "--out", str(args.out)]
    shown = " ".join(["python", f"benchmarks/{script}",
                      *(a.format(out=shown_out, **fields) for a in arguments),
                      "--out", shown_out])
    script_environment = environment
    if one_core and pin:
      command = ["taskset", "-c", "0", *command]
      shown = f'XLA_FLAGS="{ONE_CORE_XLA_FLAGS}" taskset -c 0 {shown}'
      script_environment = dict(environment, XLA_FLAGS=ONE_CORE_XLA_FLAGS)
    print(f"== {title}: {shown}", flush=True)
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=script_environment,
                            check=False)
    seconds = time.perf_counter() - start
    print(result.stdout, flush=True)
    if result.returncode:
      failed.append(script)
      print(result.stderr[-4000:], file=sys.stderr, flush=True)
    sections += [f"## {title}", "", f"`{shown}` ({seconds:.0f} s"
                 + (f", exit code {result.returncode}" if result.returncode else "") + ")",
                 "", "```", result.stdout.strip(), "```", ""]
  plots = sorted(p.name for p in args.out.glob("*.png"))
  sections += ["## Plots", ""] + [f"![{name}]({name})" for name in plots] + [""]
  (args.out / "SUMMARY.md").write_text("\n".join(sections))
  print(f"wrote {args.out / 'SUMMARY.md'}; python benchmarks/figures.py remakes the README's"
        " table and the site's figures from benchmarks/results")
  if failed:
    sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
  main()
