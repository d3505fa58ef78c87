"""Batches of byte sequences from the example's text, this process's share of each.

The text is written by :mod:`examples.lm.grammar` in the made-up language
``Language(config.text_seed)``: ``config.train_bytes`` bytes to train on and,
from other paragraphs of the same language, ``config.eval_bytes`` held out.
Nothing is downloaded; the same config gives the same bytes anywhere.

A batch is ``{"tokens": int32[local_batch, context_length + 1]}``: windows of
the text, bytes as tokens (0 to 255); the model reads the first
``context_length`` bytes of a window and predicts each next one.

* Training windows start at random offsets of the training text, drawn from
  ``(config.seed, step)`` alone: batch ``step`` is the same whether the stream
  started at 0 or resumed there, and skipping to it costs nothing.
* Held-out windows tile the held-out text without overlap, in order; every
  evaluation reads the same ones.

Each process takes its own rows of every global batch (``jax.process_index()``),
and its devices split them further; under ``hybrid`` parallelism the devices of a
data group shard the model instead, each reading all of the group's rows.
"""

import functools
from collections.abc import Iterator
from typing import NamedTuple

import jax
import numpy as np

from examples.lm import grammar

Batch = dict[str, np.ndarray]


class Corpus(NamedTuple):
  """The example's text as bytes.

  Attributes:
    train: ``uint8[train_bytes]``, the training split.
    held_out: ``uint8[eval_bytes]``, the held-out split (other paragraphs).
  """

  train: np.ndarray
  held_out: np.ndarray


def corpus(config) -> Corpus:
  """The text of ``config``, written once a process and kept."""
  return _corpus(config.text_seed, config.train_bytes, config.eval_bytes)


@functools.cache
def _corpus(text_seed: int, train_bytes: int, eval_bytes: int) -> Corpus:
  language = grammar.Language(text_seed)

  def split(name: str, num_bytes: int) -> np.ndarray:
    # String seeds (hashed by random.Random) cannot collide with the language's int seed.
    text = language.text(seed=f"{name} {text_seed}", num_bytes=num_bytes)
    return np.frombuffer(text.encode(), np.uint8)[:num_bytes].copy()

  return Corpus(split("train", train_bytes), split("held-out", eval_bytes))


def batch_shards(config) -> int:
  """The parts a global batch splits into: one a device, or under ``hybrid`` parallelism one
  a data group (its devices shard the model, and each reads all of the group's rows)."""
  if config.parallelism == "hybrid":
    return jax.device_count() // (config.fsdp_devices * config.tensor_devices)
  return jax.device_count()


def local_batch_size(config) -> int:
  """Rows of a global batch of ``config.batch_size`` that this process feeds to its devices."""
  shards = batch_shards(config)
  if config.batch_size % shards or config.batch_size % jax.process_count():
    where = "data groups" if config.parallelism == "hybrid" else "devices"
    raise ValueError(
        f"batch_size {config.batch_size} must be divisible by the {shards} {where} and the "
        f"{jax.process_count()} processes.")
  return config.batch_size // jax.process_count()


def train_batches(config, start_step: int = 0) -> Iterator[Batch]:
  """An endless stream of this process's training batches, from batch ``start_step`` on."""
  train = corpus(config).train
  window = config.context_length + 1
  if len(train) < window:
    raise ValueError(f"train_bytes {len(train)} is shorter than one window of "
                     f"context_length + 1 = {window} bytes.")
  rows = _process_rows(config)
  step = start_step
  while True:
    starts = np.random.default_rng((config.seed, step)).integers(
        0, len(train) - window + 1, size=config.batch_size)[rows]
    yield {"tokens": _windows(train, starts, window)}
    step += 1


def num_eval_batches(config) -> int:
  """``config.num_eval_batches`` (when positive) or as many as the held-out text fills."""
  window = config.context_length + 1
  available = len(corpus(config).held_out) // window // config.batch_size
  if available == 0:
    raise ValueError(
        f"eval_bytes {config.eval_bytes} does not fill one batch of {config.batch_size} "
        f"windows of {window} bytes: raise eval_bytes to {config.batch_size * window} or more.")
  return min(config.num_eval_batches, available) if config.num_eval_batches > 0 else available


def eval_batches(config, num_batches: int) -> Iterator[Batch]:
  """The first ``num_batches`` batches of held-out windows, the same at every call."""
  held_out = corpus(config).held_out
  window = config.context_length + 1
  rows = np.arange(config.batch_size)[_process_rows(config)]
  for batch in range(num_batches):
    yield {"tokens": _windows(held_out, (batch * config.batch_size + rows) * window, window)}


def conditional_entropy(data: np.ndarray, order: int) -> float:
  """Entropy of a byte given the ``order`` bytes before it, in nats, as counted in ``data``.

  The empirical ``H(x[t] | x[t - order], ..., x[t - 1])``: the least loss a
  model that sees only ``order`` bytes back can reach on ``data`` (order 0:
  the unigram entropy). Counted on ``data`` itself, it is optimistic for a
  model that has not seen ``data``.
  """
  if not 0 <= order <= 2:
    raise ValueError(f"order must be 0, 1 or 2, got {order}.")

  def entropy(offsets: range) -> float:
    # The bytes at ``offsets`` from each position 0, ..., len(data) - order - 1, as one integer.
    codes = np.zeros(len(data) - order, np.int64)
    for offset in offsets:
      codes = codes * 256 + data[offset : len(data) - order + offset]
    _, counts = np.unique(codes, return_counts=True)
    probabilities = counts / counts.sum()
    return float(-(probabilities * np.log(probabilities)).sum())

  # H(context, next byte) - H(context); the context is the ``order`` bytes before.
  return entropy(range(order + 1)) - (entropy(range(order)) if order else 0.0)


def _process_rows(config) -> slice:
  size = local_batch_size(config)
  return slice(jax.process_index() * size, (jax.process_index() + 1) * size)


def _windows(data: np.ndarray, starts: np.ndarray, window: int) -> np.ndarray:
  return data[starts[:, None] + np.arange(window)].astype(np.int32)
