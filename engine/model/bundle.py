"""An index directory carries the model its vectors were embedded with, so it is a search engine on its own.

``build-index`` stores the model in the index directory: ``model.onnx`` (a hard link where possible, else a
copy), its card ``model.json`` and the PDDM unit and explainer the card names, the card last, so a card in
place means its files are too. The manifest's ``model_file`` names it. Querying and serving then need no
model path; one given anyway must be the model the index was built with (same fingerprint). Indexes built
before carry none and are served with the model path given.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from engine.model.model_card import ModelCard
from foundation.atomic import atomic_link_or_copy, atomic_write_bytes
from foundation.errors import InvalidInputError, NotFoundError
from index.gallery import IndexMismatchError, ModelWriter
from index.manifest import Manifest

STORED_MODEL = "model.onnx"


def store_model(directory: Path, model_path: Path) -> str:
    """Store the model at ``model_path`` (with its card and PDDM unit) in the index ``directory``.

    Nothing is written when the directory already holds this model. Returns the stored file's name, for
    the manifest's ``model_file``.
    """
    card = ModelCard.load(model_path)
    target = directory / STORED_MODEL
    stored_card = ModelCard.path_for(target)
    if target.exists() and stored_card.exists() and ModelCard.load(target).fingerprint == card.fingerprint:
        return STORED_MODEL  # already stored (or being served from here)
    if card.reranker is not None:
        if card.reranker.file == STORED_MODEL:
            raise InvalidInputError(
                f"{ModelCard.path_for(model_path)} names its PDDM unit {STORED_MODEL}: re-export it"
            )
        atomic_link_or_copy(card.reranker.path_beside(model_path), card.reranker.path_beside(target))
    if card.explainer is not None:
        atomic_link_or_copy(card.explainer.path_beside(model_path), card.explainer.path_beside(target))
    atomic_link_or_copy(model_path, target)
    atomic_write_bytes(ModelCard.path_for(target), ModelCard.path_for(model_path).read_bytes())
    return STORED_MODEL


def model_writer(model_path: Path) -> ModelWriter:
    """The model at ``model_path``, as a staged write stores it in the new index (``index.staging``)."""
    return functools.partial(store_model, model_path=model_path)


def stored_model(directory: Path, manifest: Manifest) -> Path | None:
    """The model the index directory carries, or None for an index built before indexes stored theirs."""
    if manifest.model_file is None:
        return None
    path = directory / manifest.model_file
    if not path.is_file() or not ModelCard.path_for(path).is_file():
        raise NotFoundError(
            f"{directory} should hold its model {manifest.model_file} and {ModelCard.path_for(path).name}, "
            "but they are missing: copy the whole index directory"
        )
    return path


@dataclass(frozen=True)
class ModelFile:
    """A model located for an index, with its card read once: what loads it (``Embedder(path, card=card)``)
    and what compares it with the model served need not read ``model.json`` again."""

    path: Path
    card: ModelCard


def locate_model(index_dir: Path, model_path: Path | None = None) -> ModelFile:
    """The model to embed queries for ``index_dir`` with: ``model_path`` if given (it must be the model the
    index was built with), else the one the index carries."""
    manifest = Manifest.load(index_dir)
    if model_path is None:
        stored = stored_model(index_dir, manifest)
        if stored is None:
            raise NotFoundError(
                f"{index_dir} carries no model (it was built before indexes stored theirs): give the "
                "model.onnx it was built with, or rebuild it with dmlsearch index rebuild"
            )
        return ModelFile(stored, ModelCard.load(stored))
    if not model_path.is_file():
        raise NotFoundError(f"model file {model_path} does not exist")
    card = ModelCard.load(model_path)
    if card.fingerprint != manifest.model_fingerprint:
        carried = "leave the model path out to use the one it carries, or " if manifest.model_file else ""
        raise IndexMismatchError(
            f"model {model_path} (fingerprint {card.fingerprint[:12]}) is not the model {index_dir} was "
            f"built with ({manifest.model_fingerprint[:12]}): {carried}rebuild the index with this model "
            "(dmlsearch index rebuild)"
        )
    return ModelFile(model_path, card)
