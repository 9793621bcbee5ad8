"""``model.json``: the self-description written next to every exported ``model.onnx``."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from index.atomic import atomic_write_text


class Preprocessing(BaseModel):
    """How an image becomes the model's input tensor (NCHW float32)."""

    input_size: int = 224
    resize_size: int = 224  # shorter side is resized to this, then centre-cropped to input_size
    interpolation: str = "bicubic"
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)


class ModelCard(BaseModel):
    format_version: int = 1
    embedding_dim: int
    preprocessing: Preprocessing = Field(default_factory=Preprocessing)
    fingerprint: str  # sha256 of the ONNX bytes
    backbone: str
    head: str = "none"
    loss: str | None = None
    run: str | None = None
    created: str
    extra: dict[str, Any] = Field(default_factory=dict)

    @staticmethod
    def path_for(model_path: Path) -> Path:
        return model_path.with_suffix(".json")

    @classmethod
    def load(cls, model_path: Path) -> ModelCard:
        card_path = cls.path_for(model_path)
        if not card_path.exists():
            raise FileNotFoundError(f"{card_path} is missing: every model.onnx needs its model.json")
        return cls.model_validate_json(card_path.read_text())

    def save(self, model_path: Path) -> None:
        atomic_write_text(self.path_for(model_path), self.model_dump_json(indent=2))


def file_fingerprint(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
