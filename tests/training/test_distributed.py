"""torchrun + DistributedDataParallel on CPU (gloo): two processes end with identical weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.lib.servers import free_port
from tests.support.train_config import tiny_train_config
from training.run_dir import RunDirectory

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.cluster  # torchrun: a rendezvous and two training processes
def test_two_cpu_processes_end_with_identical_weights(
    labelled_folder: Path, feature_cache: Path, tmp_path: Path
) -> None:
    config = tiny_train_config(
        labelled_folder,
        feature_cache,
        loss="pddm",  # a loss with its own parameters (the PDDM unit): they must stay in sync too
        max_steps=6,
        eval_every=3,
        lr=1e-2,
        classes_per_batch=3,
    )
    config_path = tmp_path / "config.json"
    config_path.write_text(config.model_dump_json())
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--nnodes",
        "1",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(REPO / "tests" / "training" / "ddp_worker.py"),
        str(config_path),
        str(out),
    ]
    environment = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]

    rank0, rank1 = (torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in (0, 1))
    assert rank0.keys() == rank1.keys() and "loss.unit.fc_s.weight" in rank0
    # Each rank draws its own batches (seeded by rank): without DDP's gradient averaging they would differ.
    for key in rank0:
        torch.testing.assert_close(rank0[key], rank1[key], rtol=0, atol=0)
    residual = rank0["head.residual.2.weight"]
    assert residual.abs().sum() > 0, "the zero-initialised residual branch trained"
    run = RunDirectory(out)
    assert run.load_last().progress.step == 6
    assert [record["step"] for record in run.read_metrics()] == [0, 3, 6]
    assert run.read_summary().steps == 6
