"""Low-precision decentralized SGD on a ring of peers (DCD-PSGD, Bagua)."""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from qsgd_jax._src import axes, axis_checks, base, stats, wire
from qsgd_jax._src.averaging import ring_exchange
from qsgd_jax._src.compressors.zero_aligned_minmax import NearestZeroAlignedMinMax

_OWNER = "low_precision_decentralized"
_TOPOLOGIES = ("ring",)
_BAGUA_BUCKET_BYTES = 10 * 2**20
_BAGUA_COMPRESSOR = NearestZeroAlignedMinMax()


class LowPrecisionDecentralizedState(NamedTuple):
  """State of :func:`low_precision_decentralized` on one worker.

  Attributes:
    inner_state: the wrapped optimizer's state, this worker's own.
    left_replica: this worker's copy of its left peer's (worker ``i - 1``)
      params, a pytree with their shapes and dtypes.
    right_replica: the same for the right peer (worker ``i + 1``); with two
      workers both replicas hold the single peer.
    key: typed PRNG key ``key<impl>[]``, split every step; the same on every
      worker (each worker folds in its index along the ring).
    stats: the last step's :class:`~qsgd_jax.CompressionStats`: the bits a
      worker sent, against a float32 all-reduce of the parameters over all
      workers (NaN before the first step).

  Examples:
    >>> import jax, jax.numpy as jnp, optax, qsgd_jax
    >>> n = jax.local_device_count()
    >>> tx = qsgd_jax.low_precision_decentralized(optax.sgd(0.1), "batch")
    >>> state = jax.pmap(tx.init, axis_name="batch")(jnp.zeros((n, 4)))
    >>> state.left_replica.shape == state.right_replica.shape == (n, 4)
    True
  """

  inner_state: optax.OptState
  left_replica: optax.Params
  right_replica: optax.Params
  key: jax.Array
  stats: stats.CompressionStats


def low_precision_decentralized(
    inner: optax.GradientTransformation,
    axis_name: Any,
    *,
    compressor: base.Compressor = _BAGUA_COMPRESSOR,
    bucket_bytes: int | None = _BAGUA_BUCKET_BYTES,
    topology: str = "ring",
    key: jax.Array | int = 0,
) -> optax.GradientTransformationExtraArgs:
  r"""Decentralized SGD that exchanges quantized model differences with ring peers.

  There is no all-reduce: worker :math:`i` of :math:`n` keeps its own model
  :math:`x_i` and talks only to its two ring neighbours :math:`i - 1` and
  :math:`i + 1` (mod :math:`n`), whose models it tracks in replicas
  :math:`\hat x_{i-1}, \hat x_{i+1}`; its own replica is :math:`\hat x_i = x_i`.
  With :math:`u_i` the ``inner`` optimizer's update of the local gradient (for
  ``optax.sgd(lr)``, :math:`u_i = -\gamma g_i`), a step is

  .. math::

    x_{i,t+1/2} &= \textstyle\sum_j W_{ij} \hat x_{j,t} + u_i, \qquad
    z_i = x_{i,t+1/2} - x_{i,t}, \\
    x_{i,t+1} &= x_{i,t} + Q(z_i), \qquad
    \hat x_{j,t+1} = \hat x_{j,t} + Q(z_j) \text{ for each peer } j,

  where :math:`Q` is ``compressor`` (``encode`` then ``decode``) and the
  mixing weights are Bagua's: :math:`1/3` for the worker and each of its two
  neighbours. With two workers the single peer is both neighbours, so it
  weighs :math:`2/3` and the worker :math:`1/3`. The weights sum to one, so
  :math:`z_i` is computed as :math:`u_i + ((\hat x_{i-1} - x_i) + (\hat x_{i+1}
  - x_i)) / 3`, the same quantity with less cancellation than Bagua's float32
  :math:`(x_i + u_i) + \hat x_{i-1}/3 + \hat x_{i+1}/3 - 5 x_i / 3`: the two
  agree to float rounding (with a rounding to nearest :math:`Q`, a value
  within float rounding of a tie between two levels can land on either).

  The differences are sent in Bagua's buckets: the leaves, in the order of
  ``jax.tree.leaves``, join a bucket whole until it holds ``bucket_bytes`` or
  more (Bagua's default bucketing, 10 MiB); each bucket is flattened,
  concatenated in float32 and encoded as one array, so one minimum and
  maximum of the default compressor covers a whole bucket of leaves, as in
  Bagua. A compressor whose scales cover runs of elements (QSGD's buckets,
  OneBit's rows) gets each leaf padded to whole runs, so that no run
  straddles two leaves. All buckets' payloads travel as one ``uint32`` buffer, sent to each
  neighbour with one ``jax.lax.ppermute``. The update returned is
  :math:`Q(z_i)` decoded from the same payload, so ``optax.apply_updates``
  gives :math:`x_{i,t+1}`; the receivers add the same decoded values to
  their replicas, so every replica equals its peer's model bit for bit at
  all times, provided the updates are applied unchanged (make this
  transform the last of a chain). Models differ across workers: read
  :func:`averaged_params` for the model to evaluate and
  :func:`consensus_distance` for how far apart they are. With a constant
  step size and different data on each worker they stay :math:`O(\gamma)`
  apart, as in decentralized SGD without compression; a step size decaying
  to zero brings every worker to the optimum.

  Hierarchical mode (Bagua's default where a machine holds several GPUs):
  with ``axis_name=(ring, *local)``, e.g. ``("node", "local")``, the workers
  of a node (the devices along the ``local`` axes) first average their
  steps :math:`u` in float32 (one ``pmean`` over ``local``), then
  the nodes run the ring above along ``ring`` with one model a node, which
  every device of the node holds. Bagua reduces the stepped models to the
  node's first GPU, which alone talks to the neighbouring nodes and then
  broadcasts the new model; here every device computes the node's step, and
  the ring buffer is cut into one piece a device: each device sends its piece
  to the device of the same local index in each neighbouring node, and one
  ``all_gather`` over ``local`` puts the received buffers back together. The
  bytes between nodes are Bagua's, spread over the node's devices.

  On a mesh whose model is sharded over other axes (``fsdp``, ``tensor``)
  inside each worker, a worker is a group of devices along ``axis_name``
  holding one model laid out over those axes. Run ``update`` under a
  ``jax.shard_map`` manual over ``axis_name`` alone with the other axes
  explicit (``jax.sharding.explicit_axes``, the leaves' specs as
  ``in_sharding``), each worker's parameters its own copy laid out as the
  model is. The leaves laid out over the same mesh axes form a group, run
  in a ``jax.shard_map`` manual over those axes too: its buckets hold a
  device's own shards, and each device sends them, in one ``ppermute`` a
  direction a group, to the device holding the same shards in each
  neighbouring worker, so nothing crosses the model axes. Each shard draws
  its own rounding. The replicas (and an inner optimizer's moments) are
  laid out as the parameters.

  Tang et al. (DCD-PSGD) prove the :math:`O(1/\sqrt{nT})` rate of centralized
  SGD for an unbiased :math:`Q` (:math:`E[Q(z)] = z`) whose error is small
  enough for the ring's spectral gap. Because :math:`Q` compresses the
  *difference* :math:`z_i`, which shrinks as workers agree and gradients
  vanish, min-max quantization's error shrinks with it. The default
  compressor, Bagua's :class:`~qsgd_jax.NearestZeroAlignedMinMax`, rounds to
  nearest: biased, but with half the mean squared error of the unbiased
  stochastic :class:`~qsgd_jax.MinMax`, which is the one the analysis covers
  (pass ``compressor=qsgd_jax.MinMax(bits=8)``).

  On the wire, each step a worker sends the same payload to each of its two
  neighbours (once to its only peer when :math:`n = 2`, where Bagua sends it
  twice): with the default compressor, one byte a coordinate packed into
  ``uint32`` words plus two float32 a bucket, about a quarter of the
  parameters' float32 bytes a neighbour. Bytes and latency are
  :math:`O(\text{peers})` and do not grow with the number of workers. In
  hierarchical mode a device sends :math:`1/k` of that (:math:`k` devices a
  node) to each neighbouring node, plus the ``pmean`` of its step and the
  ``all_gather`` of the received pieces inside the node.

  Args:
    inner: the optimizer whose update of the local gradient is the local
      step :math:`u_i`, e.g. ``optax.sgd(0.1)``; it is given the worker's own
      params and any extra arguments.
    axis_name: the mapped axis of ``pmap`` or ``shard_map`` along which the
      workers lie, of size at least 2; or a tuple ``(ring, *local)``: the
      ring runs along ``ring`` (at least 2 nodes) and the steps are averaged
      over the ``local`` axes.
    compressor: a :class:`~qsgd_jax.Compressor`; the default
      ``qsgd_jax.NearestZeroAlignedMinMax()`` is Bagua's 8-bit quantizer,
      one minimum and maximum a bucket.
    bucket_bytes: the bucket size in bytes of the parameters (Bagua's
      default, 10 MiB); ``None`` puts all leaves in one bucket, ``1`` each
      leaf in its own. Each bucket is one ``encode``, so many small buckets
      make a larger program.
    topology: the peers graph; ``"ring"`` is the one supported. Peers never
      change during a run.
    key: an int seed or a PRNG key for the compressor's random rounding. Each
      step splits it, and each worker (each node, in hierarchical mode)
      folds in its index along the ring so that its draws are its own.

  Returns:
    An ``optax.GradientTransformationExtraArgs``. Its ``init(params)`` assumes
    that every worker starts from the same ``params`` (as data-parallel
    training does), so the peers' replicas start as copies of them. Its
    ``update(updates, state, params, **extra_args)`` needs ``params`` and must
    run inside ``pmap`` or ``shard_map`` over ``axis_name``; the updates it
    returns are :math:`Q(z_i)`.

  Raises:
    NameError: if ``update`` runs where an axis of ``axis_name`` is not bound.
    TypeError: if ``compressor`` is not a :class:`~qsgd_jax.Compressor`, or a
      parameter is not floating point (the error names its path).
    ValueError: for an unknown ``topology``, a ``bucket_bytes`` that is not a
      positive int or None, an empty ``axis_name`` tuple, an ``update``
      without ``params``, or a ring of fewer than 2 workers.

  Examples:
    Four workers, simulated on one device by ``jax.vmap`` with an axis name
    (``jax.pmap`` or ``jax.shard_map`` run them on four devices); worker
    :math:`i` minimizes :math:`\|x - c_i\|^2 / 2`, and together they find the
    mean of the :math:`c_i`. A step size decaying to zero lets every worker,
    not only their average, reach it.

    >>> import jax, jax.numpy as jnp, optax, qsgd_jax
    >>> optimizer = qsgd_jax.low_precision_decentralized(
    ...     optax.sgd(optax.cosine_decay_schedule(0.2, 300)), "workers")
    >>> def train(target):
    ...   def step(carry, _):
    ...     params, state = carry
    ...     updates, state = optimizer.update(params - target, state, params)
    ...     return (optax.apply_updates(params, updates), state), None
    ...   params = jnp.zeros(3)
    ...   carry = (params, optimizer.init(params))
    ...   (params, _), _ = jax.lax.scan(step, carry, length=300)
    ...   return params, qsgd_jax.consensus_distance(params, "workers")
    >>> targets = jnp.arange(4.0)[:, None] * jnp.ones(3)  # The optimum is 1.5.
    >>> params, distance = jax.vmap(train, axis_name="workers")(targets)
    >>> bool(jnp.allclose(params, 1.5, atol=1e-2)), bool(distance[0] < 1e-2)
    (True, True)

  References:
    Tang et al., `Communication Compression for Decentralized Training
    <https://arxiv.org/abs/1803.06443>`_, NeurIPS 2018 (DCD-PSGD); Bagua's
    ``LowPrecisionDecentralizedAlgorithm`` (BaguaSys/bagua,
    ``decentralized_low_precision_synchronous.rs``).
  """
  if not isinstance(compressor, base.Compressor):
    raise TypeError(
        "low_precision_decentralized: compressor must be a qsgd_jax.Compressor, "
        f"got {type(compressor).__name__}."
    )
  if topology not in _TOPOLOGIES:
    raise ValueError(
        f"low_precision_decentralized: topology must be one of {_TOPOLOGIES}, got {topology!r}."
    )
  if bucket_bytes is not None and (
      not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes <= 0
  ):
    raise ValueError(
        "low_precision_decentralized: bucket_bytes must be a positive int or None, "
        f"got {bucket_bytes!r}."
    )
  parsed = axes.parse(axis_name, _OWNER)
  if parsed.is_local:
    raise ValueError(
        f"{_OWNER}: axis_name=None has no ring: decentralized training exchanges models "
        "between workers of a mapped axis; name it (and use optax alone on one device).")
  ring_axis, local_axes = parsed.outer, parsed.inner
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    base.check_float_leaves(params, "low_precision_decentralized")
    return LowPrecisionDecentralizedState(
        inner_state=inner.init(params),
        left_replica=jax.tree.map(jnp.copy, params),
        right_replica=jax.tree.map(jnp.copy, params),
        key=base.as_key(key),
        stats=stats.make(jnp.nan, jnp.nan, jnp.nan),
    )

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError(
          "low_precision_decentralized: update needs the worker's params: "
          "call update(updates, state, params)."
      )
    base.check_float_leaves(params, "low_precision_decentralized")
    axes.check_not_in_apply_if_finite(
        "qsgd_jax.low_precision_decentralized", axis_name,
        "Wrap the inner optimizer instead, low_precision_decentralized(optax.apply_if_finite("
        "optax.sgd(...), max_consecutive_errors), ...): each worker then skips its own "
        "non-finite step and still exchanges with its peers.")
    axis_checks.check_mesh_axes(params, parsed, f"qsgd_jax.{_OWNER}")
    size, *local_sizes = parsed.sizes(_OWNER)
    # Each worker applies its own gradient: one summed over the axis by autodiff is n times it.
    axes.check_varying(updates, parsed, _OWNER)
    local_size = math.prod(local_sizes)
    if size < 2:
      raise ValueError(
          f"low_precision_decentralized: axis {ring_axis!r} has size {size}; "
          "decentralized training needs at least 2 workers on the ring."
      )
    local_steps, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    if local_axes:  # The node's workers average their steps, in float32.
      local_steps = jax.tree.map(
          lambda u: jax.lax.pmean(u.astype(jnp.float32), local_axes), local_steps)
    key, step_key = jax.random.split(state.key)
    worker_key = jax.random.fold_in(step_key, jax.lax.axis_index(ring_axis))

    leaves, treedef = jax.tree.flatten(params)
    lefts = treedef.flatten_up_to(state.left_replica)
    rights = treedef.flatten_up_to(state.right_replica)
    # With two workers both replicas hold the single peer, which so weighs 2/3.
    differences = [
        u.astype(x.dtype) + ((left - x) + (right - x)) / 3
        for x, u, left, right in zip(
            leaves, treedef.flatten_up_to(local_steps), lefts, rights, strict=True)
    ]
    ring = ring_exchange.Ring(compressor, bucket_bytes, ring_axis, size, local_axes, local_size)
    moved = ring_exchange.exchange(differences, lefts, rights, worker_key, ring)
    new_updates = [u.astype(x.dtype) for u, x in zip(moved.updates, leaves, strict=True)]
    ring_bits, node_bits = moved.ring_bits, moved.node_bits
    if local_axes:
      node_bits += wire.float32_allreduce_bits(moved.elements, local_size)

    new_state = LowPrecisionDecentralizedState(
        inner_state=inner_state,
        left_replica=treedef.unflatten(moved.lefts),
        right_replica=treedef.unflatten(moved.rights),
        key=key,
        stats=stats.make(
            ring_bits + node_bits, wire.float32_allreduce_bits(moved.elements, size * local_size),
            jnp.nan, ring_bits, wire.float32_allreduce_bits(moved.elements / local_size, size)),
    )
    return treedef.unflatten(new_updates), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def consensus_distance(params: optax.Params, axis_name: Any) -> jax.Array:
  r"""How far the workers' models are from their average.

  .. math::

    \sqrt{\tfrac{1}{n} \textstyle\sum_i \|x_i - \bar x\|^2}, \qquad
    \bar x = \tfrac{1}{n} \textstyle\sum_i x_i,

  with :math:`\|\cdot\|` the Euclidean norm over all leaves together: the
  root-mean-square distance of a worker's model from the average model. It is
  zero when all workers agree. Call it inside ``pmap`` or ``shard_map`` over
  ``axis_name``.

  Args:
    params: this worker's floating-point parameters.
    axis_name: the mapped axis along which the workers lie.

  Returns:
    A float32 scalar, the same on every worker.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> distance = jax.vmap(lambda x: qsgd_jax.consensus_distance(x, "i"), axis_name="i")
    >>> distance(jnp.array([[0.0, 0.0], [3.0, 4.0]]))
    Array([2.5, 2.5], dtype=float32)
  """
  average = averaged_params(params, axis_name)
  squares = jax.tree.map(
      lambda x, mean: jnp.sum(jnp.square(x.astype(jnp.float32) - mean.astype(jnp.float32))),
      params,
      average,
  )
  total = sum(jax.tree.leaves(squares), jnp.float32(0))
  return jnp.sqrt(jax.lax.pmean(total, axis_name))


def averaged_params(params: optax.Params, axis_name: Any) -> optax.Params:
  r"""The average of the workers' models, :math:`\bar x = \frac{1}{n}\sum_i x_i`.

  Decentralized workers hold different models; the average is the one the
  convergence theory speaks of and the one to evaluate. Call it inside
  ``pmap`` or ``shard_map`` over ``axis_name`` (one all-reduce of the model,
  so for evaluation, not every step). The result is the same on every worker.

  Args:
    params: this worker's parameters.
    axis_name: the mapped axis along which the workers lie.

  Returns:
    A pytree like ``params``, each leaf averaged over the workers.

  Examples:
    >>> import jax, jax.numpy as jnp, qsgd_jax
    >>> average = jax.vmap(lambda x: qsgd_jax.averaged_params(x, "i"), axis_name="i")
    >>> average({"w": jnp.array([[1.0, 2.0], [3.0, 6.0]])})["w"]
    Array([[2., 4.],
           [2., 4.]], dtype=float32)
  """
  return jax.tree.map(lambda x: jax.lax.pmean(x, axis_name), params)
