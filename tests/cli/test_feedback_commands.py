"""``dmlsearch feedback list|export|clear --index DIR`` on an index's judgments."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cli.main import app
from index.gallery import GalleryIndex
from index.judgments import JudgedQuery
from tests.support.vectors import clustered_vectors, entries

runner = CliRunner()
DIM = 8
TIME = "2026-01-02T03:04:05+00:00"


@pytest.fixture
def judged(tmp_path: Path) -> tuple[Path, list[int]]:
    """An index of 10 items with three judgments: two by item, one by an uploaded image."""
    index = GalleryIndex.create(tmp_path / "index", dim=DIM, model_fingerprint="f" * 64, gallery_root=None)
    ids = index.add(clustered_vectors(10, DIM), entries(10))
    index.save()
    upload = JudgedQuery(content_hash="ab" * 32, embedding=np.arange(DIM, dtype=np.float32))
    index.judgments.add(JudgedQuery(item=ids[0]), ids[1], 1, "f" * 64, TIME)
    index.judgments.add(upload, ids[2], -1, "f" * 64, TIME)
    index.judgments.add(JudgedQuery(item=ids[3]), ids[4], -1, "f" * 64, TIME)
    index.close()
    return tmp_path / "index", ids


def _invoke(*args: object) -> tuple[int, str, str]:
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def test_list_pages_through_the_judgments(judged: tuple[Path, list[int]]) -> None:
    index, ids = judged
    code, out, err = _invoke("feedback", "list", "--index", index, "--offset", 1, "--limit", 1)
    assert code == 0, out + err
    (line,) = out.splitlines()
    assert line.split("\t")[:4] == ["2", "upload abababababab", f"result {ids[2]}", "-1"]
    assert "1 of 3 judgments" in err


def test_export_writes_json_lines_or_csv(judged: tuple[Path, list[int]], tmp_path: Path) -> None:
    index, ids = judged
    code, out, err = _invoke("feedback", "export", "--index", index)
    assert code == 0, out + err
    records = [json.loads(line) for line in out.splitlines()]
    assert [(r["id"], r["query_item"], r["result"], r["sign"]) for r in records] == [
        (1, ids[0], ids[1], 1),
        (2, None, ids[2], -1),
        (3, ids[3], ids[4], -1),
    ]
    assert records[1]["query_hash"] == "ab" * 32 and records[1]["query_embedding"] == list(range(DIM))
    assert records[0]["query_embedding"] is None and records[0]["model_fingerprint"] == "f" * 64

    target = tmp_path / "judgments.csv"
    code, out, err = _invoke("feedback", "export", "--index", index, "--format", "csv", "--out", target)
    assert code == 0 and "wrote 3 judgments" in err
    rows = list(csv.DictReader(target.open()))
    assert [(row["id"], row["query_item"], row["sign"]) for row in rows] == [
        ("1", str(ids[0]), "1"),
        ("2", "", "-1"),
        ("3", str(ids[3]), "-1"),
    ]
    assert json.loads(rows[1]["query_embedding"]) == list(range(DIM)) and rows[0]["query_embedding"] == ""
    code, _, err = _invoke("feedback", "export", "--index", index, "--format", "xml")
    assert code == 2


def test_clear_needs_yes(judged: tuple[Path, list[int]]) -> None:
    index, _ = judged
    code, out, err = _invoke("feedback", "clear", "--index", index)
    assert code == 2 and "give --yes" in err and "3 judgments" in err
    assert _invoke("feedback", "export", "--index", index)[1].count("\n") == 3  # nothing deleted
    code, out, err = _invoke("feedback", "clear", "--index", index, "--yes")
    assert code == 0 and f"deleted 3 judgments from {index}" in out
    assert _invoke("feedback", "export", "--index", index)[1] == ""
    code, out, err = _invoke("feedback", "list", "--index", index.parent / "nowhere")
    assert code == 2 and err.startswith("error: ")
