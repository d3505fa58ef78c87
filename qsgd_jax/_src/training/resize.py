"""Optimizer states saved on one number of devices, restored on another (``qsgd_jax.resize``)."""

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qsgd_jax._src.accumulation import AccumulationState
from qsgd_jax._src.adam.onebit_adam import ScaleByOneBitAdamState
from qsgd_jax._src.adam.zero_one_adam import ZeroOneAdamState
from qsgd_jax._src.averaging.allreduce import CompressedAllReduceState
from qsgd_jax._src.averaging.decentralized import LowPrecisionDecentralizedState
from qsgd_jax._src.diloco.exchange import SplitAverageState
from qsgd_jax._src.diloco.fragment import DelayedFragmentState
from qsgd_jax._src.diloco.transform import DiLoCoState
from qsgd_jax._src.fsdp.onebit_state import FSDPOneBitErrorState
from qsgd_jax._src.powersgd.transform import PowerSGDState

Rule = Callable[[Any, Any], Any]


@dataclasses.dataclass(frozen=True)
class _Field:
  rule: Rule
  residual: bool


_FIELDS: dict[tuple[type, str], _Field] = {}


def register(state_type: type, field: str, rule: Rule, *, residual: bool = False) -> None:
  """Declares how :func:`~qsgd_jax.resize_state` lays out a per-device field of a state.

  In the layout of ``jax.shard_map`` (``resize_state(..., stacked=False)``)
  the field's leaves of one or more dimensions are taken to hold every
  device's values end to end along their first axis, and its scalars to be
  replicated, as :func:`~qsgd_jax.state_partition_specs` lays out the
  library's states: a new state type must be laid out so there too.

  Args:
    state_type: a ``NamedTuple`` state class.
    field: one of its fields.
    rule: ``rule(saved, target) -> resized``: ``saved`` is the field with
      every leaf a NumPy array ``[n, ...]`` (one row a saved device),
      ``target`` the field with a ``jax.ShapeDtypeStruct`` ``[m, ...]`` a
      leaf; it returns the field with arrays of the target's shapes and
      dtypes. :func:`mean`, :func:`pieces` and :func:`first_device` are such
      rules; a ``ValueError`` it raises is reported with the leaf's path and
      both device counts.
    residual: whether the field holds error-feedback residuals, which
      ``resize_state(..., drop=True)`` sets to zero instead.

  Raises:
    ValueError: ``field`` is not a field of ``state_type``.

  Examples:
    A state whose ``error`` is each worker's residual and whose ``server``
    is an owner's piece of the reduced vector::

      qsgd_jax.resize.register(MyState, "error", qsgd_jax.resize.mean, residual=True)
      qsgd_jax.resize.register(MyState, "server", qsgd_jax.resize.pieces(), residual=True)
  """
  if field not in getattr(state_type, "_fields", ()):
    raise ValueError(f"resize.register: {state_type.__name__} has no field {field!r}.")
  _FIELDS[(state_type, field)] = _Field(rule, residual)


def mean(saved, target):
  """Every new device gets the mean over the saved devices (float leaves; others: device 0's).

  Examples:
    >>> import jax, numpy as np
    >>> from qsgd_jax import resize
    >>> saved = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)  # 2 devices' residuals.
    >>> resize.mean(saved, jax.ShapeDtypeStruct((4, 2), np.float32)).tolist()
    [[2.0, 3.0], [2.0, 3.0], [2.0, 3.0], [2.0, 3.0]]
  """

  def leaf(saved_leaf, target_leaf):
    _check_per_device(saved_leaf, target_leaf)
    if not jnp.issubdtype(saved_leaf.dtype, jnp.floating):
      return _broadcast(saved_leaf[0], target_leaf)
    average = saved_leaf.astype(np.float64).mean(axis=0)
    return _broadcast(average.astype(saved_leaf.dtype), target_leaf)

  return _map(leaf, saved, target)


def first_device(saved, target):
  """Every new device gets device 0's values.

  Examples:
    >>> import jax, numpy as np
    >>> from qsgd_jax import resize
    >>> saved = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    >>> resize.first_device(saved, jax.ShapeDtypeStruct((3, 2), np.float32)).tolist()
    [[1.0, 2.0], [1.0, 2.0], [1.0, 2.0]]
  """

  def leaf(saved_leaf, target_leaf):
    _check_per_device(saved_leaf, target_leaf)
    return _broadcast(saved_leaf[0], target_leaf)

  return _map(leaf, saved, target)


def row(index: int) -> Rule:
  """Every new device gets saved device ``index``'s values (``-1``: the last device's).

  Examples:
    >>> import jax, numpy as np
    >>> from qsgd_jax import resize
    >>> saved = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    >>> resize.row(-1)(saved, jax.ShapeDtypeStruct((3, 2), np.float32)).tolist()
    [[3.0, 4.0], [3.0, 4.0], [3.0, 4.0]]
  """

  def rule(saved, target):
    def leaf(saved_leaf, target_leaf):
      _check_per_device(saved_leaf, target_leaf)
      return _broadcast(saved_leaf[index], target_leaf)

    return _map(leaf, saved, target)

  return rule


def pieces(batch_dims: int = 0) -> Rule:
  """Pieces of vectors, one a device, joined in device order and cut again.

  Args:
    batch_dims: leading dimensions of a device's leaf that index separate
      vectors (a block's segments), not cut.

  Returns:
    A rule: a saved leaf ``[n, *batch, *piece]`` becomes ``[m, *batch,
    *new_piece]``, the target's. For each vector, the ``n`` pieces are laid
    end to end (each flattened, row-major), cut or zero-padded at the end to
    ``m`` times the new piece's size, and cut into ``m`` pieces. Whatever a
    shorter layout cuts off is past the end of every piece of the target,
    padding that no parameter reads.

  Examples:
    >>> import jax, numpy as np
    >>> from qsgd_jax import resize
    >>> saved = np.arange(8, dtype=np.float32).reshape(4, 2)  # 4 devices, a piece of 2 each.
    >>> resize.pieces()(saved, jax.ShapeDtypeStruct((2, 4), np.float32)).tolist()
    [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
  """

  def leaf(saved_leaf, target_leaf):
    n, m = saved_leaf.shape[0], target_leaf.shape[0]
    batch = saved_leaf.shape[1:1 + batch_dims]
    if target_leaf.shape[1:1 + batch_dims] != batch or saved_leaf.dtype != target_leaf.dtype:
      raise ValueError(
          f"saved as {n} pieces {saved_leaf.dtype}{list(saved_leaf.shape[1:])}, but the target "
          f"wants {m} pieces {target_leaf.dtype}{list(target_leaf.shape[1:])}: the vectors "
          f"(leading {batch_dims} dimensions) differ.")
    new_piece = target_leaf.shape[1 + batch_dims:]
    joined = np.moveaxis(saved_leaf.reshape(n, *batch, -1), 0, batch_dims).reshape(*batch, -1)
    length = m * int(np.prod(new_piece, dtype=int))
    out = np.zeros((*batch, length), saved_leaf.dtype)
    kept = min(length, joined.shape[-1])
    out[..., :kept] = joined[..., :kept]
    return np.moveaxis(out.reshape(*batch, m, *new_piece), batch_dims, 0)

  return lambda saved, target: _map(leaf, saved, target)


def resize_state(state, target, *, from_devices: int, to_devices: int, stacked: bool = False,
                 drop: bool = False):
  """An optimizer state saved on ``from_devices`` devices, laid out for ``to_devices``.

  The per-device fields of the library's states are redistributed so that
  what they stand for is kept (module :mod:`qsgd_jax.resize` says how):

  * :class:`~qsgd_jax.CompressedAllReduceState`: worker residuals
    (``local_error``) by :func:`~qsgd_jax.resize.mean`, owner residuals (``chunk_error``) by
    :func:`~qsgd_jax.resize.pieces` of each block. Owner residuals of blocks that stack several
    whole-leaf segments (a compressor with one scale a leaf) cannot be
    matched across device counts: they raise, unless dropped. Worker
    residuals over several axes hold a slice whose length depends on the
    device counts: they raise too, unless dropped;
  * :class:`~qsgd_jax.AccumulationState`: each device's running mean of its
    gradients by :func:`~qsgd_jax.resize.mean` (the group's mean gradient is kept);
  * :class:`~qsgd_jax.PowerSGDState`: each device's error memory by
    :func:`~qsgd_jax.resize.mean` (the mean the error feedback owes is kept);
  * :class:`~qsgd_jax.ScaleByOneBitAdamState` and
    :class:`~qsgd_jax.ZeroOneAdamState`: the 1-bit exchange's errors are cut
    into chunks whose boundaries and padding depend on the device count:
    they raise unless dropped (DeepSpeed drops them at every load); 0/1
    Adam's accumulator of local steps by :func:`~qsgd_jax.resize.first_device`;
  * :class:`~qsgd_jax.FSDPOneBitErrorState`: FSDP 1-bit Adam's worker
    errors, one row a device of each device's shards: likewise, dropped;
  * :class:`~qsgd_jax.LowPrecisionDecentralizedState`: every new worker takes
    worker 0's inner state, and both replicas become worker 0's model (worker
    1's copy of it), so the caller must give every worker worker 0's
    parameters too: what the stacked layout does to leaves outside these
    states.

  * :class:`~qsgd_jax.DiLoCoState`: every new worker takes worker 0's inner
    optimizer state (:func:`~qsgd_jax.resize.first_device`); the outer
    gradients not yet exchanged (a :class:`~qsgd_jax.DelayedFragmentState`'s
    ``outer_gradient``) become their mean over the saved workers
    (:func:`~qsgd_jax.resize.mean`: what a float32 exchange would make of
    them); the averages' states by their own rules (a compressed average's
    residuals by their mean); the count, the global parameters, the outer
    optimizers' states and the averaged outer gradients are the same on
    every worker and kept. The caller gives the
    new workers their parameters: the global parameters (best at the end of
    a round) or worker 0's.

  States of other types, and leaves outside any state, are replicated: under
  the stacked layout every new device gets device 0's values; otherwise the
  saved leaf must already have the target's shape. A state type of your own
  declares its per-device fields with :func:`qsgd_jax.resize.register`.

  On a mesh whose model is sharded over other axes (``('data', 'fsdp',
  'tensor')``, :func:`~qsgd_jax.data_parallel` over ``data``), a device's
  per-device arrays are those of its shards, laid out along the data axis
  first and then the axes of the shards (as
  :func:`~qsgd_jax.data_parallel`'s ``abstract_state`` gives them): pass the
  numbers of *data groups* as ``from_devices`` and ``to_devices``. A data
  group's row then holds every shard's values, and the rules above apply to
  each shard's (a residual's mean is each shard's mean over the data
  groups). The model axes must lay the model out as they did: what a state
  holds of a shard depends on the shard's shape (the 1-bit exchange's and
  PowerSGD's blocks), and another layout is an error naming the leaf.

  Args:
    state: the saved state (arrays, e.g. as orbax restored them with their
      saved shapes).
    target: the state to lay it out like: ``init``'s result on the new
      devices, or its ``jax.eval_shape`` (only shapes and dtypes are read).
    from_devices: the devices ``state`` was laid out for (the data groups, on
      a mesh whose model is sharded).
    to_devices: the devices ``target`` is laid out for (likewise).
    stacked: every leaf has a leading axis of devices, ``[n, ...]``, as
      under ``jax.pmap``; otherwise per-device leaves are those of the
      devices laid end to end along their first axis and the rest replicated,
      as :func:`~qsgd_jax.state_partition_specs` lays them out for
      ``jax.shard_map`` and :func:`~qsgd_jax.data_parallel`.
    drop: set error-feedback residuals to zero instead of redistributing
      them, with a one-line warning.

  Returns:
    A tree like ``target`` of host arrays (NumPy; PRNG keys as JAX key
    arrays), to put onto the devices with the target's shardings; ``state``
    itself when the device counts are equal.

  Raises:
    ValueError: a leaf the rules cannot lay out (another tree, another
      dtype, a replicated leaf of another shape, a per-device field without
      a rule), naming the leaf and both device counts.

  Examples:
    1-bit SGD's residuals saved on 8 devices, resumed on 4, in pmap's layout:

    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> def init_on(n):  # The state as jax.pmap over n devices holds it.
    ...   state = qsgd_jax.onebit_sgd("batch", axis_size=n).init(jnp.zeros(8192))
    ...   return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), state)
    >>> saved = init_on(8)._replace(local_error=(jnp.arange(8.0)[:, None] * jnp.ones(8192),))
    >>> resized = qsgd_jax.resize_state(saved, jax.eval_shape(lambda: init_on(4)),
    ...                                 from_devices=8, to_devices=4, stacked=True)
    >>> resized.local_error[0].shape, float(resized.local_error[0][0, 0])  # The mean, 3.5.
    ((4, 8192), 3.5)
  """
  for name, count in (("from_devices", from_devices), ("to_devices", to_devices)):
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
      raise ValueError(f"resize_state: {name} must be a positive int, got {count!r}.")
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), target)
  resizer = _Resizer(from_devices, to_devices, stacked, drop)
  if from_devices == to_devices:  # Nothing moves: the state must already fit.
    resizer.check_same(state, shapes)
    return state
  out = resizer.node(state, shapes, "")
  if resizer.dropped:
    warnings.warn(
        f"resize_state: dropped the error-feedback residuals {', '.join(resizer.dropped)} "
        f"saved on {from_devices} devices: on {to_devices} devices they start at zero.",
        stacklevel=2)
  return out


@dataclasses.dataclass
class _Resizer:
  """One :func:`resize_state` call: its device counts and layout, and what it dropped."""

  from_devices: int
  to_devices: int
  stacked: bool
  drop: bool
  dropped: list[str] = dataclasses.field(default_factory=list)

  def node(self, saved, target, path: str):
    """``saved`` laid out like ``target``: states by their fields, other leaves replicated."""
    states = tuple({state_type for state_type, _ in _FIELDS})
    target_leaves, treedef = jax.tree_util.tree_flatten_with_path(
        target, is_leaf=lambda x: isinstance(x, states))
    saved_leaves = self._flatten_up_to(treedef, saved, path)
    out = []
    for (key_path, t), s in zip(target_leaves, saved_leaves, strict=True):
      where = path + jax.tree_util.keystr(key_path)
      if isinstance(t, states):
        out.append(self.state(s, t, where))
      else:
        out.append(self.field(first_device, s, t, where, per_device=False))
    return jax.tree_util.tree_unflatten(treedef, out)

  def state(self, saved, target, path: str):
    if type(saved) is not type(target):
      raise self.error(path, f"saved as {type(saved).__name__}, the target is "
                             f"{type(target).__name__}")
    fields = {}
    for name in target._fields:
      where = f"{path}.{name}"
      saved_field, target_field = getattr(saved, name), getattr(target, name)
      declared = _FIELDS.get((type(target), name))
      if declared is None:
        fields[name] = self.node(saved_field, target_field, where)
      elif declared.residual and self.drop:
        self.dropped.append(f"{type(target).__name__}.{name}")
        fields[name] = jax.tree.map(lambda t: np.zeros(t.shape, t.dtype), target_field)
      else:
        try:
          fields[name] = self.field(declared.rule, saved_field, target_field, where,
                                    per_device=True)
        except ValueError as error:
          if not declared.residual:
            raise
          raise ValueError(f"{error} Pass drop=True to start these residuals at zero.") from None
    return type(target)(**fields)

  def field(self, rule: Rule, saved, target, path: str, per_device: bool):
    """One field through ``rule``, its leaves stacked along a device axis and back.

    Without the stacked layout, a leaf lies along the devices if ``per_device``
    and it has a dimension; else it is replicated.
    """
    target_leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
    saved_leaves = self._flatten_up_to(treedef, saved, path)
    stacked_saved, stacked_target, kinds = [], [], []
    for (key_path, t), s in zip(target_leaves, saved_leaves, strict=True):
      where = path + jax.tree_util.keystr(key_path)
      data, key_impl = _key_data(s)
      if (key_impl is None) != (not jnp.issubdtype(t.dtype, jax.dtypes.prng_key)):
        raise self.error(where, f"saved as {jnp.result_type(s)}, the target is {t.dtype}")
      along = self.stacked or (per_device and len(t.shape) > 0)
      kinds.append((along, key_impl))
      if key_impl is not None:  # A key's data has trailing dimensions of its own.
        t = jax.ShapeDtypeStruct((*t.shape, *data.shape[len(s.shape):]), data.dtype)
      stacked_saved.append(self._stack(data, along, where, self.from_devices))
      stacked_target.append(self._stack_shape(t, along, where))
    try:
      resized = rule(jax.tree_util.tree_unflatten(treedef, stacked_saved),
                     jax.tree_util.tree_unflatten(treedef, stacked_target))
      resized_leaves = treedef.flatten_up_to(resized)
    except ValueError as error:
      raise self.error(path, str(error)) from None
    out = []
    for (key_path, t), leaf, (along, key_impl) in zip(target_leaves, resized_leaves, kinds,
                                                      strict=True):
      leaf = self._unstack(np.asarray(leaf), along)
      if key_impl is not None:
        leaf = jax.random.wrap_key_data(leaf, impl=key_impl)
      elif leaf.shape != t.shape or leaf.dtype != t.dtype:
        raise self.error(path + jax.tree_util.keystr(key_path),
                         f"its rule gave {leaf.dtype}{list(leaf.shape)}, the target is "
                         f"{t.dtype}{list(t.shape)}")
      out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)

  def check_same(self, saved, target) -> None:
    target_leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
    for (key_path, t), s in zip(target_leaves, self._flatten_up_to(treedef, saved, ""),
                                strict=True):
      if tuple(jnp.shape(s)) != t.shape or jnp.result_type(s) != t.dtype:
        raise self.error(jax.tree_util.keystr(key_path),
                         f"saved as {jnp.result_type(s)}{list(jnp.shape(s))}, the target is "
                         f"{t.dtype}{list(t.shape)} on as many devices: another configuration, "
                         "or another layout over the model axes of a mesh whose model is "
                         "sharded")

  def _stack(self, data: np.ndarray, along: bool, path: str, count: int) -> np.ndarray:
    """A saved leaf as ``[count, ...]``, one row a device."""
    if self.stacked:
      if data.ndim == 0 or data.shape[0] != count:
        raise self.error(path, f"stacked layout, but its shape is {list(data.shape)}, not "
                               f"[{count}, ...]")
      return data
    if not along:
      return np.broadcast_to(data, (count, *data.shape))
    if data.shape[0] % count:
      raise self.error(path, f"its first axis ({list(data.shape)}) does not hold {count} "
                             "devices' values end to end")
    return data.reshape(count, data.shape[0] // count, *data.shape[1:])

  def _stack_shape(self, target: jax.ShapeDtypeStruct, along: bool, path: str):
    zeros = np.broadcast_to(np.zeros((), target.dtype), target.shape)
    return jax.ShapeDtypeStruct(self._stack(zeros, along, path, self.to_devices).shape,
                                target.dtype)

  def _unstack(self, leaf: np.ndarray, along: bool) -> np.ndarray:
    if self.stacked:
      return leaf
    if not along:
      return leaf[0]
    return leaf.reshape(leaf.shape[0] * leaf.shape[1], *leaf.shape[2:])

  def _flatten_up_to(self, treedef, saved, path: str):
    try:
      return treedef.flatten_up_to(saved)
    except (ValueError, TypeError) as error:
      raise self.error(path or "the state", f"the saved tree differs from the target's: "
                                            f"{error}") from None

  def error(self, path: str, message: str) -> ValueError:
    return ValueError(
        f"resize_state: {path or 'the state'}: {message} ({self.from_devices} devices saved "
        f"it, {self.to_devices} now).")


def _key_data(leaf):
  """A leaf as a NumPy array, and its PRNG key implementation if it is a key (else ``None``)."""
  if jnp.issubdtype(jnp.result_type(leaf), jax.dtypes.prng_key):
    return np.asarray(jax.random.key_data(leaf)), jax.random.key_impl(leaf)
  return np.asarray(leaf), None


def _map(leaf_fn, saved, target):
  return jax.tree.map(lambda s, t: leaf_fn(np.asarray(s), t), saved, target)


def _check_per_device(saved: np.ndarray, target) -> None:
  if saved.shape[1:] != target.shape[1:] or saved.dtype != target.dtype:
    raise ValueError(
        f"each device saved {saved.dtype}{list(saved.shape[1:])}, each now needs "
        f"{target.dtype}{list(target.shape[1:])}: its layout depends on the device count (a "
        "residual over several axes), the model axes of a mesh whose model is sharded lay it "
        "out otherwise (a state moves between numbers of data groups with the same model "
        "axes), or the state comes from another configuration")


def _broadcast(row_values: np.ndarray, target) -> np.ndarray:
  return np.broadcast_to(row_values, target.shape).copy()


def _owner_residuals(saved, target):
  """:func:`pieces` of each block of ``chunk_error``, where the blocks match across counts.

  A block ``[batch, *element_shape]`` of one segment (runs of buckets or rows)
  is that segment's at any device count. Whole-leaf segments of the same
  piece width share a block, and the widths move with the device count, so
  which leaves share one can change: those blocks are not matched.
  """
  saved, target = tuple(saved), tuple(target)
  if len(saved) != len(target) or any(block.shape[1] != 1 for block in (*saved, *target)):
    raise ValueError(
        f"blocks {[list(b.shape[1:]) for b in saved]} saved, "
        f"{[list(b.shape[1:]) for b in target]} now: owner residuals of whole-leaf segments "
        "stacked into one block (a compressor with one scale a leaf) cannot be matched across "
        "device counts")
  return pieces(batch_dims=1)(saved, target)


def _split_average_state(saved, target):
  """A split exchange's per-device average states: not matched across device counts."""
  del saved, target
  raise ValueError(
      "a split DiLoCo exchange's average states (qsgd_jax.SplitAverageState) hold each "
      "device's part of the outer gradient, cut for the worker's device count and in the "
      "devices' order: they are not matched across device counts. Build the new state with "
      "init and carry over the global parameters, or resize without split_axis")


def _sign_exchange_errors(saved, target):
  """The 1-bit exchange's errors: not matched across device counts (drop them instead)."""
  del saved, target
  raise ValueError(
      "the 1-bit exchange's worker and server errors are laid out in chunks of every leaf, one "
      "a device, padded for the device count: resume with drop=True, which starts them at zero "
      "(DeepSpeed resets them at every checkpoint load, and measured no loss on BERT)")


register(CompressedAllReduceState, "local_error", mean, residual=True)
register(CompressedAllReduceState, "chunk_error", _owner_residuals, residual=True)
register(AccumulationState, "accumulated", mean)
register(DiLoCoState, "inner_state", first_device)
register(DelayedFragmentState, "outer_gradient", mean)
register(SplitAverageState, "state", _split_average_state)
register(LowPrecisionDecentralizedState, "inner_state", first_device)
# Worker 0's model, as its right neighbour (worker 1) and its left one (the last) hold it.
register(LowPrecisionDecentralizedState, "left_replica", row(1))
register(LowPrecisionDecentralizedState, "right_replica", row(-1))
# Each device's residual of (gradient + residual) less the low-rank mean.
register(PowerSGDState, "error", mean, residual=True)
for _state_type in (ScaleByOneBitAdamState, ZeroOneAdamState, FSDPOneBitErrorState):
  register(_state_type, "worker_error", _sign_exchange_errors, residual=True)
for _state_type in (ScaleByOneBitAdamState, ZeroOneAdamState):
  register(_state_type, "server_error", _sign_exchange_errors, residual=True)
# 0/1 Adam's updates since the devices last synchronized: every device restarts from device 0's,
# as from its parameters (the model of device 0, which the caller gives every device).
register(ZeroOneAdamState, "accumulator", first_device)
