"""qsgd_jax.initialize_distributed: a lost process ends the run, fast, with one line.

The watch's rules run first against an in-memory key-value store (threads, no
JAX processes); then three real processes, one killed.
"""

import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import pytest

import qsgd_jax
from qsgd_jax._src import distributed

_WORKER = pathlib.Path(__file__).with_name("fault_worker.py")
# Long enough that on a loaded machine (the suite on 2 cores) every thread runs within it.
_TIMEOUT = 1.0


class _Store:
  """The coordination service's key-value store, in memory; ``reachable`` turns it off."""

  def __init__(self):
    self.values: dict[str, str] = {}
    self.reachable = True
    self.lock = threading.Lock()

  def key_value_set(self, key, value, allow_overwrite=False):
    del allow_overwrite
    self._check()
    with self.lock:
      self.values[key] = value

  def key_value_dir_get(self, directory):
    self._check()
    with self.lock:
      return [(key, value) for key, value in self.values.items() if key.startswith(directory)]

  def _check(self):
    if not self.reachable:
      raise RuntimeError("UNAVAILABLE: Socket closed")


class _Exits:
  """Records the exit statuses a watch asks for, instead of exiting."""

  def __init__(self):
    self.codes: list[int] = []
    self.done = threading.Event()

  def __call__(self, code):
    self.codes.append(code)
    self.done.set()


def _watch(store, process_id, num_processes=2):
  exits = _Exits()
  watch = qsgd_jax.ProcessWatch(store, process_id, num_processes, _TIMEOUT, exit_fn=exits)
  return watch, exits


def test_a_silent_process_is_lost_after_the_timeout(capfd):
  store = _Store()
  watch, exits = _watch(store, 0)
  start = time.monotonic()
  with watch:  # Process 1 never beats.
    assert exits.done.wait(10 * _TIMEOUT)
    elapsed = time.monotonic() - start
  assert exits.codes[0] == qsgd_jax.LOST_PROCESS_EXIT_CODE
  assert _TIMEOUT <= elapsed <= 2 * _TIMEOUT
  line, = capfd.readouterr().err.strip().splitlines()
  assert "process 0 of 2: lost process 1: no heartbeat for" in line
  assert "resume from the last checkpoint" in line


def test_beating_and_finished_processes_are_not_lost():
  store = _Store()
  first, first_exits = _watch(store, 0)
  second, second_exits = _watch(store, 1)
  with first:
    with second:
      time.sleep(3 * _TIMEOUT)
    time.sleep(3 * _TIMEOUT)  # Process 1 is done: no longer watched.
  assert not first_exits.codes and not second_exits.codes
  assert store.values[distributed._KEY + "1"] == distributed._DONE


def test_a_failed_process_is_named_at_once(capfd):
  store = _Store()
  first, first_exits = _watch(store, 0)
  second, second_exits = _watch(store, 1)
  with first:
    with pytest.raises(ValueError), second:
      raise ValueError("the data ran out")
    assert second_exits.codes == [1]
    assert first_exits.done.wait(_TIMEOUT)  # Well before a silence would count.
  assert first_exits.codes[0] == qsgd_jax.LOST_PROCESS_EXIT_CODE
  err = capfd.readouterr().err
  assert "ValueError: the data ran out" in err  # Process 1's traceback.
  assert "process 1 failed (ValueError: the data ran out)" in err.strip().splitlines()[-1]


def test_an_unreachable_coordination_service_is_lost(capfd):
  store = _Store()
  watch, exits = _watch(store, 1)
  with watch:
    store.values[distributed._KEY + "0"] = "1"
    store.reachable = False
    assert exits.done.wait(10 * _TIMEOUT)
  assert exits.codes[0] == qsgd_jax.LOST_PROCESS_EXIT_CODE
  assert "lost the coordination service (process 0)" in capfd.readouterr().err


class _Beating:
  """A process beating into ``store`` every tenth of a timeout, until ``stop`` is set."""

  def __init__(self, store, process_id):
    self.stop = threading.Event()
    key = distributed._KEY + str(process_id)

    def beat():
      count = 0
      while not self.stop.wait(_TIMEOUT / 10):
        count += 1
        store.key_value_set(key, str(count))

    self.thread = threading.Thread(target=beat, daemon=True)
    self.thread.start()


_COLLECTIVE_ERROR = jax.errors.JaxRuntimeError("UNAVAILABLE: Connection reset by peer")


def test_a_collective_error_waits_for_a_lost_processs_late_read_last_heartbeat(capfd):
  # Process 1 is killed; its last heartbeat reaches process 2's watch only after the
  # collective's error (a loaded host runs the heartbeat thread late), so its silence counts
  # from then. The watch must still name it, not mark process 2 failed after a fixed wait.
  store = _Store()
  store.values[distributed._KEY + "1"] = "1"
  watch, exits = _watch(store, 2, num_processes=3)
  alive = _Beating(store, 0)
  with pytest.raises(jax.errors.JaxRuntimeError), watch:
    time.sleep(2 * _TIMEOUT / 10)
    threading.Timer(0.3 * _TIMEOUT,
                    lambda: store.values.__setitem__(distributed._KEY + "1", "2")).start()
    raise _COLLECTIVE_ERROR
  alive.stop.set()
  assert exits.codes == [qsgd_jax.LOST_PROCESS_EXIT_CODE]
  assert "process 2 of 3: lost process 1: no heartbeat for" in capfd.readouterr().err
  assert store.values[distributed._KEY + "2"].startswith(distributed._ENDED + "lost process 1")


def test_a_collective_error_of_this_processs_own_is_reported_once_the_others_beat():
  store = _Store()
  watch, exits = _watch(store, 1, num_processes=3)
  others = [_Beating(store, 0), _Beating(store, 2)]
  start = time.monotonic()
  with pytest.raises(jax.errors.JaxRuntimeError), watch:
    raise _COLLECTIVE_ERROR
  elapsed = time.monotonic() - start
  for other in others:
    other.stop.set()
  assert exits.codes == [1]
  assert elapsed < _TIMEOUT  # Not a whole failure timeout: the others beat on.
  word = store.values[distributed._KEY + "1"]
  assert word.startswith(distributed._FAILED) and word.endswith("Connection reset by peer")


def test_a_collective_error_after_a_peer_failed_names_the_peer(capfd):
  # The peer's failure (its word in the store) must be named, and this process end with the
  # lost-process status a launcher restarts on, not blame itself.
  store = _Store()
  watch, exits = _watch(store, 1)
  with pytest.raises(jax.errors.JaxRuntimeError), watch:
    store.values[distributed._KEY + "0"] = distributed._FAILED + "ValueError: bad batch"
    raise _COLLECTIVE_ERROR
  assert exits.codes == [qsgd_jax.LOST_PROCESS_EXIT_CODE]
  assert "process 1 of 2: process 0 failed (ValueError: bad batch)" in capfd.readouterr().err
  assert store.values[distributed._KEY + "1"].startswith(distributed._ENDED)


def test_leaving_the_block_while_the_watch_ends_the_run_keeps_its_verdict():
  store = _Store()
  watch, exits = _watch(store, 1)
  with watch:  # Process 0 never beats; the block ends as the watch says so.
    assert exits.done.wait(10 * _TIMEOUT)
  assert exits.codes == [qsgd_jax.LOST_PROCESS_EXIT_CODE]
  # Its last word is the verdict, not "done" written over it as the block ended.
  assert store.values[distributed._KEY + "1"].startswith(distributed._ENDED + "lost process 0")


def test_process_0_exits_after_the_other_survivors_have_named_the_lost_process(capfd):
  # Process 0 hosts the coordination service: leaving first, it would take the others down
  # (JAX aborts them) before they say why. Process 2 reaches its verdict later here.
  store, ended = _Store(), []
  watches = {i: qsgd_jax.ProcessWatch(store, i, 3, _TIMEOUT,
                                      exit_fn=lambda code, i=i: ended.append((i, code)))
             for i in (0, 2)}
  with watches[0]:
    time.sleep(0.3 * _TIMEOUT)
    with watches[2]:  # Process 1 never beats.
      deadline = time.monotonic() + 10 * _TIMEOUT
      while len(ended) < 2 and time.monotonic() < deadline:
        time.sleep(_TIMEOUT / 20)
  code = qsgd_jax.LOST_PROCESS_EXIT_CODE
  assert ended == [(2, code), (0, code)]
  lines = capfd.readouterr().err.strip().splitlines()
  assert all(f"process {i} of 3: lost process 1: no heartbeat for" in line
             for i, line in zip((0, 2), lines, strict=True))


@pytest.mark.parametrize("failure_timeout", [0, -1.0, float("nan"), "10"])
def test_failure_timeout_must_be_a_positive_number(failure_timeout):
  with pytest.raises(ValueError, match="failure_timeout must be a positive number"):
    qsgd_jax.initialize_distributed("127.0.0.1:1", 2, 0, failure_timeout=failure_timeout)


# A real run ---------------------------------------------------------------------------------

_PROCESSES = 3
_STARTUP_SECONDS = 120
# The bound: every survivor gone within 15 s of the loss. The watch takes the
# default failure timeout (10 s) plus up to two heartbeats (1 s each); the rest is margin
# for this loaded machine.
_SURVIVOR_SECONDS = 15.0


def _free_port() -> int:
  with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    return probe.getsockname()[1]


def _environment() -> dict[str, str]:
  flags = [flag for flag in os.environ.get("XLA_FLAGS", "").split()
           if not flag.startswith("--xla_force_host_platform_device_count")]
  root = str(pathlib.Path(__file__).resolve().parent.parent)
  return dict(os.environ, XLA_FLAGS=" ".join([*flags, "--xla_force_host_platform_device_count=1"]),
              JAX_PLATFORMS="cpu",
              PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))


@pytest.mark.slow
def test_survivors_of_a_killed_process_exit_within_15_seconds_naming_it(tmp_path):
  port, ready = _free_port(), tmp_path / "ready"
  ready.mkdir()
  processes, logs = [], [tmp_path / f"process{i}.log" for i in range(_PROCESSES)]
  try:
    for process_id, log in enumerate(logs):
      with open(log, "wb") as stream:
        processes.append(subprocess.Popen(
            [sys.executable, str(_WORKER), str(process_id), str(_PROCESSES), str(port),
             str(distributed.DEFAULT_FAILURE_TIMEOUT), str(ready)],
            stdout=stream, stderr=subprocess.STDOUT, env=_environment(),
            start_new_session=True))
    deadline = time.monotonic() + _STARTUP_SECONDS
    while len(list(ready.iterdir())) < _PROCESSES:
      failed = [i for i, p in enumerate(processes) if p.poll() is not None]
      assert not failed and time.monotonic() < deadline, (
          logs[(failed or [0])[0]].read_text(errors="replace")[-3000:])
      time.sleep(0.1)

    processes[1].kill()
    killed = time.monotonic()
    ended = {}
    while len(ended) < _PROCESSES and time.monotonic() - killed < 3 * _SURVIVOR_SECONDS:
      for i, process in enumerate(processes):
        if i not in ended and process.poll() is not None:
          ended[i] = time.monotonic() - killed
      time.sleep(0.05)
  finally:
    for process in processes:
      if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
      process.wait()

  assert processes[1].returncode == -signal.SIGKILL
  for survivor in (0, 2):
    log = logs[survivor].read_text(errors="replace")
    assert processes[survivor].returncode == qsgd_jax.LOST_PROCESS_EXIT_CODE, log[-3000:]
    assert ended[survivor] < _SURVIVOR_SECONDS, (ended, log[-3000:])
    last = log.strip().splitlines()[-1]
    assert last.startswith(f"qsgd_jax: process {survivor} of 3: lost process 1:"), last
    assert "resume from the last checkpoint" in last
