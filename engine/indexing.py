"""Embed a folder of images into a new index directory."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image
from tqdm import tqdm

from engine.embedder import Embedder
from engine.images import IMAGE_SUFFIXES, ImageDecodeError, decode_image, list_images
from index.gallery import GalleryIndex, replace_directory


@dataclass
class BuildReport:
    indexed: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (relative path, reason)
    duplicates: list[tuple[str, str]] = field(default_factory=list)  # (relative path, path it duplicates)


@dataclass(frozen=True)
class _Decoded:
    relative_path: str
    label: str | None
    content_hash: str
    image: Image.Image


def _decode_gallery(
    root: Path, files: list[Path], report: BuildReport, draft_size: int
) -> Iterator[_Decoded]:
    first_by_hash: dict[str, str] = {}
    for path in files:
        relative = path.relative_to(root).as_posix()
        try:
            data = path.read_bytes()
            content_hash = hashlib.sha256(data).hexdigest()
            if content_hash in first_by_hash:
                report.duplicates.append((relative, first_by_hash[content_hash]))
                continue
            image = decode_image(data, draft_size=draft_size)
        except (ImageDecodeError, OSError) as err:
            report.skipped.append((relative, str(err)))
            continue
        first_by_hash[content_hash] = relative
        label = path.parent.name if path.parent != root else None
        yield _Decoded(relative, label, content_hash, image)


def build_index(
    gallery_root: Path, embedder: Embedder, out_dir: Path, *, batch_size: int = 32, progress: bool = True
) -> BuildReport:
    """Index every image below ``gallery_root`` into ``out_dir`` (written aside, then swapped in).

    Unreadable files are skipped and listed in the report; identical files are indexed once.
    """
    files = list_images(gallery_root)
    if not files:
        raise ValueError(f"no images ({', '.join(sorted(IMAGE_SUFFIXES))}) under {gallery_root}")
    out_dir = out_dir.resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.building.", dir=out_dir.parent))
    report = BuildReport()
    try:
        index = GalleryIndex.create(
            staging, dim=embedder.dim, model_fingerprint=embedder.fingerprint, gallery_root=gallery_root
        )
        batch: list[_Decoded] = []
        bar = tqdm(total=len(files), desc="embedding gallery", unit="img", disable=not progress)

        def flush() -> None:
            vectors = embedder.embed([entry.image for entry in batch])
            index.add(vectors, [(entry.relative_path, entry.label, entry.content_hash) for entry in batch])
            report.indexed += len(batch)
            batch.clear()

        draft_size = embedder.card.preprocessing.resize_size
        for entry in _decode_gallery(gallery_root, files, report, draft_size):
            batch.append(entry)
            if len(batch) == batch_size:
                flush()
                bar.n = report.indexed + len(report.skipped) + len(report.duplicates)
                bar.refresh()
        if batch:
            flush()
        bar.n = len(files)
        bar.close()
        if report.indexed == 0:
            raise ValueError(f"none of the {len(files)} files under {gallery_root} could be decoded")
        index.save()
        index.close()
        replace_directory(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return report
