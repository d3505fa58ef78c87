"""Unbiased stochastic rounding driven by a counter-based hash.

Stochastic rounding needs one uniform draw an element, and on CPU
``jax.random``'s threefry costs several times a memory-bound pass over the
data. A draw here is a hash of ``(key, element index)`` instead: the key gives
two 32-bit words ``(a, c)``; element ``i`` takes ``x = i * (a | 1) + c`` (mod
``2**32``) through the ``lowbias32`` integer finalizer (two multiplies, three
xor-shifts; C. Wellons, "Hash function prospector", 2018), and the top 24 bits
of the result are the draw. For a fixed key the map from ``i`` to ``x`` is a
bijection and so is the finalizer, so within one array of fewer than ``2**32``
elements no two elements share a hash; distinct keys use distinct odd
multipliers, so their counter streams do not overlap by a shift.

Exactness: ``floor(y + u)`` with ``u`` uniform on the grid ``{k / 2**24}``
rounds ``y`` up with probability ``ceil(2**24 * frac(y)) / 2**24``, so the
rounding is unbiased to within ``2**-24`` of one quantization step, the
resolution of a float32 mantissa. The uniformity of the draws is tested in
``tests/rounding_test.py``.
"""

import math

import jax
import jax.numpy as jnp

_UNIFORM_BITS = 24


def _finalize(x: jax.Array) -> jax.Array:
  """The ``lowbias32`` finalizer, a bijection on ``uint32``."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def uniform_grid(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Uniform integers in ``[0, 2**24)``, one a position of ``shape``.

  Args:
    key: a PRNG key (typed or raw ``uint32[2]``).
    shape: static output shape; elements are counted in row-major order.

  Returns:
    ``uint32`` array of ``shape``.
  """
  seed = jax.random.bits(key, (2,), jnp.uint32)
  index = jax.lax.iota(jnp.uint32, math.prod(shape)).reshape(shape)
  hashed = _finalize(index * (seed[0] | jnp.uint32(1)) + seed[1])
  return hashed >> (32 - _UNIFORM_BITS)


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
  floor = jnp.floor(y)
  threshold = (y - floor) * jnp.float32(2**_UNIFORM_BITS)
  up = uniform_grid(key, y.shape).astype(jnp.float32) < threshold
  return floor + up.astype(jnp.float32)


def round_stochastic_to_level(key: jax.Array, y: jax.Array, top: int) -> jax.Array:
  """:func:`round_stochastic` of ``y >= 0``, clamped to ``top``, as ``int32``.

  Float error can push ``y`` a hair past ``top`` and non-finite input gives
  NaN: both become ``top``. The integer is read out of the float by adding
  ``2**23``, which moves it into the low bits of the mantissa, then a bitcast
  and a mask: exact for ``top < 2**23``, and a few instructions fewer than a
  float-to-int conversion, which also handles NaN and overflow.

  Args:
    key: a PRNG key.
    y: float32 array of non-negative values (or NaN).
    top: the largest level, below ``2**23``.

  Returns:
    int32 array of levels in ``[0, top]``, the shape of ``y``.
  """
  level = round_stochastic(key, y)
  level = jnp.where(level <= top, level, top) + jnp.float32(2**23)
  return jax.lax.bitcast_convert_type(level, jnp.int32) & jnp.int32(2**23 - 1)
