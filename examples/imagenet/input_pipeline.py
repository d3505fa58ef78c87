"""Batches of images and labels for this process: digits, fake data or ImageNet.

* ``digits``: the 1,797 8x8 handwritten digits that scikit-learn ships; the
  first 80% (1,437 images) train, shifted at random by up to a pixel, and the
  last 20% (360) evaluate.
* ``fake``: one batch of random ImageNet-shaped data, repeated, to measure
  throughput without an input pipeline in the way.
* any other name: a TensorFlow Datasets builder, e.g. ``imagenet2012``, read
  from ``config.data_dir`` where it must already be prepared (ImageNet cannot
  be downloaded automatically). Needs ``tensorflow`` and
  ``tensorflow-datasets``, imported only here.

Every process gets its own rows of each global batch (``jax.process_index()``)
and yields numpy dicts: ``image`` ``float32[local_batch, H, W, C]``, ``label``
``int32[local_batch]`` and, for evaluation, ``mask`` ``float32[local_batch]``
(0 for the padding that fills the last batch).
"""

import functools
import math
from collections.abc import Iterator
from typing import NamedTuple

import jax
import numpy as np

MEAN_RGB = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STDDEV_RGB = (0.229 * 255, 0.224 * 255, 0.225 * 255)
DIGITS_TEST_FRACTION = 0.2
FAKE_TRAIN_EXAMPLES, FAKE_EVAL_EXAMPLES, FAKE_CLASSES = 1_281_167, 50_000, 1000

Batch = dict[str, np.ndarray]


class DatasetInfo(NamedTuple):
  """Sizes of a dataset.

  Attributes:
    num_train_examples: images in the training split.
    num_eval_examples: images in the evaluation split.
    num_classes: labels run from 0 to ``num_classes - 1``.
    image_shape: ``(height, width, channels)`` of a batch's images.
  """

  num_train_examples: int
  num_eval_examples: int
  num_classes: int
  image_shape: tuple[int, int, int]


def dataset_info(config) -> DatasetInfo:
  """The sizes of ``config.dataset`` as this example feeds it."""
  if config.dataset == "digits":
    images, _, test_images, _ = _digits()
    return DatasetInfo(len(images), len(test_images), 10, images.shape[1:])
  if config.dataset == "fake":
    size = config.image_size
    return DatasetInfo(FAKE_TRAIN_EXAMPLES, FAKE_EVAL_EXAMPLES, FAKE_CLASSES, (size, size, 3))
  builder = _tfds_builder(config)
  splits = builder.info.splits
  return DatasetInfo(
      splits["train"].num_examples,
      splits["validation"].num_examples,
      builder.info.features["label"].num_classes,
      (config.image_size, config.image_size, 3),
  )


def local_batch_size(global_batch_size: int) -> int:
  """Rows of a global batch that this process feeds to its devices."""
  if global_batch_size % jax.device_count():
    raise ValueError(
        f"batch_size {global_batch_size} must be divisible by the {jax.device_count()} devices."
    )
  return global_batch_size // jax.process_count()


def train_batches(config, start_step: int = 0) -> Iterator[Batch]:
  """An endless stream of this process's training batches, from batch ``start_step`` on.

  A stream that starts at ``start_step`` (a run resumed from a checkpoint)
  yields what the stream from 0 yields from its ``start_step``-th batch on:
  the same arrays for digits and fake data (functions of ``config.seed``);
  for a TensorFlow dataset, the same examples in the same order, but the
  random crops and flips are drawn afresh (they are not seeded, resumed or
  not).
  """
  batch_size = local_batch_size(config.batch_size)
  if config.dataset == "digits":
    return _digits_train(config, batch_size, start_step)
  if config.dataset == "fake":
    return _fake(config, batch_size)
  return _tfds_batches(config, batch_size, train=True, skip=start_step)


def eval_batches(config, num_batches: int) -> Iterator[Batch]:
  """``num_batches`` evaluation batches, the same number on every process.

  The data ends with padding (``mask`` 0) where the split does not fill the
  last batch, or where this process's share of it is shorter than another's.
  """
  batch_size = local_batch_size(config.batch_size)
  if config.dataset == "digits":
    _, _, images, labels = _digits()
    rows = np.array_split(np.arange(len(images)), jax.process_count())[jax.process_index()]
    batches = (
        {"image": images[rows[i : i + batch_size]], "label": labels[rows[i : i + batch_size]]}
        for i in range(0, len(rows), batch_size)
    )
  elif config.dataset == "fake":
    batches = _fake(config, batch_size)
  else:
    batches = _tfds_batches(config, batch_size, train=False)
  return _padded(batches, num_batches, batch_size)


def num_eval_batches(config, info: DatasetInfo) -> int:
  """``config.steps_per_eval``, or enough batches to cover the evaluation split."""
  if config.steps_per_eval > 0:
    return config.steps_per_eval
  return math.ceil(info.num_eval_examples / config.batch_size)


def _padded(batches: Iterator[Batch], num_batches: int, batch_size: int) -> Iterator[Batch]:
  batches = iter(batches)
  template = None
  for _ in range(num_batches):
    batch = next(batches, None)
    if batch is None:  # This process's data is used up: feed padding until the others finish.
      yield {key: np.zeros_like(value) for key, value in template.items()}
      continue
    size = len(batch["label"])
    padding = batch_size - size
    batch = {key: np.concatenate([value, np.zeros((padding, *value.shape[1:]), value.dtype)])
             for key, value in batch.items() if key != "mask"}
    batch["mask"] = (np.arange(batch_size) < size).astype(np.float32)
    template = batch
    yield batch


@functools.cache
def _digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """Digits images ``float32[n, 8, 8, 1]``, standardized by the training pixels, and labels."""
  from sklearn.datasets import load_digits

  digits = load_digits()
  images = digits.images.astype(np.float32)[..., None] / 16.0
  labels = digits.target.astype(np.int32)
  num_train = len(images) - int(round(DIGITS_TEST_FRACTION * len(images)))
  mean, std = images[:num_train].mean(), images[:num_train].std()
  images = (images - mean) / std
  return images[:num_train], labels[:num_train], images[num_train:], labels[num_train:]


def _digits_train(config, batch_size: int, start_step: int) -> Iterator[Batch]:
  """Shuffled digits, each shifted by up to one pixel in each direction."""
  images, labels, _, _ = _digits()
  rng = np.random.default_rng(config.seed)  # The same order on every process.
  start = jax.process_index() * batch_size
  padded = np.pad(images, ((0, 0), (1, 1), (1, 1), (0, 0)), constant_values=images.min())
  height, width = images.shape[1:3]
  step = 0
  while True:
    order = rng.permutation(len(images))
    for first in range(0, len(order) - config.batch_size + 1, config.batch_size):
      shifts = rng.integers(0, 3, size=(config.batch_size, 2))[start : start + batch_size]
      step += 1
      if step <= start_step:  # Drawn all the same, so that later batches are the same.
        continue
      rows = order[first + start : first + start + batch_size]
      shifted = np.stack([padded[row, dy : dy + height, dx : dx + width]
                          for row, (dy, dx) in zip(rows, shifts, strict=True)])
      yield {"image": shifted, "label": labels[rows]}


def _fake(config, batch_size: int) -> Iterator[Batch]:
  rng = np.random.default_rng(config.seed + jax.process_index())
  size = config.image_size
  batch = {
      "image": rng.normal(size=(batch_size, size, size, 3)).astype(np.float32),
      "label": rng.integers(0, FAKE_CLASSES, size=batch_size).astype(np.int32),
  }
  while True:
    yield batch


def _tfds_builder(config):
  import tensorflow_datasets as tfds

  return tfds.builder(config.dataset, data_dir=config.data_dir)


def _tfds_batches(config, batch_size: int, *, train: bool, skip: int = 0) -> Iterator[Batch]:
  """This process's share of an image-classification split, decoded and normalized.

  Training skips the first ``skip`` batches (read and dropped: the shuffle's
  order is fixed by ``config.seed``).
  """
  import tensorflow as tf
  import tensorflow_datasets as tfds

  tf.config.set_visible_devices([], "GPU")  # TensorFlow must leave the accelerators to JAX.
  split = tfds.split_for_jax_process("train" if train else "validation", drop_remainder=train)
  dataset = _tfds_builder(config).as_dataset(
      split=split, decoders={"image": tfds.decode.SkipDecoding()}
  )
  if config.cache:
    dataset = dataset.cache()
  if train:
    dataset = dataset.repeat().shuffle(config.shuffle_buffer_size, seed=config.seed)

  def preprocess(example):
    image = _decode_image(tf, example["image"], config.image_size, train)
    return {"image": image, "label": tf.cast(example["label"], tf.int32)}

  dataset = dataset.map(preprocess, num_parallel_calls=tf.data.AUTOTUNE)
  dataset = dataset.batch(batch_size, drop_remainder=train).skip(skip).prefetch(config.prefetch)
  return iter(tfds.as_numpy(dataset))


def _decode_image(tf, image_bytes, image_size: int, train: bool):
  """A JPEG decoded, cropped, resized to ``image_size`` and normalized per channel.

  Training takes a random crop covering 8% to 100% of the image with an aspect
  ratio between 3/4 and 4/3, flipped at random; evaluation takes the central
  ``image_size / (image_size + 32)`` of the shorter side.
  """
  shape = tf.io.extract_jpeg_shape(image_bytes)
  if train:
    whole_image = tf.constant([0.0, 0.0, 1.0, 1.0], tf.float32, shape=(1, 1, 4))
    begin, size, _ = tf.image.sample_distorted_bounding_box(
        shape, bounding_boxes=whole_image, min_object_covered=0.1,
        aspect_ratio_range=(3 / 4, 4 / 3), area_range=(0.08, 1.0), max_attempts=10,
        use_image_if_no_bounding_boxes=True,
    )
    top, left, _ = tf.unstack(begin)
    height, width, _ = tf.unstack(size)
  else:
    side = tf.cast(
        image_size / (image_size + 32) * tf.cast(tf.minimum(shape[0], shape[1]), tf.float32),
        tf.int32,
    )
    top, left = (shape[0] - side + 1) // 2, (shape[1] - side + 1) // 2
    height = width = side
  window = tf.stack([top, left, height, width])
  image = tf.io.decode_and_crop_jpeg(image_bytes, window, channels=3)
  image = tf.image.resize(image, (image_size, image_size), method="bicubic")
  if train:
    image = tf.image.random_flip_left_right(image)
  image = (image - tf.constant(MEAN_RGB, tf.float32)) / tf.constant(STDDEV_RGB, tf.float32)
  return tf.reshape(image, (image_size, image_size, 3))
