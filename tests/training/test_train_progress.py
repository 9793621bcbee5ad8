"""`dmlsearch train` into a pipe (issue 44): plain progress lines, no carriage returns, no blank lines."""

from __future__ import annotations

from pathlib import Path

from tests.cli.test_progress_lines import assert_plain_lines, piped


def test_train_prints_plain_progress_lines_into_a_pipe(
    labelled_folder: Path, feature_cache: Path, tmp_path: Path
) -> None:
    output = piped(
        "train", "--loss", "contrastive", "--mode", "frozen", "--data", labelled_folder,
        "--cache-dir", feature_cache, "--out", tmp_path / "run", "-p", "max_steps=20", "-p", "eval_every=10",
    )  # fmt: skip
    assert_plain_lines(output, "training contrastive")
