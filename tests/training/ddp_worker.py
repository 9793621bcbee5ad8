"""One torchrun process of the DDP test: train, then save this rank's final weights as rank{RANK}.pt.

Usage: ``torchrun --nproc_per_node 2 tests/training/ddp_worker.py CONFIG.json RUN_DIR``
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from training import trainer
from training.config import TrainConfig

original_loop = trainer._Training._loop


def loop_then_save(self: trainer._Training, *args: object, **kwargs: object) -> None:
    original_loop(self, *args, **kwargs)
    weights = {key: value.detach().cpu() for key, value in self.objective.state_dict().items()}
    torch.save(weights, self.run_dir.path / f"rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    trainer._Training._loop = loop_then_save  # type: ignore[method-assign]
    config = TrainConfig.model_validate_json(Path(sys.argv[1]).read_text())
    trainer.train(config, Path(sys.argv[2]), progress=False)
