"""SIGTERM of a real ``dmlsearch train`` process saves ``last.pt`` after the current step; a rerun resumes.

In finetune mode the signal goes to the run's whole process group, DataLoader workers included, as ``pkill
-f`` or systemd's control group sends it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.lib.cluster import group_alive, group_members
from tests.support.waiting import wait_until
from training import workloads
from training.run_dir import RunDirectory


@pytest.mark.slow  # a real training process, fine-tuning in two cases: 20, 95 and 95 s of CPU
@pytest.mark.parametrize(
    ("mode", "whole_group", "source"),
    [("frozen", False, "folder"), ("finetune", True, "folder"), ("finetune", True, "judgments")],
)
def test_sigterm_of_train_saves_last_pt_and_the_rerun_resumes(
    tmp_path: Path,
    labelled_folder: Path,
    partly_judged_index: Path,
    feature_cache: Path,
    mode: str,
    whole_group: bool,
    source: str,
) -> None:
    """``source``: the labelled folder, or the judgments of an index alone (``--feedback``), which fine-tune
    from the files of the judged photos (without the frozen first stage and in small batches: the stage's
    1000 steps and the step measured before fine-tuning outlast the wait on a loaded machine)."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "cli.main", "train", "--loss", "contrastive"]
    if source == "judgments":
        command += ["--feedback", str(partly_judged_index), "-p", "frozen_first=false", "-p", "train_size=64"]
        command += ["-p", "classes_per_batch=2", "-p", "samples_per_class=2"]
    else:
        command += ["--data", str(labelled_folder)]
    command += ["--out", str(out), "--cache-dir", str(feature_cache), "--mode", mode]
    command += [
        "-p",
        "embedding_dim=16",
        "-p",
        "head_hidden=32",
        "-p",
        "eval_every=1000",
        "-p",
        "patience=1000",
        "-p",
        "workers=1",
    ]
    last = out / "checkpoints" / "last.pt"
    best = out / "checkpoints" / "best.pt"
    process = subprocess.Popen(
        [*command, "-p", "max_steps=1000000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=whole_group,
    )
    # The step-0 validation writes best.pt, then last.pt; the next validation is 1000 steps away.
    wait_until(lambda: last.exists() or process.poll() is not None, 180, "training to start")
    assert best.exists()
    assert RunDirectory(out).load_last().progress.step == 0
    if mode == "finetune":  # signal once the training batches' DataLoader worker runs
        workers = lambda: len(group_members(process.pid)) > 1  # noqa: E731
        wait_until(lambda: workers() or process.poll() is not None, 60, "a DataLoader worker")
    if whole_group:
        os.killpg(process.pid, signal.SIGTERM)
    else:
        process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, output  # before: killed, nothing saved since step 0
    assert "last.pt is saved" in output
    if whole_group:  # the trainer ended its worker before exiting
        wait_until(lambda: not group_alive(process.pid, process), 10, "the DataLoader worker to exit")
    step = RunDirectory(out).load_last().progress.step
    assert 0 < step < 1000

    resumed = subprocess.run(
        [*command, "-p", f"max_steps={step + 3}"], capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr
    assert RunDirectory(out).load_last().progress.step == step + 3
    assert f"resuming from step {step} of {step + 3}" in resumed.stdout
    assert f"of {step + 3}" in resumed.stdout  # "best step B of N": the run went on from the saved step


class _Numbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return index


def test_a_stop_signal_reaching_a_worker_as_it_starts_is_left_to_the_trainer() -> None:
    """Torch's worker handles SIGTERM by dying until its ``worker_init_fn`` ignores it; the workers start
    with it blocked, so a signal in that window waits, then is dropped (the window is widened here)."""

    def slow_start(worker_id: int) -> None:
        time.sleep(1.0)  # torch's own handler is in place: without the block, SIGTERM now kills us
        workloads._obey_the_trainer(worker_id)

    loader = workloads.StopSafeLoader(_Numbers(), batch_size=4, num_workers=1)
    loader.worker_init_fn = slow_start
    batches = iter(loader)
    worker = batches._workers[0].pid  # type: ignore[attr-defined]
    subprocess.run(["kill", "-TERM", str(worker)], check=True)  # from another process, as `pkill` sends it
    assert [batch.tolist() for batch in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]


CRASH_WITH_WORKERS_RUNNING = """
from training import workloads
batches = iter(workloads.StopSafeLoader(list(range(100)), batch_size=4, num_workers=1))
print(next(batches).tolist(), flush=True)
raise RuntimeError("a crash with the batches alive")
"""


def test_a_run_that_crashes_with_its_workers_running_still_exits() -> None:
    """At exit, multiprocessing ends the workers with SIGTERM from this process and waits for them: a
    worker that ignored every SIGTERM hung the exit forever."""
    done = subprocess.run(
        [sys.executable, "-c", CRASH_WITH_WORKERS_RUNNING], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1 and done.stdout.strip() == "[0, 1, 2, 3]", done.stderr
    assert "a crash with the batches alive" in done.stderr
