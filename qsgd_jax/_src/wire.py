"""Bytes on the wire, read from a compiled program's HLO.

The collectives in the optimized HLO, with their result types, are what the
runtime sends. Each device's share for a group of ``n`` devices and a result of
``R`` bytes, under the usual ring and pairwise algorithms:

* ``all-reduce``: ``2 (n - 1) / n * R`` (a reduce-scatter, then an all-gather);
* ``all-gather`` and ``all-to-all``: ``(n - 1) / n * R``;
* ``reduce-scatter``: ``(n - 1) * R`` (``R`` is one device's shard);
* ``collective-permute``: ``R`` (each device sends its buffer to one peer).

A collective inside a branch of a ``conditional`` (``jax.lax.cond``,
``jax.lax.switch``) runs only on the steps that take that branch:
:func:`wire_bytes` sums every branch, :func:`wire_bytes_by_branch` tells them
apart.
"""

import math
import re
from typing import NamedTuple

import numpy as np

_ITEM_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1,
}
_KINDS = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")
_INSTRUCTION = re.compile(
    r"=\s*(?P<type>\(.*?\)|\S+)\s+(?P<op>" + "|".join(_KINDS) + r")(?P<start>-start)?\("
)
_ARRAY_TYPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_EXPLICIT_GROUPS = re.compile(r"replica_groups=\{(\{[0-9,]*\}(?:,\{[0-9,]*\})*)\}")
_IOTA_GROUPS = re.compile(
    r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\((.*?)\))? \{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{(.*?)\}\}")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[^\s(]+)\s+\(.*\{\s*$")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_CALLED_LISTS = re.compile(r"\b(?:called_computations|branch_computations)=\{([^}]*)\}")
_TRUE_FALSE = re.compile(r"\btrue_computation=%?([\w.\-]+).*?\bfalse_computation=%?([\w.\-]+)")
_REPLICAS = re.compile(r"replica_count=(\d+)")


class Collective(NamedTuple):
  """One collective instruction of a compiled program.

  Attributes:
    kind: ``"all-reduce"``, ``"all-gather"``, ``"all-to-all"``,
      ``"reduce-scatter"`` or ``"collective-permute"``.
    result_type: the HLO result type, e.g. ``"u32[4096]"``.
    result_bytes: bytes of that result on one device.
    group_size: devices taking part in one group.
    bytes_sent: bytes one device sends for it (see the module docstring).

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> n = jax.local_device_count()
    >>> program = jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")
    >>> hlo = program.lower(jnp.zeros((n, 1024))).compile().as_text()
    >>> [(c.kind, c.result_type, c.result_bytes) for c in qsgd_jax.collectives_in_hlo(hlo)]
    [('all-reduce', 'f32[1024]{0}', 4096)]
  """

  kind: str
  result_type: str
  result_bytes: int
  group_size: int
  bytes_sent: float
  groups: tuple[tuple[int, ...], ...] = ()

  def crosses(self, mesh, axis_name) -> bool:
    """Whether a group of this collective spans two devices that differ along
    ``axis_name`` (a mesh axis, or a tuple of them) of ``mesh``, the mesh the program
    was compiled over (its devices in ``mesh.devices.flat`` order are the program's)."""
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    where = [mesh.axis_names.index(name) for name in names]
    coordinates = np.stack(np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape),
                           axis=1)[:, where]
    return any(len({tuple(coordinates[d]) for d in group}) > 1 for group in self.groups)


def _array_bytes(result_type: str) -> list[int]:
  return [
      _ITEM_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
      for dtype, dims in _ARRAY_TYPE.findall(result_type)
      if dtype in _ITEM_BYTES
  ]


def _groups(line: str, devices: int) -> tuple[tuple[int, ...], ...]:
  """The device groups of a collective's line (a collective-permute's pairs): in any of
  the three forms XLA prints (listed, iota, mesh axes); all devices where none is given."""
  if match := _EXPLICIT_GROUPS.search(line):
    return tuple(tuple(int(d) for d in group.split(",") if d)
                 for group in re.findall(r"\{([0-9,]*)\}", match.group(1)))
  if match := _IOTA_GROUPS.search(line):
    count, size = int(match.group(1)), int(match.group(2))
    ids = np.arange(count * size).reshape([int(d) for d in match.group(3).split(",")])
    if match.group(4):
      ids = ids.transpose([int(d) for d in match.group(4).split(",")])
    return tuple(map(tuple, ids.reshape(count, size).tolist()))
  if match := _MESH_GROUPS.search(line):
    return _mesh_axes_groups(*match.groups())
  if match := _PAIRS.search(line):
    return tuple(tuple(int(d) for d in pair.split(","))
                 for pair in re.findall(r"\{(\d+,\d+)", "{" + match.group(1) + "}}"))
  return (tuple(range(devices)),)


def _mesh_axes_groups(axes_text: str, device_ids: str | None,
                      grouped_text: str) -> tuple[tuple[int, ...], ...]:
  """Groups given as ``mesh['a'=2,'b'=4] {'b'}``: the devices that differ only along the
  listed axes (or sub-axes, ``'b':(2)2``: size 2 of ``b`` after its first 2) form one."""
  sizes = [(name, int(size)) for name, size in re.findall(r"'?(\w+)'?=(\d+)", axes_text)]
  listed = re.findall(r"'?(\w+)'?(?::\((\d+)\)(\d+))?", grouped_text)
  listed = [(name, int(pre) if pre else None, int(size) if size else None)
            for name, pre, size in listed if name]
  dims, grouped = [], []
  for name, size in sizes:  # Each axis, cut where a sub-axis of it is listed.
    cuts = sorted((pre, sub) for axis, pre, sub in listed if axis == name and pre)
    start, before = len(dims), 1
    for pre, sub in cuts:
      if pre > before:
        dims.append(pre // before)
      grouped.append((name, pre, sub, len(dims)))
      dims.append(sub)
      before = pre * sub
    if before < size:
      dims.append(size // before)
    if not cuts and any(axis == name for axis, _, _ in listed):
      grouped.append((name, None, None, start))
  ids = np.arange(math.prod(dims))
  if device_ids and (iota := re.fullmatch(r"\[([0-9,]+)\](?:T\(([0-9,]+)\))?", device_ids)):
    ids = ids.reshape([int(d) for d in iota.group(1).split(",")])
    if iota.group(2):
      ids = ids.transpose([int(d) for d in iota.group(2).split(",")])
    ids = ids.reshape(-1)
  elif device_ids:
    ids = np.array([int(d) for d in re.findall(r"\d+", device_ids)])
  order = [next(dim for axis, pre, sub, dim in grouped if (axis, pre, sub) == entry)
           for entry in listed]
  rest = [dim for dim in range(len(dims)) if dim not in order]
  groups = ids.reshape(dims).transpose(rest + order).reshape(
      -1, math.prod(dims[dim] for dim in order))
  return tuple(map(tuple, groups.tolist()))


def collectives_in_hlo(hlo_text: str) -> list[Collective]:
  """The collectives of an optimized HLO module, in program order.

  Args:
    hlo_text: ``jax.jit(f).lower(*args).compile().as_text()`` (or of a
      ``jax.pmap``-ed function).

  Returns:
    One :class:`Collective` an instruction (asynchronous ``-start``/``-done``
    pairs count once).

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> n = jax.local_device_count()
    >>> program = jax.pmap(lambda x: jax.lax.all_gather(x, "i"), axis_name="i")
    >>> hlo = program.lower(jnp.zeros((n, 256))).compile().as_text()
    >>> [collective] = qsgd_jax.collectives_in_hlo(hlo)
    >>> collective.kind, collective.bytes_sent == (n - 1) * 256 * 4
    ('all-gather', True)
  """
  devices = _devices(hlo_text)
  found = []
  for line in hlo_text.splitlines():
    if (collective := _collective(line, devices)) is not None:
      found.append(collective)
  return found


def _devices(hlo_text: str) -> int:
  header = hlo_text[: hlo_text.find("\n")]
  return max(
      int(m.group(1)) if (m := pattern.search(header)) else 1
      for pattern in (_PARTITIONS, _REPLICAS)
  )


def _collective(line: str, devices: int) -> Collective | None:
  """The :class:`Collective` of one HLO instruction line, or ``None`` if it is none."""
  match = _INSTRUCTION.search(line)
  if match is None:
    return None
  kind, result_type = match.group("op"), match.group("type")
  arrays = _array_bytes(result_type)
  # Asynchronous starts: an all-gather-start returns (operands, results), a
  # collective-permute-start (operand, result, context); an all-reduce-start
  # has the all-reduce's own shape, a tuple of every result when combined.
  is_async_tuple = match.group("start") and result_type.startswith("(")
  if is_async_tuple and kind == "all-gather":
    result_bytes = sum(arrays[len(arrays) // 2 :])
  elif is_async_tuple and kind == "collective-permute":
    result_bytes = arrays[1]
  else:
    result_bytes = sum(arrays)
  groups = _groups(line, devices)
  n = len(set(groups[0])) if kind != "collective-permute" else len(
      {d for group in groups for d in group})
  return Collective(kind, result_type, result_bytes, n, bytes_sent(kind, result_bytes, n),
                    groups)


def bytes_sent(kind: str, result_bytes: float, group_size: int) -> float:
  """Bytes one device sends for a collective (see the module docstring).

  The one formula shared by the HLO reader and the reduction plan's accounting.

  Args:
    kind: one of the HLO collective kinds of :class:`Collective`.
    result_bytes: bytes of the collective's result on one device.
    group_size: devices taking part in one group.
  """
  n = group_size
  if kind == "all-reduce":
    return 2 * (n - 1) / n * result_bytes
  if kind == "reduce-scatter":
    return (n - 1) * result_bytes
  if kind == "collective-permute":
    return float(result_bytes)
  if kind in ("all-gather", "all-to-all"):
    return (n - 1) / n * result_bytes
  raise ValueError(f"Unknown collective kind {kind!r}; expected one of {_KINDS}.")


def float32_allreduce_bits(num_elements: int, group_size: int) -> float:
  """Bits one device sends in a float32 all-reduce of ``num_elements`` among ``group_size``."""
  return 8 * bytes_sent("all-reduce", 4 * num_elements, group_size)


def wire_bytes(hlo_text: str, *, mesh=None, across=None) -> float:
  """Total bytes one device sends in the collectives of an optimized HLO module.

  Args:
    hlo_text: the compiled program's text, e.g.
      ``jax.jit(f).lower(x).compile().as_text()``.
    mesh: with ``across``, the mesh the program was compiled over.
    across: a mesh axis (or a tuple of them): count only the collectives
      whose groups span devices that differ along it, those that cross its
      links (on a mesh of ``data`` between nodes and ``fsdp`` inside them,
      ``across="data"`` is what the slow links carry). ``None`` counts all.

  Returns:
    The sum of :attr:`Collective.bytes_sent` over :func:`collectives_in_hlo`:
    **every branch of a conditional included**, though a step runs one. A
    program that switches with ``jax.lax.cond`` (1-bit Adam's and 0/1 Adam's
    float32 warm-up against their compressed steps, PowerSGD's
    ``start_iter``) reads as the sum of both; :func:`wire_bytes_by_branch`
    gives what each branch sends.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> f = jax.pmap(lambda x: jax.lax.psum(x, "i"), "i")
    >>> n = jax.local_device_count()
    >>> text = f.lower(jnp.ones((n, 1024))).compile().as_text()
    >>> qsgd_jax.wire_bytes(text) == (2 * (n - 1) / n * 4096 if n > 1 else 0)
    True

    Over a mesh of 2 nodes of 2 devices, what crosses between the nodes:

    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((2, 2), ("node", "local"))
    >>> def mean(x):  # Over the nodes only.
    ...   return jax.lax.pmean(x, "node")
    >>> f = jax.jit(jax.shard_map(mean, mesh=mesh, in_specs=P(("node", "local")),
    ...                           out_specs=P("local")))
    >>> x = jax.device_put(jnp.ones((4, 1024)), NamedSharding(mesh, P(("node", "local"))))
    >>> text = f.lower(x).compile().as_text()
    >>> qsgd_jax.wire_bytes(text, mesh=mesh, across="node") == 2 * (2 - 1) / 2 * 4096
    True
    >>> qsgd_jax.wire_bytes(text, mesh=mesh, across="local")
    0
  """
  return sum(c.bytes_sent for c in collectives_in_hlo(hlo_text)
             if _counted(c, mesh, across))


def _counted(collective: Collective, mesh, across) -> bool:
  """Whether ``collective`` counts towards the bytes sent ``across`` axes of ``mesh``."""
  if across is None:
    return True
  if mesh is None:
    raise ValueError("wire_bytes: across= needs the mesh the program was compiled over, "
                     "mesh=, to place the devices of each collective's groups.")
  return collective.crosses(mesh, across)


class BranchWireBytes(NamedTuple):
  """What a compiled program sends a step, by the branches of its conditionals.

  Attributes:
    unconditional: bytes one device sends in the collectives outside every
      conditional: on every step.
    conditionals: one tuple a conditional that sends in some branch
      (outside any other conditional, in program order; those that send
      nothing are left out), the bytes of each of its branches, in
      branch-index order: ``jax.lax.switch``'s branches; ``(false_fun, true_fun)`` for
      ``jax.lax.cond``. A conditional nested in a branch counts in that
      branch with all of its own branches summed.
    least: the fewest bytes a step can send: the cheapest branch of every
      conditional, nested ones included.
    most: the most bytes a step can send: the costliest branch of every
      conditional, nested ones included.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> n = jax.local_device_count()
    >>> def whole(x):
    ...   return jax.lax.psum(x, "i")
    >>> def half(x):
    ...   return jnp.tile(jax.lax.psum(x[:512], "i"), 2)
    >>> def step(x, count):  # The whole vector for 10 steps, then half of it.
    ...   return jax.lax.cond(count < 10, whole, half, x)
    >>> text = jax.pmap(step, "i").lower(jnp.ones((n, 1024)), jnp.zeros(n, jnp.int32)
    ...                                   ).compile().as_text()
    >>> by_branch = qsgd_jax.wire_bytes_by_branch(text)
    >>> [round(sent / (2 * (n - 1) / n)) for sent in by_branch.conditionals[0]] if n > 1 else []
    [2048, 4096]
    >>> by_branch.sent(1) == by_branch.unconditional + by_branch.conditionals[0][1]
    True
    >>> by_branch.least == by_branch.sent(0) and by_branch.most == by_branch.sent(1)
    True
  """

  unconditional: float
  conditionals: tuple[tuple[float, ...], ...]
  least: float
  most: float

  def sent(self, *branches: int) -> float:
    """Bytes of a step that takes branch ``branches[k]`` of conditional ``k``, for each ``k``."""
    if len(branches) != len(self.conditionals):
      raise ValueError(f"Give one branch a conditional: this program has "
                       f"{len(self.conditionals)}, got {len(branches)} ({branches}).")
    return self.unconditional + sum(
        sent[branch] for sent, branch in zip(self.conditionals, branches, strict=True))


def wire_bytes_by_branch(hlo_text: str, *, mesh=None, across=None) -> BranchWireBytes:
  """:func:`wire_bytes`, the collectives inside each branch of a conditional apart.

  Walks the program from its entry computation through the computations it
  calls (loop bodies, calls, asynchronous wrappers); the collectives in a
  ``conditional``'s branch computations count in that branch alone. A
  computation called from several places counts at each.

  Args:
    hlo_text: the compiled program's text, e.g.
      ``jax.jit(f).lower(x).compile().as_text()``.
    mesh, across: as for :func:`wire_bytes`: only the collectives that cross
      ``across``.

  Returns:
    A :class:`BranchWireBytes`: the bytes sent on every step, and those of
    each branch of each conditional.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> f = jax.pmap(lambda x: jax.lax.psum(x, "i"), "i")
    >>> n = jax.local_device_count()
    >>> text = f.lower(jnp.ones((n, 1024))).compile().as_text()
    >>> by_branch = qsgd_jax.wire_bytes_by_branch(text)
    >>> by_branch.unconditional == qsgd_jax.wire_bytes(text), by_branch.conditionals
    (True, ())
  """
  devices = _devices(hlo_text)
  computations: dict[str, list[str]] = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    if current is None:
      if (match := _COMPUTATION.match(line)) is not None:
        current = match.group("name")
        computations[current] = []
        if line.startswith("ENTRY"):
          entry = current
    elif line.strip() == "}":
      current = None
    else:
      computations[current].append(line)
  if entry is None:
    total = wire_bytes(hlo_text, mesh=mesh, across=across)
    return BranchWireBytes(total, (), total, total)

  def branches_of(line: str) -> list[str] | None:
    if " conditional(" not in line:
      return None
    if (match := _TRUE_FALSE.search(line)) is not None:
      return [match.group(2), match.group(1)]  # Branch index int(pred): false, then true.
    if (match := _CALLED_LISTS.search(line)) is not None:
      return _names(match.group(1))
    return None

  def callees(line: str) -> list[str]:
    names = _CALLED.findall(line)
    for listed in _CALLED_LISTS.findall(line):
      names += _names(listed)
    return [name for name in names if name in computations]

  def walk(name: str, found: list[tuple[float, ...]],
           depth: int = 0) -> tuple[float, float, float]:
    """Bytes ``name`` sends outside its conditionals, and in all, the cheapest and the
    costliest branch of each conditional taken; each conditional's branches into ``found``
    (a nested one's branches summed in its branch)."""
    if depth > len(computations):
      raise ValueError(f"The HLO's computations call each other in a cycle through {name}.")
    outside = least = most = 0.0
    for line in computations.get(name, ()):
      collective = _collective(line, devices)
      if collective is not None and _counted(collective, mesh, across):
        outside, least, most = (x + collective.bytes_sent for x in (outside, least, most))
      if (branches := branches_of(line)) is not None:
        sent, lows, highs = [], [], []
        for branch in branches:
          nested: list[tuple[float, ...]] = []
          branch_outside, low, high = walk(branch, nested, depth + 1)
          sent.append(branch_outside + sum(sum(n) for n in nested))
          lows.append(low)
          highs.append(high)
        if any(sent):
          found.append(tuple(sent))
        least, most = least + min(lows), most + max(highs)
        continue
      for callee in callees(line):
        callee_outside, low, high = walk(callee, found, depth + 1)
        outside, least, most = outside + callee_outside, least + low, most + high
    return outside, least, most

  conditionals: list[tuple[float, ...]] = []
  unconditional, least, most = walk(entry, conditionals)
  return BranchWireBytes(unconditional, tuple(conditionals), least, most)


def _names(listed: str) -> list[str]:
  return [name.strip().lstrip("%") for name in listed.split(",") if name.strip()]
