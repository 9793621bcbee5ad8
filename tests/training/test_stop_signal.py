"""SIGTERM of a real ``dmlsearch train`` process saves ``last.pt`` after the current step; a rerun resumes."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from tests.helpers import wait_until
from training.run_dir import RunDirectory


def test_sigterm_of_train_saves_last_pt_and_the_rerun_resumes(
    tmp_path: Path, labelled_folder: Path, feature_cache: Path
) -> None:
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "cli.main",
        "train",
        "--loss",
        "contrastive",
        "--data",
        str(labelled_folder),
    ]
    command += ["--out", str(out), "--cache-dir", str(feature_cache), "--mode", "frozen"]
    command += [
        "-p",
        "embedding_dim=16",
        "-p",
        "head_hidden=32",
        "-p",
        "eval_every=1000",
        "-p",
        "patience=1000",
    ]
    last = out / "checkpoints" / "last.pt"
    best = out / "checkpoints" / "best.pt"
    process = subprocess.Popen(
        [*command, "-p", "max_steps=1000000"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    # The step-0 validation writes best.pt, then last.pt; the next validation is 1000 steps away.
    wait_until(lambda: last.exists() or process.poll() is not None, 180, "training to start")
    assert best.exists()
    assert RunDirectory(out).load_last().progress.step == 0
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, output  # before: killed, nothing saved since step 0
    assert "last.pt is saved" in output
    step = RunDirectory(out).load_last().progress.step
    assert 0 < step < 1000

    resumed = subprocess.run(
        [*command, "-p", f"max_steps={step + 3}"], capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr
    assert RunDirectory(out).load_last().progress.step == step + 3
    assert f"resuming from step {step} of {step + 3}" in resumed.stdout
    assert f"of {step + 3}" in resumed.stdout  # "best step B of N": the run went on from the saved step
