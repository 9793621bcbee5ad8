"""Synthetic images and a small model: inputs the benches and the tests make on the spot."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps


def make_image(seed: int, size: tuple[int, int] = (96, 80), mode: str = "RGB") -> Image.Image:
    """A deterministic synthetic photo-like image: smooth colour gradients plus seeded blobs."""
    rng = np.random.default_rng(seed)
    width, height = size
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    channels = []
    for _ in range(3):
        a, b, c = rng.uniform(-3, 3, size=3)
        channels.append(np.sin(a * x * 6 + b * y * 6 + c))
    array = (np.stack(channels, axis=-1) * 0.5 + 0.5) * 255
    return Image.fromarray(array.astype(np.uint8), "RGB").convert(mode)


def image_bytes(image: Image.Image, fmt: str = "PNG", **save_args: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save_args)
    return buffer.getvalue()


def write_labelled_folder(root: Path, classes: int = 12, per_class: int = 5, size: int = 64) -> Path:
    """``root/class_XX/img_Y.png``: each class is one generated picture; its images are crops/tints of it."""
    for label in range(classes):
        base = make_image(1000 + label, (size + 16, size + 16))
        folder = root / f"class_{label:02d}"
        folder.mkdir(parents=True)
        rng = np.random.default_rng(label)
        for i in range(per_class):
            left, top = rng.integers(0, 16, size=2)
            image = base.crop((left, top, left + size, top + size))
            if i % 2:
                image = ImageOps.mirror(image)
            tint = Image.new("RGB", image.size, tuple(int(v) for v in rng.integers(0, 255, size=3)))
            Image.blend(image, tint, 0.15).save(folder / f"img_{i}.png")
    return root


def export_small_model(path: Path, *, seed: int, dim: int = 24, reranker: object = None) -> Path:
    """A small seeded CNN embedder exported like any model (model.onnx + model.json): a "new model" for
    rebuild and reload tests that embeds fast and differs from the pretrained one (fingerprint, dimension)."""
    import torch
    from torch import nn

    from engine.model.model_card import Preprocessing
    from training.export import export_onnx
    from training.model import EmbeddingModel

    torch.manual_seed(seed)
    network = nn.Sequential(
        nn.Conv2d(3, 8, kernel_size=4, stride=4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(32, dim),
    )
    export_onnx(
        EmbeddingModel(network),
        path,
        preprocessing=Preprocessing(input_size=32, resize_size=32),
        backbone=f"small-cnn-seed{seed}",
        reranker=reranker,
    )
    return path
