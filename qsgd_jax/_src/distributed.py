"""Starting a multi-process run that ends cleanly and fast when one of its processes is lost."""

import dataclasses
import math
import os
import sys
import threading
import time
import traceback

import jax

# Seconds without a heartbeat after which a process counts as lost.
DEFAULT_FAILURE_TIMEOUT = 10.0
# A survivor's exit status: sysexits.h's EX_TEMPFAIL, "try again later".
LOST_PROCESS_EXIT_CODE = 75
# JAX's own heartbeat and shutdown timeouts, in failure timeouts: a backstop that the watch
# must beat. With a heartbeat timeout of 10 s the coordination service aborted the survivors
# (SIGABRT, a long log) 7.8 s after a peer was killed: it acts from about half its timeout on.
_JAX_TIMEOUTS_IN_FAILURE_TIMEOUTS = 3
# Heartbeats a failure timeout.
_BEATS_A_TIMEOUT = 10
_KEY = "qsgd_jax/heartbeat/"
# A process's last words: left the run normally, raised, or ended it on a verdict.
_DONE, _FAILED, _ENDED = "done", "failed: ", "ended: "


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    failure_timeout: float = DEFAULT_FAILURE_TIMEOUT,
    initialization_timeout: int = 300,
    cpu_collectives: str | None = "gloo",
) -> "ProcessWatch":
  r"""``jax.distributed.initialize``, with every process ending soon after one is lost.

  By default a multi-process JAX run that loses a process (killed, crashed,
  stopped, or its machine gone) does not end: the survivors block in their
  next collective, or get a transport error and then block in
  ``jax.distributed``'s shutdown, until the coordination service's heartbeat
  timeout (100 s) aborts them with ``SIGABRT`` and a long log. This starts
  the run with one option, ``failure_timeout`` (:math:`T`), for all of it:

  * JAX's heartbeat and shutdown timeouts become :math:`3T`, a backstop;
  * the returned :class:`ProcessWatch`, used as a context manager around the
    run, makes each process beat a heartbeat into the coordination service's
    key-value store every :math:`T/10` and read everyone's. When a process
    has not beaten for :math:`T` (killed or stopped), has failed, or the
    coordination service itself is unreachable for :math:`T` (process 0 is
    gone), every survivor prints one line naming that process and exits with
    status :data:`LOST_PROCESS_EXIT_CODE` (75): within :math:`T` plus two
    heartbeats of the loss, about 11 s by default.

  Process 0 hosts the coordination service: when it dies outright (its
  sockets close), JAX itself aborts the others within a second (``SIGABRT``,
  its log saying the leader task died) before the watch speaks; when it stops
  or hangs, the watch names it. So that its own exit takes nobody down
  unheard, process 0, on a verdict or a failure of its own, waits up to
  :math:`T` for every other process still beating to leave its last word.

  The exit skips ``jax.distributed``'s shutdown, which would wait for the lost
  process. Restart every process to resume from the last checkpoint. A
  process whose code raises inside the ``with`` block marks itself failed (the
  others then end at once, naming it), prints its traceback and exits with
  status 1 (or a ``SystemExit``'s status), also without that shutdown. An
  error of a collective (``jax.errors.JaxRuntimeError``, as gloo raises when a
  peer's connection drops) first waits for the watch to name a lost process,
  or for every other process to beat again (the error is then this process's
  own), at most :math:`3T`. Leaving the block normally marks the process
  done, so that the others stop watching it.

  Each process reads everyone's heartbeat: :math:`N` small requests to the
  coordination service every :math:`T/10`, each of :math:`N` keys; for
  thousands of processes, raise ``failure_timeout``. The heartbeats run in a
  Python thread: a main thread that holds the interpreter lock for
  :math:`T` at a stretch without releasing it (XLA's compilation and
  execution release it) is taken for stopped.

  Args:
    coordinator_address, num_processes, process_id: as for
      ``jax.distributed.initialize`` (``None`` where JAX detects the cluster:
      SLURM, Open MPI, ``JAX_COORDINATOR_ADDRESS``).
    failure_timeout: seconds of silence after which a process is lost. It
      must exceed the longest pause of a live process's Python threads (a
      stop-the-world pause of the machine, a swap storm).
    initialization_timeout: seconds to wait for every process to connect.
    cpu_collectives: ``jax_cpu_collectives_implementation`` for CPU devices
      (``"gloo"`` lets them talk across processes; ``None`` leaves it).

  Returns:
    A :class:`ProcessWatch`: enter it right away (the other processes time
    their first heartbeat from their own start).

  Raises:
    ValueError: ``failure_timeout`` is not a positive number.

  Examples:
    In each process of a launcher::

      with qsgd_jax.initialize_distributed("10.0.0.1:1234", num_processes=4,
                                           process_id=rank):
        train()  # Resumes from the latest checkpoint.

  References:
    TorchElastic (``torchrun``) likewise stops every worker when one fails and
    starts them all again (up to ``max_restarts``), each loading the last
    checkpoint; here the restart is the launcher's (``benchmarks/soak.py``
    has a small one).
  """
  if (not isinstance(failure_timeout, int | float) or isinstance(failure_timeout, bool)
      or not failure_timeout > 0 or not math.isfinite(failure_timeout)):
    raise ValueError(
        f"initialize_distributed: failure_timeout must be a positive number of seconds, "
        f"got {failure_timeout!r}.")
  if cpu_collectives is not None:
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  jax_timeout = math.ceil(_JAX_TIMEOUTS_IN_FAILURE_TIMEOUTS * failure_timeout)
  jax.distributed.initialize(
      coordinator_address=coordinator_address,
      num_processes=num_processes,
      process_id=process_id,
      initialization_timeout=initialization_timeout,
      heartbeat_timeout_seconds=jax_timeout,
      shutdown_timeout_seconds=jax_timeout,
  )
  return ProcessWatch(_client(), jax.process_index(), jax.process_count(), failure_timeout)


def _client():
  """The coordination service's client of this process (JAX keeps it private, as orbax reads it)."""
  from jax._src import distributed

  return distributed.global_state.client


@dataclasses.dataclass
class _Peer:
  value: str | None = None
  changed: float = 0.0
  changes: int = 0  # Values seen: two after a moment prove the process beat after it.


class ProcessWatch:
  """Heartbeats between the processes of a run; see :func:`initialize_distributed`.

  Args:
    client: the coordination service's client (``key_value_set`` and
      ``key_value_dir_get``).
    process_id: this process's index.
    num_processes: the processes of the run.
    failure_timeout: seconds of silence after which a process is lost.
    exit_fn: ends the process with a status (``os._exit``; a test passes one
      that records it).

  Examples:
    ``initialize_distributed`` makes and enters one; a test can drive it with a
    client of its own:

    >>> import qsgd_jax
    >>> class Client:  # The coordination service's key-value store, in memory.
    ...   def __init__(self):
    ...     self.store = {}
    ...   def key_value_set(self, key, value, allow_overwrite=False):
    ...     self.store[key] = value
    ...   def key_value_dir_get(self, directory):
    ...     return [(k, v) for k, v in self.store.items() if k.startswith(directory)]
    >>> with qsgd_jax.ProcessWatch(Client(), 0, 1, failure_timeout=10.0) as watch:
    ...   watch.num_processes
    1
  """

  def __init__(self, client, process_id: int, num_processes: int, failure_timeout: float,
               exit_fn=os._exit):
    self.process_id = process_id
    self.num_processes = num_processes
    self.failure_timeout = float(failure_timeout)
    self._client = client
    self._exit = exit_fn
    self._interval = self.failure_timeout / _BEATS_A_TIMEOUT
    self._peers = {i: _Peer() for i in range(num_processes) if i != process_id}
    self._lock = threading.Lock()  # Guards the peers and the last reply.
    self._writing = threading.Lock()  # Held while a heartbeat is in flight.
    self._stopped = threading.Event()
    self._verdict = threading.Event()
    self._ending = threading.Lock()  # Taken by whichever thread ends the process.
    self._last_reply = 0.0
    self._beats = 0
    self._threads = ()

  def __enter__(self) -> "ProcessWatch":
    now = time.monotonic()
    self._last_reply = now
    for peer in self._peers.values():
      peer.changed = now
    self._threads = (threading.Thread(target=self._beat_loop, name="qsgd_jax heartbeat",
                                      daemon=True),
                     threading.Thread(target=self._judge_loop, name="qsgd_jax watch",
                                      daemon=True))
    for thread in self._threads:
      thread.start()
    return self

  def __exit__(self, exc_type, exc, tb) -> bool:
    clean = exc_type is None or (exc_type is SystemExit and exc.code in (None, 0))
    if not clean and isinstance(exc, jax.errors.JaxRuntimeError):
      # A peer's loss reaches this process as a collective's error at once, and its
      # heartbeats stop: the watch names it (and exits) within a failure timeout.
      self._await_verdict()
    if not self._ending.acquire(blocking=False):
      # The watch reached a verdict: it says it, leaves its last word and exits.
      self._threads[1].join(timeout=2 * self.failure_timeout + 4 * self._interval)
      if self._threads[1].is_alive():  # Stuck on the way: end the process from here.
        self._exit(LOST_PROCESS_EXIT_CODE)
      return False
    if clean:
      self._stop(_DONE)
      return False
    summary = traceback.format_exception_only(exc_type, exc)[-1].strip()
    self._stop(_FAILED + summary[:200])
    self._linger()
    if exc_type is SystemExit:
      code = exc.code if isinstance(exc.code, int) else 1
      if not isinstance(exc.code, int):
        print(exc.code, file=sys.stderr)
    else:
      code = 1
      traceback.print_exception(exc_type, exc, tb)
    _flush()
    self._exit(code)
    return False

  def _await_verdict(self) -> None:
    """Waits for the watch to name a lost process, or until every other process has beaten
    since now (the error is this process's own); at most JAX's backstop, :math:`3T`.

    Not a fixed wait of :math:`T`: a loaded host may run the heartbeat thread late, and a
    lost process's last heartbeat, read late, restarts its silence. A process has beaten
    since now when its value changed twice after now: the first change may be a heartbeat
    written before now and read after. A process that failed is the watch's to name.
    """
    with self._lock:
      seen = {index: peer.changes for index, peer in self._peers.items()}
    deadline = time.monotonic() + _JAX_TIMEOUTS_IN_FAILURE_TIMEOUTS * self.failure_timeout
    while not self._verdict.wait(self._interval / 2) and time.monotonic() < deadline:
      with self._lock:
        if all(_left(peer.value) or (not _failed(peer.value)
                                     and peer.changes - seen[index] >= 2)
               for index, peer in self._peers.items()):
          return

  def _stop(self, value: str) -> None:
    """Stops beating, and leaves ``value`` as this process's last word.

    The word waits for a heartbeat in flight, so that no heartbeat overwrites
    it; a coordination service that is gone may never answer, so it waits at
    most two heartbeats.
    """
    self._stopped.set()

    def tell():
      if not self._writing.acquire(timeout=2 * self._interval):
        return
      try:
        self._client.key_value_set(_KEY + str(self.process_id), value, allow_overwrite=True)
      except Exception:  # noqa: BLE001 - the coordination service is gone: nobody to tell.
        pass

    last_word = threading.Thread(target=tell, name="qsgd_jax last heartbeat", daemon=True)
    last_word.start()
    last_word.join(timeout=4 * self._interval)

  def _linger(self) -> None:
    """In process 0, waits until every other process has left its last word or is lost.

    Process 0 hosts the coordination service: once it exits, JAX aborts every
    other process within a second (``SIGABRT``), before their watches name
    the lost process or their own failure. Those still beating get up to
    :math:`T` to reach their verdict (about a heartbeat after this one's) and
    say it; a process silent for :math:`T` is lost and not waited for.
    """
    if self.process_id != 0:
      return
    deadline = time.monotonic() + self.failure_timeout
    while time.monotonic() < deadline:
      entries = self._read_heartbeats(timeout=self._interval)
      if entries is None:  # The service does not answer: nobody to wait for.
        return
      now = time.monotonic()
      with self._lock:
        self._record(entries, now)
        if all(_settled(peer.value) or now - peer.changed > self.failure_timeout
               for peer in self._peers.values()):
          return
      time.sleep(self._interval / 2)

  def _record(self, entries, now: float) -> None:
    """Takes the heartbeat values ``entries`` (``(key, value)`` pairs, or a dict) read at
    ``now`` into the peers: a changed value is a beat. Call with the lock held."""
    for key, value in dict(entries).items():
      peer = self._peers.get(_process_of(key))
      if peer is not None and value != peer.value:
        peer.value, peer.changed = value, now
        peer.changes += 1

  def _read_heartbeats(self, timeout: float) -> dict[str, str] | None:
    """Every process's heartbeat value by key, or ``None`` if the service fails or does not
    answer within ``timeout`` (a read in a thread of its own: the client may block)."""
    entries = []

    def read():
      try:
        entries.append(dict(self._client.key_value_dir_get(_KEY)))
      except Exception:  # noqa: BLE001 - unreachable: the caller stops waiting.
        pass

    reader = threading.Thread(target=read, name="qsgd_jax last reads", daemon=True)
    reader.start()
    reader.join(timeout=timeout)
    return entries[0] if entries else None

  def _beat_loop(self) -> None:
    while True:
      with self._writing:
        if self._stopped.is_set():
          return
        self._beats += 1
        try:
          self._client.key_value_set(_KEY + str(self.process_id), str(self._beats),
                                     allow_overwrite=True)
          entries = self._client.key_value_dir_get(_KEY)
        except Exception:  # noqa: BLE001 - unreachable: the judge counts the silence.
          entries = None
      if entries is None:
        self._stopped.wait(self._interval)
        continue
      now = time.monotonic()
      with self._lock:
        self._last_reply = now
        self._record(entries, now)
      self._stopped.wait(self._interval)

  def _judge_loop(self) -> None:
    while not self._stopped.wait(self._interval / 2):
      verdict = self._judge(time.monotonic())
      if verdict is None:
        continue
      if not self._ending.acquire(blocking=False):
        return  # The main thread is ending the process already.
      self._verdict.set()
      print(f"qsgd_jax: process {self.process_id} of {self.num_processes}: {verdict}; "
            f"exiting with status {LOST_PROCESS_EXIT_CODE}: restart every process to "
            "resume from the last checkpoint.", file=sys.stderr)
      _flush()
      self._stop(_ENDED + verdict[:200])
      self._linger()
      self._exit(LOST_PROCESS_EXIT_CODE)
      return

  def _judge(self, now: float) -> str | None:
    """Why the run is broken, or ``None`` while every other process beats or is done."""
    with self._lock:
      if now - self._last_reply > self.failure_timeout:
        return (f"lost the coordination service (process 0): no reply for "
                f"{now - self._last_reply:.1f} s")
      for index, peer in sorted(self._peers.items()):
        if _failed(peer.value):
          return f"process {index} failed ({peer.value.removeprefix(_FAILED)})"
      # A peer's silence counts to the last read of the service: while the service does not
      # answer, the peers' heartbeats cannot be seen, and the service is what is lost.
      for index, peer in sorted(self._peers.items()):
        silence = self._last_reply - peer.changed
        if not _settled(peer.value) and silence > self.failure_timeout:
          return f"lost process {index}: no heartbeat for {silence:.1f} s"
    return None


def _settled(value: str | None) -> bool:
  """Whether a heartbeat value is a last word: the process left the run, so is not watched."""
  return _left(value) or _failed(value)


def _left(value: str | None) -> bool:
  """Whether a process left the run normally or ended it on a verdict of its own."""
  return value is not None and value.startswith((_DONE, _ENDED))


def _failed(value: str | None) -> bool:
  return value is not None and value.startswith(_FAILED)


def _process_of(key: str) -> int:
  try:
    return int(key.rsplit("/", 1)[-1])
  except ValueError:
    return -1


def _flush() -> None:
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass
