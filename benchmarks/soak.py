"""Does a long multi-process run survive lost processes, and lose nothing but time?

The ImageNet-style example (``examples/imagenet/main.py --multihost``) trains
``--processes`` processes (one CPU device each, gloo) for ``--steps`` steps
with compressed gradient averaging (1-bit SGD by default: error-feedback
residuals in every checkpoint), checkpointing every ``--checkpoint-every``
steps, twice:

1. uninterrupted, the reference;
2. under a small supervisor that, at random times (``--faults`` of them, each
   a uniform ``--kill-after`` seconds after the run is training again), sends
   a random process SIGKILL or SIGSTOP (``--signals``), waits for the others
   to end (by ``qsgd_jax.initialize_distributed``'s watch: status 75 and one
   line naming the lost process; a killed process 0 ends them through JAX's
   own abort), kills a stopped one, and starts them all again in the same
   workdir, where the run resumes from its newest checkpoint that passes
   verification. Any other failure (status 1: a non-finite loss, no good
   checkpoint) ends the benchmark.

It prints, for each fault, the process and signal, the step the run had
logged, the step it resumed from, the seconds until the others had ended, and
the time lost: from the fault until the resumed run logged that step again. Last,
it compares the final checkpoints of both runs, every array bit for bit, and
exits with status 1 if they differ.

Usage::

  python benchmarks/soak.py                           # 3 processes x 2,000 steps, 3 faults
  python benchmarks/soak.py --steps 200 --faults 2    # a quick one
"""

import argparse
import contextlib
import ctypes
import json
import os
import pathlib
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

_ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = "examples/imagenet/configs/digits.py"
# Exit statuses after which the supervisor starts the run again: the watch's, SIGKILL's
# (the process it killed) and SIGABRT's (JAX's own abort when process 0 is the one lost).
RESTARTABLE = (75, -signal.SIGKILL, -signal.SIGABRT)


def _free_port() -> int:
  with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    return probe.getsockname()[1]


def _die_with_parent() -> None:
  """In the child before exec: SIGKILL it if the supervisor dies (prctl PR_SET_PDEATHSIG)."""
  ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def _environment() -> dict[str, str]:
  flags = [flag for flag in os.environ.get("XLA_FLAGS", "").split()
           if not flag.startswith("--xla_force_host_platform_device_count")]
  flags.append("--xla_force_host_platform_device_count=1")
  path = os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))
  return dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu", PYTHONPATH=path)


def _log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


class Run:
  """The example's processes in one workdir, started as often as it takes."""

  def __init__(self, args, workdir: pathlib.Path):
    self.args = args
    self.workdir = workdir
    self.launches = 0

  def start(self) -> list[subprocess.Popen]:
    self.launches += 1
    logs = self.workdir / "logs" / f"launch{self.launches}"
    logs.mkdir(parents=True, exist_ok=True)
    address = f"127.0.0.1:{_free_port()}"
    overrides = [f"--config.{setting}" for setting in (
        f"compression={self.args.compression}", f"num_train_steps={self.args.steps}",
        f"checkpoint_every_steps={self.args.checkpoint_every}", "log_every_steps=1",
        f"eval_every_steps={self.args.steps}", f"batch_size={32 * self.args.processes}")]
    processes = []
    for process_id in range(self.args.processes):
      with open(logs / f"process{process_id}.log", "wb") as log:
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "examples.imagenet.main", f"--config={CONFIG}", *overrides,
             f"--workdir={self.workdir}", "--multihost", f"--coordinator_address={address}",
             f"--num_processes={self.args.processes}", f"--process_id={process_id}",
             f"--failure_timeout={self.args.failure_timeout}"],
            stdout=log, stderr=subprocess.STDOUT, env=_environment(), cwd=_ROOT,
            start_new_session=True, preexec_fn=_die_with_parent))
    return processes

  def first_step(self) -> int | None:
    """The step this launch trains from, once process 0 has said so (its checkpoint's)."""
    log = self.workdir / "logs" / f"launch{self.launches}" / "process0.log"
    found = re.search(r"Training from step (\d+)", log.read_text(errors="replace"))
    return int(found.group(1)) if found else None

  def logged_step(self) -> int:
    """The last training step in ``metrics.jsonl`` (0 before the first)."""
    path = self.workdir / "metrics.jsonl"
    if not path.exists():
      return 0
    steps = [0]
    for line in path.read_text().splitlines():
      with contextlib.suppress(ValueError):
        record = json.loads(line)
        if "loss" in record:
          steps.append(record["step"])
    return steps[-1]

  def log_tail(self, process_id: int) -> str:
    log = self.workdir / "logs" / f"launch{self.launches}" / f"process{process_id}.log"
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return "\n".join(lines[-15:])


def _wait(processes, timeout: float) -> list[int] | None:
  """Every process's exit status, or ``None`` if one still runs after ``timeout`` seconds."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if all(p.poll() is not None for p in processes):
      return [p.returncode for p in processes]
    time.sleep(0.05)
  return None


def _stop(processes) -> None:
  for process in processes:
    if process.poll() is None:
      os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def uninterrupted(args, workdir: pathlib.Path) -> float:
  run = Run(args, workdir)
  start = time.monotonic()
  processes = run.start()
  try:
    codes = _wait(processes, args.timeout)
  finally:
    _stop(processes)
  if codes != [0] * args.processes:
    raise SystemExit(f"the uninterrupted run failed ({codes}):\n{run.log_tail(0)}")
  return time.monotonic() - start


def with_faults(args, workdir: pathlib.Path, rng: random.Random) -> tuple[float, list[dict]]:
  """Runs to the end, killing a process ``args.faults`` times; returns seconds and faults."""
  run = Run(args, workdir)
  start, faults, catching_up = time.monotonic(), [], None
  while True:
    processes = run.start()
    delay = rng.uniform(*args.kill_after) if len(faults) < args.faults else None
    resumed_from, training_since = None, None
    try:
      while all(p.poll() is None for p in processes):
        time.sleep(0.05)
        now = time.monotonic()
        if resumed_from is None:  # Until the run has restored its checkpoint.
          resumed_from = run.first_step()
          if resumed_from is not None and catching_up is not None:
            catching_up["resumed_from"] = resumed_from
          continue
        step = run.logged_step()
        if step <= resumed_from:
          continue
        training_since = training_since or now
        if catching_up is not None and step >= catching_up["step"]:
          catching_up["seconds_lost"] = now - catching_up["killed_at"]
          catching_up = None
        if delay is not None and now >= training_since + delay:
          victim, how = rng.randrange(args.processes), rng.choice(args.signals)
          os.killpg(processes[victim].pid, getattr(signal, f"SIG{how}"))
          survivors = [p for i, p in enumerate(processes) if i != victim]
          if _wait(survivors, args.timeout) is None:
            raise SystemExit(f"processes still running {args.timeout:.0f} s after process "
                             f"{victim} got SIG{how}:\n"
                             f"{run.log_tail((victim + 1) % args.processes)}")
          ended = time.monotonic() - now
          os.killpg(processes[victim].pid, signal.SIGKILL)  # A stopped one never ends.
          codes = _wait(processes, args.timeout)
          said = re.findall(r"qsgd_jax: process .*", run.log_tail((victim + 1) % args.processes))
          catching_up = {"process": victim, "signal": how, "step": step, "killed_at": now,
                         "all_ended_seconds": ended, "exit_codes": codes,
                         "survivor_said": said[-1] if said else "(no line from the watch)"}
          faults.append(catching_up)
          _log(f"fault {len(faults)}: SIG{how} to process {victim} at step {step}; the others "
               f"ended in {ended:.1f} s ({codes})")
          break
      codes = _wait(processes, args.timeout)
    finally:
      _stop(processes)
    if codes == [0] * args.processes:
      return time.monotonic() - start, faults
    if codes is None or any(code not in (0, *RESTARTABLE) for code in codes):
      failed = next((i for i, code in enumerate(codes or []) if code not in (0, *RESTARTABLE)),
                    0)
      raise SystemExit(f"the run failed ({codes}), not restarting:\n{run.log_tail(failed)}")
    _log(f"launch {run.launches} ended with {codes}; starting again")


def final_state(workdir: pathlib.Path, step: int):
  """The checkpoint of ``step`` in ``workdir``, every array on this process's one device."""
  import jax
  import orbax.checkpoint as ocp

  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  with ocp.CheckpointManager((workdir / "checkpoints").absolute(),
                             item_handlers=ocp.StandardCheckpointHandler()) as manager:
    metadata = manager.item_metadata(step)
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                          metadata)
    return jax.device_get(manager.restore(step, args=ocp.args.StandardRestore(target)))


def identical(first, second) -> list[str]:
  """The paths of the arrays that differ (bit for bit) between two checkpoints."""
  import jax
  import numpy as np

  def raw(x):
    return np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x)

  left = dict(jax.tree_util.tree_flatten_with_path(first)[0])
  right = dict(jax.tree_util.tree_flatten_with_path(second)[0])
  if left.keys() != right.keys():
    return ["the trees differ"]
  return [jax.tree_util.keystr(path) for path in left
          if raw(left[path]).tobytes() != raw(right[path]).tobytes()]


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--processes", type=int, default=3)
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--checkpoint-every", type=int, default=50)
  parser.add_argument("--faults", type=int, default=3)
  parser.add_argument("--kill-after", type=float, nargs=2, default=(5.0, 40.0),
                      metavar=("LOW", "HIGH"),
                      help="seconds of training before a kill, drawn uniformly")
  parser.add_argument("--signals", nargs="+", choices=("KILL", "STOP"), default=["KILL", "STOP"],
                      help="what a fault sends the process, drawn at random: SIGKILL, or SIGSTOP"
                           " (then SIGKILL once the others have ended)")
  parser.add_argument("--compression", default="onebit")
  parser.add_argument("--failure-timeout", type=float, default=10.0)
  parser.add_argument("--timeout", type=float, default=1800,
                      help="seconds a launch may run, or its processes take to end after a kill")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--workdir", type=pathlib.Path, default=None,
                      help="where both runs go (default: a new temporary directory)")
  return parser.parse_args(argv)


def main(argv=None) -> None:
  args = parse_args(argv)
  work = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="qsgd_jax_soak_"))
  _log(f"workdirs, checkpoints and logs under {work}")
  reference_seconds = uninterrupted(args, work / "uninterrupted")
  _log(f"uninterrupted: {args.steps} steps in {reference_seconds:.0f} s")
  seconds, faults = with_faults(args, work / "faults", random.Random(args.seed))
  differing = identical(final_state(work / "uninterrupted", args.steps),
                        final_state(work / "faults", args.steps))

  print(f"\n{args.processes} processes x {args.steps} steps of {CONFIG} ({args.compression}),"
        f" a checkpoint every {args.checkpoint_every} steps, failure timeout"
        f" {args.failure_timeout:g} s; load average {os.getloadavg()[0]:.1f}.")
  print("\n| fault | process | signal | at step | resumed from | others ended in s | exit codes"
        " | time lost s |\n|---|---|---|---|---|---|---|---|")
  for number, fault in enumerate(faults, start=1):
    lost = fault.get("seconds_lost")
    print(f"| {number} | {fault['process']} | SIG{fault['signal']} | {fault['step']}"
          f" | {fault.get('resumed_from', '-')} | {fault['all_ended_seconds']:.1f}"
          f" | {fault['exit_codes']} | {'-' if lost is None else f'{lost:.1f}'} |")
  print(f"\nSurvived {len(faults)} faults. Uninterrupted: {reference_seconds:.0f} s; with the"
        f" faults: {seconds:.0f} s ({seconds - reference_seconds:+.0f} s).")
  for fault in faults:
    print(f"  SIG{fault['signal']} to process {fault['process']}: {fault['survivor_said']}")
  if differing:
    print(f"The final states differ: {', '.join(differing[:10])}.")
    raise SystemExit(1)
  print("The final states are identical, bit for bit (params, BatchNorm statistics, optimizer"
        " state with its residuals and key, step).")


if __name__ == "__main__":
  main()
