"""DeepSpeed's two-round 1-bit average with worker and server error feedback.

The momentum exchange of 1-bit Adam and 0/1 Adam (Tang et al. 2021; Lu et
al. 2022), as DeepSpeed's ``NcclBackend.compressed_allreduce``
(``deepspeed/runtime/comm/nccl.py``) does it for one tensor, here for several
vectors at once in two collectives. With ``n`` devices, each vector of ``d``
elements is zero-padded to ``D``, the next multiple of ``n * lcm(n, 8)``, and
cut into ``n`` chunks of ``D / n`` elements; device ``j`` is the *server* of
chunk ``j`` of every vector.

* Worker: ``c = x + e_w`` (``e_w`` the worker error, ``float32[D]``), one
  scale ``s = ||c||_2 / sqrt(D)``, one sign bit an element (``c >= 0`` gives
  ``+1``, as DeepSpeed's ``sign().add_(1).bool()`` maps zero to ``+1``), and
  ``e_w <- c - s * sign(c)``. One ``all_to_all`` sends chunk ``j`` of the
  packed signs, with every vector's scale, to device ``j``.
* Server ``j``: ``u = sum_k sign_k * (s_k / n) + e_s`` over the ``n``
  workers' chunks (``e_s`` the server error, ``float32[D / n]``), one scale
  ``t = ||u||_2 / sqrt(D / n)``, ``e_s <- u - t * sign(u)``; one
  ``all_gather`` gives every device every server's signs and scales.
* The result, the same on every device: chunk ``j`` is ``t_j * sign(u_j)``.

A device sends ``(n - 1) / n`` of its padded signs twice, plus two float32
scales a vector, against ``2 (n - 1) / n * 32`` bits an element for a float32
all-reduce: about 32x fewer bytes.

All vectors travel together: device ``j``'s row holds chunk ``j`` of every
vector end to end (``width = sum_i D_i / n`` elements), so the worker error of
a device is ``float32[n, width]`` and its server error ``float32[width]``. On
the wire each chunk's signs start on a ``uint32`` word (at most 31 bits of
padding a vector), so that every step works on one vector, and one row of it,
at a time: XLA:CPU adds the ``n`` rows of unpacked signs, or cuts a row out of
an unpacked array, 40 to 50x slower than it unpacks each row by itself.
"""

import dataclasses
import functools
import math
import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qsgd_jax._src import axes as axes_lib
from qsgd_jax._src import wire
from qsgd_jax._src.compressors import packing, pallas_kernels


@dataclasses.dataclass(frozen=True)
class SignLayout:
  """Where each vector's chunks lie in the rows that one exchange sends.

  Attributes:
    sizes: elements of each vector.
    num_devices: ``n``, the devices exchanging.
  """

  sizes: tuple[int, ...]
  num_devices: int

  @functools.cached_property
  def padded_sizes(self) -> tuple[int, ...]:
    """Each vector's length padded to a multiple of ``n * lcm(n, 8)``, as DeepSpeed pads it."""
    n = self.num_devices
    multiple = n * math.lcm(n, 8)
    return tuple(-(-size // multiple) * multiple for size in self.sizes)

  @functools.cached_property
  def chunks(self) -> tuple[int, ...]:
    """Elements of one chunk of each vector, ``padded_size / n``: a multiple of 8."""
    return tuple(size // self.num_devices for size in self.padded_sizes)

  @functools.cached_property
  def offsets(self) -> tuple[int, ...]:
    """Where each vector's chunk starts in a row."""
    return tuple(int(offset) for offset in np.cumsum((0,) + self.chunks[:-1]))

  @property
  def width(self) -> int:
    """Elements of a row: one chunk of every vector."""
    return sum(self.chunks)

  @functools.cached_property
  def word_offsets(self) -> tuple[int, ...]:
    """Where each vector's packed signs start in a row's words, and (last) its scales."""
    return tuple(int(offset) for offset in np.cumsum(
        (0,) + tuple(packing.num_words(chunk, 1) for chunk in self.chunks)))

  @property
  def words(self) -> int:
    """``uint32`` words of a row: each vector's signs, packed from a word of its own, then
    one scale a vector."""
    return self.word_offsets[-1] + len(self.sizes)

  def worker_error_shape(self) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((self.num_devices, self.width), jnp.float32)

  def server_error_shape(self) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((self.width,), jnp.float32)

  def wire_bits(self) -> float:
    """Bits one device sends: the ``all_to_all`` and the ``all_gather`` of ``[n, words]``."""
    result_bytes = 4 * self.num_devices * self.words
    n = self.num_devices
    return 8 * (wire.bytes_sent("all-to-all", result_bytes, n)
                + wire.bytes_sent("all-gather", result_bytes, n))


def sign_layout(sizes, num_devices: int) -> SignLayout:
  """The :class:`SignLayout` of vectors of ``sizes`` elements over ``num_devices``."""
  return SignLayout(tuple(int(size) for size in sizes), int(num_devices))


class Exchanged(NamedTuple):
  """What :func:`exchange` returns.

  Attributes:
    vectors: the 1-bit averages, ``float32[sizes[i]]`` each, the same on every
      device (typed replicated under ``jax.shard_map``).
    worker_error: ``float32[n, width]``, this device's new worker error.
    server_error: ``float32[width]``, its new server error.
    all_finite: ``bool[]``, whether every device's vectors were finite, the
      same on every device (typed replicated).
  """

  vectors: list[jax.Array]
  worker_error: jax.Array
  server_error: jax.Array
  all_finite: jax.Array


def exchange(vectors, worker_error: jax.Array, server_error: jax.Array, layout: SignLayout,
             axis_name: str | None) -> Exchanged:
  """The 1-bit average of ``vectors`` over ``axis_name``, with error feedback.

  Args:
    vectors: this device's float vectors, ``[sizes[i]]`` each (any float dtype;
      quantized in float32).
    worker_error: ``float32[n, width]``, this device's worker error.
    server_error: ``float32[width]``, the error of the chunks it serves.
    layout: from :func:`sign_layout`, with ``n`` the size of ``axis_name``.
    axis_name: a bound mapped axis, or ``None`` for one device (no collective).

  Returns:
    An :class:`Exchanged`.
  """
  n = layout.num_devices
  columns = [slice(offset, offset + chunk)
             for offset, chunk in zip(layout.offsets, layout.chunks, strict=True)]
  compensated = [
      _pad(v.reshape(-1).astype(jnp.float32), padded).reshape(n, chunk) + worker_error[:, cut]
      for v, padded, chunk, cut in zip(vectors, layout.padded_sizes, layout.chunks, columns,
                                       strict=True)]
  worker_scales = jnp.stack([_rms(c) for c in compensated])
  worker_errors, worker_words = [], []
  for c, scale in zip(compensated, worker_scales, strict=True):
    nonnegative = c >= 0
    worker_errors.append(c - _plus_minus(nonnegative) * scale)
    worker_words.append(jnp.stack([_pack(row) for row in nonnegative]))
  send = jnp.concatenate(
      [*worker_words, jnp.broadcast_to(_as_words(worker_scales), (n, len(layout.sizes)))],
      axis=1)
  if axis_name is None:
    received = send
  else:
    received = jax.lax.all_to_all(axes_lib.as_varying(send, axis_name), axis_name, 0, 0)
  # Row k is worker k's chunk of the vectors this device serves.
  signs, scales = _read_rows(received, layout)
  served = []
  for i, cut in enumerate(columns):
    weighted = [row * scale for row, scale in zip(signs[i], scales[:, i] * np.float32(1 / n),
                                                  strict=True)]
    served.append(functools.reduce(operator.add, weighted) + server_error[cut])
  server_scales = jnp.stack([_rms(u) for u in served])
  server_errors, server_words = [], []
  for u, scale in zip(served, server_scales, strict=True):
    nonnegative = u >= 0
    server_errors.append(u - _plus_minus(nonnegative) * scale)
    server_words.append(_pack(nonnegative))
  reply = jnp.concatenate([*server_words, _as_words(server_scales)])
  if axis_name is None:
    gathered = reply[None]
  else:
    gathered = axes_lib.all_gather_replicated(reply, axis_name)
  # Row j is server j's chunk of every vector: a vector's rows, end to end, are its average.
  word_offsets = layout.word_offsets
  out_scales = _read_scales(gathered, layout)
  averages = [
      _scaled_rows(gathered[:, start:stop], out_scales[:, i], chunk).reshape(-1)[:size]
      for i, (start, stop, chunk, size) in enumerate(zip(
          word_offsets[:-1], word_offsets[1:], layout.chunks, layout.sizes, strict=True))]
  # A NaN or inf in any worker's vector makes its scale so, then the sums its servers
  # add, then their scales: the gathered server scales tell every device alike.
  all_finite = jnp.all(jnp.isfinite(out_scales))
  return Exchanged(averages, jnp.concatenate(worker_errors, axis=1),
                   jnp.concatenate(server_errors), all_finite)


def _pad(vector: jax.Array, size: int) -> jax.Array:
  return vector if vector.shape[0] == size else jnp.pad(vector, (0, size - vector.shape[0]))


def _plus_minus(nonnegative: jax.Array) -> jax.Array:
  return jnp.where(nonnegative, np.float32(1), np.float32(-1))


def _rms(x: jax.Array) -> jax.Array:
  """``||x||_2 / sqrt(x.size)``, a float32 scalar."""
  return jnp.sqrt(jnp.sum(jnp.square(x))) / np.float32(math.sqrt(x.size))


def _pack(nonnegative: jax.Array) -> jax.Array:
  """``bool[chunk]`` as ``uint32[ceil(chunk / 32)]``, one bit an element."""
  return packing.pack(nonnegative.astype(jnp.uint32), 1)


def _as_words(scales: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(scales, jnp.uint32)


def _unpacked_rows(words: jax.Array, chunk: int) -> jax.Array:
  """``uint32[k, ceil(chunk / 32)]``, a vector's signs in ``k`` rows, as +-1, ``float32[k, chunk]``.

  Unpacked in one piece, not row by row and joined: XLA:CPU runs a fused
  concatenation an element at a time, some 18x slower.
  """
  rows, row_words = words.shape
  bits = packing.unpack(words.reshape(-1), rows * row_words * 32, 1).reshape(rows, -1)
  return _plus_minus(bits[:, :chunk].astype(bool))


def _scaled_rows(words: jax.Array, scales: jax.Array, chunk: int) -> jax.Array:
  """``uint32[k, ceil(chunk / 32)]`` signs times their rows' ``float32[k]`` scales,
  ``float32[k, chunk]``; on GPU with ``QSGD_JAX_PALLAS=gpu``, one fused kernel."""
  def xla(words, scales):
    return _unpacked_rows(words, chunk) * scales[:, None]

  def fused(words, scales, *, interpret):
    return pallas_kernels.sign_unpack_rows(words, scales, interpret=interpret)[:, :chunk]

  return pallas_kernels.dispatch(xla, fused, words, scales)


def _read_rows(rows: jax.Array, layout: SignLayout) -> tuple[list[list[jax.Array]], jax.Array]:
  """``rows`` (``uint32[k, words]``) as signs and scales.

  Returns:
    For each vector ``i``, its ``k`` rows of signs, ``float32[chunks[i]]`` of
    +-1 each; and the scales, ``float32[k, len(sizes)]``.
  """
  word_offsets = layout.word_offsets
  signs = [[_plus_minus(packing.unpack(row[start:stop], chunk, 1).astype(bool)) for row in rows]
           for start, stop, chunk in zip(word_offsets[:-1], word_offsets[1:], layout.chunks,
                                         strict=True)]
  return signs, _read_scales(rows, layout)


def _read_scales(rows: jax.Array, layout: SignLayout) -> jax.Array:
  """The scales of ``rows`` (``uint32[k, words]``), ``float32[k, len(sizes)]``."""
  return jax.lax.bitcast_convert_type(rows[:, layout.word_offsets[-1]:], jnp.float32)
