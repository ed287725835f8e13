"""Procedural handwritten-like digits: numpy only, vectorised, deterministic from a Generator.

Each digit class is one or more stroke skeletons (polylines and arcs in a unit box, y down).
A skeleton is resampled to a fixed number of points so that every image in a batch is the
same array shape; per image we then bend the points with a smooth random field, apply a random
affine (rotation, scale, shear, translation), splat the points bilinearly onto the 28x28 grid,
blur with a per-image Gaussian (stroke thickness), saturate the ink and add pixel noise.
Random position, angle and thickness are what keep a linear model on raw pixels well below a
small CNN, which is the point: the data set must reward convolution, not memorise templates.
"""

from __future__ import annotations

import numpy as np

SIZE = 28
NUM_CLASSES = 10

_POINTS = 128  # points per skeleton: spacing stays under ~0.6 px, below the blur width
_CHUNK = 2048  # images rendered at once: bounds the (chunk, 28, 28) temporaries
_BOX_PX = 19.0  # height of the unit box in pixels at scale 1 (MNIST digits sit in a ~20 px box)

Stroke = np.ndarray  # (k, 2) polyline, columns x, y in the unit box


def _line(*points: tuple[float, float]) -> Stroke:
    return np.asarray(points, dtype=np.float64)


def _arc(cx: float, cy: float, rx: float, ry: float, a0: float, a1: float) -> Stroke:
    """Elliptic arc from angle a0 to a1 (degrees, counter-clockwise as seen on screen)."""
    n = max(4, int(abs(a1 - a0) / 10) + 1)
    a = np.deg2rad(np.linspace(a0, a1, n))
    return np.stack([cx + rx * np.cos(a), cy - ry * np.sin(a)], axis=1)


def _then(*parts: Stroke) -> Stroke:
    """Join pieces into one continuous stroke (the pen does not lift between them)."""
    return np.concatenate(parts, axis=0)


def _skeletons() -> dict[int, list[list[Stroke]]]:
    """Per class, a few style variants; each variant is a list of pen-down strokes."""
    return {
        0: [
            [_arc(0.5, 0.5, 0.3, 0.45, 95, 455)],
            [_arc(0.5, 0.5, 0.26, 0.46, 80, 430)],
        ],
        1: [
            [_line((0.5, 0.03), (0.5, 0.97))],
            [_line((0.32, 0.22), (0.55, 0.03), (0.5, 0.97))],
            [_line((0.36, 0.2), (0.54, 0.03), (0.54, 0.95)), _line((0.34, 0.96), (0.74, 0.96))],
        ],
        2: [
            [_then(_arc(0.5, 0.3, 0.28, 0.25, 160, -30), _line((0.2, 0.95), (0.85, 0.95)))],
            [_then(_arc(0.48, 0.3, 0.3, 0.26, 170, -20), _line((0.18, 0.95), (0.86, 0.92)))],
        ],
        3: [
            [_arc(0.47, 0.28, 0.27, 0.23, 150, -90), _arc(0.47, 0.73, 0.31, 0.24, 90, -150)],
            [_then(_line((0.2, 0.04), (0.78, 0.04), (0.44, 0.44)), _arc(0.47, 0.7, 0.3, 0.26, 90, -150))],
        ],
        4: [
            [_line((0.66, 0.97), (0.66, 0.03), (0.14, 0.66), (0.86, 0.66))],
            [_line((0.26, 0.03), (0.2, 0.6), (0.84, 0.6)), _line((0.66, 0.1), (0.66, 0.97))],
        ],
        5: [
            [_then(_line((0.8, 0.04), (0.3, 0.04), (0.26, 0.45)), _arc(0.48, 0.68, 0.3, 0.28, 130, -150))],
            [
                _line((0.28, 0.04), (0.24, 0.46)),
                _line((0.3, 0.04), (0.8, 0.04)),
                _arc(0.48, 0.68, 0.31, 0.28, 140, -145),
            ],
        ],
        6: [
            [_then(_arc(0.78, 0.62, 0.55, 0.58, 95, 180), _arc(0.5, 0.7, 0.27, 0.25, 180, 540))],
            [_then(_line((0.7, 0.03), (0.27, 0.6)), _arc(0.5, 0.72, 0.26, 0.24, 160, 520))],
        ],
        7: [
            [_line((0.16, 0.04), (0.84, 0.04), (0.4, 0.97))],
            [_line((0.16, 0.04), (0.84, 0.04), (0.42, 0.97)), _line((0.36, 0.5), (0.76, 0.5))],
        ],
        8: [
            [_arc(0.5, 0.27, 0.22, 0.22, 270, 630), _arc(0.5, 0.72, 0.28, 0.24, 90, 450)],
            [_then(_arc(0.5, 0.27, 0.21, 0.23, 300, 630), _arc(0.5, 0.72, 0.27, 0.25, 90, 460))],
        ],
        9: [
            [_then(_arc(0.5, 0.3, 0.27, 0.25, 0, 360), _line((0.77, 0.3), (0.72, 0.97)))],
            [_then(_arc(0.48, 0.3, 0.27, 0.25, 20, 380), _arc(0.2, 0.3, 0.55, 0.67, 0, -80))],
        ],
    }


def _resample(strokes: list[Stroke], n: int) -> tuple[np.ndarray, np.ndarray]:
    """n points spread along the strokes by arc length, and each point's share of ink length."""
    lengths = [float(np.linalg.norm(np.diff(s, axis=0), axis=1).sum()) for s in strokes]
    counts = np.maximum(2, np.floor(n * np.asarray(lengths) / sum(lengths))).astype(int)
    counts[np.argmax(lengths)] += n - counts.sum()
    points, weights = [], []
    for stroke, length, k in zip(strokes, lengths, counts, strict=True):
        cum = np.concatenate([[0.0], np.cumsum(np.linalg.norm(np.diff(stroke, axis=0), axis=1))])
        t = np.linspace(0.0, cum[-1], k)
        points.append(np.stack([np.interp(t, cum, stroke[:, 0]), np.interp(t, cum, stroke[:, 1])], axis=1))
        weights.append(np.full(k, length / k))
    return np.concatenate(points), np.concatenate(weights)


def _templates() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Stacked skeletons: points (T, P, 2), weights (T, P), first variant and variant count per class."""
    points, weights, first, count = [], [], [], []
    for digit, variants in sorted(_skeletons().items()):
        first.append(len(points))
        count.append(len(variants))
        for strokes in variants:
            p, w = _resample(strokes, _POINTS)
            points.append(p)
            weights.append(w)
        assert digit == len(first) - 1
    return np.stack(points), np.stack(weights), np.asarray(first), np.asarray(count)


_TEMPLATE_POINTS, _TEMPLATE_WEIGHTS, _FIRST, _COUNT = _templates()


def _bend(points: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Displace points by a smooth random field: a few low-frequency sines per axis (elastic jitter)."""
    b = points.shape[0]
    freq = rng.uniform(-1.5, 1.5, size=(b, 3, 2, 2))
    phase = rng.uniform(0.0, 2 * np.pi, size=(b, 3, 2))
    amp = rng.normal(0.0, 0.02, size=(b, 3, 2))
    proj = np.einsum("bpi,bkdi->bpkd", points, freq)
    return points + (amp[:, None] * np.sin(2 * np.pi * proj + phase[:, None])).sum(axis=2)


def _affines(b: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-image 2x2 matrices (unit box -> pixels), translations, and the overall scale."""
    theta = np.deg2rad(rng.uniform(-15.0, 15.0, b))
    scale = rng.uniform(0.8, 1.15, b)
    aspect = rng.uniform(0.85, 1.15, b)
    shear = rng.uniform(-0.25, 0.25, b)
    cos, sin = np.cos(theta), np.sin(theta)
    rot = np.stack([np.stack([cos, -sin], -1), np.stack([sin, cos], -1)], axis=1)
    shr = np.zeros((b, 2, 2))
    shr[:, 0, 0], shr[:, 0, 1], shr[:, 1, 1] = aspect, shear, 1.0
    mat = rot @ shr * (scale * _BOX_PX)[:, None, None]
    shift = (SIZE - 1) / 2 + rng.uniform(-3.0, 3.0, size=(b, 2))
    return mat, shift, scale


def _splat(pix: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Bilinear splat of (B, P, 2) pixel positions (x, y) with (B, P) ink into (B, 28, 28)."""
    b = pix.shape[0]
    base = np.floor(pix)
    frac = pix - base
    base = base.astype(np.int64)
    index, value = [], []
    for dx, dy in ((0, 0), (1, 0), (0, 1), (1, 1)):
        x, y = base[..., 0] + dx, base[..., 1] + dy
        wx = frac[..., 0] if dx else 1.0 - frac[..., 0]
        wy = frac[..., 1] if dy else 1.0 - frac[..., 1]
        inside = (x >= 0) & (x < SIZE) & (y >= 0) & (y < SIZE)
        flat = (np.arange(b)[:, None] * SIZE + y) * SIZE + x
        index.append(flat[inside])
        value.append((weights * wx * wy)[inside])
    grid = np.bincount(np.concatenate(index), np.concatenate(value), minlength=b * SIZE * SIZE)
    return grid.reshape(b, SIZE, SIZE)


def _blur(images: np.ndarray, sigma: np.ndarray) -> np.ndarray:
    """Separable per-image Gaussian blur as two batched matmuls (G @ X @ G, G symmetric)."""
    d = np.arange(SIZE, dtype=np.float64)
    d2 = (d[:, None] - d[None, :]) ** 2
    s = sigma[:, None, None]
    g = np.exp(-d2[None] / (2 * s**2)) / (np.sqrt(2 * np.pi) * s)
    return g @ images @ g


def _render_chunk(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    b = labels.shape[0]
    variant = _FIRST[labels] + np.floor(rng.random(b) * _COUNT[labels]).astype(np.int64)
    points = _bend(_TEMPLATE_POINTS[variant], rng)
    mat, shift, scale = _affines(b, rng)
    pix = np.einsum("bij,bpj->bpi", mat, points - 0.5) + shift[:, None, :]
    ink = _splat(pix, _TEMPLATE_WEIGHTS[variant] * (scale * _BOX_PX)[:, None])
    sigma = rng.uniform(0.55, 1.1, b)
    density = _blur(ink, sigma)
    # Saturate: the gain sets how far from the skeleton the ink reaches, i.e. stroke thickness.
    gain = rng.uniform(1.5, 6.0, b) * np.sqrt(2 * np.pi) * sigma
    darkness = rng.uniform(0.8, 1.0, b)
    img = darkness[:, None, None] * -np.expm1(-gain[:, None, None] * density)
    img += rng.normal(0.0, 1.0, img.shape) * rng.uniform(0.0, 0.06, b)[:, None, None]
    return np.clip(np.rint(img * 255.0), 0, 255).astype(np.uint8)


def render_digits(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Render one random 28x28 uint8 image per label (0-9); the same rng state gives the same images."""
    labels = np.asarray(labels, dtype=np.int64)
    if labels.ndim != 1 or (labels.size and (labels.min() < 0 or labels.max() >= NUM_CLASSES)):
        raise ValueError(f"labels must be a 1-D array of digits 0-{NUM_CLASSES - 1}")
    out = np.empty((labels.size, SIZE, SIZE), dtype=np.uint8)
    for start in range(0, labels.size, _CHUNK):
        out[start : start + _CHUNK] = _render_chunk(labels[start : start + _CHUNK], rng)
    return out


def sample_digits(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n random labels (uniform over 0-9, so classes are balanced in expectation) and their images."""
    labels = rng.integers(0, NUM_CLASSES, size=n, dtype=np.int64)
    return render_digits(labels, rng), labels
