"""``model.json``: the self-description written next to every exported ``model.onnx``."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from foundation import defaults
from foundation.atomic import atomic_write_text
from foundation.errors import InvalidInputError, NotFoundError
from foundation.regular_files import open_regular, read_regular


class Preprocessing(BaseModel):
    """How an image becomes the model's input tensor (NCHW float32)."""

    input_size: int = 224
    resize_size: int = 224  # shorter side is resized to this, then centre-cropped to input_size
    interpolation: str = "bicubic"
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)


# The graph contract of an exported reranker: its two inputs and its output, by name.
RERANKER_INPUTS = ("queries", "candidates")
RERANKER_OUTPUT = "scores"


class RerankerCard(BaseModel):
    """A scoring unit exported beside the model (``rerank=<kind>`` re-orders search candidates by it).

    The PDDM unit's graph takes ``queries`` (q, d) and their ``candidates`` (q, k, d), both embeddings of
    this model, and returns ``scores`` (q, k): the learned similarity S(query, candidate), higher = more
    similar, not bounded (it is not a cosine).
    """

    kind: Literal["pddm"]
    file: str = Field(pattern=r"^[^/\\]+\.onnx$", description="ONNX file in the model's folder")
    fingerprint: str  # sha256 of that file

    def path_beside(self, model_path: Path) -> Path:
        return model_path.parent / self.file


# The graph contract of an explainable model: model.onnx's second output, the backbone's feature map, is the
# input of the explainer graph, whose outputs split the embedding over the map's positions.
EMBEDDINGS_OUTPUT = "embeddings"
MAPS_OUTPUT = "feature_maps"
EXPLAINER_OUTPUTS = ("contributions", "rest")


class ExplainerCard(BaseModel):
    """The graph that splits the model's embeddings over image positions, exported beside the model.

    ``model.onnx`` then has a second output, ``feature_maps`` (n, c, h, w): the backbone's last feature map,
    whose average the head embeds. The explainer takes it and returns ``contributions`` (n, h, w, d) and
    ``rest`` (n, d), whose sum over positions plus ``rest`` is the embedding (``training.model``'s
    ``PositionContributions``): the cosine with any unit vector splits over positions the same way.
    """

    file: str = Field(pattern=r"^[^/\\]+\.onnx$", description="ONNX file in the model's folder")
    fingerprint: str  # sha256 of that file
    grid: tuple[int, int]  # (h, w): the feature map's positions for the model's input size

    def path_beside(self, model_path: Path) -> Path:
        return model_path.parent / self.file


class ValidationCheck(BaseModel):
    """What ``dmlsearch export`` found when it checked a run against the untrained backbone."""

    passed: bool  # better on the validation classes (the interval above zero); False: exported with --force
    detail: str  # recall@1 of both, the difference and its interval, e.g. "... 65.62 vs 65.62 untrained ..."


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
    reranker: RerankerCard | None = None  # a model trained with the pddm loss carries its PDDM unit
    explainer: ExplainerCard | None = None  # models exported before it existed have none
    precision: Literal["fp32", "int8"] = "fp32"  # int8: static QDQ quantisation (training/quantize.py)
    calibration_images: int | None = None  # how many images calibrated the int8 activation ranges
    validation_check: ValidationCheck | None = None  # models exported from a run (none: the pretrained one)

    @staticmethod
    def path_for(model_path: Path) -> Path:
        return model_path.with_suffix(".json")

    @classmethod
    def load(cls, model_path: Path) -> ModelCard:
        card_path = cls.path_for(model_path)
        if not card_path.exists():
            raise NotFoundError(f"{card_path} is missing: every model.onnx needs its model.json")
        try:
            return cls.model_validate_json(read_regular(card_path, defaults.MODEL_CARD_BYTES))
        except ValidationError as err:  # not the JSON of a model card: a damaged file, not a bug
            raise InvalidInputError(str(err)) from err

    def save(self, model_path: Path) -> None:
        atomic_write_text(self.path_for(model_path), self.model_dump_json(indent=2))


def check_fingerprint(path: Path, expected: str, model_path: Path) -> None:
    """Refuse a file that is not the one the model's card describes (edited, truncated, another export)."""
    actual = file_fingerprint(path)
    if actual != expected:
        raise InvalidInputError(
            f"{path} does not match its {ModelCard.path_for(model_path).name} (fingerprint {actual[:12]} "
            f"vs {expected[:12]}): re-export the model"
        )


def file_fingerprint(path: Path) -> str:
    digest = hashlib.sha256()
    with open_regular(path) as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
