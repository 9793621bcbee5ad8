"""cli/common.py's ``reports_errors``: an error the user can act on is ``error: message`` with exit 2, a bug
keeps its traceback and exits 1 (in a real process, as a user sees it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# A one-command Typer app whose command raises what argv[1] names.
SCRIPT = textwrap.dedent(
    """
    import sys
    import typer
    from cli.common import reports_errors
    from foundation.errors import NotFoundError
    from index.gallery import IndexMismatchError

    RAISED = {
        "mismatch": IndexMismatchError("built with model abc, not def"),
        "missing": NotFoundError("idx is not an index directory"),
        "denied": PermissionError(13, "Permission denied", "/root/index"),
        "bug": ValueError("a bug, not bad input"),
        "key": KeyError("wrong key"),
    }
    app = typer.Typer(pretty_exceptions_enable=False)

    @app.command()
    @reports_errors
    def run(what: str) -> None:
        raise RAISED[what]

    app()
    """
)


def _run(what: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, what], cwd=REPO, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("mismatch", "error: built with model abc, not def"),
        ("missing", "error: idx is not an index directory"),
        ("denied", "error: [Errno 13] Permission denied: '/root/index'"),
    ],
)
def test_an_error_the_user_can_act_on_is_one_line_and_exit_2(what: str, message: str) -> None:
    done = _run(what)
    assert done.returncode == 2
    assert done.stderr.strip() == message and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("what", "shown"), [("bug", "ValueError: a bug, not bad input"), ("key", "KeyError")]
)
def test_a_bug_keeps_its_traceback_and_exits_1(what: str, shown: str) -> None:
    done = _run(what)
    assert done.returncode == 1
    assert "Traceback (most recent call last)" in done.stderr and shown in done.stderr
    assert "error:" not in done.stderr
