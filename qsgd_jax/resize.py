r"""Laying out per-device optimizer state for another device count.

A state that differs per device (error-feedback residuals, running means of
gradients, decentralized workers' models) is laid out for the device count
it was saved on. :func:`resize_state` (also ``qsgd_jax.resize_state``) lays
it out for another, field by field, each by the rule its state type declared
with :func:`register`; everything else is replicated, and copied.

A rule sees every leaf of its field stacked along a leading axis of devices,
``[n, ...]`` (NumPy arrays, whatever the layout of the state), and returns
leaves ``[m, ...]`` shaped like the target's. The rules:

* :func:`mean`: every new device gets the mean over the saved devices. Error
  feedback keeps what compression dropped: :math:`\sum_t \bar g_t` minus the
  sum of the averaged updates is :math:`\frac{1}{n}\sum_i e_i`, the worker
  residuals :math:`e_i` summed over devices and, as every device's
  contribution to a mean is, divided by the device count. Giving each of the
  :math:`m` new devices that mean keeps it,
  :math:`\frac{1}{m}\sum_k e'_k = \frac{1}{n}\sum_i e_i`: read as plain sums,
  the residuals are scaled by :math:`m/n`.
* :func:`pieces`: device ``j`` holds piece ``j`` of a vector cut into one
  piece a device (an owner's residual of the part of the averaged sum it
  owns, which enters the mean undivided): the pieces are joined in device
  order, and the vector is cut again into ``m`` pieces of the target's
  length, zero-padded or cut at the end. Every element keeps its value, so
  the sum over owners is kept exactly; only the boundaries between owners
  move.
* :func:`first_device` and :func:`row`: every new device gets one saved
  device's values (replicated state; decentralized workers, which all restart
  from worker 0's model).
"""

from qsgd_jax._src.training.resize import (
    Rule,
    first_device,
    mean,
    pieces,
    register,
    resize_state,
    row,
)

__all__ = ("Rule", "first_device", "mean", "pieces", "register", "resize_state", "row")
