"""Where a training run keeps its proof: the files ``dmlsearch eval`` and ``dmlsearch report`` write into
the run directory, and what each plot shows. Part of the on-disk format (docs/architecture.md), so it lives
in the engine: the API server reads these files beside a served model's run, and training writes them."""

from __future__ import annotations

from pathlib import Path

EVAL_FILE = "eval.json"
REPORT_FILE = "report.html"
PLOTS_DIR = "report"
# The plots, in page order: file stem -> caption.
PLOTS = {
    "training": "Training loss and validation Recall@1 against step; the star marks the selected checkpoint.",
    "recall_at_k": "Recall@K on the test images, trained vs the untrained backbone.",
    "per_class": "Per-class change of Recall@1 on the test classes (trained minus untrained).",
    "embedding_map": "t-SNE map of the test embeddings, coloured by class: untrained (left), trained "
    "(right).",
    "examples": "Queries whose nearest neighbour the training fixed (top) and broke (bottom).",
}


def plot_path(run_dir: Path, name: str) -> Path:
    return run_dir / PLOTS_DIR / f"{name}.png"
