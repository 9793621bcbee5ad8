"""Every command's --help reads well in an 80-column terminal: nothing cut, no markup shown or swallowed."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from cli.main import app
from engine.duplicates.groups import DEFAULT_THRESHOLD

WIDTH = 80


def _command_paths() -> list[list[str]]:
    paths = []

    def walk(command: object, path: list[str]) -> None:
        paths.append(path)
        for name, sub in getattr(command, "commands", {}).items():  # a group (Typer's own Click)
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    return paths


def _help(path: list[str]) -> str:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": str(WIDTH)}, terminal_width=WIDTH)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("path", _command_paths(), ids=lambda path: " ".join(path) or "dmlsearch")
def test_help_fits_80_columns_as_plain_text(path: list[str]) -> None:
    text = _help(path)
    too_wide = [line for line in text.splitlines() if len(line) > WIDTH]
    assert not too_wide, too_wide
    assert "…" not in text  # a flag name or help cut short
    assert "``" not in text  # reStructuredText markup shown literally
    assert "╭" not in text  # Rich panels: their columns cut names at 80 columns


def test_defaults_written_in_help_texts_are_shown() -> None:
    assert f"[default: {DEFAULT_THRESHOLD} when" in _help(["duplicates"])
    serve = _help(["serve"])
    assert "DMLSEARCH_INDEX_PATH" in serve
    assert "[default: artifacts/index]" in " ".join(serve.split())  # not "(artifacts/index)"


@pytest.mark.parametrize("path", _command_paths(), ids=lambda path: " ".join(path) or "dmlsearch")
def test_usage_lines_name_arguments_plainly(path: list[str]) -> None:
    usage = _help(path).splitlines()[0]
    assert usage.startswith("Usage: ") and "{" not in usage and "}" not in usage, usage


def test_usage_line_of_a_command_with_arguments() -> None:
    result = CliRunner().invoke(app, ["query"], terminal_width=WIDTH)  # IMAGE missing: the usage line
    assert result.exit_code == 2
    assert result.output.splitlines()[0] == "Usage: root query [OPTIONS] IMAGE"
    assert _help(["index", "add"]).splitlines()[0] == "Usage: root index add [OPTIONS] [INDEX] PATHS..."
