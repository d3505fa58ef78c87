"""The sparse family in the language-model example: top-k with error feedback before AdamW
(``--config.average=topk_ef``), DeMo in place of AdamW (``--config.optimizer=demo``) and
SparseLoCo's outer average for DiLoCo (``--config.outer_average=sparseloco``).

Every kernel is seen as its layer's input-to-output matrix
(``models.powersgd_matrix_view``: the fused ``qkv`` kernel ``(width, 3, heads, head_width)`` as
``width x 3 width``), so that DeMo's blocks are blocks of that matrix.
"""

import jax.numpy as jnp
import ml_collections
import optax

import qsgd_jax
from examples.lm import models

VALUE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def topk_average(config: ml_collections.ConfigDict,
                 axis: str) -> optax.GradientTransformation:
  """The gradients averaged by top-k with error feedback: the ``config.topk_density`` largest
  of each chunk of ``config.topk_chunk``, values in ``config.topk_value_bits`` (0: float32)."""
  bits = config.topk_value_bits or None
  return qsgd_jax.compressed_allreduce(
      qsgd_jax.TopK(density=config.topk_density, chunk=config.topk_chunk, value_bits=bits),
      axis, key=config.seed, error_feedback=True,
      min_compressed_size=config.min_compressed_size)


def demo(config: ml_collections.ConfigDict, learning_rate_fn: optax.Schedule, axis: str,
         weight_decay_mask) -> optax.GradientTransformation:
  """DeMo (``qsgd_jax.demo``) on each device's gradient, clipped by its own norm first (as
  OLMo clips before DeMo): ``config.demo_k`` coefficients of each ``config.demo_chunk``-sided
  block, the momentum decaying by ``config.demo_decay``."""
  clip = ([optax.clip_by_global_norm(config.grad_clip_norm)] if config.grad_clip_norm > 0
          else [])
  return optax.chain(*clip, qsgd_jax.demo(
      learning_rate_fn, axis, chunk=config.demo_chunk, k=config.demo_k, decay=config.demo_decay,
      weight_decay=config.demo_weight_decay, mask=weight_decay_mask,
      value_dtype=VALUE_DTYPES[config.demo_value_dtype],
      matrix_view=models.powersgd_matrix_view))


def sparseloco_average(config: ml_collections.ConfigDict,
                       axis: str) -> optax.GradientTransformation:
  """SparseLoCo's average of the outer gradients (``qsgd_jax.sparseloco_average``):
  ``config.sparseloco_density`` of each 64 x 64 block, 2-bit values, error feedback decaying by
  ``config.sparseloco_error_decay``, averaged as ``config.sparseloco_aggregation`` says."""
  return qsgd_jax.sparseloco_average(
      axis, density=config.sparseloco_density, value_bits=2,
      error_decay=config.sparseloco_error_decay, aggregation=config.sparseloco_aggregation)
