"""The emulated links of ``network.py``: private network namespaces shaped by ``tc``.

Two layouts, each a context manager that deletes a stale copy of itself on
entering and everything it made on leaving (killing what still runs inside),
also when a run fails or is interrupted:

* :class:`Namespace`, one namespace whose loopback all processes share: the
  link of Parts 1 to 6, every process a node of one CPU device.
* :class:`Nodes`, a namespace a node, each joined by a link of its own to a
  switch (a bridge in a namespace of its own): the slow link between nodes,
  and inside each node its own loopback, unshaped, the fast link between the
  devices of one process. gloo connects even the devices of one process over
  TCP (an all-reduce over 4 devices of one process sent its whole ring over
  the loopback here), so a node's own devices must not share the shaped
  link with the other nodes'.

Both are shaped by ``tc``'s token bucket filter (tbf). Every interface either
makes lives inside its namespaces (the veth pairs are created there), so no
interface of the host is made or touched, and nothing leaves them.
"""

import contextlib
import os
import shutil
import signal
import subprocess

NAMESPACE = "qsgd_jax_network"
LOOPBACK_MTU = 9000  # Also the nodes' links': see tbf_command.
MIN_BURST_BYTES = 32 * 1024
BURST_SECONDS = 1e-3
TBF_LATENCY = "50ms"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# The nodes' addresses, NODE_SUBNET.1 to NODE_SUBNET.N, on links private to the namespaces.
NODE_SUBNET = "10.44.0"
NODE_LINK = "uplink"  # A node's end of its link, in the node's namespace.
SWITCH = "switch"  # The bridge, in the switch's namespace; node i's port there is "node{i}".


def run_command(command: list[str], check: bool = True) -> subprocess.CompletedProcess:
  return subprocess.run(command, capture_output=True, text=True, check=check)


def tbf_command(bits_per_second: float | None, num_processes: int,
                device: str = "lo") -> list[str]:
  """The ``tc`` command, run inside a namespace, that gives its ``device`` this rate.

  ``burst`` is the larger of 32 KiB and 1 ms of the rate: tbf drops every
  packet larger than its bucket, so the links' MTU is :data:`LOOPBACK_MTU`
  (tbf cuts larger segments to it), not the loopback's 64 KiB.

  Args:
    bits_per_second: the per-node rate; ``None`` removes any limit.
    num_processes: the nodes sharing ``device``; it is limited to their sum.
    device: the interface.
  """
  if bits_per_second is None:  # Back to the device's default, no queueing discipline.
    return ["tc", "qdisc", "del", "dev", device, "root"]
  aggregate = bits_per_second * num_processes
  burst = max(MIN_BURST_BYTES, int(aggregate / 8 * BURST_SECONDS))
  return ["tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", f"{aggregate:.0f}bit",
          "burst", str(burst), "latency", TBF_LATENCY]


class _Made:
  """A context manager of namespaces: entering deletes stale ones of the same names and makes
  them afresh (``make``), deleting them if that fails; leaving deletes them (``delete``)."""

  def __enter__(self):
    self.delete()
    try:
      self.make()
    except BaseException:
      self.delete()
      raise
    return self

  def __exit__(self, *exc_info) -> None:
    self.delete()


class Namespace(_Made):
  """A private network namespace whose loopback is the emulated link.

  Use as a context manager: entering deletes a stale namespace of the same
  name and creates a fresh one with its loopback up; leaving kills what still
  runs inside and deletes it.
  """

  coordinator_host = "127.0.0.1"

  def __init__(self, name: str):
    self.name = name

  def make(self) -> None:
    run_command(["ip", "netns", "add", self.name])
    run_command(["ip", "-n", self.name, "link", "set", "lo", "mtu", str(LOOPBACK_MTU), "up"])

  def prefix(self, process_id: int = 0) -> list[str]:
    """What runs a command inside the namespace (every process's the same)."""
    del process_id
    return ["ip", "netns", "exec", self.name]

  def exists(self) -> bool:
    return self.name in run_command(["ip", "netns", "list"], check=False).stdout.split()

  def delete(self) -> None:
    """Kills what runs inside, then deletes the namespace; a signal waits until it is done."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
      if not self.exists():
        return
      for pid in run_command(["ip", "netns", "pids", self.name], check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError):
          os.kill(int(pid), signal.SIGKILL)
      run_command(["ip", "netns", "del", self.name])
    finally:
      signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

  def set_rate(self, bits_per_second: float | None, num_processes: int) -> None:
    # Removing a limit that is not there fails harmlessly.
    run_command(self.prefix() + tbf_command(bits_per_second, num_processes),
                check=bits_per_second is not None)


class Nodes(_Made):
  """``N`` nodes, a namespace each, joined by a link a node to a switch.

  Node ``i`` is the namespace ``{name}_node{i}``: its loopback, and one end
  (``uplink``) of a veth pair with the address ``10.44.0.{i + 1}``, whose other
  end is port ``node{i}`` of a bridge in ``{name}_switch``. A process started
  by :meth:`prefix` runs in its node with the host name set to the node's
  address (in a UTS namespace of its own): gloo's TCP transport listens on
  the address of the host's name, JAX giving it no other, so every
  connection to a process goes to its node's address, and those between the
  devices of one process stay on that node's loopback. :meth:`set_rate`
  limits each link both ways, a node's sending on its own end and its
  receiving on the switch's port: the links of a switch with one such link a
  node, each node held to its own link's rate (the loopback of
  :class:`Namespace` holds only their sum).
  """

  def __init__(self, name: str, num_nodes: int):
    self.name = name
    self.switch = Namespace(f"{name}_{SWITCH}")
    self.nodes = [Namespace(f"{name}_node{i}") for i in range(num_nodes)]
    self.addresses = [f"{NODE_SUBNET}.{i + 1}" for i in range(num_nodes)]
    self.coordinator_host = self.addresses[0]

  def make(self) -> None:
    self.switch.make()
    run_command(["ip", "-n", self.switch.name, "link", "add", SWITCH, "type", "bridge"])
    run_command(["ip", "-n", self.switch.name, "link", "set", SWITCH, "up"])
    for i, (node, address) in enumerate(zip(self.nodes, self.addresses, strict=True)):
      node.make()
      run_command(["ip", "link", "add", "name", NODE_LINK, "netns", node.name, "mtu",
                   str(LOOPBACK_MTU), "type", "veth", "peer", "name", f"node{i}", "netns",
                   self.switch.name, "mtu", str(LOOPBACK_MTU)])
      run_command(["ip", "-n", self.switch.name, "link", "set", f"node{i}", "master", SWITCH,
                   "up"])
      run_command(["ip", "-n", node.name, "addr", "add", f"{address}/24", "dev", NODE_LINK])
      run_command(["ip", "-n", node.name, "link", "set", NODE_LINK, "up"])

  def prefix(self, process_id: int) -> list[str]:
    """What runs a command as process ``process_id``: in its node, named by its address."""
    return [*self.nodes[process_id].prefix(), "unshare", "--uts", "sh", "-c",
            'hostname "$0" && exec "$@"', self.addresses[process_id]]

  def exists(self) -> bool:
    return any(namespace.exists() for namespace in (self.switch, *self.nodes))

  def delete(self) -> None:
    for namespace in (*self.nodes, self.switch):
      namespace.delete()

  def set_rate(self, bits_per_second: float | None, num_processes: int) -> None:
    """Each node's link at ``bits_per_second`` both ways (``None``: unshaped)."""
    del num_processes  # A link a node.
    for i, node in enumerate(self.nodes):
      for namespace, device in ((node, NODE_LINK), (self.switch, f"node{i}")):
        run_command(namespace.prefix() + tbf_command(bits_per_second, 1, device),
                    check=bits_per_second is not None)


def namespace_permission(tools: tuple[str, ...] = ("ip", "tc")) -> str | None:
  """``None`` where this process may create a network namespace and has ``tools`` (iproute2's;
  :class:`Nodes` needs util-linux's ``unshare`` too), else why not."""
  missing = [tool for tool in tools if shutil.which(tool) is None]
  if missing:
    return f"{' and '.join(missing)} not found"
  probe = f"{NAMESPACE}_probe{os.getpid()}"
  created = run_command(["ip", "netns", "add", probe], check=False)
  if created.returncode:
    return (f"`ip netns add` failed (it needs root: CAP_SYS_ADMIN and CAP_NET_ADMIN):"
            f" {created.stderr.strip()}")
  run_command(["ip", "netns", "del", probe], check=False)
  return None
