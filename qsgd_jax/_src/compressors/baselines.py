"""Baselines: full precision, and a cast to a narrower float on the wire."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from qsgd_jax._src import base

_EMPTY_SCALES = (0, 0)


@dataclasses.dataclass(frozen=True)
class Identity(base.Compressor):
  """Sends the array as it is: the uncompressed baseline.

  On the wire: ``n * itemsize * 8`` bits (32 a coordinate for float32).

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> qsgd_jax.Identity().wire_bits((1000,))
    32000
  """

  unbiased = True
  deterministic = True

  def bucket_length(self, shape: tuple[int, ...]) -> int:
    del shape
    return 1  # Every element on its own.

  def encode(self, key: jax.Array, x: jax.Array) -> base.Payload:
    del key  # Deterministic.
    x = jnp.asarray(x)
    base.as_float32(x, "Identity.encode")
    return base.Payload(
        packed=x, scales=jnp.zeros(_EMPTY_SCALES, jnp.float32), shape=x.shape, dtype=x.dtype
    )

  def decode(self, payload: base.Payload) -> jax.Array:
    return payload.packed


@dataclasses.dataclass(frozen=True)
class Cast(base.Compressor):
  """Casts to a narrower float on the wire (fp16 or bf16, as Horovod offers).

  Round-to-nearest: deterministic and slightly biased; values beyond the
  target's range become infinite (float16 overflows above 65504), so non-finite
  inputs stay non-finite.

  On the wire: ``n * itemsize(dtype) * 8`` bits (16 a coordinate for bf16).

  Attributes:
    dtype: the floating dtype sent, e.g. ``jnp.bfloat16``.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> q = qsgd_jax.Cast(jnp.bfloat16)
    >>> q.wire_bits((1000,))
    16000
    >>> q.decode(q.encode(jax.random.key(0), jnp.ones(3))).dtype
    dtype('float32')
  """

  dtype: np.dtype = jnp.bfloat16

  deterministic = True

  def __post_init__(self):
    try:
      dtype = np.dtype(self.dtype)
    except TypeError as error:
      raise ValueError(f"Cast: dtype must be a floating dtype, got {self.dtype!r}.") from error
    if not jnp.issubdtype(dtype, jnp.floating):
      raise ValueError(f"Cast: dtype must be a floating dtype, got {dtype}.")
    object.__setattr__(self, "dtype", dtype)

  def bucket_length(self, shape: tuple[int, ...]) -> int:
    del shape
    return 1  # Every element on its own.

  def encode(self, key: jax.Array, x: jax.Array) -> base.Payload:
    del key  # Deterministic.
    x = jnp.asarray(x)
    base.as_float32(x, "Cast.encode")
    return base.Payload(
        packed=x.astype(self.dtype),
        scales=jnp.zeros(_EMPTY_SCALES, jnp.float32),
        shape=x.shape,
        dtype=x.dtype,
    )

  def decode(self, payload: base.Payload) -> jax.Array:
    return payload.packed.astype(payload.dtype)
