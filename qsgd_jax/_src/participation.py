"""Averages over workers that take a say in who takes part: what a caller that leaves workers
out (:func:`~qsgd_jax.diloco`) and an average that keeps its own count of them share."""

import optax


class AverageOverParticipants(optax.GradientTransformationExtraArgs):
  """An average over workers that leaves out the workers told not to take part.

  Its ``update(updates, state, params=None, *, participating=True)`` takes
  ``participating``, a ``bool[]`` on each worker, and returns the average of
  the inputs of the workers where it is true, the same on every worker: what
  a worker left out passes in is neither sent into the average nor counted
  in it, and its state (its error feedback) stays as it was. Where no worker
  takes part the average is zero.

  :func:`~qsgd_jax.diloco` tells such an average which workers' outer
  gradients are finite and takes its result as it is; any other average is
  handed a left-out worker's outer gradient as zeros, and ``diloco`` scales
  the result by ``n / (workers left in)``, which is right for a mean over all
  ``n`` workers and nothing else. :func:`~qsgd_jax.sparseloco_average`, whose
  mean over the workers that kept each element such a rescale would get
  wrong, is one.

  Examples:
    >>> import qsgd_jax
    >>> isinstance(qsgd_jax.sparseloco_average("workers"), qsgd_jax.AverageOverParticipants)
    True
  """
