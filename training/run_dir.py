"""A training run directory: ``config.json``, ``metrics.jsonl``, ``checkpoints/{last,best}.pt`` and
``summary.json``, every file written to a temporary name and renamed into place."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from index.atomic import atomic_path, atomic_write_text
from index.errors import InvalidInputError
from training.config import TrainConfig


class RunDirError(InvalidInputError):
    """The directory is not a training run, or holds a run that cannot be continued as asked."""


class RunDirectory:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.config_path = path / "config.json"
        self.metrics_path = path / "metrics.jsonl"
        self.summary_path = path / "summary.json"
        self.checkpoints = path / "checkpoints"

    def checkpoint_path(self, name: str) -> Path:
        return self.checkpoints / f"{name}.pt"

    def read_config(self) -> TrainConfig | None:
        if not self.config_path.exists():
            return None
        try:
            return TrainConfig.model_validate_json(self.config_path.read_text())
        except ValidationError as err:  # not a run's config.json: a damaged file, not a bug
            raise RunDirError(str(err)) from err

    def require_config(self) -> TrainConfig:
        config = self.read_config()
        if config is None:
            raise RunDirError(f"{self.path} is not a training run (no config.json)")
        return config

    def write_config(self, config: TrainConfig) -> None:
        atomic_write_text(self.config_path, config.model_dump_json(indent=2) + "\n")

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]

    def write_metrics(self, records: list[dict[str, Any]]) -> None:
        """Rewrite the whole log (small): an append could leave a torn last line after a crash."""
        atomic_write_text(self.metrics_path, "".join(json.dumps(record) + "\n" for record in records))

    def save_checkpoint(self, name: str, state: dict[str, Any]) -> None:
        with atomic_path(self.checkpoint_path(name)) as temporary:
            torch.save(state, temporary)

    def load_checkpoint(self, name: str) -> dict[str, Any] | None:
        path = self.checkpoint_path(name)
        if not path.exists():
            return None
        return torch.load(path, map_location="cpu", weights_only=True)

    def read_summary(self) -> dict[str, Any] | None:
        return json.loads(self.summary_path.read_text()) if self.summary_path.exists() else None

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write_text(self.summary_path, json.dumps(summary, indent=2) + "\n")
