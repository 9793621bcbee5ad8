"""Resize, centre-crop and normalise images exactly as the exported backbone expects."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import Image

from engine.model.model_card import Preprocessing

_RESAMPLING = {
    "bicubic": Image.Resampling.BICUBIC,
    "bilinear": Image.Resampling.BILINEAR,
    "nearest": Image.Resampling.NEAREST,
}


def resize_and_crop(image: Image.Image, config: Preprocessing) -> Image.Image:
    """Resize the shorter side to ``resize_size`` then take the central ``input_size`` square.

    Only the region the crop keeps is resampled (Pillow's ``box``), straight to ``input_size`` pixels, so
    the memory this takes is bounded by the model input whatever the aspect ratio: resizing a 1x100000
    image in full would build a 224x22,400,000 one (~15 GB) only to keep its centre. The sampling grid is
    the one of resizing in full and then cropping (pixels agree within rounding, at most 2 levels of 255).
    """
    width, height = image.size
    scale = config.resize_size / min(width, height)
    full = (max(config.input_size, round(width * scale)), max(config.input_size, round(height * scale)))
    left = (full[0] - config.input_size) // 2
    top = (full[1] - config.input_size) // 2
    step_x, step_y = width / full[0], height / full[1]  # source pixels per resized pixel
    box = (
        left * step_x,
        top * step_y,
        (left + config.input_size) * step_x,
        (top + config.input_size) * step_y,
    )
    return image.resize((config.input_size, config.input_size), _RESAMPLING[config.interpolation], box=box)


def to_array(image: Image.Image, config: Preprocessing) -> np.ndarray:
    """One RGB image as a normalised float32 CHW array."""
    # In place on the one float copy (HWC, channels last), then transposed: the same operations in the
    # same order as out-of-place arithmetic, so the same bits, without three temporary arrays per image.
    array = np.array(resize_and_crop(image, config), dtype=np.float32)
    array /= 255.0
    array -= np.asarray(config.mean, dtype=np.float32)
    array /= np.asarray(config.std, dtype=np.float32)
    return array.transpose(2, 0, 1)


def to_tensor(images: Sequence[Image.Image], config: Preprocessing) -> np.ndarray:
    """Stack RGB images into a normalised float32 NCHW batch."""
    return np.stack([to_array(image, config) for image in images])
