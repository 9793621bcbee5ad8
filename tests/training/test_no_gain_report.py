"""A run that did not beat the untrained backbone is reported once, in plain words: `dmlsearch train` says
so itself (no Python warning with a source path), and `--loss auto` reports no raced candidate as a refused
export, only the run it keeps."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from cli.main import app
from training import auto
from training.run_dir import RunDirectory
from training.trainer import NoGainWarning

runner = CliRunner()
# At lr 1e-12 no step beats step 0, so no run beats the untrained backbone.
NO_GAIN = {"embedding_dim": 16, "head_hidden": 32, "views": 0, "eval_every": 2, "max_steps": 2, "lr": 1e-12}


def _no_gain_warnings(action: Callable[[], Any]) -> list[str]:
    """The NoGainWarning messages raised while ``action`` runs."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
    return [str(w.message) for w in caught if issubclass(w.category, NoGainWarning)]


def test_cli_train_says_so_without_a_python_warning(
    labelled_folder: Path, feature_cache: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    args = ["train", "--loss", "contrastive", "--data", str(labelled_folder), "--out", str(out)]
    args += ["--cache-dir", str(feature_cache), "--mode", "frozen"]  # no fine-tuning step measured
    args += [arg for key, value in NO_GAIN.items() for arg in ("-p", f"{key}={value}")]
    results = []
    assert _no_gain_warnings(lambda: results.append(runner.invoke(app, args))) == []
    assert results[0].exit_code == 0, results[0].output
    assert RunDirectory(out).read_summary().beats_backbone is False
    assert "NOT better than the untrained backbone" in results[0].output


def test_auto_warns_about_the_run_it_keeps_only(
    labelled_folder: Path, feature_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "auto"
    summaries = []

    def race() -> None:
        summaries.append(
            auto.train_auto(
                str(labelled_folder),
                out,
                overrides={**NO_GAIN, "max_steps": 4},  # the winner goes on after the race
                race_steps=2,
                candidates=("contrastive", "ms"),
                cache_dir=str(feature_cache),
            )
        )

    messages = _no_gain_warnings(race)
    winner = summaries[0].race["winner"]
    assert len(messages) == 1 and messages[0].startswith(f"{winner}: the selected model")
    printed = capsys.readouterr().out
    assert "race: ms for 2 steps (views=0, embedding_dim=16, head_hidden=32, eval_every=2, " in printed
    assert "{'name'" not in printed  # settings as key=value, not a Python dict
