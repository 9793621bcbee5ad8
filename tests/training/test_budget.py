"""The time budget: which mode fits it on a CPU, how many steps, and a run that stops at it."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from foundation import stopping
from tests.support.train_config import tiny_train_config
from training.budget import (
    MIN_FINETUNE_STEPS,
    Load,
    Speed,
    finetune_seconds,
    measure_head_speed,
    plan_mode,
)
from training.run_dir import RunDirectory
from training.trainer import train

IMAGES = {"train": 4000, "val": 1000, "test": 4000}  # about half of Cars196


def speed(img_per_s: float, batch: int = 128, eval_area: float = 1.0) -> Speed:
    return Speed(img_per_s, batch, IMAGES, eval_area)


def test_finetune_is_chosen_when_enough_steps_fit_and_its_steps_follow_the_budget() -> None:
    hour = plan_mode(speed(42.0), budget_s=3600, max_steps=3000)
    two = plan_mode(speed(42.0), budget_s=7200, max_steps=3000)
    assert hour.mode == two.mode == "finetune"
    assert MIN_FINETUNE_STEPS <= hour.max_steps < two.max_steps <= 3000
    assert two.max_steps > 2 * hour.max_steps - 10  # the fixed cost (features, test) is paid once
    assert finetune_seconds(hour.max_steps, img_per_s=42.0, batch=128, images=IMAGES) <= 3600
    assert finetune_seconds(hour.max_steps + 1, img_per_s=42.0, batch=128, images=IMAGES) > 3600
    assert "fit the 60-minute budget" in hour.reason and "42.0 img/s" in hour.reason
    # Smaller training crops (train_size) make steps cheaper but not the evaluation at the input size.
    small_crops = plan_mode(speed(84.0, eval_area=2.0), budget_s=3600, max_steps=3000)
    assert hour.max_steps < small_crops.max_steps < 2 * hour.max_steps
    capped = plan_mode(speed(42.0), budget_s=10**6, max_steps=3000)
    assert capped.max_steps == 3000


def test_frozen_is_chosen_when_fine_tuning_would_not_fit() -> None:
    slow = plan_mode(speed(5.0), budget_s=3600, max_steps=3000)
    assert slow.mode == "frozen" and slow.max_steps == 3000
    assert "over the 60-minute budget" in slow.reason and "--time-budget" in slow.reason
    # A short run (max_steps below the threshold) is fine-tuned when it fits.
    short = plan_mode(speed(5.0, batch=16), budget_s=3600, max_steps=20)
    assert (short.mode, short.max_steps) == ("finetune", 20)


def test_a_run_stops_at_its_time_budget_with_its_best_checkpoint(
    labelled_folder: Path, feature_cache: Path, tmp_path: Path
) -> None:
    config = tiny_train_config(
        labelled_folder, feature_cache, max_steps=500, eval_every=100, time_budget=1e-6
    )
    summary = train(config, tmp_path / "run", progress=False)
    assert summary.steps == 1 and summary.stopped_early
    run = RunDirectory(tmp_path / "run")
    assert [record["step"] for record in run.read_metrics()] == [0, 1]  # validated where it stopped
    assert run.require_best().step == summary.best_step


@pytest.mark.slow  # measures real fine-tuning steps on the CPU, which is what it tests
def test_cli_chooses_the_mode_by_the_measured_speed_and_says_why(
    labelled_folder: Path, feature_cache: Path, tmp_path: Path
) -> None:
    common = ["train", "--loss", "ms", "--data", str(labelled_folder), "--cache-dir", str(feature_cache)]
    tiny = ["-p", "classes_per_batch=2", "-p", "samples_per_class=2", "-p", "eval_every=2"]
    # 150 steps of 4 images in 6 seconds would take over 100 img/s: frozen, and the run stops at 6 s.
    result = CliRunner().invoke(app, [*common, "--out", str(tmp_path / "f"), "--time-budget", "0.1", *tiny])
    assert result.exit_code == 0, result.output
    assert "measuring a fine-tuning step" in result.output
    assert f"frozen: {MIN_FINETUNE_STEPS} fine-tuning steps would take" in result.output
    assert json.loads((tmp_path / "f" / "config.json").read_text())["mode"] == "frozen"
    result = CliRunner().invoke(
        app, [*common, "--out", str(tmp_path / "t"), "--time-budget", "30", *tiny, "-p", "max_steps=2"]
    )
    assert result.exit_code == 0, result.output
    assert "finetune: 2 steps fit the 30-minute budget" in result.output
    saved = json.loads((tmp_path / "t" / "config.json").read_text())
    assert (saved["mode"], saved["max_steps"], saved["time_budget"]) == ("finetune", 2, 1800.0)


@pytest.mark.slow  # measures real fine-tuning steps on the CPU, which is what it tests
def test_cli_says_how_long_an_explicit_fine_tuning_run_will_take(
    labelled_folder: Path, feature_cache: Path, tmp_path: Path
) -> None:
    command = ["train", "--loss", "ms", "--mode", "finetune", "--data", str(labelled_folder)]
    command += ["--cache-dir", str(feature_cache), "--out", str(tmp_path / "run"), "-p", "max_steps=1"]
    command += ["-p", "classes_per_batch=2", "-p", "samples_per_class=2", "-p", "train_size=64"]
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0, result.output
    assert re.search(
        r"estimate: about \d+ minutes for 1 steps \(a fine-tuning step of 4 images measured at "
        r"[\d.]+ img/s on this CPU; a frozen stage of at most \d+ minutes first"
        r"(; the machine looked busy[^)]*)?\)",  # a busy machine is said within
        result.output,
    ), result.output
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train_size"] == 64
    # With a time budget the estimate counts the steps it holds, not the step budget.
    budgeted = [*command[:-2], "-p", "max_steps=100000", "-p", "frozen_first=false", "--time-budget", "0.1"]
    budgeted[budgeted.index(str(tmp_path / "run"))] = str(tmp_path / "budgeted")
    result = CliRunner().invoke(app, budgeted)
    assert result.exit_code == 0, result.output
    held = re.search(
        r"estimate: about \d+ minutes for (\d+) steps \(.*on this CPU(?:; the machine looked busy[^)]*)?\); "
        r"the time budget's 0 "
        r"minutes of steps hold (\d+) of the 100000",
        result.output,
    )
    assert held and held[1] == held[2] and int(held[1]) < 100000, result.output


def test_the_frozen_stage_is_a_fixed_cost_of_the_plan() -> None:
    plain = plan_mode(speed(42.0), budget_s=3600, max_steps=3000)
    staged = Speed(42.0, 128, IMAGES, 1.0, frozen_stage_s=600.0)
    assert staged.seconds(100) == speed(42.0).seconds(100) + 600.0
    with_stage = plan_mode(staged, budget_s=3600, max_steps=3000)
    assert with_stage.mode == "finetune" and with_stage.max_steps < plain.max_steps
    assert "a frozen stage of at most 10 minutes first" in with_stage.reason
    assert speed(42.0).steps_within(60.0) == 19  # 60 s of 128-image steps at 42 img/s


def test_a_speed_is_the_fastest_of_several_steps_so_a_passing_load_does_not_decide(tmp_path: Path) -> None:
    # An injected clock: the warm-up takes 100 s, the first timed step 50 s (other work ran then), the
    # next two 2 and 3 s. The speed is the fastest step's, not the slow one's nor their mean.
    durations = iter([100.0, 50.0, 2.0, 3.0])
    ticks: list[float] = []

    def clock() -> float:
        if len(ticks) % 2 == 0:  # a step starts
            ticks.append(ticks[-1] if ticks else 0.0)
        else:  # and ends
            ticks.append(ticks[-1] + next(durations))
        return ticks[-1]

    config = tiny_train_config(tmp_path, tmp_path / "cache")
    assert measure_head_speed(config, batch=8, steps=3, clock=clock) == 1 / 2.0
    assert len(ticks) == 8  # a warm-up and three timed steps


def test_a_stop_signal_ends_the_speed_measurement_before_its_next_step(tmp_path: Path) -> None:
    """`dmlsearch train` without --mode on a loaded CPU measures fine-tuning steps of a minute or more each:
    SIGTERM then stopped the command only after all of them (seen: still measuring 40 s after it)."""
    steps: list[float] = []

    def clock() -> float:
        steps.append(0.0)
        return 0.0

    config = tiny_train_config(tmp_path, tmp_path / "cache")
    with stopping.stop_on_signals(), pytest.raises(stopping.StopRequested):
        signal.raise_signal(signal.SIGTERM)  # as `kill -TERM` while the speed is measured
        measure_head_speed(config, batch=8, steps=3, clock=clock)
    assert steps == []  # no step started after the signal


def test_the_plan_says_when_the_machine_looked_busy() -> None:
    busy = Speed(5.2, 128, IMAGES, 1.0, load=Load(5.6, 2))
    plan = plan_mode(busy, budget_s=3600, max_steps=3000)
    assert plan.mode == "frozen"
    assert "the machine looked busy, load average 5.6 on 2 cores," in plan.reason
    assert "give --mode" in plan.reason
    quiet = plan_mode(Speed(48.8, 128, IMAGES, 1.0, load=Load(0.9, 2)), budget_s=3600, max_steps=3000)
    assert quiet.mode == "finetune" and "busy" not in quiet.reason
    now = Load.now()  # this machine's own reading
    assert now.average >= 0 and now.cores >= 1
