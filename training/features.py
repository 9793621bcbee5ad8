"""Frozen-backbone features, extracted once through onnxruntime and cached on disk.

The pretrained backbone is exported to ONNX (exactly as ``dmlsearch export`` does) and run with
onnxruntime, which is several times faster on CPU than eager torch. Two stages can be cached:

* ``pooled``: the features the deployed model starts from (L2-normalised, pooled), for frozen mode;
* ``trunk``: the feature maps entering the backbone's last stage (float16, to halve the cache), for
  partial mode, which trains that stage on them.

View 0 is the serving preprocessing; views 1.. are seeded random resized crops with horizontal flips.

The cache is keyed by the backbone's ONNX fingerprint, the view and seed, and every file's content (a
SHA-256 of its bytes, in list order), so a changed image or model never reuses stale features, while the
same images copied or moved elsewhere (new paths, new modification times) reuse them. It is written in
shards, each atomically, so an interrupted extraction resumes where it stopped. Unreadable images (for
example a truncated JPEG) are skipped with a warning and flagged in ``ok``; their rows are zero.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import v2
from tqdm import tqdm

from engine.decode.images import ImageDecodeError, load_image_file
from engine.gallery.hashing import file_hash
from engine.model.embedder import Embedder
from engine.model.model_card import Preprocessing
from engine.model.preprocess import to_tensor
from foundation import defaults, stopping
from foundation.atomic import atomic_path
from foundation.progress import progress_bar
from training.backbone import BACKBONES, create_backbone, split_backbone
from training.config import AUGMENT_MIN_AREA
from training.export import export_onnx
from training.model import EmbeddingModel

Stage = Literal["pooled", "trunk"]
# How an augmented view is made: "crop", the training augmentation (random resized crop and flip); "strong",
# SimCLR's view (Chen et al. 2020: smaller crops, colour jitter, grey), a harder held-out check.
Augmentation = Literal["crop", "strong"]
STRONG_MIN_AREA = 0.2  # SimCLR's crops reach 8% of the image; 20% keeps most of an object in a tight crop
SHARD_SIZE = 512


@dataclass(frozen=True)
class FeatureSet:
    """Features of a list of files (rows in file order); ``ok[i]`` is False where the file was unreadable."""

    features: np.ndarray  # pooled: float32 (n, d); trunk: float16 (n, channels, height, width)
    ok: np.ndarray  # bool (n,)
    skipped: tuple[tuple[str, str], ...]  # (path, reason)


def backbone_model(cache_dir: Path, backbone: str, stage: Stage = "pooled") -> Path:
    """The pretrained ``backbone`` as ONNX under ``cache_dir`` (exported on first use): ``model.onnx``
    (pooled, L2-normalised) or ``trunk.onnx`` (the maps entering the last stage)."""
    path = cache_dir / "backbones" / backbone / ("model.onnx" if stage == "pooled" else "trunk.onnx")
    if not (path.exists() and path.with_suffix(".json").exists()):
        network = create_backbone(backbone)
        export_onnx(
            EmbeddingModel(network) if stage == "pooled" else split_backbone(backbone, network)[0],
            path,
            preprocessing=BACKBONES[backbone].preprocessing,
            backbone=backbone,
        )
    return path


def augment_transform(preprocessing: Preprocessing, min_area: float = AUGMENT_MIN_AREA) -> v2.Compose:
    """The training augmentation: random resized crop (``min_area`` to all of the image) to the resize size
    and a horizontal flip.

    Its output is then centre-cropped by the serving preprocessing (a no-op when both sizes agree).
    """
    return v2.Compose(
        [
            v2.RandomResizedCrop(
                preprocessing.resize_size,
                scale=(min_area, 1.0),
                interpolation=v2.InterpolationMode.BICUBIC,
                antialias=True,
            ),
            v2.RandomHorizontalFlip(),
        ]
    )


def strong_transform(preprocessing: Preprocessing) -> v2.Compose:
    """SimCLR's augmentation (Chen et al. 2020, Appendix A): random resized crop down to
    :data:`STRONG_MIN_AREA`, flip, colour jitter (0.4, 0.4, 0.4, 0.1) 80% of the time, grey 20%."""
    return v2.Compose(
        [
            augment_transform(preprocessing, STRONG_MIN_AREA),
            v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
            v2.RandomGrayscale(p=0.2),
        ]
    )


def view_transform(preprocessing: Preprocessing, augmentation: Augmentation = "crop") -> v2.Compose:
    """The transform that makes an augmented view of kind ``augmentation``."""
    return strong_transform(preprocessing) if augmentation == "strong" else augment_transform(preprocessing)


def view_images(
    images: Sequence[Image.Image],
    indices: Sequence[int],
    view: int,
    seed: int,
    preprocessing: Preprocessing,
    augmentation: Augmentation = "crop",
) -> np.ndarray:
    """The NCHW input batch for one view: the serving preprocessing, augmented for ``view > 0``.

    Each augmented image is seeded by (seed, view, its index in the file list): reproducible, and the
    same for an image whichever batch it lands in.
    """
    if view > 0:
        transform = view_transform(preprocessing, augmentation)
        images = [
            seeded_view(image, index, view, seed, transform)
            for image, index in zip(images, indices, strict=True)
        ]
    return to_tensor(images, preprocessing)


def seeded_view(image: Image.Image, index: int, view: int, seed: int, transform: v2.Compose) -> Image.Image:
    """Augmented ``view`` of the image at ``index`` of a file list: ``transform`` seeded by (seed, view,
    index), so that the same view of the same image is the same picture wherever it is made (the feature
    cache, or a fine-tuning run's held-out check)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(np.random.SeedSequence([seed, view, int(index)]).generate_state(1)[0]))
        return transform(image)


class FeatureExtractor:
    """Extract and cache backbone features (``stage``) of image files."""

    def __init__(
        self,
        cache_dir: Path,
        backbone: str = defaults.BACKBONE,
        *,
        stage: Stage = "pooled",
        batch_size: int = 32,
        progress: bool = True,
    ) -> None:
        self.cache_dir = cache_dir
        self.stage = stage
        self.embedder = Embedder(backbone_model(cache_dir, backbone, stage))
        self.batch_size = batch_size
        self.progress = progress
        size = self.embedder.card.preprocessing.input_size
        probe = self._run(np.zeros((1, 3, size, size), np.float32))  # the stage's row shape and dtype
        self.row_shape, self.dtype = probe.shape[1:], probe.dtype

    def _run(self, batch: np.ndarray) -> np.ndarray:
        if self.stage == "pooled":
            return self.embedder.embed_tensor(batch)
        return self.embedder.run_tensor(batch).astype(np.float16)

    def _empty(self, rows: int) -> np.ndarray:
        return np.zeros((rows, *self.row_shape), self.dtype)

    def extract(
        self, files: Sequence[Path], *, view: int = 0, seed: int = 0, augmentation: Augmentation = "crop"
    ) -> FeatureSet:
        """Features of ``files`` for ``view`` (made by ``augmentation``), from the cache where present."""
        directory = self.cache_dir / "features" / self._key(files, view, seed, augmentation)
        shards = [files[start : start + SHARD_SIZE] for start in range(0, len(files), SHARD_SIZE)]
        missing = [i for i in range(len(shards)) if not _shard_path(directory, i).exists()]
        bar = progress_bar(
            total=sum(len(shards[i]) for i in missing),
            desc=f"backbone features (view {view})",
            unit="img",
            disable=not self.progress or not missing,
        )
        for i in missing:
            target = _shard_path(directory, i)
            self._extract_shard(shards[i], i * SHARD_SIZE, (view, seed, augmentation), target, bar)
            stopping.checkpoint()  # SIGTERM stops after the shard just written: a rerun resumes from the next
        bar.close()
        parts = [np.load(_shard_path(directory, i)) for i in range(len(shards))]
        # Rows, not paths, are cached: the same images elsewhere reuse the cache and are named where they are.
        skipped = tuple(
            (str(files[i * SHARD_SIZE + int(row)]), str(reason))
            for i, part in enumerate(parts)
            for row, reason in zip(part["skipped_rows"], part["skipped_reasons"], strict=True)
        )
        for path, reason in skipped:
            warnings.warn(f"skipped unreadable image {path}: {reason}", stacklevel=2)
        if not parts:
            return FeatureSet(self._empty(0), np.zeros(0, bool), ())
        return FeatureSet(
            np.concatenate([part["features"] for part in parts]),
            np.concatenate([part["ok"] for part in parts]),
            skipped,
        )

    def _extract_shard(
        self, files: Sequence[Path], offset: int, how: tuple[int, int, Augmentation], target: Path, bar: tqdm
    ) -> None:
        """``how``: the view, its seed and its augmentation."""
        features = self._empty(len(files))
        ok = np.zeros(len(files), bool)
        skipped_rows: list[int] = []
        reasons: list[str] = []
        preprocessing = self.embedder.card.preprocessing
        for start in range(0, len(files), self.batch_size):
            images, rows = [], []
            for row in range(start, min(start + self.batch_size, len(files))):
                try:
                    images.append(load_image_file(files[row], draft_size=preprocessing.resize_size))
                    rows.append(row)
                except (ImageDecodeError, OSError) as err:
                    skipped_rows.append(row)
                    reasons.append(str(err))
            if images:
                batch = view_images(images, [offset + row for row in rows], *how[:2], preprocessing, how[2])
                features[rows] = self._run(batch)
                ok[rows] = True
            bar.update(min(self.batch_size, len(files) - start))
        with atomic_path(target) as temporary, temporary.open("wb") as handle:
            np.savez(
                handle,
                features=features,
                ok=ok,
                skipped_rows=np.array(skipped_rows, np.int64),
                skipped_reasons=np.array(reasons, dtype=str),
            )

    def _key(self, files: Sequence[Path], view: int, seed: int, augmentation: Augmentation) -> str:
        digest = hashlib.sha256()
        header: dict[str, object] = {
            "model": self.embedder.fingerprint,
            "view": view,
            "seed": seed if view else None,
        }
        if view and augmentation != "crop":  # the crop views' keys stay what they were: their caches hold
            header["augmentation"] = augmentation
        digest.update(json.dumps(header, sort_keys=True).encode())
        for path in files:
            # Hashing costs far less than decoding and embedding (docs/measurements.md).
            digest.update(f"\n{file_hash(path)}".encode())
        return digest.hexdigest()[:32]


def _shard_path(directory: Path, index: int) -> Path:
    return directory / f"shard-{index:05d}.npz"
