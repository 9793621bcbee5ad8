"""Resize, centre-crop and normalise images exactly as the exported backbone expects."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import Image

from engine.model_card import Preprocessing

_RESAMPLING = {
    "bicubic": Image.Resampling.BICUBIC,
    "bilinear": Image.Resampling.BILINEAR,
    "nearest": Image.Resampling.NEAREST,
}


def resize_and_crop(image: Image.Image, config: Preprocessing) -> Image.Image:
    """Resize the shorter side to ``resize_size`` then take the central ``input_size`` square."""
    width, height = image.size
    scale = config.resize_size / min(width, height)
    new_size = (max(config.input_size, round(width * scale)), max(config.input_size, round(height * scale)))
    image = image.resize(new_size, _RESAMPLING[config.interpolation])
    left = (new_size[0] - config.input_size) // 2
    top = (new_size[1] - config.input_size) // 2
    return image.crop((left, top, left + config.input_size, top + config.input_size))


def to_array(image: Image.Image, config: Preprocessing) -> np.ndarray:
    """One RGB image as a normalised float32 CHW array."""
    mean = np.asarray(config.mean, dtype=np.float32).reshape(3, 1, 1)
    std = np.asarray(config.std, dtype=np.float32).reshape(3, 1, 1)
    array = np.asarray(resize_and_crop(image, config), dtype=np.float32)
    return (array.transpose(2, 0, 1) / 255.0 - mean) / std


def to_tensor(images: Sequence[Image.Image], config: Preprocessing) -> np.ndarray:
    """Stack RGB images into a normalised float32 NCHW batch."""
    return np.stack([to_array(image, config) for image in images])
