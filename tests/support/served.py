"""Writable copies of the demo gallery, its index and its model, and the digest that shows a request changed
none of the index files."""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path

from engine.model.model_card import ModelCard
from index.manifest import Manifest

INDEX_FILES = ("manifest.json", "vectors.faiss", "items.sqlite")


@dataclass(frozen=True)
class Served:
    """A writable copy of the demo gallery, its index and its model (so tests may add, delete and tamper:
    a test that rewrote the session's exported model card changed the model every later test served)."""

    gallery: Path
    index: Path
    model: Path


def copy_served(demo_gallery: Path, demo_index: Path, exported_model: Path, target: Path) -> Served:
    gallery = target / "gallery"
    index = target / "index"
    shutil.copytree(demo_gallery, gallery)
    shutil.copytree(demo_index, index)
    manifest = Manifest.load(index)
    manifest.gallery_root = str(gallery.resolve())
    manifest.save(index)
    model = target / "model" / exported_model.name
    model.parent.mkdir()
    shutil.copy(exported_model, model)
    shutil.copy(ModelCard.path_for(exported_model), ModelCard.path_for(model))
    if (explainer := ModelCard.load(exported_model).explainer) is not None:
        shutil.copy(explainer.path_beside(exported_model), explainer.path_beside(model))
    return Served(gallery, index, model)


def index_digest(index: Path) -> dict[str, str]:
    """Content hashes of the index files, to show that a request changed nothing."""
    return {name: hashlib.sha256((index / name).read_bytes()).hexdigest() for name in INDEX_FILES}
