"""Numpy re-implementations of DeepSpeed's 1-bit Adam and 0/1 Adam, to test the library against.

Each fact cites the DeepSpeed file and line it comes from (DeepSpeed at
commit edaa72212, ``deepspeedai/DeepSpeed``):

* ``nccl.py``: ``deepspeed/runtime/comm/nccl.py``, ``NcclBackend.compressed_allreduce``;
* ``adam.py``: ``deepspeed/runtime/fp16/onebit/adam.py``, ``OnebitAdam``;
* ``zoadam.py``: ``deepspeed/runtime/fp16/onebit/zoadam.py``, ``ZeroOneAdam``;
* ``cupy.py``: ``deepspeed/runtime/compression/cupy.py``, ``CupyBackend``.

The ``n`` workers are simulated in one process. A worker's gradient reaches
the optimizer averaged over the workers (float32 mean) when DeepSpeed's
engine runs its backward all-reduce (``enable_backward_allreduce``), and as
the worker's own otherwise; the optimizers switch it as the files do.

DeepSpeed's first ``step`` call only sets up buffers: it counts a step and
changes neither moments nor parameters (adam.py 167-183 and 236-245: the
freeze key is set while the buffers are made, so the warm-up branch is
skipped and the compressed branch exchanges the zero momentum;
zoadam.py 226-237 and 292-302). ``discard_first_call=True`` does that;
``False`` starts with a real update, as the library does.
"""

import math

import numpy as np

F32 = np.float32


def padded_size(size: int, n: int) -> int:
  """adam.py 110 and 171-177: a multiple of ``n * divider``, ``divider = n * 8 / gcd(n, 8)``."""
  divider = n * 8 // math.gcd(n, 8)
  multiple = n * divider
  return size if size % multiple == 0 else size + multiple - size % multiple


def _sign_plus_minus(x: np.ndarray) -> np.ndarray:
  """nccl.py 71 and 118: ``x.sign().add_(1).bool().float().add_(-0.5).mul_(2.0)``: 0 -> +1."""
  return ((np.sign(x) + 1).astype(bool).astype(F32) - F32(0.5)) * F32(2.0)


def _rms(x: np.ndarray) -> np.float32:
  """nccl.py 70 and 116: ``torch.linalg.norm(x) / np.sqrt(x.numel())``."""
  return F32(np.linalg.norm(x) / np.sqrt(x.size))


def compressed_allreduce(buffers, worker_errors, server_errors):
  """nccl.py 52-171 for ``n`` workers: the 1-bit average, errors updated in place.

  Args:
    buffers: each worker's float32 array (one tensor), all of one shape.
    worker_errors: each worker's ``float32[padded]``.
    server_errors: each worker's ``float32[padded / n]``.

  Returns:
    The average every worker gets, in the buffers' shape.
  """
  n = len(buffers)
  shape = buffers[0].shape
  size = buffers[0].size
  padded = worker_errors[0].size
  chunk = padded // n
  signs, scales = [], []
  for k in range(n):
    buffer = np.zeros(padded, F32)
    buffer[:size] = buffers[k].reshape(-1)  # nccl.py 56-67: flatten, pad with zeros.
    buffer += worker_errors[k]  # nccl.py 69
    scale = _rms(buffer)  # nccl.py 70
    worker_errors[k][:] = buffer - scale * _sign_plus_minus(buffer)  # nccl.py 71
    signs.append(_sign_plus_minus(buffer))  # nccl.py 73-78, packed, then unpacked at 112-113
    scales.append(scale)
  # nccl.py 100-102 and cupy.py 23-26: chunk j of every worker's packed signs goes to worker j,
  # every worker's scale to every worker.
  server_signs, server_scales = [], []
  for j in range(n):
    compensated = np.sum(
        np.stack([signs[k][j * chunk:(j + 1) * chunk] for k in range(n)])
        * (np.array(scales, F32) * F32(1 / n))[:, None], axis=0, dtype=F32)  # nccl.py 112-114
    compensated = compensated + server_errors[j]  # nccl.py 115
    server_scale = _rms(compensated)  # nccl.py 116
    server_errors[j][:] = compensated - server_scale * _sign_plus_minus(compensated)  # 117-118
    server_signs.append(_sign_plus_minus(compensated))
    server_scales.append(server_scale)
  # nccl.py 150-163: every server's signs and scale to every worker, decoded end to end.
  out = np.concatenate([server_signs[j] * server_scales[j] for j in range(n)])
  return out[:size].reshape(shape)  # nccl.py 164-167


def worker_compressed_reduce_scatter(buffers, worker_errors, size):
  """The worker half of ``compressed_allreduce`` (nccl.py 56-78, 100-102), summed by each
  chunk's server without a second compression: 1-bit Adam's exchange under FSDP.

  Each worker adds its error, takes one scale for the tensor and its signs (0 -> +1), keeps
  what they missed, and sends chunk ``j`` to worker ``j``, who sums the ``n`` decoded copies.
  Not in DeepSpeed: its scale divides by the parameter's ``size`` (DeepSpeed's by its padded
  size, nccl.py 70), and elements past ``size`` (padding) are sent as zero and stay zero.

  Args:
    buffers: each worker's ``float32[n * chunk]``, zero past ``size``.
    worker_errors: each worker's ``float32[n * chunk]``, updated in place.
    size: the parameter's elements.

  Returns:
    ``[n][chunk]``: each server's sum.
  """
  n = len(buffers)
  chunk = buffers[0].size // n
  valid = np.arange(n * chunk) < size
  decoded = []
  for k in range(n):
    buffer = buffers[k] + worker_errors[k]  # nccl.py 69
    scale = F32(np.linalg.norm(buffer) / np.sqrt(size))  # nccl.py 70, over the parameter
    signs = np.where(valid, _sign_plus_minus(buffer), F32(0))  # nccl.py 71
    worker_errors[k][:] = buffer - scale * signs
    decoded.append(scale * signs)
  return [np.sum(np.stack([d[j * chunk:(j + 1) * chunk] for d in decoded]), axis=0, dtype=F32)
          for j in range(n)]


class OnebitAdam:
  """``OnebitAdam.step`` (adam.py 114-254) for ``n`` workers, one parameter group.

  Attributes:
    params: the parameters (float32 arrays), the same on every worker.
    exp_avg, exp_avg_sq: the moments, the same on every worker.
    worker_errors, server_errors: per parameter, one array a worker.
  """

  def __init__(self, params, n, *, freeze_step, betas=(0.9, 0.999), eps=1e-8,
               weight_decay=0.0, non_freeze=None, discard_first_call=True):
    self.params = [np.array(p, F32) for p in params]
    self.n = n
    self.freeze_step = freeze_step
    self.beta1, self.beta2 = (float(b) for b in betas)
    self.eps = F32(eps)
    self.weight_decay = F32(weight_decay)
    # adam.py 200-204: a group marked 'non_freeze' keeps the float32 average and its variance.
    self.non_freeze = non_freeze or [False] * len(params)
    self.step_count = 0  # adam.py 162: state['step'].
    self.exp_avg = [np.zeros_like(p) for p in self.params]  # adam.py 164
    self.exp_avg_sq = [np.zeros_like(p) for p in self.params]  # adam.py 166
    self.worker_errors = [[np.zeros(padded_size(p.size, n), F32) for _ in range(n)]
                          for p in self.params]  # adam.py 179
    self.server_errors = [[np.zeros(padded_size(p.size, n) // n, F32) for _ in range(n)]
                          for p in self.params]  # adam.py 180
    self.initialized = not discard_first_call
    self.frozen = False  # adam.py 79: adam_freeze_key.

  @property
  def backward_allreduce(self) -> bool:
    """adam.py 249-253: the engine averages gradients until the freeze."""
    return not self.frozen

  def step(self, worker_grads, lr):
    """One step; ``worker_grads[k][i]`` is worker ``k``'s gradient of parameter ``i``."""
    self.step_count += 1  # adam.py 189
    if not self.initialized:  # adam.py 167-183, 236-245: buffers made, nothing learned.
      self.initialized = True
      return
    mean = [np.mean(np.stack([g[i] for g in worker_grads]), axis=0, dtype=F32)
            for i in range(len(self.params))]
    for i, p in enumerate(self.params):
      if not self.frozen:  # adam.py 191-196
        grad = mean[i]
        self.exp_avg[i] = self.exp_avg[i] * self.beta1 + (1 - self.beta1) * grad
        self.exp_avg_sq[i] = self.exp_avg_sq[i] * self.beta2 + (1 - self.beta2) * grad * grad
      elif self.non_freeze[i]:  # adam.py 200-204: all_reduce, divide, both moments.
        grad = mean[i]
        self.exp_avg[i] = self.exp_avg[i] * self.beta1 + (1 - self.beta1) * grad
        self.exp_avg_sq[i] = self.exp_avg_sq[i] * self.beta2 + (1 - self.beta2) * grad * grad
      else:  # adam.py 206-214: each worker's momentum of its own gradient, exchanged.
        local = [self.exp_avg[i] * self.beta1 + (1 - self.beta1) * g[i] for g in worker_grads]
        self.exp_avg[i] = compressed_allreduce(local, self.worker_errors[i],
                                               self.server_errors[i])
      update = self.exp_avg[i] / (np.sqrt(self.exp_avg_sq[i]) + self.eps)  # adam.py 196, 228
      if self.weight_decay > 0:
        update = update + self.weight_decay * p  # adam.py 230-232
      self.params[i] = p - F32(lr) * update  # adam.py 233-234
    if not self.frozen and self.step_count >= self.freeze_step:  # adam.py 247-250
      self.frozen = True


class ZeroOneAdam:
  """``ZeroOneAdam.step`` (zoadam.py 124-319) for ``n`` workers, one parameter group.

  Parameters and first moments are per worker (local steps make them differ);
  the variance is shared.
  """

  def __init__(self, params, n, *, var_freeze_step, betas=(0.9, 0.999), eps=1e-8,
               weight_decay=0.0, var_update_scaler=16, local_step_scaler=32678,
               local_step_clipper=16, discard_first_call=True):
    self.n = n
    self.params = [[np.array(p, F32) for p in params] for _ in range(n)]
    self.var_freeze_step = var_freeze_step
    self.beta1, self.beta2 = (float(b) for b in betas)
    self.eps = F32(eps)
    self.weight_decay = F32(weight_decay)
    self.var_update_scaler = var_update_scaler
    self.local_step_scaler = local_step_scaler
    self.local_step_clipper = local_step_clipper
    self.step_count = 0
    self.exp_avg = [[np.zeros_like(p) for p in self.params[0]] for _ in range(n)]
    self.exp_avg_sq = [np.zeros_like(p) for p in self.params[0]]
    self.comm_buffer = [[np.zeros_like(p) for p in self.params[0]] for _ in range(n)]  # zoadam 195
    self.worker_errors = [[np.zeros(padded_size(p.size, n), F32) for _ in range(n)]
                          for p in self.params[0]]  # zoadam.py 192
    self.server_errors = [[np.zeros(padded_size(p.size, n) // n, F32) for _ in range(n)]
                          for p in self.params[0]]  # zoadam.py 193
    # zoadam.py 180-184, one set for the group (every parameter's are equal).
    self.var_interval, self.var_counter = 1, 0
    self.local_step_interval, self.local_step_counter = 1, 0
    self.lrs = 0.0
    self.initialized = not discard_first_call
    self.frozen = False  # zoadam.py 97: freeze_key.
    self.errors_reset = False  # zoadam.py 98: reinitial_error_buffer.
    self.backward_allreduce = True  # The engine's default until the optimizer switches it.

  def step(self, worker_grads, lr):
    self.step_count += 1  # zoadam.py 206
    if not self.initialized:  # zoadam.py 226-237 and 292-302: buffers made, nothing learned.
      self.initialized = True
      return
    count = len(self.exp_avg_sq)
    if self.backward_allreduce:
      mean = [np.mean(np.stack([g[i] for g in worker_grads]), axis=0, dtype=F32)
              for i in range(count)]
      worker_grads = [mean] * self.n
    step = self.step_count
    if self.frozen:
      self.lrs += float(lr)  # zoadam.py 225, before the sync reads it (260).
    lr = F32(lr)
    for i in range(count):
      if not self.frozen:
        if step % self.var_interval == 0:  # zoadam.py 210-212: the averaged gradient.
          grad = worker_grads[0][i]
          self.exp_avg_sq[i] = self.exp_avg_sq[i] * self.beta2 + (1 - self.beta2) * grad * grad
          for k in range(self.n):
            self.exp_avg[k][i] = self.exp_avg[k][i] * self.beta1 + (1 - self.beta1) * grad
        else:  # zoadam.py 213-222: the local gradients' 1-bit average.
          onebit = compressed_allreduce([g[i] for g in worker_grads], self.worker_errors[i],
                                        self.server_errors[i])
          for k in range(self.n):
            self.exp_avg[k][i] = self.exp_avg[k][i] * self.beta1 + (1 - self.beta1) * onebit
      else:  # zoadam.py 223-225
        for k in range(self.n):
          self.exp_avg[k][i] = (self.exp_avg[k][i] * self.beta1
                                + (1 - self.beta1) * worker_grads[k][i])
      denominator = np.sqrt(self.exp_avg_sq[i]) + self.eps
      for k in range(self.n):
        update = self.exp_avg[k][i] / denominator  # zoadam.py 240
        if self.weight_decay > 0:
          update = update + self.weight_decay * self.params[k][i]  # zoadam.py 241-242
        self.params[k][i] = self.params[k][i] - lr * update  # zoadam.py 244
        if self.frozen:
          self.comm_buffer[k][i] = self.comm_buffer[k][i] - lr * update  # zoadam.py 245-246
      if self.frozen and step % self.local_step_interval == 0:  # zoadam.py 247-264
        for k in range(self.n):
          self.params[k][i] = self.params[k][i] - self.comm_buffer[k][i]  # zoadam.py 249
        scaled = [self.comm_buffer[k][i] * denominator for k in range(self.n)]  # zoadam.py 250
        synced = compressed_allreduce(scaled, self.worker_errors[i], self.server_errors[i])
        for k in range(self.n):
          self.exp_avg[k][i] = -(synced / F32(self.lrs))  # zoadam.py 260
          self.params[k][i] = self.params[k][i] + synced / denominator  # zoadam.py 261
          self.comm_buffer[k][i] = np.zeros_like(synced)  # zoadam.py 262
    self._end_of_step(step)

  def _end_of_step(self, step):
    if self.frozen:
      if step % self.local_step_interval == 0:
        self.lrs = 0.0  # zoadam.py 264
      self.local_step_counter += 1  # zoadam.py 286-290
      if self.local_step_counter == self.local_step_scaler:
        self.local_step_counter = 0
        self.local_step_interval = min(self.local_step_clipper, self.local_step_interval * 2)
    else:
      if step % self.var_interval == 0:  # zoadam.py 270-274
        self.var_counter += 1
        if self.var_counter == self.var_update_scaler:
          self.var_counter = 0
          self.var_interval *= 2
      self.backward_allreduce = (step + 1) % self.var_interval == 0  # zoadam.py 275-284
    if self.step_count > self.var_freeze_step:  # zoadam.py 303-308
      self.frozen = True
      self.backward_allreduce = False
    if self.frozen and not self.errors_reset:  # zoadam.py 310-317
      for errors in self.worker_errors + self.server_errors:
        for error in errors:
          error[:] = 0
      self.errors_reset = True
