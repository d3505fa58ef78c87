"""Unbiased stochastic rounding driven by a counter-based hash.

Stochastic rounding needs one uniform draw an element, and on CPU
``jax.random``'s threefry costs several times a memory-bound pass over the
data. A draw here is a hash of ``(key, element index)`` instead: the key gives
two 32-bit words ``(a, c)``; element ``i`` takes the counter
``x = i * (a | 1) + c`` (mod ``2**32``) through two rounds of the ``lowbias32``
integer finalizer (each an xor-shift and a multiply; C. Wellons, "Hash function
prospector", 2018), and the top 24 bits of the result are the draw. Those are
``lowbias32``'s own top 24 bits but for its last xor-shift, which only touches
the low 16: the top 16 bits of every draw are exactly ``lowbias32``'s, and one
xor-shift an element is saved. The counter is a sum of one small term an axis
(each axis index times its stride times ``a | 1``), so XLA computes it with
additions in whatever loop order it vectorizes, rather than dividing a flat
index back into coordinates.

Exactness: for a fixed element, the counter is ``c`` shifted by a constant, so
a uniform ``c`` makes it uniform on ``[0, 2**32)``; the finalizer rounds are
bijections of ``uint32``, so the hash and its top 24 bits are uniform too.
``floor(y + u)`` with ``u`` uniform on the grid ``{k / 2**24}`` rounds ``y`` up
with probability ``ceil(2**24 * frac(y)) / 2**24``, so the rounding is unbiased
to within ``2**-24`` of one quantization step, the resolution of a float32
mantissa. For a fixed key the map from ``i`` to the hash is a bijection, so
within one array of fewer than ``2**32`` elements no two elements share a
hash; distinct keys use distinct odd multipliers, so their counter streams do
not overlap by a shift. The independence of neighbouring draws is tested in
``tests/rounding_test.py``.
"""


import jax
import jax.numpy as jnp
import numpy as np

UNIFORM_BITS = 24
MANTISSA = 2**23
MANTISSA_BITS = 0x4B000000  # float32 2**23's bits.


def mix(x: jax.Array) -> jax.Array:
  """Two ``lowbias32`` rounds without the final xor-shift: a bijection on ``uint32``."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  return x * jnp.uint32(0x846CA68B)


def _counter(key: jax.Array, shape: tuple[int, ...], start: int) -> jax.Array:
  """``(start + row_major_index) * (a | 1) + c`` (mod ``2**32``) for every position of ``shape``."""
  seed = jax.random.bits(key, (2,), jnp.uint32)
  multiplier = seed[0] | jnp.uint32(1)
  counter = jnp.broadcast_to(seed[1] + multiplier * jnp.uint32(start % 2**32), shape)
  for axis, stride in enumerate(np.cumprod((1, *shape[:0:-1]))[::-1]):
    if shape[axis] > 1:
      # Strides of arrays of 2**32 elements or more wrap, like the counter.
      term = jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * (
          multiplier * jnp.uint32(int(stride) % 2**32)
      )
      counter = counter + term
  return counter


def uniform_grid(key: jax.Array, shape: tuple[int, ...], start: int = 0) -> jax.Array:
  """Uniform integers in ``[0, 2**24)``, one a position of ``shape``.

  Args:
    key: a PRNG key (typed or raw ``uint32[2]``).
    shape: static output shape; elements are counted in row-major order.
    start: static index of the first element: the draws are those of
      elements ``start, start + 1, ...`` of a longer array, so an array
      handled in parts gets the draws it would get whole.

  Returns:
    ``uint32`` array of ``shape``.
  """
  shape = tuple(shape)
  return mix(_counter(key, shape, start)) >> (32 - UNIFORM_BITS)


def _round_up(key: jax.Array, y: jax.Array, start: int = 0) -> tuple[jax.Array, jax.Array]:
  """``floor(y)`` and whether ``y`` rounds up: a draw below ``2**24 * frac(y)``."""
  floor = jnp.floor(y)
  threshold = (y - floor) * jnp.float32(2**UNIFORM_BITS)
  # The draws are below 2**24: a signed conversion to float32 is exact.
  draw = jax.lax.bitcast_convert_type(uniform_grid(key, y.shape, start), jnp.int32)
  return floor, draw.astype(jnp.float32) < threshold


def round_stochastic(key: jax.Array, y: jax.Array) -> jax.Array:
  """Rounds ``y >= 0`` to ``floor(y)`` or ``floor(y) + 1``, unbiased.

  ``y`` rounds up with probability ``frac(y)`` (to ``2**-24``), so
  ``E[round_stochastic(key, y)] = y``.

  Args:
    key: a PRNG key.
    y: float32 array of non-negative values.

  Returns:
    float32 array of integers, the shape of ``y``.
  """
  floor, up = _round_up(key, y)
  return floor + up.astype(jnp.float32)


def round_stochastic_to_level(key: jax.Array, y: jax.Array, top: int, start: int = 0) -> jax.Array:
  """:func:`round_stochastic` of ``y >= 0``, clamped to ``top``, as ``int32``.

  Float error can push ``y`` a hair past ``top`` and non-finite input gives
  NaN: both become ``top``. The integer is read out of the float: adding
  ``2**23`` moves ``floor(y)`` into the low bits of the mantissa, and
  subtracting the bits of ``2**23`` from the sum's bits leaves ``floor(y)``
  exactly when it is below ``2**23``, and a number above ``top`` when it is
  not, or is infinite or NaN (their exponent bits are larger). The round-up
  adds one in the integer domain. A few instructions fewer than a
  float-to-int conversion, which also handles NaN and overflow.

  Args:
    key: a PRNG key.
    y: float32 array of non-negative values (or NaN).
    top: the largest level, below ``2**23``.
    start: static index of ``y``'s first element, as in :func:`uniform_grid`.

  Returns:
    int32 array of levels in ``[0, top]``, the shape of ``y``.
  """
  floor, up = _round_up(key, y, start)
  shifted = jax.lax.bitcast_convert_type(floor + jnp.float32(MANTISSA), jnp.int32)
  level = shifted - jnp.int32(MANTISSA_BITS) + up.astype(jnp.int32)
  return jnp.minimum(level, jnp.int32(top))
