"""The classic image recipe: shapes, ranges, seeded randomness, crop coverage, standardization."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import tensorflow as tf

from towerflow.data.preprocessing.image import (
    ImageOptions,
    distort_color,
    image_preprocessor,
    preprocess_image,
    preprocess_images,
    sample_crop,
)
from towerflow.errors import SpecError


def _images(n=4, h=40, w=48, c=3, seed=0):
    """Smooth random images (gradients plus blobs) as uint8, so crops and flips change the pixels."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
    out = np.empty((n, h, w, c), np.float64)
    for i in range(n):
        for ch in range(c):
            a, b, cx, cy = rng.uniform(-1, 1, 4)
            out[i, :, :, ch] = (
                0.5 + 0.3 * (a * xx + b * yy) + 0.2 * np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) * 8)
            )
    return np.clip(out * 255, 0, 255).astype(np.uint8)


@pytest.mark.parametrize("training", [True, False])
def test_shapes_dtypes_and_standardization(training):
    images = _images()
    out = preprocess_images(images, training=training, seed=3, size=(24, 20))
    assert out.shape == (4, 24, 20, 3) and out.dtype == tf.float32
    flat = tf.reshape(out, [4, -1]).numpy()
    assert np.allclose(flat.mean(axis=1), 0.0, atol=1e-4)
    assert np.allclose(flat.std(axis=1), 1.0, atol=1e-2)
    one = preprocess_image(images[0], training=training, seed=3, size=(24, 20))
    assert one.shape == (24, 20, 3) and one.dtype == tf.float32


@pytest.mark.parametrize("training", [True, False])
def test_values_stay_in_the_unit_range_without_standardization(training):
    out = preprocess_images(_images(8), training=training, seed=1, size=(16, 16), standardize=False).numpy()
    assert out.min() >= 0.0 and out.max() <= 1.0
    assert out.std() > 0.01  # not a constant image


def test_grayscale_images_skip_saturation_and_hue():
    gray = _images(3, 28, 28, 1)
    out = preprocess_images(gray, training=True, seed=2, size=(28, 28))
    assert out.shape == (3, 28, 28, 1)


def test_eval_is_deterministic_and_ignores_the_seed():
    images = _images()
    a = preprocess_images(images, training=False, seed=1, size=(32, 32))
    b = preprocess_images(images, training=False, seed=2, size=(32, 32))
    assert np.array_equal(a.numpy(), b.numpy())
    # Eval is the central crop, resized: compare with doing it by hand.
    manual = tf.image.resize(
        tf.image.central_crop(tf.image.convert_image_dtype(images, tf.float32), 0.875), (32, 32)
    )
    expected = tf.image.per_image_standardization(tf.clip_by_value(manual, 0.0, 1.0))
    assert np.allclose(a.numpy(), expected.numpy(), atol=1e-5)


def test_training_is_random_across_seeds_and_reproducible_for_a_seed():
    images = _images()
    a = preprocess_images(images, training=True, seed=5, size=(32, 32)).numpy()
    b = preprocess_images(images, training=True, seed=5, size=(32, 32)).numpy()
    c = preprocess_images(images, training=True, seed=6, size=(32, 32)).numpy()
    assert np.array_equal(a, b)
    assert not np.allclose(a, c)
    # Within one batch, two copies of the same image get different distortions.
    twins = preprocess_images(np.stack([images[0], images[0]]), training=True, seed=5, size=(32, 32)).numpy()
    assert not np.allclose(twins[0], twins[1])


@pytest.mark.parametrize("box, min_covered", [((0.0, 0.0, 1.0, 1.0), 0.1), ((0.2, 0.3, 0.7, 0.9), 0.6)])
def test_crops_cover_at_least_the_minimum_fraction_of_the_box(box, min_covered):
    options = ImageOptions(size=(8, 8), min_object_covered=min_covered, area_range=(0.05, 1.0))
    h, w = 100, 120
    ymin, xmin, ymax, xmax = box[0] * h, box[1] * w, box[2] * h, box[3] * w
    areas = []
    for i in range(60):
        begin, size = sample_crop(tf.constant([h, w, 3]), tf.constant([i, 7]), options, tf.constant([box]))
        (y0, x0, _), (ch, cw, _) = begin.numpy(), size.numpy()
        inter = max(0, min(y0 + ch, ymax) - max(y0, ymin)) * max(0, min(x0 + cw, xmax) - max(x0, xmin))
        # The op works on whole pixels: allow one pixel row/column of rounding.
        slack = (ymax - ymin + xmax - xmin) / ((ymax - ymin) * (xmax - xmin))
        assert inter / ((ymax - ymin) * (xmax - xmin)) >= min_covered - slack, (i, begin, size)
        areas.append(ch * cw)
    assert len(set(areas)) > 10  # crops vary with the seed


def test_colour_jitter_is_clipped_and_seeded():
    image = tf.image.convert_image_dtype(_images(1)[0], tf.float32)
    options = ImageOptions(size=(8, 8), brightness=0.6)
    outs = [distort_color(image, tf.constant([i, 1]), options).numpy() for i in range(12)]
    assert all(o.min() >= 0.0 and o.max() <= 1.0 for o in outs)
    assert any(o.min() == 0.0 or o.max() == 1.0 for o in outs)  # strong brightness: clipping happened
    one_order = ImageOptions(size=(8, 8), num_orderings=1)
    # With a fixed order, only the per-op draws change the image; the same seed gives the same image.
    assert np.array_equal(
        distort_color(image, tf.constant([1, 1]), one_order).numpy(),
        distort_color(image, tf.constant([1, 1]), one_order).numpy(),
    )


def test_per_tower_function_draws_new_seeds_each_step_and_replays_for_a_seed():
    images = tf.constant(_images(4))
    features = {"image": images, "label": tf.constant([0, 1, 2, 3], tf.int64)}

    def run(fn, steps=3):
        step = tf.function(lambda f: fn(f, True))
        return [step(features)["image"].numpy() for _ in range(steps)]

    fn = image_preprocessor("image", size=(24, 24), seed=11)
    first = run(fn)
    assert not np.allclose(first[0], first[1])  # a fresh distortion every step, inside tf.function
    replay = run(pickle.loads(pickle.dumps(image_preprocessor("image", size=(24, 24), seed=11))))
    assert all(np.array_equal(a, b) for a, b in zip(first, replay))
    out = fn(features, False)
    assert out["image"].shape == (4, 24, 24, 3) and out["label"] is features["label"]
    assert np.array_equal(out["image"].numpy(), fn(features, False)["image"].numpy())


def test_numpy_batches_in_give_numpy_out_and_a_missing_key_is_named():
    fn = image_preprocessor("pixels", size=(16, 16), seed=0)
    out = fn({"pixels": _images(2), "example_id": np.arange(2)}, True)
    assert isinstance(out["pixels"], np.ndarray) and out["pixels"].shape == (2, 16, 16, 3)
    with pytest.raises(SpecError, match="'pixels'"):
        fn({"image": _images(2)}, True)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"resize_method": "cubic"}, "resize_method"),
        ({"num_orderings": 5}, "num_orderings"),
        ({"size": (0, 4)}, "size"),
    ],
)
def test_bad_options_are_spec_errors(options, match):
    with pytest.raises(SpecError, match=match):
        ImageOptions(**{"size": (8, 8), **options})


@pytest.mark.parametrize("method", ["nearest", "area", "bicubic"])
def test_resize_method_is_used(method):
    out = preprocess_images(
        _images(2), training=False, size=(10, 10), resize_method=method, standardize=False
    )
    manual = tf.image.resize(
        tf.image.central_crop(tf.image.convert_image_dtype(_images(2), tf.float32), 0.875),
        (10, 10),
        method=method,
    )
    assert np.allclose(out.numpy(), np.clip(manual.numpy(), 0, 1), atol=1e-6)
