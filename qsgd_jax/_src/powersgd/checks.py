"""What :func:`~qsgd_jax.powersgd` checks of its options, its run's length and its state."""

import numbers

from qsgd_jax._src.powersgd import shard_step

_OWNER = "powersgd"


def check_options(rank, start_iter, min_compression_rate, use_error_feedback, warm_start,
                   orthogonalization_epsilon) -> None:
  def is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)

  def is_real(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)

  if not is_int(rank) or rank < 1:
    raise ValueError(f"{_OWNER}: rank must be a positive int, got {rank!r}.")
  if not is_int(start_iter) or start_iter < 0:
    raise ValueError(f"{_OWNER}: start_iter must be a non-negative int, got {start_iter!r}.")
  for name, value in (("use_error_feedback", use_error_feedback), ("warm_start", warm_start)):
    if not isinstance(value, bool):
      raise ValueError(f"{_OWNER}: {name} must be a bool, got {value!r}.")
  if (use_error_feedback or warm_start) and start_iter <= 1:
    raise ValueError(
        f"{_OWNER}: start_iter must be at least 2 with use_error_feedback or warm_start, got "
        f"{start_iter}, as PyTorch's PowerSGDState requires: there DDP rebuilds its gradient "
        "buckets after the first step, which would invalidate an error or Q memorized before. "
        "Pass start_iter >= 2, or use_error_feedback=False and warm_start=False.")
  if not is_real(min_compression_rate) or not min_compression_rate > 0:
    raise ValueError(f"{_OWNER}: min_compression_rate must be a positive number, got "
                     f"{min_compression_rate!r}.")
  if not is_real(orthogonalization_epsilon) or not orthogonalization_epsilon >= 0:
    raise ValueError(f"{_OWNER}: orthogonalization_epsilon must be a non-negative number, got "
                     f"{orthogonalization_epsilon!r}.")


def check_run_length(start_iter: int, total_steps) -> None:
  if total_steps is None:
    return
  if not isinstance(total_steps, numbers.Integral) or isinstance(total_steps, bool) or (
      total_steps < 1):
    raise ValueError(f"{_OWNER}: total_steps must be a positive int or None, got "
                     f"{total_steps!r}.")
  if start_iter >= total_steps:
    raise ValueError(
        f"{_OWNER}: start_iter={start_iter} is not less than total_steps={total_steps}: every "
        "step of this run would be a float32 average and none compressed (start_iter defaults "
        "to PyTorch's 1000). Pass a smaller start_iter, e.g. a tenth of the run.")


def check_state(plans, state, use_error_feedback: bool) -> None:
  """Raises, naming a leaf, where the state was made for other compressed leaves than these."""
  held = [tuple(q.shape) for q in state.q_memory]
  expected = shard_step.memory_shapes(plans, lambda g: g.q_shape)
  if use_error_feedback:
    held = list(zip(held, (tuple(e.shape) for e in state.error), strict=False))
    expected = list(zip(expected, shard_step.memory_shapes(plans, lambda g: g.matrix_shape),
                        strict=True))
  if held == expected:
    return
  # The first group that differs; past the shorter list, where a leaf was added or dropped.
  differs = next((k for k, (h, e) in enumerate(zip(held, expected, strict=False)) if h != e),
                 min(len(held), len(expected)))
  groups = [(shard_plan.plan, g) for shard_plan in plans for g in shard_plan.plan.groups]
  named = ("none" if differs >= len(groups) else ", ".join(
      f"{groups[differs][0].paths[i]} {groups[differs][0].shapes[i]}"
      for i in groups[differs][1].leaves))
  raise ValueError(
      f"{_OWNER}: the updates' compressed leaves do not match the state, made by init for "
      f"other parameters: its memories hold {held}, these updates need {expected} "
      f"((count, m, rank) of Q{', (count, n, m) of the error' if use_error_feedback else ''}"
      " a group of one matrix shape, on a mesh whose model is sharded the devices' of a "
      f"group's shards end to end). The leaves of group {differs} here: {named}. A leaf's "
      "shape (or dtype) or its layout over the mesh changed since init: call init on the new "
      "parameters, laid out as the updates are. Or the state was made with another "
      "matrix_view: a state saved before matrix_view existed saw every leaf as "
      "(prod(shape[:-1]), shape[-1]); pass matrix_view=lambda path, shape: "
      "(math.prod(shape[:-1]), shape[-1]) to resume it.")
