"""The shared-scale quantized sum: agree on the scales, then add integer codes in one psum.

The devices first agree on each bucket's scale: one ``pmax`` of the local
scales (the columns merged by minimum are negated, exactly), a float32 vector
of one or two values a bucket. Each device quantizes against the shared scale,
and the integer codes are added in one ``psum`` in the plan's ``sum_dtype``,
the narrowest integer type that cannot overflow for the axis size (for 4-bit
QSGD on 8 devices, int8). One rounding instead of the two-phase method's two,
so less error; but an all-reduce of 8-bit integers sends ``2 (n - 1) / n``
bytes a coordinate whatever the code width, so it saves at most 4x. Only
compressors with a shared-scale form (:class:`~qsgd_jax.QSGD`,
:class:`~qsgd_jax.MinMax`) support it.
"""

import jax
import jax.numpy as jnp

from qsgd_jax._src.collectives import layout
from qsgd_jax._src.collectives.plan import ReductionPlan


def shared_scale_sum(plan: ReductionPlan, vectors: list[jax.Array], key: jax.Array, *,
                     divisor: int, want_sent_error: bool):
  """Sums ``vectors`` over the plan's outer axis by the shared-scale method.

  Args:
    plan: the reduction's plan, ``method="psum"``.
    vectors: for each segment, ``float32[length]``.
    key: this device's PRNG key (already folded with its axis index).
    divisor: the decoded sum is divided by it.
    want_sent_error: also return what this device's quantization dropped.

  Returns:
    ``(results, sent_error)``: for each segment, ``float32[length]`` each;
    ``sent_error`` is ``None`` unless asked for.
  """
  compressor, axis, n = plan.compressor, plan.axes.outer, plan.outer_size
  blocks = [b[:, 0] for b in layout.join(plan, vectors)]  # [batch, *element_shape]
  signs = jnp.array([1.0 if how == "max" else -1.0 for how in compressor.scale_reductions])
  # One pmax for every block's scales, a "min" column negated (exactly). XLA:CPU's
  # max all-reduce skips NaN, so a NaN scale goes as +inf and stays non-finite.
  oriented = [jax.vmap(compressor.local_scales)(block) * signs for block in blocks]
  flat = _flat(oriented, jnp.float32)
  flat = jax.lax.pmax(jnp.where(jnp.isnan(flat), jnp.inf, flat), axis)
  shared = [s * signs for s in _unflat(flat, oriented)]
  codes = [jax.vmap(compressor.integer_codes)(
               jax.random.split(jax.random.fold_in(key, g), block.shape[0]), block, scales)
           for g, (block, scales) in enumerate(zip(blocks, shared, strict=True))]
  # One psum for every block's codes.
  totals = _unflat(jax.lax.psum(_flat(codes, plan.sum_dtype), axis), codes)

  def decoded(count, block, total, scales):
    def decode_sum(total, scales):
      return compressor.decode_code_sum(total, scales, count, block.shape[1:])
    return jax.vmap(decode_sum)(total, scales)

  summed = [decoded(n, *args) / divisor for args in zip(blocks, totals, shared, strict=True)]
  sent = None
  if want_sent_error:
    sent = [b - decoded(1, b, c, s) for b, c, s in zip(blocks, codes, shared, strict=True)]

  return layout.split(plan, summed), (layout.split(plan, sent) if want_sent_error else None)


def _flat(arrays: list[jax.Array], dtype) -> jax.Array:
  """Every array, flattened and cast, as one vector: one collective for all."""
  return jnp.concatenate([a.astype(dtype).reshape(-1) for a in arrays])


def _unflat(flat: jax.Array, like: list[jax.Array]) -> list[jax.Array]:
  """Inverse of :func:`_flat`: pieces shaped like ``like`` (in ``flat``'s dtype)."""
  out, start = [], 0
  for a in like:
    out.append(flat[start : start + a.size].reshape(a.shape))
    start += a.size
  return out
