"""Pet photos for the embedded dataset: a coloured animal blob on a textured background, drawn with numpy.

The row's hidden image score moves the background's brightness, warmth and stripe frequency (lighting,
colour and texture cues a small CNN learns from scratch at 64 px, and mean-colour statistics partly
capture); the animal's colour follows the row's Color1 code, so it carries tabular, not image, signal.
Everything is drawn from one numpy Generator in a fixed order and encoded with a fixed JPEG quality, so a
seed gives byte-identical files.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

JPEG_QUALITY = 90
# Images drawn per vectorised batch: bounds memory (batch * size^2 * 3 float32) at any size.
_BATCH = 256

# RGB in [0, 1] for colour ids 1-7 (Black, Brown, Golden, Yellow, Cream, Gray, White).
PET_RGB = np.array(
    [
        [0.0, 0.0, 0.0],
        [0.08, 0.08, 0.08],
        [0.40, 0.24, 0.12],
        [0.85, 0.62, 0.22],
        [0.92, 0.82, 0.35],
        [0.95, 0.90, 0.75],
        [0.55, 0.55, 0.58],
        [0.97, 0.97, 0.97],
    ],
    dtype=np.float32,
)


def draw_images(rng: np.random.Generator, score: np.ndarray, color_id: np.ndarray, size: int) -> np.ndarray:
    """uint8 RGB images (n, size, size, 3): one per entry of `score` (hidden image score) and `color_id`."""
    n = len(score)
    out = np.empty((n, size, size, 3), dtype=np.uint8)
    for start in range(0, n, _BATCH):
        stop = min(start + _BATCH, n)
        out[start:stop] = _draw_batch(rng, score[start:stop], color_id[start:stop], size)
    return out


def _draw_batch(rng: np.random.Generator, score: np.ndarray, color_id: np.ndarray, size: int) -> np.ndarray:
    b = len(score)
    s = score.astype(np.float32)[:, None, None]
    coords = (np.arange(size, dtype=np.float32) + 0.5) / size
    yy, xx = np.meshgrid(coords, coords, indexing="ij")  # (size, size), in [0, 1]

    # Lighting: brighter, warmer scenes for a high score (noise keeps the cue partial).
    brightness = 0.5 + 0.13 * s + rng.normal(0, 0.07, (b, 1, 1)).astype(np.float32)
    warmth = 0.09 * s + rng.normal(0, 0.05, (b, 1, 1)).astype(np.float32)
    # A light gradient in a random direction, as from a window.
    angle = rng.uniform(0, 2 * np.pi, (b, 1, 1)).astype(np.float32)
    gradient = 0.12 * ((xx - 0.5) * np.cos(angle) + (yy - 0.5) * np.sin(angle))
    # Texture: fine stripes for a high score, coarse for a low one, at a random orientation and phase.
    cycles = 2.0 + 6.0 / (1.0 + np.exp(-1.5 * s)) + rng.normal(0, 0.6, (b, 1, 1)).astype(np.float32)
    theta = rng.uniform(0, np.pi, (b, 1, 1)).astype(np.float32)
    phase = rng.uniform(0, 2 * np.pi, (b, 1, 1)).astype(np.float32)
    stripes = 0.07 * np.sin(2 * np.pi * cycles * (xx * np.cos(theta) + yy * np.sin(theta)) + phase)
    luminance = np.clip(brightness + gradient + stripes, 0.03, 0.97)
    tint = np.stack([warmth, 0.25 * warmth, -warmth], axis=-1)  # (b, 1, 1, 3): red-yellow vs blue
    img = luminance[..., None] + tint

    # The animal: an ellipse with a head, in its coat colour, at a random place and size.
    cy = rng.uniform(0.35, 0.65, (b, 1, 1)).astype(np.float32)
    cx = rng.uniform(0.3, 0.7, (b, 1, 1)).astype(np.float32)
    ry = rng.uniform(0.12, 0.22, (b, 1, 1)).astype(np.float32)
    rx = ry * rng.uniform(1.1, 1.7, (b, 1, 1)).astype(np.float32)
    body = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 <= 1.0
    side = np.where(rng.random((b, 1, 1)) < 0.5, -1.0, 1.0).astype(np.float32)
    hy, hx, hr = cy - 0.8 * ry, cx + side * 0.9 * rx, 0.6 * ry
    head = ((yy - hy) / hr) ** 2 + ((xx - hx) / hr) ** 2 <= 1.0
    coat = PET_RGB[color_id][:, None, None, :] + rng.normal(0, 0.04, (b, 1, 1, 3)).astype(np.float32)
    # Shade the coat with the scene's light so the animal sits in the same lighting.
    shade = (0.75 + 0.5 * (brightness - 0.5))[..., None]
    img = np.where((body | head)[..., None], coat * shade, img)

    img += 0.035 * rng.standard_normal(img.shape, dtype=np.float32)
    return np.rint(np.clip(img, 0.0, 1.0) * 255.0).astype(np.uint8)


def encode_jpeg(pixels: np.ndarray) -> bytes:
    """JPEG bytes of one uint8 RGB image; fixed quality and no metadata, so the bytes depend on pixels only."""
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=JPEG_QUALITY)
    return buf.getvalue()
