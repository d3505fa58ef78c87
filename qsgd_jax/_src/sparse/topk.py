"""The top-k compressor: the largest magnitudes of each chunk, their positions bit-packed."""

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from qsgd_jax._src import base
from qsgd_jax._src.compressors import packing
from qsgd_jax._src.sparse import values as values_lib

_VALUE_BITS = (2, 4, 8)
_VALUE_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))
_QUANTIZERS = ("scaled", "bin_means")
_MAX_CHUNK = 2**24


@dataclasses.dataclass(frozen=True)
class TopK(base.Compressor):
  r"""Keeps the ``k`` largest magnitudes of each chunk: their positions and values.

  The array, flattened in row-major order, is cut into chunks of ``chunk``
  elements; the last chunk is zero-padded to whole (the padding can be
  picked only where fewer than ``k`` real elements are nonzero, and is
  dropped on decode). In each chunk the ``k`` elements of largest
  :math:`|x_i|` are kept (``jax.lax.top_k``: ties to the lower position) and
  everything else decodes to zero. Top-k is biased,
  :math:`\|x - \mathrm{top}_k(x)\|^2 \le (1 - k / c) \|x\|^2` for a chunk of
  :math:`c`, and meant to run with error feedback, which keeps what it drops
  for the next step (Stich et al. 2018).

  On the wire, for each chunk, ``k`` positions of
  :math:`\lceil \log_2 c \rceil` bits, bit-packed into ``uint32`` words, then
  the values:

  * ``value_bits=None``: in ``value_dtype`` (float32, 32 bits a value;
    bfloat16, 16 bits, rounded to nearest);
  * ``value_bits`` of 8, 4 or 2, ``quantizer="scaled"``: sign+magnitude
    codes against the chunk's largest kept magnitude, one float32 scale a
    chunk, rounded stochastically: unbiased given the kept positions,
    :math:`E[\mathrm{decode}] = \mathrm{top}_k(x)`;
  * ``value_bits`` with ``quantizer="bin_means"``: SparseLoCo's quantizer, the
    centred values of the whole payload in :math:`2^b` bins of
    :math:`6 \sigma / 2^b`, each decoded to its mean, a table of
    :math:`1 + 2^b` float32 a payload; deterministic and biased.

  So a chunk costs about :math:`k (\lceil \log_2 c \rceil + b)` bits (plus 32
  with per-chunk scales), where dense float32 costs :math:`32 c`; the index
  words and value words are each padded to a whole word once an array.

  Sparse payloads cannot be added: each device keeps other positions. They are
  all-gathered and decoded one by one (``gather_only``):
  :func:`~qsgd_jax.compressed_allreduce` picks ``method="all_gather"`` for
  this compressor and averages the decoded payloads, a sum over the devices
  divided by their number (GRACE's and DGC's aggregation), and the
  reductions that sum payloads refuse it.

  Attributes:
    k: elements kept a chunk, an int in ``[1, chunk]``; or give ``density``.
    density: the fraction kept, in ``(0, 1]``: ``k = max(1, round(density *
      chunk))``.
    chunk: elements a chunk, in ``[1, 2**24]``.
    value_bits: ``None`` (values in ``value_dtype``), or 8, 4 or 2 bits a value.
    value_dtype: ``jnp.float32`` or ``jnp.bfloat16``, with ``value_bits=None``
      only. A value rounded past a narrower leaf's largest (float16's 65504 in
      bfloat16) decodes to that largest.
    quantizer: with ``value_bits`` only, ``"scaled"`` (per-chunk scales,
      stochastic) or ``"bin_means"`` (SparseLoCo's).

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> topk = qsgd_jax.TopK(k=2, chunk=4)
    >>> x = jnp.array([0.1, -3.0, 2.0, 0.5, 4.0, 0.0, 0.0, -1.0])
    >>> topk.decode(topk.encode(jax.random.key(0), x))
    Array([ 0., -3.,  2.,  0.,  4.,  0.,  0., -1.], dtype=float32)
    >>> qsgd_jax.TopK(k=2, chunk=64).wire_bits((4096,))  # 64 chunks x 2 x (6 + 32) bits
    4864

  References:
    Stich, Cordonnier and Jaggi, `Sparsified SGD with Memory
    <https://arxiv.org/abs/1809.07599>`_, NeurIPS 2018; Lin et al., `Deep
    Gradient Compression <https://arxiv.org/abs/1712.01887>`_, ICLR 2018;
    Sarfi et al., `SparseLoCo <https://arxiv.org/abs/2508.15706>`_, 2025
    (the bin-means quantizer).
  """

  k: int | None = None
  density: float | None = None
  chunk: int = 64
  value_bits: int | None = None
  value_dtype: np.dtype = jnp.float32
  quantizer: Literal["scaled", "bin_means"] = "scaled"

  gather_only = True

  def __post_init__(self):
    base.check_int_in_range("TopK", "chunk", self.chunk, 1, _MAX_CHUNK)
    object.__setattr__(self, "k", kept_count(self.k, self.density, self.chunk, "TopK"))
    if self.value_bits is not None and self.value_bits not in _VALUE_BITS:
      raise ValueError(f"TopK: value_bits must be None or one of {_VALUE_BITS}, got "
                       f"{self.value_bits!r}.")
    try:
      dtype = np.dtype(self.value_dtype)
    except TypeError as error:
      raise ValueError(f"TopK: value_dtype must be float32 or bfloat16, got "
                       f"{self.value_dtype!r}.") from error
    if dtype not in _VALUE_DTYPES:
      raise ValueError(
          f"TopK: value_dtype must be float32 or bfloat16, got {dtype}: a narrower float "
          "(float16 overflows above 65504) cannot hold every kept value; for fewer bits a "
          "value, give value_bits.")
    object.__setattr__(self, "value_dtype", dtype)
    if self.quantizer not in _QUANTIZERS:
      raise ValueError(f"TopK: quantizer must be one of {_QUANTIZERS}, got {self.quantizer!r}.")
    if self.value_bits is not None and dtype != np.dtype(jnp.float32):
      raise ValueError(
          f"TopK: value_dtype={dtype} is for values sent as floats, but value_bits="
          f"{self.value_bits} sends them as codes: give one of the two.")
    if self.value_bits is None and self.quantizer != "scaled":
      raise ValueError(
          f"TopK: quantizer={self.quantizer!r} quantizes values, but value_bits=None sends "
          "them as floats: give value_bits (2, 4 or 8) with it.")

  @property
  def deterministic(self) -> bool:
    """Whether ``encode`` ignores its key: all but the stochastic per-chunk scales."""
    return self.value_bits is None or self.quantizer == "bin_means"

  @property
  def index_bits(self) -> int:
    """The bits a kept position takes, ``ceil(log2(chunk))``, and at least 1."""
    return max(1, (self.chunk - 1).bit_length())

  def bucket_length(self, shape: tuple[int, ...]) -> int:
    del shape  # The same chunks for every shape.
    return self.chunk

  def encode(self, key: jax.Array, x: jax.Array) -> base.Payload:
    x = jnp.asarray(x)
    dtype = x.dtype
    chunks = base.to_buckets(base.as_float32(x, "TopK.encode").reshape(-1), self.chunk)
    _, positions = jax.lax.top_k(jnp.abs(chunks), self.k)
    kept = jnp.take_along_axis(chunks, positions, axis=1)
    words = [packing.pack(positions.reshape(-1).astype(jnp.uint32), self.index_bits)]
    if self.value_bits is None:
      words.append(values_lib.float_words(kept, self.value_dtype))
      scales = jnp.zeros((0, 0), jnp.float32)
    else:
      if self.quantizer == "scaled":
        codes, scales = values_lib.scaled_codes(key, kept, self.value_bits)
      else:
        codes, scales = values_lib.bin_mean_codes(kept, self.value_bits)
      words.append(packing.pack(codes.reshape(-1), self.value_bits))
    return base.Payload(packed=jnp.concatenate(words), scales=scales, shape=x.shape,
                        dtype=dtype)

  def kept(self, payload: base.Payload) -> tuple[jax.Array, jax.Array]:
    """The kept positions within their chunks and their decoded values, ``[chunks, k]`` each:
    ``(int32 positions, float32 values)``."""
    chunks = self._num_chunks(payload.shape)
    count = chunks * self.k
    index_words = packing.num_words(count, self.index_bits)
    positions = packing.unpack(payload.packed[:index_words], count, self.index_bits)
    rest = payload.packed[index_words:]
    if self.value_bits is None:
      kept = values_lib.float_values(rest, count, self.value_dtype)
    else:
      codes = packing.unpack(rest, count, self.value_bits).reshape(chunks, self.k)
      kept = (values_lib.scaled_values(codes, payload.scales, self.value_bits)
              if self.quantizer == "scaled" else values_lib.bin_mean_values(codes,
                                                                             payload.scales))
    return positions.astype(jnp.int32).reshape(chunks, self.k), kept.reshape(chunks, self.k)

  def decode(self, payload: base.Payload) -> jax.Array:
    positions, kept = self.kept(payload)
    decoded = self.scattered(payload.shape, positions, kept)
    # A value of a narrower float that rounding took past its dtype's largest (65504 of
    # float16 as bfloat16 is 65536) decodes to that largest, not to inf.
    largest = float(jnp.finfo(payload.dtype).max)
    if largest < float(jnp.finfo(jnp.float32).max):
      decoded = jnp.where(jnp.isfinite(decoded), jnp.clip(decoded, -largest, largest), decoded)
    return decoded.astype(payload.dtype)

  def support(self, payload: base.Payload) -> jax.Array:
    """``float32`` of ``payload.shape``: 1 where a position was kept, else 0."""
    positions, kept = self.kept(payload)
    return self.scattered(payload.shape, positions, jnp.ones_like(kept))

  def scattered(self, shape: tuple[int, ...], positions: jax.Array,
                kept: jax.Array) -> jax.Array:
    """``float32`` of ``shape``: ``kept`` at ``positions`` of each chunk (as :meth:`kept`
    gives them), zeros elsewhere.

    The positions of a chunk are distinct, so the scatter writes each element
    once: the same bits whatever order it runs in.
    """
    chunks = positions.shape[0]
    rows = jnp.arange(chunks, dtype=jnp.int32)[:, None]
    dense = jnp.zeros((chunks, self.chunk), jnp.float32).at[rows, positions].set(
        kept, unique_indices=True)
    return base.from_buckets(dense, shape)

  def _num_chunks(self, shape: tuple[int, ...]) -> int:
    return -(-math.prod(shape) // self.chunk)


def kept_count(k, density, chunk: int, owner: str) -> int:
  """``k``, or from ``density`` ``max(1, round(density * chunk))``, checked to lie in
  ``[1, chunk]``: exactly one of the two must be given."""
  if (k is None) == (density is None):
    raise ValueError(f"{owner}: give exactly one of k and density, got k={k!r}, "
                     f"density={density!r}.")
  if density is not None:
    check_fraction(owner, "density", density)
    return max(1, round(density * chunk))
  if not isinstance(k, int | np.integer) or isinstance(k, bool) or not 1 <= k <= chunk:
    raise ValueError(f"{owner}: k must be an int in (0, chunk] = [1, {chunk}], got {k!r}.")
  return int(k)


def check_fraction(owner: str, name: str, value) -> None:
  """Raises ``ValueError`` naming ``owner`` and ``name`` unless ``value`` is a number in
  ``(0, 1]``."""
  if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value <= 1:
    raise ValueError(f"{owner}: {name} must be a fraction in (0, 1], got {value!r}.")
