"""NumPy references of DiLoCo (Douillard et al. 2023, Algorithm 1) and Streaming DiLoCo
(Douillard et al. 2025, Algorithm 2), in float64, for ``tests/diloco_test.py``.

Parameters are lists of arrays (one a leaf); ``grad(m, t, theta)`` gives worker ``m``'s
gradient at step ``t`` (counted from 0) of its parameters ``theta``. Each reference returns,
for every step, the parameters each worker holds after it, ``[steps][workers][leaves]``, and
the global parameters after it, ``[steps][leaves]``.

Sources, cited below: DiLoCo, arXiv 2311.08105 (Algorithm 1, Section 2); Streaming DiLoCo,
arXiv 2501.18512 (Algorithm 2, Sections 2.2-2.3); torchft ``torchft/local_sgd.py`` at commit
73dafea4 (pytorch/torchft); optax's ``sgd``, ``adam`` (``optax/_src/alias.py``,
``transform.py``).
"""

import numpy as np


class SGD:
  """optax.sgd(lr, momentum, nesterov): trace = g + momentum * trace; the update is
  -lr * (g + momentum * trace) with nesterov, -lr * trace without, -lr * g with no momentum."""

  def __init__(self, lr, momentum=None, nesterov=False):
    self.lr, self.momentum, self.nesterov = lr, momentum, nesterov

  def init(self, params):
    return [np.zeros_like(x) for x in params]

  def update(self, grads, trace):
    if self.momentum is None:
      return [-self.lr * g for g in grads], trace
    trace = [g + self.momentum * t for g, t in zip(grads, trace, strict=True)]
    directions = ([g + self.momentum * t for g, t in zip(grads, trace, strict=True)]
                  if self.nesterov else trace)
    return [-self.lr * d for d in directions], trace


class Adam:
  """optax.adam(lr): bias-corrected moments, eps outside the square root."""

  def __init__(self, lr, b1=0.9, b2=0.999, eps=1e-8):
    self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps

  def init(self, params):
    return (0, [np.zeros_like(x) for x in params], [np.zeros_like(x) for x in params])

  def update(self, grads, state):
    count, mu, nu = state
    count += 1
    mu = [self.b1 * m + (1 - self.b1) * g for m, g in zip(mu, grads, strict=True)]
    nu = [self.b2 * v + (1 - self.b2) * g * g for v, g in zip(nu, grads, strict=True)]
    corrected = [(m / (1 - self.b1**count), v / (1 - self.b2**count))
                 for m, v in zip(mu, nu, strict=True)]
    updates = [-self.lr * m / (np.sqrt(v) + self.eps) for m, v in corrected]
    return updates, (count, mu, nu)


def diloco(params, grad, *, workers, rounds, sync_every, inner, outer):
  """DiLoCo, Algorithm 1, written as the paper's two nested loops."""
  theta = [np.asarray(x, np.float64) for x in params]
  # Algorithm 1 keeps each worker's inner optimizer state across rounds (Section 2: "the
  # inner optimizer state ... is kept"; torchft never resets the local optimizer).
  inner_states = [inner.init(theta) for _ in range(workers)]
  outer_state = outer.init(theta)
  local_history, global_history = [], []
  for t in range(rounds):
    locals_ = []
    for m in range(workers):
      theta_m = [x.copy() for x in theta]  # Algorithm 1: theta_i^(t) <- theta^(t-1).
      for h in range(sync_every):  # H inner steps on the worker's own data.
        step = t * sync_every + h
        updates, inner_states[m] = inner.update(grad(m, step, theta_m), inner_states[m])
        theta_m = [x + u for x, u in zip(theta_m, updates, strict=True)]
        if h < sync_every - 1:
          _record(local_history, step, m, theta_m, workers)
      locals_.append(theta_m)
    # The outer gradient: Delta^(t) = (1/k) sum_i (theta^(t-1) - theta_i^(t)), the old global
    # parameters minus the new local ones (Algorithm 1; torchft `_save_grads`,
    # local_sgd.py line 335: original_parameters - local_param).
    delta = [np.mean([g - loc[i] for loc in locals_], axis=0) for i, g in enumerate(theta)]
    # theta^(t) <- OuterOpt(theta^(t-1), Delta^(t)): the outer optimizer takes Delta as its
    # gradient (torchft `_set_grads` then `outer_optimizer.step()`, lines 467-468).
    updates, outer_state = outer.update(delta, outer_state)
    global_history += [theta] * (sync_every - 1)
    theta = [g + u for g, u in zip(theta, updates, strict=True)]
    global_history.append(theta)
    last = t * sync_every + sync_every - 1
    for m in range(workers):  # Every worker starts the next round from theta^(t).
      _record(local_history, last, m, theta, workers)
  return local_history, global_history


def streaming_diloco(params, grad, *, workers, steps, sync_every, fragment_of, inner, outer,
                     delay=0, alpha=0.0):
  """Streaming DiLoCo, Algorithm 2, one inner step at a time.

  Args:
    fragment_of: each leaf's fragment p in 0..P-1.
    delay: tau, the steps between a fragment's outer gradient and its merge (Section 2.3).
    alpha: the merge's weight of the local parameters (Section 2.3; torchft
      `fragment_update_alpha`).
  """
  count = max(fragment_of) + 1
  leaves = [[i for i, f in enumerate(fragment_of) if f == p] for p in range(count)]
  # Fragment p's offset t_p: the fragments sync H / P steps apart (Section 2.2); torchft
  # gives fragment i the offset floor(sync_every / P * (i + 1)) (local_sgd.py line 663).
  offsets = [(p + 1) * sync_every // count for p in range(count)]
  theta_global = [np.asarray(x, np.float64) for x in params]
  theta = [[x.copy() for x in theta_global] for _ in range(workers)]
  inner_states = [inner.init(theta_global) for _ in range(workers)]
  # One outer optimizer state a fragment: each fragment's outer step touches only its leaves.
  outer_states = [outer.init([theta_global[i] for i in leaves[p]]) for p in range(count)]
  in_flight = {}
  local_history, global_history = [], []
  for t in range(1, steps + 1):  # Algorithm 2 counts steps from 1: step t is our t - 1.
    for m in range(workers):
      updates, inner_states[m] = inner.update(grad(m, t - 1, theta[m]), inner_states[m])
      theta[m] = [x + u for x, u in zip(theta[m], updates, strict=True)]
    for p in range(count):
      if t >= offsets[p] and (t - offsets[p]) % sync_every == 0:
        # Algorithm 2: at t with (t - t_p) mod H = 0, fragment p's outer gradient, the global
        # fragment minus the local one, averaged over the workers, starts its exchange.
        in_flight[p] = [np.mean([theta_global[i] - theta[m][i] for m in range(workers)],
                                axis=0) for i in leaves[p]]
      if t >= offsets[p] + delay and (t - offsets[p] - delay) % sync_every == 0:
        # tau steps later (Section 2.3): the outer step on the global fragment, then the merge
        # theta_m,p <- alpha theta_m,p + (1 - alpha) theta_p with the local fragment as it is
        # now (torchft `perform_sync`: `_save_local_parameters` at line 447, then
        # `p.data.lerp_(local, alpha)` on the new global value, line 385).
        updates, outer_states[p] = outer.update(in_flight.pop(p), outer_states[p])
        for i, u in zip(leaves[p], updates, strict=True):
          theta_global[i] = theta_global[i] + u
          for m in range(workers):
            theta[m][i] = theta_global[i] + alpha * (theta[m][i] - theta_global[i])
    local_history.append([[x.copy() for x in theta[m]] for m in range(workers)])
    global_history.append([x.copy() for x in theta_global])
  return local_history, global_history


def _record(history, step, m, theta, workers):
  while len(history) <= step:
    history.append([None] * workers)
  history[step][m] = [x.copy() for x in theta]
