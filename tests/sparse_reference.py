"""NumPy references of the sparse family, for ``tests/sparse_test.py``: top-k of chunks, DeMo's
step, SparseLoCo's quantizer and outer step, DGC's step.

Written from the papers and the released code, read at these commits:

* DeMo: Peng, Quesnelle and Kingma 2024, arXiv 2411.19870, Algorithm 1; ``demo.py`` of
  ``bloc97/DeMo`` (commit cab4606).
* SparseLoCo: Sarfi, Therien, Lidin and Belilovsky 2025, arXiv 2508.15706, Algorithm 1;
  ``src/tplr/sparseloco.py`` of its initial commit (276fa59, mirrored in
  ``QErywan/RobustDiLoCo``).
* DGC: Lin, Han, Mao, Wang and Dally 2018, arXiv 1712.01887, Algorithm 1 and Section 3;
  ``dgc/memory.py`` and ``dgc/compression.py`` of ``synxlin/deep-gradient-compression``.
* GRACE (``sands-lab/grace``): ``grace_dl/torch/communicator/allgather.py`` lines 39-53, its
  sum over the workers divided by their number.

Each worker's arrays are numpy arrays; ``grads[w][i]`` is worker ``w``'s leaf ``i``.
"""

import math

import numpy as np
import scipy.fft


def largest_divisor_at_most(n, target):
  """``demo.py`` lines 396-449, ``_get_smaller_split``: the largest divisor of ``n`` that is at
  most ``target`` (``n`` itself when smaller)."""
  return max(d for d in range(1, min(n, target) + 1) if n % d == 0)


def blocks(x, rows, cols, side):
  """``demo.py`` lines 224 and 232 (``rearrange("(y h) (x w) -> y x h w")``): the leaf as a
  ``rows x cols`` matrix cut into blocks ``[y, x, h, w]``."""
  h, w = largest_divisor_at_most(rows, side), largest_divisor_at_most(cols, side)
  return x.reshape(rows // h, h, cols // w, w).transpose(0, 2, 1, 3), (h, w)


def unblocks(b, shape):
  """Inverse of :func:`blocks`."""
  return b.transpose(0, 2, 1, 3).reshape(shape)


def top_k_mask(x, k):
  """Per block (the last two axes flattened), the ``k`` largest ``|x|`` (``demo.py`` lines
  261-294, ``torch.topk(x.abs(), k)``), as a boolean mask."""
  flat = x.reshape(*x.shape[:-2], -1)
  k = min(max(k, 1), flat.shape[-1])  # demo.py's _clamp_topk
  order = np.argsort(-np.abs(flat), axis=-1, kind="stable")[..., :k]
  mask = np.zeros(flat.shape, bool)
  np.put_along_axis(mask, order, True, axis=-1)
  return mask.reshape(x.shape)


def topk_chunks(x, k, chunk):
  """:class:`qsgd_jax.TopK`'s selection: ``x`` flattened and zero-padded to chunks of
  ``chunk``, the ``k`` largest magnitudes of each kept (ties to the lower position)."""
  flat = np.asarray(x, np.float64).reshape(-1)
  padded = np.zeros(-(-flat.size // chunk) * chunk)
  padded[:flat.size] = flat
  rows = padded.reshape(-1, chunk)
  order = np.argsort(-np.abs(rows), axis=1, kind="stable")[:, :k]
  out = np.zeros_like(rows)
  np.put_along_axis(out, order, np.take_along_axis(rows, order, axis=1), axis=1)
  return out.reshape(-1)[:flat.size].reshape(np.shape(x))


def contributor_mean(sent):
  """``scatter_reduce(..., reduce="mean", include_self=False)`` over the workers' sparse arrays
  (``demo.py`` lines 296-307; ``sparseloco.py`` line 301): each element's mean over the workers
  that sent it, 0 where none did. ``sent`` is ``[(values, mask)]``, one a worker."""
  total = sum(np.where(mask, values, 0.0) for values, mask in sent)
  count = sum(mask.astype(np.float64) for _, mask in sent)
  return np.where(count > 0, total / np.maximum(count, 1.0), 0.0)


def demo_step(params, momenta, grads, lr, *, chunk, k, decay, weight_decay):
  """One step of ``DeMo.step`` (``demo.py`` lines 107-170) on every worker.

  Per leaf: decoupled weight decay (lines 124-125), ``delta = decay * delta + lr * grad``
  (128-132), the DCT's top-k (135-137), its inverse subtracted from delta (140-145), the
  workers' top-k gathered and mean-reduced (148-158), ``p -= lr * sign`` (161-170). 1-d leaves
  are one row; 2-d ones as they are. Returns the new params and momenta.
  """
  workers = len(grads)
  new_params, new_momenta = [], [[None] * len(params) for _ in range(workers)]
  for i, p in enumerate(params):
    shape = p.shape
    rows, cols = (1, p.size) if p.ndim < 2 else shape
    sent = []
    for w in range(workers):
      delta = decay * momenta[w][i] + lr * grads[w][i]
      b, _ = blocks(delta, rows, cols, chunk)
      coefficients = scipy.fft.dctn(b, axes=(-2, -1), norm="ortho")
      mask = top_k_mask(coefficients, k)
      kept = np.where(mask, coefficients, 0.0)
      new_momenta[w][i] = delta - unblocks(scipy.fft.idctn(kept, axes=(-2, -1), norm="ortho"),
                                           shape)
      sent.append((coefficients, mask))
    average = unblocks(scipy.fft.idctn(contributor_mean(sent), axes=(-2, -1), norm="ortho"),
                       shape)
    new_params.append(p * (1 - lr * weight_decay) - lr * np.sign(average))
  return new_params, new_momenta


def bin_means(values, bits, value_range=6.0):
  """``sparseloco.py`` lines 309-338: the selected values of one tensor, centred on their mean,
  in ``2**bits`` bins of ``range * std / bins`` (the unbiased std), each decoded to the mean of
  the centred values in it; returns the dequantized values."""
  values = np.asarray(values, np.float32)
  n_bins = 2**bits
  shift = values.mean(dtype=np.float32)
  centred = values - shift
  std = np.float32(np.linalg.norm(centred) / math.sqrt(values.size - 1)) if values.size > 1 else 0
  scale = np.float32(value_range * std / n_bins)
  if scale == 0 or not np.isfinite(scale):
    scale = np.float32(1.0)
  codes = np.clip(np.round(centred / scale + n_bins // 2), 0, n_bins - 1).astype(int)
  lookup = np.zeros(n_bins, np.float32)
  for b in range(n_bins):
    if np.any(codes == b):
      lookup[b] = centred[codes == b].mean()
  return lookup[codes] + shift


def sparseloco_round(errors, deltas, *, density, chunk, bits, decay):
  """One outer round of ``SparseLoCo.step`` (``sparseloco.py`` lines 394-452) at outer learning
  rate 1: ``e = decay * e + delta`` (lines 409-412), top-k of each block with ``k =
  max(1, round(block * top_k / chunk**2))`` (416-424), the values quantized (309-338) and the
  dequantized selection subtracted from ``e`` (430), the workers' mean over contributors
  (301). Returns the averaged outer gradient (a list of leaves) and the new errors."""
  workers = len(deltas)
  averaged, new_errors = [], [[None] * len(deltas[0]) for _ in range(workers)]
  for i in range(len(deltas[0])):
    shape = deltas[0][i].shape
    rows, cols = (1, deltas[0][i].size) if len(shape) < 2 else (math.prod(shape[:-1]), shape[-1])
    sent = []
    for w in range(workers):
      e = decay * errors[w][i] + deltas[w][i]
      b, (h, wide) = blocks(e, rows, cols, chunk)
      k = min(h * wide, max(1, round(h * wide * density)))
      mask = top_k_mask(b, k)
      values = b[mask]
      if bits is not None:
        values = bin_means(values, bits)
      dequantized = np.zeros(b.shape)
      dequantized[mask] = values
      new_errors[w][i] = e - unblocks(dequantized, shape)
      sent.append((dequantized, mask))
    averaged.append(unblocks(contributor_mean(sent), shape))
  return averaged, new_errors


def dgc_step(momenta, velocities, grads, *, k, chunk, momentum, masking, clip):
  """One step of DGC on every worker for leaves of two or more dimensions (``memory.py`` lines
  50-77, non-Nesterov: ``u = m u + g``, ``v += u``; masking ``v[idx] = 0`` and ``u[idx] = 0``),
  each worker's gradient first clipped by its global norm at ``clip`` (or not, for ``None``;
  the paper's local clipping, Section 3.2). The update is the sent velocities summed over the
  workers and divided by their number (``compression.py`` lines 155-206). Returns the update,
  the momenta and the velocities."""
  workers = len(grads)
  new_u, new_v, sent = [], [], []
  for w in range(workers):
    g = grads[w]
    if clip is not None:
      norm = math.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in g))
      g = [x * min(1.0, clip / norm) for x in g]
    us, vs, sends = [], [], []
    for i in range(len(g)):
      u = momentum * momenta[w][i] + g[i]
      v = velocities[w][i] + u
      send = topk_chunks(v, k, chunk)
      mask = send != 0
      us.append(np.where(mask, 0.0, u) if masking else u)
      vs.append(np.where(mask, 0.0, v))
      sends.append(send)
    new_u.append(us)
    new_v.append(vs)
    sent.append(sends)
  update = [sum(sent[w][i] for w in range(workers)) / workers for i in range(len(grads[0]))]
  return update, new_u, new_v
