"""Bytes on the wire, read from a compiled program's HLO.

The collectives in the optimized HLO, with their result types, are what the
runtime sends. Each device's share for a group of ``n`` devices and a result of
``R`` bytes, under the usual ring and pairwise algorithms:

* ``all-reduce``: ``2 (n - 1) / n * R`` (a reduce-scatter, then an all-gather);
* ``all-gather`` and ``all-to-all``: ``(n - 1) / n * R``;
* ``reduce-scatter``: ``(n - 1) * R`` (``R`` is one device's shard);
* ``collective-permute``: ``R`` (each device sends its buffer to one peer).
"""

import math
import re
from typing import NamedTuple

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
_EXPLICIT_GROUPS = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_PAIRS = re.compile(r"source_target_pairs=\{(.*?)\}\}")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")
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


def _array_bytes(result_type: str) -> list[int]:
  return [
      _ITEM_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
      for dtype, dims in _ARRAY_TYPE.findall(result_type)
      if dtype in _ITEM_BYTES
  ]


def _group_size(line: str, devices: int) -> int:
  if match := _EXPLICIT_GROUPS.search(line):
    return len([d for d in match.group(1).split(",") if d])
  if match := _IOTA_GROUPS.search(line):
    return int(match.group(2))
  if match := _PAIRS.search(line):
    return len(set(re.findall(r"\d+", match.group(1))))
  return devices


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
  header = hlo_text[: hlo_text.find("\n")]
  devices = max(
      int(m.group(1)) if (m := pattern.search(header)) else 1
      for pattern in (_PARTITIONS, _REPLICAS)
  )
  found = []
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.search(line)
    if match is None:
      continue
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
    n = _group_size(line, devices)
    found.append(Collective(kind, result_type, result_bytes, n, bytes_sent(kind, result_bytes, n)))
  return found


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


def wire_bytes(hlo_text: str) -> float:
  """Total bytes one device sends in the collectives of an optimized HLO module.

  Args:
    hlo_text: the compiled program's text, e.g.
      ``jax.jit(f).lower(x).compile().as_text()``.

  Returns:
    The sum of :attr:`Collective.bytes_sent` over :func:`collectives_in_hlo`.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> f = jax.pmap(lambda x: jax.lax.psum(x, "i"), "i")
    >>> n = jax.local_device_count()
    >>> text = f.lower(jnp.ones((n, 1024))).compile().as_text()
    >>> qsgd_jax.wire_bytes(text) == (2 * (n - 1) / n * 4096 if n > 1 else 0)
    True
  """
  return sum(c.bytes_sent for c in collectives_in_hlo(hlo_text))
