"""A numpy reference of PyTorch's ``powerSGD_hook``, for ``powersgd_test.py`` to compare against.

Written from ``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py`` (read,
not copied) as it stands in PyTorch 2.x, with ``orthogonalization_epsilon`` and
``batch_tensors_with_same_shape``; line numbers are those of the copy read, at
commit ``41d3ad7`` of the ``Chao1Han/pytorch`` fork (its hook is PyTorch's but for
``torch.xpu`` in place of ``torch.cuda`` in one synchronization). One call is the hook
on one DDP bucket for one iteration, every worker at once: worker ``i``'s arrays are
``x[i]``, float32 throughout as in a float32 bucket. The random Q that PyTorch draws
from its own generator (``torch.manual_seed(state.rng.randint(...))``, then
``torch.randn``, lines 549-557) is an input here, so that a test can feed the draws
the library made.
"""

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np


class HookConfig(NamedTuple):
  """``PowerSGDState``'s hyperparameters, its defaults (``__init__``, lines 179-191)."""

  rank: int = 1  # matrix_approximation_rank, line 182.
  start_iter: int = 1000  # start_powerSGD_iter, line 183.
  min_compression_rate: float = 2  # Line 184.
  use_error_feedback: bool = True  # Line 185.
  warm_start: bool = True  # Line 186.
  orthogonalization_epsilon: float = 0  # Line 187.


class HookState(NamedTuple):
  """``PowerSGDState``'s memories for one bucket.

  Attributes:
    iter: ``state.iter``, 0 at first (line 258).
    error: ``error_dict[bucket]``, ``float32[workers, length]`` over the
      whole bucket, or ``None`` before the first compressed step (lines
      420-430).
    q_memory: the Q factors after the last step's all-reduce and division
      (line 612), one ``float32[b, m, r]`` a batch of same-shape tensors, or
      ``None`` when none are kept (before the first compressed step, and
      after every step without warm start: lines 477, 633-635).
  """

  iter: int = 0
  error: np.ndarray | None = None
  q_memory: list[np.ndarray] | None = None


def gram_schmidt(matrices: np.ndarray, epsilon: float) -> np.ndarray:
  """``_orthogonalize_gram_schmidt`` (lines 44-74) on ``float32[b, n, r]``.

  Each column is divided by its norm (plus ``epsilon`` when it is not 0, line
  70) and its projection is removed from the columns after it (lines 72-74).
  With ``epsilon == 0`` a zero column is divided by zero (line 61): NaN, as
  dividing tensors does not raise the ``ZeroDivisionError`` that lines 62-68
  catch.
  """
  matrices = np.array(matrices, np.float32)
  for i in range(matrices.shape[2]):
    column = matrices[:, :, i : i + 1]
    norm = np.sqrt(np.sum(column * column, axis=1, keepdims=True))
    with np.errstate(divide="ignore", invalid="ignore"):
      column /= norm if epsilon == 0 else norm + np.float32(epsilon)
    if i + 1 < matrices.shape[2]:
      rest = matrices[:, :, i + 1 :]
      rest -= np.sum(column * rest, axis=1, keepdims=True) * column
  return matrices


def orthogonalize(matrices: np.ndarray, epsilon: float) -> np.ndarray:
  """``_orthogonalize`` (lines 19-41): Gram-Schmidt for rank <= 2, else QR's Q (line 33)."""
  if matrices.shape[2] <= 2:
    return gram_schmidt(matrices, epsilon)
  return np.stack([np.linalg.qr(m, mode="reduced")[0] for m in matrices]).astype(np.float32)


def should_compress(rows: int, columns: int, rank: int, min_compression_rate: float) -> bool:
  """``_should_compress`` (lines 77-103), called with ``rank = min(n, m, rank)`` (line 448)."""
  return (rows + columns) * rank * min_compression_rate < rows * columns


def matrix_view(shape: Sequence[int]) -> tuple[int, int]:
  """``tensor.view(tensor.shape[0], -1)`` (line 446): a 1-d tensor is ``(n, 1)``."""
  return (shape[0], int(np.prod(shape[1:], dtype=np.int64)))


def hook_step(config: HookConfig, state: HookState, tensors: Sequence[np.ndarray],
              draw_q: Callable[[list[tuple[int, int, int]]], list[np.ndarray]],
              ) -> tuple[list[np.ndarray], HookState]:
  """One iteration of ``powerSGD_hook`` (lines 339-647) on a bucket of ``tensors``.

  Args:
    config: the hyperparameters.
    state: the memories before the iteration.
    tensors: the bucket's gradients, in order, each ``float32[workers, *shape]``.
    draw_q: given the Q shapes ``(b, m, r)`` of the batches of same-shape
      compressed tensors, in order, the standard normal draws PyTorch would
      make (lines 549-557); called only on the iterations that draw.

  Returns:
    Each tensor after the hook, ``float32[workers, *shape]`` (every worker's
    is the same), and the new state.
  """
  workers = tensors[0].shape[0]
  # Lines 408-410: the default all-reduce, which divides by the world size
  # first and then sums (default_hooks._allreduce_fut); iter advances.
  if state.iter < config.start_iter:
    means = [np.sum(t.astype(np.float32) / np.float32(workers), axis=0) for t in tensors]
    return ([np.broadcast_to(m, t.shape) for m, t in zip(means, tensors, strict=True)],
            state._replace(iter=state.iter + 1))

  sizes = [int(np.prod(t.shape[1:], dtype=np.int64)) for t in tensors]
  bucket = np.concatenate([t.reshape(workers, -1) for t in tensors], axis=1).astype(np.float32)
  error = state.error
  if config.use_error_feedback:  # Lines 420-435.
    if error is not None:
      bucket = bucket + error
    else:
      error = np.zeros_like(bucket)
    copy = bucket.copy()
  offsets = np.cumsum([0, *sizes])
  views = [bucket[:, offsets[k] : offsets[k + 1]] for k in range(len(tensors))]

  # Lines 445-460: which tensors are compressed, and at which rank (line 448).
  compressed, uncompressed = [], []
  for k, tensor in enumerate(tensors):
    n, m = matrix_view(tensor.shape[1:])
    rank = min(n, m, config.rank)
    if should_compress(n, m, rank, config.min_compression_rate):
      compressed.append(k)
    else:
      uncompressed.append(k)

  # Lines 495-512: batches of same-shape tensors, in the order shapes first appear.
  batches: dict[tuple[int, int], list[int]] = {}
  for k in compressed:
    batches.setdefault(matrix_view(tensors[k].shape[1:]), []).append(k)
  matrices = [np.stack([views[k].reshape(workers, n, m) for k in ks], axis=1)
              for (n, m), ks in batches.items()]  # [workers, b, n, m] a batch.
  q_shapes = [(len(ks), m, min(n, m, config.rank)) for (n, m), ks in batches.items()]

  # Lines 476-478 and 537-558: the kept Q, or a new draw, orthogonalized.
  if config.warm_start and state.q_memory is not None:
    qs = [orthogonalize(q, config.orthogonalization_epsilon) for q in state.q_memory]
  else:
    qs = [orthogonalize(np.asarray(q, np.float32), config.orthogonalization_epsilon)
          for q in draw_q(q_shapes)]

  # Lines 561-562, 580-587 and 591-592: P = M Q, summed (not divided), orthogonalized.
  ps = [np.sum(np.matmul(mats, q), axis=0) for mats, q in zip(matrices, qs, strict=True)]
  ps = [orthogonalize(p, config.orthogonalization_epsilon) for p in ps]
  # Lines 595-596, 604-612: Q = M^T P, summed and divided by the world size.
  qs = [np.sum(np.matmul(np.swapaxes(mats, -1, -2), p), axis=0) / np.float32(workers)
        for mats, p in zip(matrices, ps, strict=True)]

  out = bucket.copy()
  # Lines 567-578: the uncompressed tensors' sum, divided by the world size.
  for k in uncompressed:
    out[:, offsets[k] : offsets[k + 1]] = np.sum(views[k], axis=0) / np.float32(workers)
  # Lines 614-625: each compressed tensor becomes P Q^T.
  for ks, p, q in zip(batches.values(), ps, qs, strict=True):
    approximations = np.matmul(p, np.swapaxes(q, -1, -2))
    for b, k in enumerate(ks):
      out[:, offsets[k] : offsets[k + 1]] = approximations[b].reshape(-1)

  if config.use_error_feedback:  # Line 632: over the whole bucket, uncompressed tensors too.
    error = copy - out
  new_state = HookState(iter=state.iter + 1, error=error,  # Line 637.
                        q_memory=qs if config.warm_start else None)  # Lines 633-635.
  results = [out[:, offsets[k] : offsets[k + 1]].reshape(t.shape)
             for k, t in enumerate(tensors)]
  return results, new_state
