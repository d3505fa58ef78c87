"""DiLoCo's conditionals: a phase runs when the schedule says, its two branches typed alike in
one place, decided in the program or on the host."""

import jax
import jax.numpy as jnp

from qsgd_jax._src import axes


def cond(predicate, true_fn, false_fn, *operands):
  """``true_fn(*operands)`` if ``predicate`` else ``false_fn(*operands)``, typed alike.

  Both functions' outputs are cast to one type (:func:`alike`), read once
  from their traces, so that the branches of ``jax.lax.cond`` agree whatever
  the dtypes and the axes each varies over. Each function is traced once
  (under ``jax.jit``, whose cache the branch's call hits).

  ``predicate`` is either a traced ``bool[]``, the same on every device (a
  step count's, an average's), or a Python bool decided on the host. The
  first is a ``jax.lax.cond``; for the second only the function it names
  runs, its outputs typed as the conditional's would be.
  """
  true_fn, false_fn = jax.jit(true_fn), jax.jit(false_fn)
  first, second = (fn.trace(*operands).out_info for fn in (true_fn, false_fn))

  def typed(fn):
    return lambda *args: alike(fn(*args), first, second, predicate)

  if isinstance(predicate, bool):
    return typed(true_fn if predicate else false_fn)(*operands)
  return jax.lax.cond(predicate, typed(true_fn), typed(false_fn), *operands)


def alike(tree, first, second, predicate=None):
  """``tree`` cast to the type two branches share: each leaf in the dtype that ``first``'s and
  ``second``'s leaves (arrays or ``jax.ShapeDtypeStruct``) promote to, and varying over every
  axis either varies over, or a traced ``predicate`` does (a selection by it varies there)."""
  chosen = axes.varying_axes(predicate) if isinstance(predicate, jax.Array) else ()

  def cast(x, a, b):
    if a.dtype != b.dtype:
      x = x.astype(jnp.promote_types(a.dtype, b.dtype))
    names = sorted({*axes.varying_axes(a), *axes.varying_axes(b), *chosen})
    return axes.as_varying(x, tuple(names)) if names else x

  return jax.tree.map(cast, tree, first, second)

