"""TensorFlow's classic image preprocessing recipe (Inception / CIFAR style), seeded and stateless.

Training: a random crop that covers at least `min_object_covered` of a bounding box (by default
the whole image) with aspect ratio and area in given ranges, resize to `size` by the chosen
method, random flips, brightness/saturation/hue/contrast jitter in one of several orders (picked
at random per image), clip to [0, 1], per-image standardization. Eval: a central crop and the
same resize and standardization, nothing random.

Every random op is a stateless one driven by an explicit seed (a pair of ints), so a seed gives
the same image anywhere. Three entry points:
- `preprocess_image(image, training=..., seed=...)`: one [h, w, c] image;
- `preprocess_images(images, training=..., seed=...)`: a [batch, h, w, c] batch, one derived seed
  per image;
- `image_preprocessor(key="image", size=(h, w), seed=0)`: a `fn(features, training) -> dict` for
  per-tower (inside tf.function) or per-batch (numpy in, numpy out) use; it draws a fresh seed per
  call from a generator seeded once, so a run is reproducible and every step sees new distortions.

Integer images are scaled to [0, 1] (`tf.image.convert_image_dtype`); float images must already be
in [0, 1]. Saturation and hue need RGB and are skipped for other channel counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from towerflow.errors import SpecError

RESIZE_METHODS = (
    "bilinear",
    "nearest",
    "bicubic",
    "area",
    "lanczos3",
    "lanczos5",
    "gaussian",
    "mitchellcubic",
)
WHOLE_IMAGE = ((0.0, 0.0, 1.0, 1.0),)  # ymin, xmin, ymax, xmax, relative to the image

# The four colour orderings of the Inception recipe (b = brightness, s = saturation, h = hue, c = contrast).
COLOR_ORDERINGS = ("bshc", "sbch", "chbs", "hscb")


@dataclass(frozen=True)
class ImageOptions:
    """How to preprocess; the defaults follow the Inception training recipe."""

    size: tuple[int, int]
    min_object_covered: float = 0.1
    aspect_ratio_range: tuple[float, float] = (3 / 4, 4 / 3)
    area_range: tuple[float, float] = (0.05, 1.0)
    max_attempts: int = 100
    flip_left_right: bool = True
    flip_up_down: bool = False
    brightness: float = 32.0 / 255.0  # max delta
    saturation: tuple[float, float] = (0.5, 1.5)
    hue: float = 0.2  # max delta
    contrast: tuple[float, float] = (0.5, 1.5)
    num_orderings: int = 4
    resize_method: str = "bilinear"
    central_fraction: float = 0.875  # eval crop
    standardize: bool = True

    def __post_init__(self) -> None:
        if len(self.size) != 2 or min(self.size) < 1:
            raise SpecError(f"image preprocessing: size must be (height, width) > 0, got {self.size}")
        if self.resize_method not in RESIZE_METHODS:
            raise SpecError(
                f"image preprocessing: unknown resize_method {self.resize_method!r}; use one of "
                f"{', '.join(RESIZE_METHODS)}"
            )
        if not 1 <= self.num_orderings <= len(COLOR_ORDERINGS):
            raise SpecError(f"image preprocessing: num_orderings must be 1-4, got {self.num_orderings}")
        if not 0.0 < self.central_fraction <= 1.0 or not 0.0 <= self.min_object_covered <= 1.0:
            raise SpecError(
                "image preprocessing: central_fraction must be in (0, 1], min_object_covered in [0, 1]"
            )


def to_float(image: tf.Tensor) -> tf.Tensor:
    """float32 in [0, 1]: integer images are rescaled by their dtype's range, floats kept."""
    image = tf.convert_to_tensor(image)
    return (
        tf.image.convert_image_dtype(image, tf.float32)
        if image.dtype.is_integer
        else tf.cast(image, tf.float32)
    )


def sample_crop(
    image_shape: tf.Tensor, seed: tf.Tensor, options: ImageOptions, bbox: tf.Tensor | None = None
) -> tuple[tf.Tensor, tf.Tensor]:
    """(begin, size) of a random crop covering >= min_object_covered of the bounding box(es)."""
    boxes = (
        tf.constant([WHOLE_IMAGE], tf.float32)
        if bbox is None
        else tf.reshape(tf.cast(bbox, tf.float32), [1, -1, 4])
    )
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        image_shape,
        bounding_boxes=boxes,
        seed=seed,
        min_object_covered=options.min_object_covered,
        aspect_ratio_range=options.aspect_ratio_range,
        area_range=options.area_range,
        max_attempts=options.max_attempts,
        use_image_if_no_bounding_boxes=True,
    )
    return begin, size


def _jitter(image: tf.Tensor, op: str, seed: tf.Tensor, options: ImageOptions, rgb: bool) -> tf.Tensor:
    if op == "b":
        return tf.image.stateless_random_brightness(image, options.brightness, seed)
    if op == "c":
        return tf.image.stateless_random_contrast(image, *options.contrast, seed)
    if not rgb:
        return image
    if op == "s":
        return tf.image.stateless_random_saturation(image, *options.saturation, seed)
    return tf.image.stateless_random_hue(image, options.hue, seed)


def distort_color(image: tf.Tensor, seed: tf.Tensor, options: ImageOptions) -> tf.Tensor:
    """Brightness, saturation, hue and contrast jitter in a randomly chosen order, then clip to [0, 1]."""
    seeds = tf.random.experimental.stateless_split(seed, num=5)
    rgb = image.shape[-1] == 3

    def ordering(order: str):
        def apply():
            out = image
            for op in order:  # each op keeps its own seed whatever its position
                out = _jitter(out, op, seeds[1 + "bshc".index(op)], options, rgb)
            return out

        return apply

    choice = tf.random.stateless_uniform([], seeds[0], 0, options.num_orderings, dtype=tf.int32)
    branches = [ordering(order) for order in COLOR_ORDERINGS[: options.num_orderings]]
    image = branches[0]() if len(branches) == 1 else tf.switch_case(choice, branches)
    return tf.clip_by_value(image, 0.0, 1.0)


def _finish(image: tf.Tensor, options: ImageOptions) -> tf.Tensor:
    return tf.image.per_image_standardization(image) if options.standardize else image


def _resize(image: tf.Tensor, options: ImageOptions) -> tf.Tensor:
    return tf.image.resize(image, options.size, method=options.resize_method)


def train_image(
    image: tf.Tensor, seed: tf.Tensor, options: ImageOptions, bbox: tf.Tensor | None = None
) -> tf.Tensor:
    """The random training distortions of one [h, w, c] image."""
    image = to_float(image)
    crop_seed, lr_seed, ud_seed, color_seed = tf.unstack(tf.random.experimental.stateless_split(seed, num=4))
    begin, size = sample_crop(tf.shape(image), crop_seed, options, bbox)
    image = _resize(tf.slice(image, begin, size), options)
    if options.flip_left_right:
        image = tf.image.stateless_random_flip_left_right(image, lr_seed)
    if options.flip_up_down:
        image = tf.image.stateless_random_flip_up_down(image, ud_seed)
    return _finish(distort_color(image, color_seed, options), options)


def eval_image(image: tf.Tensor, options: ImageOptions) -> tf.Tensor:
    """Central crop, resize, standardize: no randomness."""
    image = to_float(image)
    if options.central_fraction < 1.0:
        image = tf.image.central_crop(image, options.central_fraction)
    return _finish(tf.clip_by_value(_resize(image, options), 0.0, 1.0), options)


def _options(
    size: Sequence[int] | None, options: ImageOptions | None, overrides: dict[str, Any]
) -> ImageOptions:
    if options is None:
        if size is None:
            raise SpecError("image preprocessing: give size=(height, width) or options=ImageOptions(...)")
        return ImageOptions(size=tuple(size), **overrides)
    return options


def _seed(seed: int | Sequence[int] | tf.Tensor) -> tf.Tensor:
    """A stateless seed: an int becomes the pair (seed, 0)."""
    if isinstance(seed, int | np.integer):
        return tf.constant([int(seed), 0], tf.int64)
    return tf.cast(tf.reshape(seed, [2]), tf.int64)


def preprocess_image(
    image: tf.Tensor | np.ndarray,
    *,
    training: bool,
    seed: int | Sequence[int] | tf.Tensor = 0,
    size: Sequence[int] | None = None,
    bbox: tf.Tensor | None = None,
    options: ImageOptions | None = None,
    **overrides: Any,
) -> tf.Tensor:
    """One [h, w, c] image -> float32 [size[0], size[1], c]; `overrides` are ImageOptions fields."""
    opts = _options(size, options, overrides)
    return train_image(image, _seed(seed), opts, bbox) if training else eval_image(image, opts)


def preprocess_images(
    images: tf.Tensor | np.ndarray,
    *,
    training: bool,
    seed: int | Sequence[int] | tf.Tensor = 0,
    size: Sequence[int] | None = None,
    bboxes: tf.Tensor | None = None,
    options: ImageOptions | None = None,
    **overrides: Any,
) -> tf.Tensor:
    """A [batch, h, w, c] batch; image i gets its own seed derived from `seed` and i."""
    opts = _options(size, options, overrides)
    images = tf.convert_to_tensor(images)
    channels = images.shape[-1]
    if channels is None:
        raise SpecError("image preprocessing: the channel count must be known (shape [batch, h, w, c])")
    if not training:
        return tf.map_fn(lambda im: eval_image(im, opts), images, fn_output_signature=tf.float32)
    count = tf.shape(images)[0]
    seeds = tf.random.stateless_uniform([count, 2], _seed(seed), minval=None, maxval=None, dtype=tf.int64)
    if bboxes is None:
        return tf.map_fn(
            lambda args: train_image(args[0], args[1], opts), (images, seeds), fn_output_signature=tf.float32
        )
    return tf.map_fn(
        lambda args: train_image(args[0], args[1], opts, args[2]),
        (images, seeds, tf.cast(bboxes, tf.float32)),
        fn_output_signature=tf.float32,
    )


class ImagePreprocessor:
    """`fn(features, training) -> features` that replaces `key` by its preprocessed batch.

    A new seed is drawn per training call from a `tf.random.Generator` seeded with `seed` (made on
    first use, outside any tf.function, so the callable itself pickles and travels to Ray actors).
    Numpy inputs (Ray Data's map_batches) give numpy outputs; tensors give tensors.
    """

    def __init__(self, key: str, options: ImageOptions, seed: int = 0, bbox_key: str | None = None):
        self.key, self.options, self.seed, self.bbox_key = key, options, seed, bbox_key
        self._generator: tf.random.Generator | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_generator": None}

    def _next_seed(self) -> tf.Tensor:
        if self._generator is None:
            with tf.init_scope():  # a variable made eagerly even when first called inside tf.function
                self._generator = tf.random.Generator.from_seed(self.seed)
        return self._generator.make_seeds(1)[:, 0]

    def __call__(self, features: dict[str, Any], training: bool) -> dict[str, Any]:
        if self.key not in features:
            raise SpecError(f"image preprocessing: no feature {self.key!r} (have {', '.join(features)})")
        images = features[self.key]
        as_numpy = isinstance(images, np.ndarray)
        seed = self._next_seed() if training else 0
        bboxes = features.get(self.bbox_key) if self.bbox_key else None
        out = preprocess_images(images, training=training, seed=seed, bboxes=bboxes, options=self.options)
        return {**features, self.key: out.numpy() if as_numpy else out}


def image_preprocessor(
    key: str = "image",
    size: Sequence[int] = (224, 224),
    *,
    seed: int = 0,
    bbox_key: str | None = None,
    **overrides: Any,
) -> ImagePreprocessor:
    """A per-tower / per-batch preprocessing function for the image feature `key` (see ImageOptions)."""
    return ImagePreprocessor(key, ImageOptions(size=tuple(size), **overrides), seed=seed, bbox_key=bbox_key)
