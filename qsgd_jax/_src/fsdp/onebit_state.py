"""1-bit Adam under FSDP with its worker errors in the optimizer's state.

:func:`~qsgd_jax.fsdp_onebit_gather`'s derivative reads each device's worker
error and hands the new one out as the "gradient" of that argument: a custom
derivative has no other way out of the backward pass. Left to the caller, the
error lives beside the optimizer's state, where ``state_partition_specs``,
``resize_state`` and checkpoints that save the optimizer's state do not see
it, and the ``compress`` switch must be kept in step with the optimizer's
count by hand. :func:`keep_fsdp_onebit_error` keeps both in the state: its
``update`` stores the new errors it is given (``worker_error=``, an extra
argument of ``update``, which gradient clipping and the other transforms of
a chain never touch), and :func:`fsdp_onebit_step_inputs` reads, from the
whole optimizer state, the errors and the switch a step passes to the
gather.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

_OWNER = "qsgd_jax.keep_fsdp_onebit_error"


class FSDPOneBitErrorState(NamedTuple):
  """State of :func:`keep_fsdp_onebit_error`.

  Attributes:
    worker_error: the worker errors, each device's own: the tree
      ``worker_errors(params)`` made at ``init`` (for one gather of all the
      parameters, :func:`~qsgd_jax.fsdp_onebit_error`'s ``float32[n, width]``).
    warm_up_left: ``int32[]``, float32 steps left before the gradient goes
      1-bit; the step whose value is 0 compresses.

  Examples:
    >>> import jax.numpy as jnp, qsgd_jax
    >>> tx = qsgd_jax.keep_fsdp_onebit_error(lambda p: jnp.zeros((2, 3)), freeze_step=10)
    >>> state = tx.init(jnp.zeros(3))
    >>> state.worker_error.shape, int(state.warm_up_left)
    ((2, 3), 10)
  """

  worker_error: Any
  warm_up_left: jax.Array


def keep_fsdp_onebit_error(
    worker_errors: Callable[[optax.Params], Any], *, freeze_step: int,
) -> optax.GradientTransformationExtraArgs:
  """Keeps FSDP 1-bit Adam's worker errors and its compression switch in the state.

  Updates pass through unchanged. ``update(updates, state, params,
  worker_error=new)`` stores ``new``: the second result of
  ``jax.grad(loss, argnums=(0, 1))(shards, worker_error)``, where
  ``worker_error`` came from :func:`fsdp_onebit_step_inputs` of the state
  before the step. The switch counts the updates: the first ``freeze_step``
  steps send float32 gradients, the later ones 1 bit, as
  :func:`~qsgd_jax.scale_by_fsdp_onebit_adam` freezes its variance after
  ``freeze_step`` updates.

  ``init`` calls ``worker_errors(params)`` as given: inside the mapped
  function on this device's shards, or, on the global arrays, a function
  that maps itself (a ``jax.shard_map`` of
  :func:`~qsgd_jax.fsdp_onebit_error`, as the FSDP guide does). Accumulate
  micro-batches inside the loss (one backward pass a step, e.g. a
  ``jax.lax.scan`` over them), not with ``optax.MultiSteps``, whose
  mini-steps would drop the errors that their backward passes hand out.

  Args:
    worker_errors: ``params -> tree`` of zero worker errors, e.g.
      ``functools.partial(qsgd_jax.fsdp_onebit_error, axis_name="batch")`` on
      this device's shards, or one per layer for a model that gathers layer
      by layer.
    freeze_step: the float32 warm-up steps, a positive int.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Examples:
    >>> import functools, jax, jax.numpy as jnp, qsgd_jax
    >>> n = jax.local_device_count()
    >>> tx = qsgd_jax.keep_fsdp_onebit_error(
    ...     functools.partial(qsgd_jax.fsdp_onebit_error, axis_name="batch"), freeze_step=1)
    >>> def switch_and_error(w):
    ...   state = tx.init(w)
    ...   error, before = qsgd_jax.fsdp_onebit_step_inputs(state)
    ...   _, state = tx.update(w, state, w, worker_error=error + 1)
    ...   error, after = qsgd_jax.fsdp_onebit_step_inputs(state)
    ...   return before, after, error[0, 0]
    >>> before, after, error = jax.pmap(switch_and_error, axis_name="batch")(
    ...     jnp.zeros((n, 64, 128)))
    >>> bool(before[0]), bool(after[0]), float(error[0])
    (False, True, 1.0)
  """
  if not isinstance(freeze_step, int) or isinstance(freeze_step, bool) or freeze_step < 1:
    raise ValueError(f"{_OWNER}: freeze_step must be a positive int (the float32 warm-up "
                     f"steps), got {freeze_step!r}.")
  if not callable(worker_errors):
    raise TypeError(f"{_OWNER}: worker_errors must be a function of the parameters' shards "
                    "that returns their zero worker errors, e.g. functools.partial("
                    "qsgd_jax.fsdp_onebit_error, axis_name=...); got "
                    f"{type(worker_errors).__name__}.")

  def init_fn(params):
    return FSDPOneBitErrorState(worker_error=worker_errors(params),
                                warm_up_left=jnp.asarray(freeze_step, jnp.int32))

  def update_fn(updates, state, params=None, *, worker_error=None, **extra_args):
    del params, extra_args
    if worker_error is None:
      raise ValueError(
          f"{_OWNER}: update needs worker_error=, the new worker errors: the gradient with "
          "respect to the errors that fsdp_onebit_step_inputs(opt_state) gave the step "
          "(jax.grad(loss, argnums=(0, 1))(shards, worker_error)[1]).")
    _check_like(worker_error, state.worker_error)
    return updates, FSDPOneBitErrorState(
        worker_error=worker_error, warm_up_left=jnp.maximum(state.warm_up_left - 1, 0))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def fsdp_onebit_step_inputs(opt_state) -> tuple[Any, jax.Array]:
  """``(worker_error, compress)`` for this step's :func:`~qsgd_jax.fsdp_onebit_gather`.

  Reads the one :class:`FSDPOneBitErrorState` in ``opt_state`` (anywhere in
  it: a chain, ``optax.inject_hyperparams``, a Flax ``TrainState``'s
  ``opt_state``): its errors, and ``compress``, ``bool[]``, true once the
  float32 warm-up is over.

  Raises:
    ValueError: ``opt_state`` holds no such state (the optimizer was built
      without ``worker_errors=``) or several.

  Examples:
    >>> import jax.numpy as jnp, qsgd_jax
    >>> tx = qsgd_jax.fsdp_onebit_adam(1e-3, freeze_step=2,
    ...                                worker_errors=lambda p: {"w": jnp.zeros((2, 3))})
    >>> error, compress = qsgd_jax.fsdp_onebit_step_inputs(tx.init(jnp.zeros(3)))
    >>> error["w"].shape, bool(compress)
    ((2, 3), False)
  """
  found = [node for node in jax.tree.leaves(
      opt_state, is_leaf=lambda node: isinstance(node, FSDPOneBitErrorState))
           if isinstance(node, FSDPOneBitErrorState)]
  if len(found) != 1:
    raise ValueError(
        f"fsdp_onebit_step_inputs: opt_state holds {len(found)} FSDPOneBitErrorState, not one: "
        "build the optimizer with qsgd_jax.fsdp_onebit_adam(..., worker_errors=...) (or chain "
        "qsgd_jax.keep_fsdp_onebit_error once), and pass its whole state.")
  (state,) = found
  return state.worker_error, state.warm_up_left == 0


def _check_like(new, old) -> None:
  """``new`` errors have ``old``'s structure, shapes and dtypes, or a clear error."""
  if jax.tree.structure(new) != jax.tree.structure(old):
    raise ValueError(
        f"{_OWNER}: worker_error= has the structure {jax.tree.structure(new)}, the state's "
        f"errors {jax.tree.structure(old)}: pass the gradient with respect to the errors that "
        "fsdp_onebit_step_inputs gave this step.")
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(new), jax.tree.leaves(old),
                          strict=True):
    if (jnp.shape(a), jnp.result_type(a)) != (jnp.shape(b), jnp.result_type(b)):
      raise ValueError(
          f"{_OWNER}: worker_error{jax.tree_util.keystr(path)} is "
          f"{jnp.result_type(a)}{list(jnp.shape(a))}, the state holds "
          f"{jnp.result_type(b)}{list(jnp.shape(b))} there: pass the new errors of the same "
          "gathers, on this device.")
