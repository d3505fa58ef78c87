"""Whether a traced gradient was already reduce-scattered over an axis: "reduced twice".

Autodiff reduces gradients on its own in two ways that a user can miss. A
gradient with respect to a value replicated over an axis comes back summed
over it (a ``psum``): under ``jax.shard_map`` it is typed invariant, which
:func:`~qsgd_jax._src.axes.check_varying` catches. The transpose of
``jax.lax.all_gather`` is ``jax.lax.psum_scatter``: a gradient with respect to
the shards of an all-gather (JAX's FSDP tutorial differentiates through
one) comes back reduce-scattered, varying over the axis like any per-device
value, and the types cannot tell it from one. The traced program can:
:func:`check_not_reduced` follows each leaf back through the equations that
made it (through casts, reshapes, scalings and sums, and into the bodies of
``jit``, ``checkpoint``, ``scan`` and custom-derivative calls) and raises where
it meets a reduce-scatter over the axis. (It does not look for ``psum``: under
``jax.pmap`` the transpose of the ``pmean`` of a loss is a ``psum`` of its
cotangent, which a legitimate per-device gradient can be scaled by.) The
library's own reduce-scatter runs in a named scope (:func:`scope`), so its
result, :func:`qsgd_jax.fsdp_gather`'s gradient among others, is found the
same way.

It reads the tracer's producing equation, which JAX keeps while tracing
(``DynamicJaxprTracer.parent``): outside a trace, or where a JAX version
keeps no such link, it finds nothing and raises nothing, never wrongly.
"""

import re

import jax

from qsgd_jax._src import axes as axes_lib

_SCOPE = "qsgd_jax_psum_scatter"
_SCOPE_PATTERN = re.compile(_SCOPE + r"\[([^\]]*)\]")

# Reduce-scatters: what autodiff makes of an all-gather.
_REDUCING = frozenset({"reduce_scatter", "unreduced_reduce_scatter", "reduce_scatter_start"})
# Equations whose output is a reduced input still reduced: casts, reshapes,
# scalings, and sums of cotangents (any reduced part of a sum would be
# reduced again).
_TRANSPARENT = frozenset({
    "add_any", "add", "sub", "mul", "div", "neg", "convert_element_type", "reshape",
    "squeeze", "expand_dims", "broadcast_in_dim", "transpose", "copy", "copy_p",
    "reduce_precision", "pvary", "reduce_scatter_done", "optimization_barrier",
    "select_n", "slice", "dynamic_slice", "concatenate", "pad",
})
# Higher-order equations whose outputs are those of a body jaxpr, by position,
# and whose inputs are the body's inputs, by position.
_BODIES = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
           "remat2": "jaxpr", "checkpoint": "jaxpr", "scan": "jaxpr",
           "custom_vjp_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr"}
# Equations a walk visits at most: a trace-time check must stay cheap.
_MAX_STEPS = 256


def scope(axes: axes_lib.Axes) -> str:
  """The name scope of the library's reduce-scatter over ``axes``, which :func:`reduced_by`
  recognizes in the equations it made."""
  return f"{_SCOPE}[{','.join(axes.names)}]"


def check_not_reduced(tree, axes: axes_lib.Axes, owner: str) -> None:
  """Raises where a leaf of ``tree`` was reduce-scattered over one of ``axes`` already.

  Args:
    tree: the gradients a reduction is about to sum, traced.
    axes: the reduction's axes.
    owner: the public function asking, named in the error.

  Raises:
    ValueError: naming the leaf, the axis, the collective, and what to do.
  """
  names = frozenset(axes.names)
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    found = reduced_by(leaf, names)
    if found is None:
      continue
    primitive, axis = found
    leaf_name = jax.tree_util.keystr(path) or "<root>"
    if primitive == _SCOPE:
      raise ValueError(
          f"{owner}: leaf {leaf_name} is already the result of the library's quantized "
          f"reduce-scatter over axis {axis!r} (the gradient of qsgd_jax.fsdp_gather is one), "
          "so reducing it again would count it n times: drop this call.")
    raise ValueError(
        f"{owner}: leaf {leaf_name} was already summed over axis {axis!r} by a {primitive} "
        "in the traced program, so reducing it again would count it n times. "
        "Differentiating through jax.lax.all_gather (as JAX's FSDP tutorial does) makes "
        "autodiff reduce-scatter the gradient in float32 itself: gather the shards with "
        f"qsgd_jax.fsdp_gather(shards, {axes.name!r}) instead, whose gradient is the "
        "compressed reduce-scatter, and drop this call; or differentiate with respect to "
        "the gathered parameters, not the shards, and keep it.")


def reduced_by(leaf, names: frozenset) -> tuple[str, str] | None:
  """``(primitive, axis)`` of a reduce-scatter over one of ``names`` that ``leaf`` comes
  from, or ``None``."""
  parent = getattr(leaf, "parent", None)
  val = getattr(leaf, "val", None)
  if parent is None or val is None:
    return None
  steps = [0]
  return _walk_tracing(parent, _position(parent.outvars, val), names, steps)


def _position(outvars, var) -> int | None:
  for k, out in enumerate(outvars):
    if out is var:
      return k
  return None


def _axes_of(params) -> frozenset:
  axes = params.get("axes", params.get("axis_name", ()))
  return frozenset(axes if isinstance(axes, tuple | list) else (axes,))


def _walk_tracing(eqn, k, names, steps):
  """The walk from output ``k`` of a tracing-time equation (inputs are tracers)."""
  steps[0] += 1
  if k is None or steps[0] > _MAX_STEPS:
    return None
  found = _at_equation(eqn, k, names, steps)
  if found != "inputs":
    return found
  for tracer in eqn.in_tracers:
    parent, val = getattr(tracer, "parent", None), getattr(tracer, "val", None)
    if parent is not None and val is not None:
      result = _walk_tracing(parent, _position(parent.outvars, val), names, steps)
      if result is not None:
        return result
  return None


def _at_equation(eqn, k, names, steps):
  """What equation ``eqn``'s output ``k`` says: a finding, ``None``, or ``"inputs"`` (look at
  its inputs; for a body, those of output ``k`` that lead out of it)."""
  stack = str(getattr(getattr(eqn, "source_info", None), "name_stack", ""))
  for match in _SCOPE_PATTERN.finditer(stack):
    common = frozenset(match.group(1).split(",")) & names
    if common:
      return _SCOPE, sorted(common)[0]
  name = eqn.primitive.name
  if name in _REDUCING:
    common = _axes_of(eqn.params) & names
    return (name, sorted(common)[0]) if common else None
  if name in _TRANSPARENT:
    return "inputs"
  body = _BODIES.get(name)
  if body is None or body not in eqn.params:
    return None
  jaxpr = getattr(eqn.params[body], "jaxpr", eqn.params[body])
  return _walk_body(jaxpr, jaxpr.outvars[k], names, steps)


def _walk_body(jaxpr, var, names, steps):
  """The walk inside a body jaxpr from ``var``; stops at the body's inputs."""
  producers = {out: (eqn, k) for eqn in jaxpr.eqns for k, out in enumerate(eqn.outvars)}
  pending = [var]
  while pending:
    steps[0] += 1
    if steps[0] > _MAX_STEPS:
      return None
    current = pending.pop()
    if current not in producers:
      continue
    eqn, k = producers[current]
    found = _at_equation(eqn, k, names, steps)
    if found == "inputs":
      pending.extend(v for v in eqn.invars if not hasattr(v, "val"))  # Not literals.
    elif found is not None:
      return found
  return None
