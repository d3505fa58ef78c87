"""Low-precision decentralized SGD on a ring of peers (DCD-PSGD, Bagua)."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from qsgd_jax._src import axes, base, grouping, serialize, stats, wire
from qsgd_jax._src.minmax import MinMax

_TOPOLOGIES = ("ring",)
_BAGUA_COMPRESSOR = MinMax(bits=8)


class LowPrecisionDecentralizedState(NamedTuple):
  """State of :func:`low_precision_decentralized` on one worker.

  Attributes:
    inner_state: the wrapped optimizer's state, this worker's own.
    left_replica: this worker's copy of its left peer's (worker ``i - 1``)
      params, a pytree with their shapes and dtypes.
    right_replica: the same for the right peer (worker ``i + 1``); with two
      workers both replicas hold the single peer.
    key: typed PRNG key ``key<impl>[]``, split every step; the same on every
      worker (each worker folds in its axis index).
    stats: the last step's :class:`~qsgd_jax.CompressionStats`: the bits a
      worker sent its neighbours, against a float32 all-reduce of the
      parameters (NaN before the first step).
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

  where :math:`Q` is ``compressor`` (``encode`` then ``decode``) and the ring's
  mixing weights are :math:`W_{ii} = W_{i,i\pm1} = 1/3`; with two workers the
  ring has one peer and the weights are :math:`1/2, 1/2`. As the weights sum
  to one, :math:`z_i` is computed as :math:`u_i + \sum_{j \ne i} W_{ij}
  (\hat x_j - x_i)`, which is the same quantity with less cancellation.

  Each worker encodes :math:`z_i` once a leaf (batched: leaves of one shape
  under one ``vmap``, or with a fixed ``bucket_size`` all leaves side by side in
  one encode), packs the payloads into one ``uint32`` buffer, sends it to both
  neighbours with one ``jax.lax.ppermute`` each, and returns :math:`Q(z_i)`
  decoded from the same payload as its update, so ``optax.apply_updates`` gives
  :math:`x_{i,t+1}`; the receivers add the same decoded values to their
  replicas, so every replica equals its peer's model bit for bit at all times,
  provided the updates are applied unchanged (make this transform the last of a
  chain). Models differ across workers: read :func:`averaged_params` for the
  model to evaluate and :func:`consensus_distance` for how far apart they are.
  With a constant step size and different data on each worker they stay
  :math:`O(\gamma)` apart, as in decentralized SGD without compression; a step
  size decaying to zero brings every worker to the optimum.

  Tang et al. (DCD-PSGD) prove the :math:`O(1/\sqrt{nT})` rate of centralized
  SGD for an unbiased :math:`Q` (:math:`E[Q(z)] = z`) whose error is small
  enough for the ring's spectral gap. Because :math:`Q` compresses the
  *difference* :math:`z_i`, which shrinks as workers agree and gradients
  vanish, min-max quantization's error (at most one step,
  :math:`(\max z - \min z) / (2^b - 1)` a coordinate) shrinks with it.

  On the wire, each step a worker sends the same payload to each of its two
  neighbours (once to its only peer when :math:`n = 2`): for a leaf of
  :math:`d` coordinates and ``MinMax(bits=8)``, :math:`\lceil 8d/32 \rceil`
  ``uint32`` words plus two float32 scales, about a quarter of the leaf's
  float32 bytes a neighbour. Bytes and latency are :math:`O(\text{peers})`
  and do not grow with the number of workers.

  Args:
    inner: the optimizer whose update of the local gradient is the local
      step :math:`u_i`, e.g. ``optax.sgd(0.1)``; it is given the worker's own
      params and any extra arguments.
    axis_name: the mapped axis of ``pmap`` or ``shard_map`` along which the
      workers lie; its size must be at least 2.
    compressor: a :class:`~qsgd_jax.Compressor`; the default
      ``qsgd_jax.MinMax(bits=8)`` is Bagua's 8-bit min-max quantizer.
    topology: the peers graph; ``"ring"`` is the one supported. Peers never
      change during a run.
    key: an int seed or a PRNG key for the compressor's random rounding. Each
      step splits it, and each worker folds in its ``axis_index`` so that its
      draws are its own.

  Returns:
    An ``optax.GradientTransformationExtraArgs``. Its ``init(params)`` assumes
    that every worker starts from the same ``params`` (as data-parallel
    training does), so the peers' replicas start as copies of them. Its
    ``update(updates, state, params, **extra_args)`` needs ``params`` and must
    run inside ``pmap`` or ``shard_map`` over ``axis_name``; the updates it
    returns are :math:`Q(z_i)`.

  Raises:
    NameError: if ``update`` runs where ``axis_name`` is not bound.
    TypeError: if ``compressor`` is not a :class:`~qsgd_jax.Compressor`, or a
      parameter is not floating point (the error names its path).
    ValueError: for an unknown ``topology``, an ``update`` without ``params``,
      or an axis of size 1.

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
    ``LowPrecisionDecentralizedAlgorithm``.
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
    size = axes.parse(axis_name, "low_precision_decentralized").size(
        "low_precision_decentralized")
    if size < 2:
      raise ValueError(
          f"low_precision_decentralized: axis {axis_name!r} has size {size}; "
          "decentralized training needs at least 2 workers."
      )
    local_steps, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    key, step_key = jax.random.split(state.key)
    worker_key = jax.random.fold_in(step_key, jax.lax.axis_index(axis_name))

    leaves, treedef = jax.tree.flatten(params)
    lefts = treedef.flatten_up_to(state.left_replica)
    rights = treedef.flatten_up_to(state.right_replica)
    # Worker i sends to i + 1 along `to_right`, so what arrives came from its left peer.
    to_right = [(i, (i + 1) % size) for i in range(size)]
    to_left = [(i, (i - 1) % size) for i in range(size)]

    differences = []
    for x, local_step, left, right in zip(
        leaves, treedef.flatten_up_to(local_steps), lefts, rights, strict=True
    ):
      local_step = local_step.astype(x.dtype)
      if size == 2:  # One peer, held in both replicas.
        differences.append(local_step + (right - x) / 2)
      else:
        differences.append(local_step + ((left - x) + (right - x)) / 3)
    if grouping.fixed_bucket_size(compressor) is not None:  # Side by side, as vectors.
      differences = [z.astype(jnp.float32).reshape(-1) for z in differences]
    layout = grouping.layout(compressor, differences)
    payloads = grouping.encode_blocks(compressor, worker_key, layout.join(differences))
    # All leaves travel as one uint32 buffer: one ppermute a direction.
    words = jnp.concatenate([jax.vmap(serialize.to_words)(p).reshape(-1) for p in payloads])
    from_left = jax.lax.ppermute(words, axis_name, to_right)
    from_right = from_left if size == 2 else jax.lax.ppermute(words, axis_name, to_left)

    def as_leaves(decoded_blocks):
      return [d.reshape(-1)[: x.size].reshape(x.shape)
              for d, x in zip(layout.split(decoded_blocks), leaves, strict=True)]

    def decoded(buffer):
      received, start = [], 0
      for payload, (batch, _) in zip(payloads, layout.block_sizes(), strict=True):
        template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), payload)
        width = serialize.num_words(template)
        words = buffer[start : start + batch * width].reshape(batch, width)
        received.append(jax.vmap(lambda w, t=template: serialize.from_words(w, t))(words))
        start += batch * width
      return as_leaves(grouping.decode_blocks(compressor, received))

    new_updates, new_lefts, new_rights = [], [], []
    for x, own, left_step, right_step, left, right in zip(
        leaves, as_leaves(grouping.decode_blocks(compressor, payloads)), decoded(from_left),
        decoded(from_right), lefts, rights, strict=True
    ):
      new_updates.append(own.astype(x.dtype))
      new_lefts.append(left + left_step.astype(x.dtype))
      new_rights.append(right + right_step.astype(x.dtype))

    new_state = LowPrecisionDecentralizedState(
        inner_state=inner_state,
        left_replica=treedef.unflatten(new_lefts),
        right_replica=treedef.unflatten(new_rights),
        key=key,
        # One buffer to each neighbour (one to the single peer of a pair).
        stats=stats.make((1 if size == 2 else 2) * 32 * words.size,
                         wire.float32_allreduce_bits(_num_elements(params), size), jnp.nan),
    )
    return treedef.unflatten(new_updates), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _num_elements(tree) -> int:
  return sum(jnp.size(leaf) for leaf in jax.tree.leaves(tree))


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
