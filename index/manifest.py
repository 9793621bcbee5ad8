"""``manifest.json``: what an index directory holds and which model made its vectors."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from index.atomic import atomic_write_text

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"


class Manifest(BaseModel):
    format_version: int = FORMAT_VERSION
    backend: str = "faiss"
    index_type: str = "flat"
    dim: int
    metric: str = "cosine"
    count: int = 0
    model_fingerprint: str
    gallery_root: str | None = None
    achieved_recall: float | None = None
    created: str
    updated: str

    @classmethod
    def load(cls, directory: Path) -> Manifest:
        path = directory / MANIFEST_NAME
        if not path.exists():
            raise FileNotFoundError(f"{directory} is not an index directory (no manifest.json)")
        manifest = cls.model_validate_json(path.read_text())
        if manifest.format_version != FORMAT_VERSION:
            raise ValueError(
                f"index format {manifest.format_version} is not supported (expected {FORMAT_VERSION})"
            )
        return manifest

    def save(self, directory: Path) -> None:
        atomic_write_text(directory / MANIFEST_NAME, self.model_dump_json(indent=2))
