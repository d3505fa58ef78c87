"""The compressor interface and the payload it puts on the wire."""

import abc
import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

_MAGNITUDE_BITS = 0x7FFFFFFF  # All bits of a float32 but its sign.


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["packed", "scales"],
    meta_fields=["shape", "dtype"],
)
@dataclasses.dataclass(frozen=True)
class Payload:
  """What a compressor sends for one array.

  Attributes:
    packed: the codes, bit-packed into ``uint32`` words by the quantizers; the
      values themselves for :class:`~qsgd_jax.Cast` and
      :class:`~qsgd_jax.Identity`.
    scales: ``float32[num_buckets, num_scales]``, what each bucket needs to
      turn its codes back into values (empty for the baselines).
    shape: static shape of the encoded array.
    dtype: static dtype of the encoded array; ``decode`` returns it.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> payload = qsgd_jax.QSGD(bits=4, bucket_size=512).encode(jax.random.key(0), jnp.ones(1024))
    >>> payload.packed.dtype, payload.packed.shape, payload.scales.shape, payload.shape
    (dtype('uint32'), (128,), (2, 1), (1024,))
  """

  packed: jax.Array
  scales: jax.Array
  shape: tuple[int, ...]
  dtype: np.dtype


def payload_bits(payload: Payload) -> int:
  """Bits the payload's arrays occupy, from their static shapes and dtypes."""
  arrays = (payload.packed, payload.scales)
  return 8 * sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in arrays)


class Compressor(abc.ABC):
  """A pure, stateless map from an array to a compact :class:`Payload` and back.

  Subclasses are frozen dataclasses, hashable and usable as static arguments of
  ``jax.jit``. ``encode`` and ``decode`` are pure functions of their inputs and
  work under ``jit`` and ``vmap``.

  Attributes:
    unbiased: whether ``E[decode(encode(key, x))] = x`` over keys.
    deterministic: whether ``encode`` ignores ``key``.
    gather_only: whether its payloads can only be all-gathered, each decoded
      on its own: a sparse payload (:class:`~qsgd_jax.TopK`) holds other
      coordinates on every device, so codes cannot be added and a sum
      re-encoded would be sparsified a second time. The reductions that sum
      payloads refuse it.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> compressor = qsgd_jax.QSGD(bits=4)
    >>> isinstance(compressor, qsgd_jax.Compressor), compressor.unbiased
    (True, True)
    >>> x = jnp.linspace(-1.0, 1.0, 1024)
    >>> compressor.decode(compressor.encode(jax.random.key(0), x)).shape
    (1024,)
  """

  unbiased: bool = False
  deterministic: bool = False
  gather_only: bool = False

  @abc.abstractmethod
  def encode(self, key: jax.Array, x: jax.Array) -> Payload:
    """Compresses ``x`` (any shape, a float dtype) with the PRNG ``key``."""

  @abc.abstractmethod
  def decode(self, payload: Payload) -> jax.Array:
    """Reconstructs an array of ``payload.shape`` and ``payload.dtype``."""

  def encode_concatenated(self, key: jax.Array, parts: Sequence[jax.Array]) -> Payload:
    """``encode(key, jnp.concatenate(parts))``, bit for bit, from the parts.

    A two-phase sum quantizes pieces that span several leaves of a tree;
    encoding the leaves' rows where they lie, rather than writing them out
    end to end first, saves a pass over the whole gradient. This default
    writes the concatenation out; a compressor whose payload of runs laid end
    to end is their payloads end to end overrides it.

    Args:
      key: a PRNG key, as for ``encode``.
      parts: float arrays of one dtype, alike but in their first axis.

    Returns:
      The :class:`Payload` of ``encode(key, jnp.concatenate(parts))``.
    """
    return self.encode(key, parts[0] if len(parts) == 1 else jnp.concatenate(parts))

  def bounded_to(self, largest: float) -> "Compressor":
    """This compressor, its decoded magnitudes at most ``largest`` where its inputs' are.

    The collectives quantize in float32 what they cast back to a leaf's
    dtype, such as the float32 mean of float16 gradients; they call this
    with the leaves' narrowest dtype's largest value, so that no decode
    overflows that dtype. This default returns the compressor itself, for a
    compressor whose decoded magnitudes never exceed its input's largest.
    """
    del largest
    return self

  def encoded_all_finite(self, payload: Payload) -> jax.Array | None:
    """Whether every value encoded into ``payload`` was finite, told by the payload alone.

    A step must notice a NaN or inf in any device's gradient. Where the
    payload tells, that costs a look at its scales instead of another pass
    over the gradient.

    Args:
      payload: from ``encode`` or ``encode_concatenated``, or a stack of such
        payloads (leading batch axes).

    Returns:
      ``bool[]``, false exactly when some encoded value was NaN or infinite;
      or ``None`` (the default) for a compressor whose payloads cannot tell.
    """
    del payload
    return None

  def bucket_length(self, shape: tuple[int, ...]) -> int | None:
    """How many consecutive elements of an array of ``shape`` share their scales.

    ``encode`` quantizes the array, flattened in row-major order, as runs
    of this many elements, each run on its own. So arrays zero-padded to
    whole runs can be laid end to end and cut at run boundaries, and every
    run is quantized as it would be alone: the collectives batch and split
    leaves this way. ``None`` (the default) means that one scale spans the
    whole array, which must then be encoded whole.
    """
    del shape
    return None

  def wire_bits(self, shape: tuple[int, ...], dtype=jnp.float32) -> int:
    """Exact bits that ``encode`` of an array of ``shape`` and ``dtype`` occupies.

    Computed from the payload's static shapes (no data is touched), so it is
    a Python int usable for accounting inside traced code.
    """
    return _wire_bits(self, tuple(shape), np.dtype(dtype))


class FixedBuckets:
  """For a compressor with a ``bucket_size`` field: runs of that many elements.

  ``bucket_size=None`` is one run for the whole array. Mixed in before the
  compressor's base class.
  """

  def bucket_length(self, shape: tuple[int, ...]) -> int | None:
    del shape  # The same runs for every shape.
    return self.bucket_size

  def _bucket_len(self, size: int) -> int:
    """Elements of a bucket of an array of ``size`` elements (its only one if shorter)."""
    return max(1, size if self.bucket_size is None else min(self.bucket_size, size))


class PackedBuckets(FixedBuckets):
  """For a compressor whose payload is each bucket's scales and its ``bits``-bit codes, packed.

  ``encode_concatenated`` then encodes each part in place, where the parts
  are whole buckets whose codes fill whole words: the scales of each part's
  buckets, and its codes packed after the previous part's, with the random
  draws the concatenation would get. Subclasses give ``_bucket_scales``
  and ``_pack``, which ``encode`` uses too. Mixed in before the compressor's
  base class.

  A bucket's scales must be NaN or infinite exactly when one of its values
  is (maxima and minima of the floats' bits, :func:`bucket_max_abs` and
  :func:`bucket_max_min`, are): ``encoded_all_finite`` reads the scales.
  """

  def encoded_all_finite(self, payload: Payload) -> jax.Array:
    return jnp.all(jnp.isfinite(payload.scales))

  def encode_concatenated(self, key: jax.Array, parts: Sequence[jax.Array]) -> Payload:
    owner = f"{type(self).__name__}.encode_concatenated"
    dtype = parts[0].dtype
    buckets = concatenated_parts([as_float32(part, owner) for part in parts],
                                 self._bucket_len(sum(part.size for part in parts)), self.bits)
    if buckets is None:
      return super().encode_concatenated(key, parts)
    scales = [self._bucket_scales(b, dtype) for b, _, _ in buckets]
    shape = (sum(part.shape[0] for part in parts), *parts[0].shape[1:])
    return self._pack(key, [(*b, s) for b, s in zip(buckets, scales, strict=True)],
                      jnp.concatenate(scales), shape, dtype)


class SharedScaleCompressor(Compressor):
  """A compressor whose codes are integers against per-bucket scales.

  Devices that agree on the scales can add their integer codes in one
  integer ``psum`` and decode the sum: the ``"psum"`` method of
  :func:`qsgd_jax.quantized_psum`. ``encode`` is ``integer_codes`` against
  ``local_scales``, bit-packed.

  Attributes:
    scale_reductions: for each scale column, ``"max"`` or ``"min"``: how
      devices merge their local scales into a shared one that every device's
      values fit.

  Examples:
    >>> import qsgd_jax
    >>> isinstance(qsgd_jax.QSGD(), qsgd_jax.SharedScaleCompressor)
    True
    >>> qsgd_jax.QSGD().scale_reductions
    ('max',)
  """

  scale_reductions: tuple[str, ...] = ()

  @property
  @abc.abstractmethod
  def code_range(self) -> tuple[int, int]:
    """The smallest and largest integer code."""

  @abc.abstractmethod
  def local_scales(self, x: jax.Array) -> jax.Array:
    """``float32[num_buckets, len(scale_reductions)]`` of ``x`` alone."""

  @abc.abstractmethod
  def integer_codes(self, key: jax.Array, x: jax.Array, scales: jax.Array) -> jax.Array:
    """``int32[x.size]`` codes of ``x`` (flattened) against ``scales``."""

  @abc.abstractmethod
  def decode_code_sum(self, total: jax.Array, scales: jax.Array, count: int,
                      shape: tuple[int, ...]) -> jax.Array:
    """float32 values of ``shape`` from the sum of ``count`` devices' codes."""


@functools.lru_cache(maxsize=4096)
def _wire_bits(compressor: Compressor, shape: tuple[int, ...], dtype: np.dtype) -> int:
  payload = jax.eval_shape(
      compressor.encode, jax.random.key(0), jax.ShapeDtypeStruct(shape, dtype)
  )
  return payload_bits(payload)


def as_key(key: jax.Array | int) -> jax.Array:
  """A typed PRNG key from a seed, a typed key, or a raw ``uint32[2]`` key.

  A seed is any integer scalar: a Python or numpy int, a 0-d integer array,
  or a traced ``int32[]`` (what ``optax.inject_hyperparams`` passes). Host
  integers give the key ``jax.random.key`` gives their Python int.
  """
  if isinstance(key, bool) or (isinstance(key, np.ndarray | np.generic) and key.dtype == bool):
    raise TypeError(f"key must be a PRNG key or an integer seed, got the bool {key!r}.")
  if isinstance(key, int | np.integer) or (
      isinstance(key, np.ndarray) and key.shape == () and np.issubdtype(key.dtype, np.integer)):
    return jax.random.key(int(key))
  key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key
  if key.dtype == jnp.uint32 and key.shape[-1:] == (2,):
    return jax.random.wrap_key_data(key)
  if key.shape == () and jnp.issubdtype(key.dtype, jnp.integer):
    return jax.random.key(key)
  raise TypeError(
      f"key must be a PRNG key, a raw uint32[2] key or an integer seed, "
      f"got {key.dtype}{list(key.shape)}.")


def check_static_options(owner: str, **options) -> None:
  """Raises ``TypeError`` if an option that fixes shapes or control flow is a JAX array.

  ``optax.inject_hyperparams`` turns every numeric argument of a factory into
  a JAX array (traced under ``jit`` and ``pmap``) unless it is named in
  ``static_args``; options such as ``bits`` and ``bucket_size`` set the shapes
  of what is sent and must stay Python values.

  Args:
    owner: the factory, named in the error.
    **options: the static options, by name.
  """
  arrays = [name for name, value in options.items() if isinstance(value, jax.Array)]
  if arrays:
    names = tuple(options)
    raise TypeError(
        f"{owner}: {', '.join(arrays)} got a JAX array, but {', '.join(names)} are static "
        "options (they fix the shapes sent and the program's control flow) and must be "
        "Python values. With optax.inject_hyperparams, name them in static_args: "
        f"optax.inject_hyperparams({owner}, static_args={names!r})(...)."
    )


def check_float_leaves(tree, owner: str) -> None:
  """Raises ``TypeError`` naming the first leaf of ``tree`` that is not float."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    dtype = jnp.result_type(leaf)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(
          f"{owner}: leaf {jax.tree_util.keystr(path) or '<root>'} has dtype {dtype}; "
          "only floating-point leaves can be quantized."
      )


def all_finite(tree) -> jax.Array:
  """``bool[]``: whether every float leaf of ``tree`` is finite (``True`` for none).

  ``x * 0`` is zero for a finite ``x`` and NaN for an infinite or NaN one, so
  the sum of a leaf's ``x * 0`` is finite exactly when the leaf is (and
  cannot overflow). XLA on CPU fuses that product into the sum; it wrote
  ``isfinite(leaf)`` out as a boolean array a leaf before reducing it: 40% of
  the kernel time of the default step on ResNet-50's gradient (two CPU
  devices, ``benchmarks/step_cost.py``). Integer leaves are always finite.
  """
  sums = [jnp.sum(leaf * jnp.zeros((), leaf.dtype), dtype=jnp.float32)
          for leaf in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(leaf), jnp.floating)]
  return jnp.isfinite(sum(sums)) if sums else jnp.bool_(True)


def as_float32(x: jax.Array, owner: str) -> jax.Array:
  """``x`` in float32, or a ``TypeError`` naming ``owner`` if it is not float."""
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{owner} expects a floating-point array, got dtype {x.dtype}.")
  return x.astype(jnp.float32)


def check_bucket_size(owner: str, bucket_size: int | None) -> None:
  """Raises ``ValueError`` unless ``bucket_size`` is None or a positive int."""
  if bucket_size is not None and (
      not isinstance(bucket_size, int) or isinstance(bucket_size, bool) or bucket_size <= 0
  ):
    raise ValueError(f"{owner}: bucket_size must be a positive int or None, got {bucket_size!r}.")


def check_int_in_range(owner: str, name: str, value, low: int, high: int) -> None:
  """Raises ``ValueError`` unless ``low <= value <= high`` is an int."""
  if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
    raise ValueError(f"{owner}: {name} must be an int in [{low}, {high}], got {value!r}.")


def to_buckets(flat: jax.Array, bucket_len: int, mode: str = "constant") -> jax.Array:
  """Views a vector as ``[num_buckets, bucket_len]``, padding the last bucket.

  Args:
    flat: vector of ``n`` elements.
    bucket_len: static bucket length, at least 1.
    mode: ``jnp.pad`` mode for the padding; ``"constant"`` pads zeros,
      ``"edge"`` repeats the last element (so minima and maxima keep).

  Returns:
    ``[ceil(n / bucket_len), bucket_len]``.
  """
  n = flat.shape[0]
  num_buckets = -(-n // bucket_len)
  pad = num_buckets * bucket_len - n
  if pad and n:
    flat = jnp.pad(flat, (0, pad), mode=mode)
  return flat.reshape(num_buckets, bucket_len)


def bucket_parts(
    flat: jax.Array, bucket_len: int, mode: str = "constant", num_bits: int | None = None
) -> list[tuple[jax.Array, int, int]]:
  """The buckets of a vector in parts that XLA reads without copying the vector.

  :func:`to_buckets` pads the whole vector, and XLA on CPU writes that padded
  copy out in full wherever two computations read it (the scales and the
  codes do), a whole extra pass. Here the whole buckets are a view of
  ``flat`` and only a short last bucket is padded, on its own.

  Args:
    flat: vector of ``n`` elements.
    bucket_len: static bucket length, at least 1.
    mode: ``jnp.pad`` mode for the short bucket, as in :func:`to_buckets`.
    num_bits: bits a code, if the parts' codes are to be packed one after
      the other: unless the whole buckets fill whole ``uint32`` words, the
      vector is one padded part, as from :func:`to_buckets`.

  Returns:
    ``(buckets, start, size)`` for each part, in order: ``buckets`` is
    ``[num_buckets, bucket_len]``, its first element is element ``start`` of
    ``flat``, and it holds ``size`` elements of ``flat`` (the rest padding).
    Together the parts' buckets are :func:`to_buckets` of ``flat``.
  """
  n = flat.shape[0]
  whole, short = divmod(n, bucket_len)
  if not (whole and short) or (num_bits is not None and bucket_len * num_bits % 32):
    return [(to_buckets(flat, bucket_len, mode), 0, n)]
  start = whole * bucket_len
  last = jnp.pad(flat[start:], (0, bucket_len - short), mode=mode)[None]
  return [(flat[:start].reshape(whole, bucket_len), 0, start), (last, start, short)]


def concatenated_parts(
    parts: Sequence[jax.Array], bucket_len: int, num_bits: int
) -> list[tuple[jax.Array, int, int]] | None:
  """The buckets of ``parts`` laid end to end, as :func:`bucket_parts` gives them, in place.

  For ``encode_concatenated``: each part is whole buckets already, and its
  codes packed one after the other fill whole ``uint32`` words (all but the
  last part's), so each part's words follow the previous part's as the
  concatenation's would.

  Args:
    parts: float32 ``[num_buckets, bucket_len]`` each.
    bucket_len: the concatenation's bucket length.
    num_bits: bits a code.

  Returns:
    ``(buckets, start, size)`` for each part, as from :func:`bucket_parts`;
    ``None`` if a part is not whole buckets or not whole words (the caller
    then encodes the concatenation).
  """
  out, start = [], 0
  for k, part in enumerate(parts):
    if part.ndim != 2 or part.shape[1] != bucket_len:
      return None
    if k < len(parts) - 1 and part.size * num_bits % 32:
      return None
    out.append((part, start, part.size))
    start += part.size
  return out


def bucket_parts_with_scales(
    flat: jax.Array, bucket_len: int, scales: jax.Array, mode: str = "constant",
    num_bits: int | None = None,
):
  """Each part of :func:`bucket_parts`, with the rows of ``scales`` for its buckets.

  Yields:
    ``(buckets, start, size, part_scales)``.
  """
  for buckets, start, size in bucket_parts(flat, bucket_len, mode, num_bits):
    first = start // bucket_len
    yield buckets, start, size, scales[first : first + buckets.shape[0]]


def _float_bits(buckets: jax.Array, dtype) -> jax.Array:
  return jax.lax.bitcast_convert_type(buckets.astype(jnp.float32), dtype)


def _as_float(bits: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def bucket_max_abs(buckets: jax.Array) -> jax.Array:
  """Each bucket's largest magnitude, ``float32[num_buckets]``; NaN propagates.

  Integer maxima of the float32 bits, in one two-operand reduction (one pass
  over ``buckets``, and cheaper than a float maximum, which must test every
  element for NaN). A float's magnitude orders like its bits with the sign
  cleared, NaN above infinity. Read as signed integers, the values with the
  sign clear are the largest, and among them the largest magnitude has the
  largest bits; read as unsigned integers, the values with the sign set are
  the largest, and among them likewise. So the larger magnitude of the signed
  and the unsigned maximum is the largest of all.
  """
  (magnitude,) = _max_abs_and_sums(buckets, ())
  return magnitude


def bucket_max_abs_and_sum_of_squares(
    buckets: jax.Array, scale: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """:func:`bucket_max_abs`, and each bucket's sum of ``(x * scale)**2``, in one pass.

  Args:
    buckets: ``float32[num_buckets, bucket_len]``.
    scale: ``float32[num_buckets]``, a factor for each bucket's squares.

  Returns:
    ``(max_abs, sum_of_squares)``, ``float32[num_buckets]`` each.
  """
  scaled = buckets * scale[:, None]
  magnitude, sum_of_squares = _max_abs_and_sums(buckets, (scaled * scaled,))
  return magnitude, sum_of_squares


def _max_abs_and_sums(buckets: jax.Array, summands: tuple[jax.Array, ...]) -> tuple:
  """Largest magnitudes, then the row sums of ``summands``, in one reduction.

  A float sum goes into the integer reduction rather than a reduction of its
  own: XLA on CPU hands a one-operand float sum of a computed array to a
  library, after writing the whole array out.
  """
  signed, unsigned, *sums = jax.lax.reduce(
      (_float_bits(buckets, jnp.int32), _float_bits(buckets, jnp.uint32), *summands),
      (np.int32(np.iinfo(np.int32).min), np.uint32(0), *(np.float32(0) for _ in summands)),
      lambda a, b: (jnp.maximum(a[0], b[0]), jnp.maximum(a[1], b[1]),
                    *(p + q for p, q in zip(a[2:], b[2:], strict=True))),
      (1,),
  )
  magnitude = jnp.maximum(
      jax.lax.bitcast_convert_type(signed, jnp.uint32) & np.uint32(_MAGNITUDE_BITS),
      unsigned & np.uint32(_MAGNITUDE_BITS),
  )
  return _as_float(magnitude), *sums


def bucket_max_min(buckets: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Each bucket's maximum and minimum, ``float32[num_buckets]`` each; NaN propagates.

  Both come from one two-operand integer reduction over an order-preserving
  image of the float32 bits (one pass over ``buckets``): flipping the
  magnitude bits of negative floats makes their signed-integer order the
  float order, with positive NaNs above ``inf`` and negative NaNs below
  ``-inf``. A bucket holding a NaN gets NaN for both. This also keeps NaN,
  which ``jnp.max`` and ``jnp.min`` of a long row can drop on CPU in JAX 0.10
  (XLA hands such plain reductions to a library that ignores it).
  """
  bits = _float_bits(buckets, jnp.int32)
  ordered = bits ^ ((bits >> 31) & _MAGNITUDE_BITS)
  high, low = jax.lax.reduce(
      (ordered, ordered),
      (np.int32(np.iinfo(np.int32).min), np.int32(np.iinfo(np.int32).max)),
      lambda a, b: (jnp.maximum(a[0], b[0]), jnp.minimum(a[1], b[1])),
      (1,),
  )
  high, low = (_as_float(k ^ ((k >> 31) & _MAGNITUDE_BITS)) for k in (high, low))
  has_nan = jnp.isnan(high) | jnp.isnan(low)
  return jnp.where(has_nan, jnp.nan, high), jnp.where(has_nan, jnp.nan, low)


def power_of_two_normalizer(magnitude: jax.Array) -> jax.Array:
  """A power of two ``f`` for each ``magnitude`` with ``magnitude * f`` in ``[2**-23, 4)``.

  Multiplying by a power of two is exact (while the product stays a normal
  float), so values scaled by ``f`` keep every bit, and arithmetic on them
  can neither overflow (a bucket's values near the float32 maximum) nor lose
  precision to subnormals (a bucket of tiny values). ``f`` is ``2**(127 - e)``
  for the biased exponent ``e`` of ``magnitude``, kept within ``[2**-126,
  2**126]``: ``magnitude * f`` is in ``[1, 2)`` for a normal magnitude below
  ``2**127``. Zero, infinite and NaN magnitudes get a finite ``f`` too, so
  they stay zero, infinite and NaN. (XLA on CPU flushes subnormal floats to
  zero in arithmetic, so there a subnormal magnitude times ``f`` is zero: a
  bucket of subnormals counts as a bucket of zeros.)

  Args:
    magnitude: ``float32`` non-negative values (or NaN).

  Returns:
    ``float32`` powers of two, the shape of ``magnitude``.
  """
  exponent = (_float_bits(magnitude, jnp.int32) >> 23) & 0xFF
  return _as_float(jnp.clip(254 - exponent, 1, 253) << 23)


def from_buckets(buckets: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Inverse of :func:`to_buckets`: drops padding and restores ``shape``."""
  return buckets.reshape(-1)[: math.prod(shape)].reshape(shape)
