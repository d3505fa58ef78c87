"""The ResNet family in Flax linen (He et al. 2016), with a stem for small images, and an MLP.

``ResNet18`` ... ``ResNet200`` are the ImageNet networks: a 7x7 stride-2
convolution and a max-pool, then four stages whose widths double. The same
networks built with ``small_inputs=True`` start with one 3x3 stride-1
convolution and no pooling, which suits 8x8 digits and 32x32 images; ``ResNet8``
(three stages of one block) is the digits model and ``ResNet1`` (one block) the
tiny model of the tests. ``WideMLP`` (three hidden layers of 1,024) has 2.2M
parameters on digits but little arithmetic a parameter: over a slow link its
gradient all-reduce takes longer than its step.
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

ModuleDef = Any


class ResNetBlock(nn.Module):
  """Two 3x3 convolutions and a shortcut (the block of ResNet-18 and -34)."""

  filters: int
  conv: ModuleDef
  norm: ModuleDef
  act: Callable
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    shortcut = x
    y = self.act(self.norm()(self.conv(self.filters, (3, 3), self.strides)(x)))
    y = self.conv(self.filters, (3, 3))(y)
    # The block's last scale starts at zero, so each block starts as the identity.
    y = self.norm(scale_init=nn.initializers.zeros_init())(y)
    if shortcut.shape != y.shape:
      shortcut = self.conv(self.filters, (1, 1), self.strides, name="shortcut_conv")(shortcut)
      shortcut = self.norm(name="shortcut_norm")(shortcut)
    return self.act(shortcut + y)


class BottleneckResNetBlock(nn.Module):
  """A 1x1 reduction, a 3x3 convolution, a 1x1 expansion by four (ResNet-50 and up)."""

  filters: int
  conv: ModuleDef
  norm: ModuleDef
  act: Callable
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    shortcut = x
    y = self.act(self.norm()(self.conv(self.filters, (1, 1))(x)))
    y = self.act(self.norm()(self.conv(self.filters, (3, 3), self.strides)(y)))
    y = self.conv(4 * self.filters, (1, 1))(y)
    y = self.norm(scale_init=nn.initializers.zeros_init())(y)
    if shortcut.shape != y.shape:
      shortcut = self.conv(4 * self.filters, (1, 1), self.strides, name="shortcut_conv")(shortcut)
      shortcut = self.norm(name="shortcut_norm")(shortcut)
    return self.act(shortcut + y)


class ResNet(nn.Module):
  """A residual network for image classification.

  Attributes:
    stage_sizes: blocks in each stage; every stage after the first halves the
      resolution and doubles the width.
    block_cls: ``ResNetBlock`` or ``BottleneckResNetBlock``.
    num_classes: outputs of the final dense layer.
    num_filters: width of the first stage.
    small_inputs: a 3x3 stride-1 stem without pooling instead of ImageNet's
      7x7 stride-2 convolution and 3x3 max-pool.
    dtype: the computation's dtype (parameters stay float32).
    act: the activation.
    axis_name: the mapped axis over which BatchNorm averages its batch
      statistics, so that every device normalizes with the global batch's;
      ``None`` outside ``pmap``/``shard_map``.
  """

  stage_sizes: Sequence[int]
  block_cls: ModuleDef
  num_classes: int
  num_filters: int = 64
  small_inputs: bool = False
  dtype: Any = jnp.float32
  act: Callable = nn.relu
  axis_name: str | None = "batch"

  @nn.compact
  def __call__(self, x, train: bool = True):
    conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
    norm = functools.partial(
        nn.BatchNorm,
        use_running_average=not train,
        momentum=0.9,
        epsilon=1e-5,
        dtype=self.dtype,
        axis_name=self.axis_name,
    )
    if self.small_inputs:
      x = conv(self.num_filters, (3, 3), name="stem_conv")(x)
    else:
      x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="stem_conv")(x)
    x = self.act(norm(name="stem_norm")(x))
    if not self.small_inputs:
      x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    for stage, num_blocks in enumerate(self.stage_sizes):
      for block in range(num_blocks):
        strides = (2, 2) if stage > 0 and block == 0 else (1, 1)
        x = self.block_cls(
            self.num_filters * 2**stage, conv=conv, norm=norm, act=self.act, strides=strides
        )(x)
    x = jnp.mean(x, axis=(1, 2))
    x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
    return jnp.asarray(x, jnp.float32)


ResNet18 = functools.partial(ResNet, stage_sizes=(2, 2, 2, 2), block_cls=ResNetBlock)
ResNet34 = functools.partial(ResNet, stage_sizes=(3, 4, 6, 3), block_cls=ResNetBlock)
ResNet50 = functools.partial(ResNet, stage_sizes=(3, 4, 6, 3), block_cls=BottleneckResNetBlock)
ResNet101 = functools.partial(ResNet, stage_sizes=(3, 4, 23, 3), block_cls=BottleneckResNetBlock)
ResNet152 = functools.partial(ResNet, stage_sizes=(3, 8, 36, 3), block_cls=BottleneckResNetBlock)
ResNet200 = functools.partial(ResNet, stage_sizes=(3, 24, 36, 3), block_cls=BottleneckResNetBlock)

class MLP(nn.Module):
  """A multilayer perceptron on flattened images: Dense, BatchNorm, activation a hidden layer.

  Attributes:
    hidden_sizes: the width of each hidden layer.
    num_classes: outputs of the final dense layer.
    dtype: the computation's dtype (parameters stay float32).
    act: the activation.
    axis_name: the mapped axis over which BatchNorm averages its batch
      statistics; ``None`` outside ``pmap``/``shard_map``.
  """

  hidden_sizes: Sequence[int]
  num_classes: int
  dtype: Any = jnp.float32
  act: Callable = nn.relu
  axis_name: str | None = "batch"

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = x.reshape((x.shape[0], -1))
    for width in self.hidden_sizes:
      x = nn.Dense(width, use_bias=False, dtype=self.dtype)(x)
      x = nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5,
                       dtype=self.dtype, axis_name=self.axis_name)(x)
      x = self.act(x)
    x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
    return jnp.asarray(x, jnp.float32)


# Small networks for small images: digits (8x8) and the tests.
ResNet8 = functools.partial(
    ResNet, stage_sizes=(1, 1, 1), block_cls=ResNetBlock, num_filters=16, small_inputs=True
)
ResNet1 = functools.partial(
    ResNet, stage_sizes=(1,), block_cls=ResNetBlock, num_filters=8, small_inputs=True
)
# 64 x 1024 + 2 x 1024 x 1024 + 1024 x 10 weights on digits: communication-bound.
WideMLP = functools.partial(MLP, hidden_sizes=(1024, 1024, 1024))
