"""A run that learns nothing (its loss stuck at 0, constant or not finite) fails and says why, and the
report does not present it as training (issue 44)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from cli.main import app
from training.run_dir import RunDirectory
from training.trainer import STUCK_WINDOW, LossWatch, mostly_zero_loss


def test_a_run_whose_loss_is_0_at_every_step_fails_and_the_report_says_it_learned_nothing(
    labelled_folder: Path, feature_cache: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    # Margins no pair can violate (unit embeddings are at most 2 apart): the loss is 0 at every step.
    command = ["train", "--loss", "contrastive", "--mode", "frozen", "--data", str(labelled_folder)]
    command += ["--cache-dir", str(feature_cache), "--out", str(run), "-p", "pos_margin=3"]
    command += ["-p", "neg_margin=-1", "-p", "max_steps=500", "-p", "eval_every=20", "-p", "patience=100"]
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 2, result.output
    assert f"the contrastive loss was 0 at {STUCK_WINDOW} of the last {STUCK_WINDOW} steps" in result.output
    assert "nothing was learned" in result.output and "best step" not in result.output
    summary = RunDirectory(run).read_summary()
    assert summary is not None
    assert summary.steps == STUCK_WINDOW and summary.best_step == 0 and summary.stopped_early
    assert summary.failure is not None and "was 0 at" in summary.failure

    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert "verdict: the run learned nothing (the contrastive loss was 0 at" in result.output
    page = (run / "report.html").read_text()
    assert "learned nothing" in page and "the training fixed" not in page
    assert sorted(path.name for path in (run / "report").iterdir()) == ["training.png"]


def test_the_loss_watch_tells_zero_constant_and_diverged_losses_from_a_moving_one() -> None:
    def reason(values: list[float], final: bool = False) -> str | None:
        watch = LossWatch("magnet", "why")
        for value in values:
            watch.add(value)
        return watch.stuck(final=final)

    last = f"{STUCK_WINDOW} of the last {STUCK_WINDOW} steps"
    assert reason([0.0] * STUCK_WINDOW) == f"the magnet loss was 0 at {last}, so nothing was learned: why"
    assert reason([0.3] + [0.0] * (STUCK_WINDOW - 1)) is not None  # a first batch may still move
    assert "stayed at 0.25" in (reason([0.25] * STUCK_WINDOW) or "")
    assert "not finite" in (reason([float("nan")] * STUCK_WINDOW) or "")
    assert reason([0.0, 0.2] * (STUCK_WINDOW // 2)) is None  # sparse, but it learns
    assert reason([0.0] * (STUCK_WINDOW - 1)) is None  # not yet a window
    assert reason([0.137] + [0.0] * 7, final=True) is not None  # issue 44's run: 8 steps, then stopped


def test_a_loss_at_0_through_most_steps_is_counted_from_the_metrics_log() -> None:
    records = [{"step": 0, "train_loss": None}, {"step": 10, "train_loss": 0.0}]
    records += [{"step": 12, "train_loss": 0.4}, {"step": 20, "train_loss": 0.0}]
    said = mostly_zero_loss("magnet", records)
    assert said is not None and said.startswith("the magnet loss was 0 through 18 of its 20 steps")
    assert "no close impostor clusters" in said  # Magnet's own reason
    assert mostly_zero_loss("magnet", [*records[:3], {"step": 40, "train_loss": 0.1}]) is None  # 10 of 40


def test_a_run_whose_loss_was_0_through_most_steps_says_so_and_its_report_says_it_is_not_served(
    labelled_folder: Path, feature_cache: Path, tmp_path: Path
) -> None:
    """Issue 44's Magnet run on a small folder: loss 0 at 89 of 111 steps, not stuck by the watch's rule,
    refused by export; its report showed the test gain and the queries "training fixed", and said neither."""
    run = tmp_path / "run"
    command = ["train", "--loss", "contrastive", "--mode", "frozen", "--data", str(labelled_folder)]
    command += ["--cache-dir", str(feature_cache), "--out", str(run), "-p", "lr=1e-12"]  # no gain
    command += ["-p", "max_steps=6", "-p", "eval_every=2", "-p", "embedding_dim=16", "-p", "head_hidden=32"]
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0, result.output
    assert "NOT better than the untrained backbone" in result.output
    directory = RunDirectory(run)
    records = directory.read_metrics()
    assert [record["step"] for record in records] == [0, 2, 4, 6] and records[1]["train_loss"] > 0
    # As the metrics log of a run whose loss was 0 after its first steps.
    directory.write_metrics([records[0], records[1], *({**r, "train_loss": 0.0} for r in records[2:])])

    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    page = (run / "report.html").read_text()
    assert "<dt>served</dt><dd>no: `dmlsearch export` refuses it (validation recall@1" in page
    assert "<dt>training loss</dt><dd>the contrastive loss was 0 through 4 of its 6 steps" in page
