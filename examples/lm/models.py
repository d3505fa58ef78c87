"""A GPT-style decoder-only transformer over bytes, in Flax linen.

Token (byte) embeddings plus learned position embeddings, ``num_layers``
pre-LayerNorm blocks (causal multi-head self-attention, then a 4x-wide GELU
MLP, each added to the residual stream), a final LayerNorm and an output head
over the 256 byte values, as GPT-2 (Radford et al. 2019) arranges them.
Weights start as GPT-2's: normal with standard deviation 0.02, the two
projections that write into the residual stream scaled by
``1 / sqrt(2 num_layers)``; biases at zero.

``dtype`` is the computation's dtype (``jnp.bfloat16`` for mixed precision);
the parameters stay float32 and the logits come back float32.

With ``logical_axes``, every parameter is annotated with the logical names of
its axes, as Flax's ``lm1b`` names them (``embed``, ``mlp``, ``heads``, ``kv``,
``vocab``; ``nn.with_logical_partitioning``): ``init`` then returns them boxed
(``nn.unbox`` them), and ``nn.get_partition_spec`` with
``nn.logical_to_mesh_sharding`` lays them out over a mesh by a table of rules
(``hybrid.py``).

For FSDP, ``gather`` makes each layer (a block, an embedding, the head) gather
its own parameters from this device's shards just before it runs. The blocks
and the head do it inside ``nn.remat`` with ``qsgd_jax.fsdp_remat_policy``, so
that only one layer's parameters are whole at a time and the backward pass
gathers them again; an embedding's backward pass needs the token ids only, not
its table, so it is gathered once.

References:
  Vaswani et al., Attention Is All You Need, NeurIPS 2017; Radford et al.,
  Language Models are Unsupervised Multitask Learners, 2019.
"""

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import qsgd_jax

VOCAB_SIZE = 256  # Bytes.
INIT_STDDEV = 0.02


def _named(init, names: tuple[str | None, ...], logical_axes: bool):
  """``init``, its parameter's axes named ``names`` when ``logical_axes``."""
  return nn.with_logical_partitioning(init, names) if logical_axes else init


def powersgd_matrix_view(path: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, int]:
  """The matrix PowerSGD sees of each kernel here: its layer's input-to-output map.

  The fused ``qkv`` kernel ``(width, 3, heads, head_width)`` is ``(width, 3 *
  width)``; every other leaf is as :func:`qsgd_jax.attention_matrix_view`
  sees it (the last axis the output: ``Dense`` ``(in, out)``, the attention's
  ``out`` kernel ``(heads, head_width, width)`` as ``(width, width)``).
  """
  if len(path) >= 2 and path[-2:] == ("qkv", "kernel"):
    return shape[0], math.prod(shape[1:])
  return qsgd_jax.attention_matrix_view(path, shape)


class CausalSelfAttention(nn.Module):
  """Multi-head self-attention in which each position sees itself and the ones before.

  Attributes:
    num_heads: heads; the width must be a multiple.
    residual_init: initializer of the output projection.
    dtype: the computation's dtype.
    logical_axes: whether to name the parameters' axes (see the module).
  """

  num_heads: int
  residual_init: Any
  dtype: Any = jnp.float32
  logical_axes: bool = False

  @nn.compact
  def __call__(self, x):
    """``x``: ``[batch, length, width]``; returns the same shape."""
    width = x.shape[-1]
    if width % self.num_heads:
      raise ValueError(f"width {width} is not a multiple of num_heads {self.num_heads}.")
    head_width = width // self.num_heads
    # One kernel for queries, keys and values: [width, 3, heads, head_width].
    logical = self.logical_axes
    qkv = nn.DenseGeneral(
        (3, self.num_heads, head_width), dtype=self.dtype,
        kernel_init=_named(nn.initializers.normal(INIT_STDDEV), ("embed", None, "heads", "kv"),
                           logical),
        bias_init=_named(nn.initializers.zeros, (None, "heads", "kv"), logical), name="qkv")(x)
    query, key, value = (qkv[..., i, :, :] for i in range(3))
    y = jax.nn.dot_product_attention(query, key, value, is_causal=True)
    return nn.DenseGeneral(
        width, axis=(-2, -1), dtype=self.dtype,
        kernel_init=_named(self.residual_init, ("heads", "kv", "embed"), logical),
        bias_init=_named(nn.initializers.zeros, ("embed",), logical), name="out")(y)


class Block(nn.Module):
  """``x + attention(norm(x))``, then ``x + mlp(norm(x))``.

  Attributes:
    num_heads: attention heads.
    residual_init: initializer of the projections into the residual stream.
    mlp_ratio: the MLP's hidden width over the model's width.
    dtype: the computation's dtype.
    logical_axes: whether to name the parameters' axes (see the module).
  """

  num_heads: int
  residual_init: Any
  mlp_ratio: int = 4
  dtype: Any = jnp.float32
  logical_axes: bool = False

  @nn.compact
  def __call__(self, x):
    width, logical = x.shape[-1], self.logical_axes
    normed = nn.LayerNorm(dtype=self.dtype, name="attention_norm")(x)
    x = x + CausalSelfAttention(self.num_heads, self.residual_init, self.dtype, logical,
                                name="attention")(normed)
    normed = nn.LayerNorm(dtype=self.dtype, name="mlp_norm")(x)
    hidden = nn.Dense(
        self.mlp_ratio * width, dtype=self.dtype,
        kernel_init=_named(nn.initializers.normal(INIT_STDDEV), ("embed", "mlp"), logical),
        bias_init=_named(nn.initializers.zeros, ("mlp",), logical), name="mlp_in")(normed)
    hidden = nn.gelu(hidden)
    return x + nn.Dense(
        width, dtype=self.dtype, kernel_init=_named(self.residual_init, ("mlp", "embed"), logical),
        bias_init=_named(nn.initializers.zeros, ("embed",), logical), name="mlp_out")(hidden)


class TransformerLM(nn.Module):
  """A decoder-only transformer language model over bytes.

  Attributes:
    num_layers: blocks.
    width: the residual stream's width (``d_model``).
    num_heads: attention heads a block.
    context_length: the most positions a sequence may have (position embeddings).
    mlp_ratio: the MLP's hidden width over ``width``.
    dtype: the computation's dtype.
    gather: ``None``, or for FSDP a function from a layer's variables as this
      device holds them, ``{collection: tree}`` for the ``gather_collections``
      (the parameters' shards), to the same with the whole parameters, such as
      ``lambda v: {"params": qsgd_jax.fsdp_gather(v["params"], "batch")}``. The
      parameters' tree is the same either way: initialize without it.
    gather_collections: the variable collections ``gather`` gets, those of
      them that the layer has.
    logical_axes: whether to name the parameters' axes (see the module).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> model = TransformerLM(num_layers=1, width=32, num_heads=2, context_length=16)
    >>> tokens = jnp.zeros((2, 16), jnp.int32)
    >>> params = model.init(jax.random.key(0), tokens)["params"]
    >>> model.apply({"params": params}, tokens).shape
    (2, 16, 256)
  """

  num_layers: int
  width: int
  num_heads: int
  context_length: int
  mlp_ratio: int = 4
  dtype: Any = jnp.float32
  gather: Callable | None = None
  gather_collections: tuple[str, ...] = ("params",)
  logical_axes: bool = False

  def _gathering(self, module_class: type[nn.Module], remat: bool = True) -> type[nn.Module]:
    """``module_class``, gathering its parameters just before it runs if there is ``gather``
    (and again in the backward pass with ``remat``)."""
    if self.gather is None:
      return module_class
    gathering = nn.map_variables(module_class, list(self.gather_collections),
                                 trans_in_fn=self.gather, init=True)
    return nn.remat(gathering, policy=qsgd_jax.fsdp_remat_policy) if remat else gathering

  @nn.compact
  def __call__(self, tokens):
    """``tokens``: ``int32[batch, length]``, bytes; returns ``float32[batch, length, 256]`` logits.

    The logits at position ``t`` predict byte ``t + 1`` from bytes ``0..t``.
    """
    length = tokens.shape[-1]
    if length > self.context_length:
      raise ValueError(f"{length} tokens exceed the context_length {self.context_length}.")
    embed_init, logical = nn.initializers.normal(INIT_STDDEV), self.logical_axes
    embed = self._gathering(nn.Embed, remat=False)
    x = embed(VOCAB_SIZE, self.width, name="token_embedding",
              embedding_init=_named(embed_init, ("vocab", "embed"), logical))(tokens)
    x = x + embed(self.context_length, self.width, name="position_embedding",
                  embedding_init=_named(embed_init, (None, "embed"), logical))(jnp.arange(length))
    x = x.astype(self.dtype)
    residual_init = nn.initializers.normal(INIT_STDDEV / (2 * self.num_layers) ** 0.5)
    block = self._gathering(Block)
    for layer in range(self.num_layers):
      x = block(self.num_heads, residual_init, self.mlp_ratio, self.dtype, logical,
                name=f"block_{layer}")(x)
    x = nn.LayerNorm(dtype=self.dtype, name="final_norm")(x)
    logits = self._gathering(nn.Dense)(
        VOCAB_SIZE, dtype=self.dtype, kernel_init=_named(embed_init, ("embed", "vocab"), logical),
        bias_init=_named(nn.initializers.zeros, ("vocab",), logical), name="head")(x)
    return logits.astype(jnp.float32)
