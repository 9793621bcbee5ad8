"""Is the untrained (step-0) head as good a retrieval model as the raw backbone, on small folders too?

    OMP_NUM_THREADS=1 python bench/head_init.py --data CARS196/images [--cache-dir ~/.cache/dmlsearch] \\
        [--seeds 5] [--report-only]

Users train on their own, often small, labelled folders. The trainer keeps step 0 when no step beats it
on validation, so step 0 must not be worse than the backbone it starts from. Folders are cut from the 98
Cars196 *training* classes (the test classes are never touched): ``classes x images`` drawn at random per
seed, split as ``dmlsearch train`` splits a folder (first half of the classes for training, their last
20% held out for validation, the second half for test). Each init is fitted on the training images'
cached pooled features and judged by Recall@1 on the test classes, against (a) the raw backbone features
(cosine). Inits:

* ``before``: the previous ``ResidualHead.init_from_pca`` (centred PCA, at most n-1 components, the other
  rows 1e-2-scaled random directions), reproduced here as the reference;
* ``head (now)``: ``ResidualHead.init_from_pca`` as it is now (PCA rows completed orthonormally, the
  completion energy-scaled, not centred when the samples are fewer than the output dimensions);
* alternatives: the completion at unit scale, centred or not, and a plain random orthonormal projection
  (Johnson-Lindenstrauss, no PCA).

Writes ``bench/results/head_init.{md,json}``.
"""

from __future__ import annotations

import json
import shlex
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from lib.options import bench_parser, data_option
from sklearn.decomposition import PCA

from foundation.atomic import atomic_write_text
from foundation.defaults import CACHE_DIR
from training.config import TrainConfig
from training.data import load_labelled_images, split_classes
from training.features import FeatureExtractor
from training.heads import ResidualHead, orthonormal_completion
from training.metrics import retrieval_metrics

RESULTS = Path(__file__).parent / "results"
OUT_DIM = TrainConfig.model_fields["embedding_dim"].default
VAL_FRACTION = TrainConfig.model_fields["val_fraction"].default
# (classes, images per class); None = every image of the class.
FOLDERS = ((16, 6), (30, 8), (98, 12), (98, None))
HELD_OUT = 2000  # images sampled from the classes an init did not see

Init = Callable[[np.ndarray, np.ndarray, int], np.ndarray]  # (train, vectors, seed) -> embeddings


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def before(train: np.ndarray, vectors: np.ndarray, seed: int) -> np.ndarray:
    """The previous init: centred PCA, at most n-1 components, the rest 1e-2-scaled random rows."""
    x = unit(train)
    components = min(OUT_DIM, len(x) - 1)
    pca = PCA(n_components=components, random_state=seed).fit(x)
    rest = torch.randn(OUT_DIM - components, x.shape[1], generator=torch.Generator().manual_seed(seed))
    weight = np.concatenate([pca.components_, 1e-2 * unit(rest.numpy())])
    return (unit(vectors) - pca.mean_) @ weight.T


def head(train: np.ndarray, vectors: np.ndarray, seed: int) -> np.ndarray:
    module = ResidualHead(train.shape[1], OUT_DIM)
    module.init_from_pca(train, seed=seed)
    with torch.no_grad():
        return module(torch.as_tensor(vectors)).numpy()


def completed(basis: np.ndarray, seed: int) -> np.ndarray:
    """``basis`` completed with random orthonormal unit rows to OUT_DIM rows (no energy scaling)."""
    return np.concatenate([basis, orthonormal_completion(basis, OUT_DIM, seed)])


def pca_basis(train: np.ndarray, seed: int) -> np.ndarray:
    return PCA(n_components=min(OUT_DIM, len(train) - 1), random_state=seed).fit(unit(train)).components_


def uncentred(train: np.ndarray, vectors: np.ndarray, seed: int) -> np.ndarray:
    return unit(vectors) @ completed(pca_basis(train, seed), seed).T


def centred(train: np.ndarray, vectors: np.ndarray, seed: int) -> np.ndarray:
    pca = PCA(n_components=min(OUT_DIM, len(train) - 1), random_state=seed).fit(unit(train))
    return (unit(vectors) - pca.mean_) @ completed(pca.components_, seed).T


def random_orthonormal(train: np.ndarray, vectors: np.ndarray, seed: int) -> np.ndarray:
    return unit(vectors) @ completed(np.zeros((0, train.shape[1]), train.dtype), seed).T


INITS: dict[str, Init] = {
    "raw backbone": lambda train, vectors, seed: vectors,
    "before": before,
    "head (now)": head,
    "PCA completed, uncentred": uncentred,
    "PCA completed, centred": centred,
    "random orthonormal": random_orthonormal,
}


def folder(labels: np.ndarray, pool_classes: np.ndarray, classes: int, images: int | None, seed: int):
    """(train, test) indices of one folder: random classes and images, split like ``dmlsearch train``."""
    rng = np.random.default_rng([seed, classes])
    chosen = np.sort(rng.choice(pool_classes, classes, replace=False))
    members = []
    for label in chosen:
        rows = np.flatnonzero(labels == label)
        members.append(np.sort(rng.choice(rows, images, replace=False)) if images else rows)
    half = classes // 2
    validation = max(2, round(VAL_FRACTION * half))
    return np.concatenate(members[: half - validation]), np.concatenate(members[half:])


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__, data_option())
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR, help="backbone feature cache")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--report-only", action="store_true", help="rebuild the table from the .json")
    args = parser.parse_args(argv)
    if args.report_only:
        recorded = json.loads((RESULTS / "head_init.json").read_text())
        write(recorded["rows"], recorded["command"])
        return
    images = load_labelled_images(args.data)
    features = FeatureExtractor(args.cache_dir, progress=False).extract(images.files())
    pool = split_classes(images).pool
    pool = pool[features.ok[pool]]
    labels = images.labels
    rows: list[dict] = []
    for classes, per_class in FOLDERS:
        for seed in range(args.seeds):
            train, test = folder(labels[pool], np.unique(labels[pool]), classes, per_class, seed)
            train, test = pool[train], pool[test]
            # Every pool image of a class the init never saw: a far larger, steadier judge than the folder.
            unseen = pool[~np.isin(labels[pool], labels[train])]
            held_out = np.sort(np.random.default_rng(seed).choice(unseen, HELD_OUT, replace=False))
            for name, init in INITS.items():
                recall = {
                    key: 100
                    * retrieval_metrics(
                        init(features.features[train], features.features[split], seed), labels[split], ks=(1,)
                    )["recall@1"]
                    for key, split in (("test", test), ("held_out", held_out))
                }
                rows.append(
                    {
                        "classes": classes,
                        "images": per_class,
                        "seed": seed,
                        "train_images": len(train),
                        "held_out_images": len(held_out),
                        "init": name,
                        **recall,
                    }
                )
            print(
                classes, per_class, seed, {r["init"]: (r["test"], r["held_out"]) for r in rows[-len(INITS) :]}
            )
    write(rows, "OMP_NUM_THREADS=1 python bench/head_init.py " + shlex.join(sys.argv[1:]))


def write(rows: list[dict], command: str) -> None:
    seeds = len({row["seed"] for row in rows})
    lines = [
        "# Step-0 head vs the raw backbone on small folders (Cars196 training classes)",
        "",
        f"`{command}`",
        "",
        f"Recall@1 (%) over {seeds} seeds: on the folder's own test classes (the user's view, noisy: "
        f"a few dozen images) and on {HELD_OUT} images drawn per seed from the Cars196 training classes the "
        "init did not see (held out: a steadier judge). Gap: the init minus the raw backbone on the same "
        "seed, mean and worst; negative means the init loses retrieval quality.",
        "",
        "| folder | train imgs | init | test R@1 mean [min, max] | test gap mean / worst "
        "| held-out R@1 mean | held-out gap mean / worst |",
        "|---|---|---|---|---|---|---|",
    ]
    for classes, per_class in FOLDERS:
        block = [r for r in rows if (r["classes"], r["images"]) == (classes, per_class)]
        raw = {r["seed"]: r for r in block if r["init"] == "raw backbone"}
        size = block[0]["train_images"]
        for name in INITS:
            values = [r for r in block if r["init"] == name]
            cells = []
            for key in ("test", "held_out"):
                recalls = [r[key] for r in values]
                gaps = [r[key] - raw[r["seed"]][key] for r in values]
                spread = f" [{min(recalls):.2f}, {max(recalls):.2f}]" if key == "test" else ""
                cells += [
                    f"{statistics.mean(recalls):.2f}{spread}",
                    f"{statistics.mean(gaps):+.2f} / {min(gaps):+.2f}",
                ]
            lines.append(
                f"| {classes} x {per_class or 'all'} | {size} | {name} | " + " | ".join(cells) + " |"
            )
    RESULTS.mkdir(exist_ok=True)
    atomic_write_text(RESULTS / "head_init.md", "\n".join(lines) + "\n")
    atomic_write_text(
        RESULTS / "head_init.json", json.dumps({"command": command, "rows": rows}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
