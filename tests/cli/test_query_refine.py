"""``dmlsearch query IMAGE --like ID --unlike ID [--strategy S]``: the search refined by those items, as the
engine refines it; a bad example is a one-line error, exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from engine.serve.query import SearchOptions
from engine.serve.refine import Refinement, Strategy
from engine.serve.search import SearchService

runner = CliRunner()
CAT = "cat/00_crop.jpg"


def query(demo_gallery: Path, demo_index: Path, *extra: str) -> object:
    return runner.invoke(
        app, ["query", str(demo_gallery / CAT), "--index", str(demo_index), "-k", "6", *extra]
    )


@pytest.mark.parametrize("strategy", list(Strategy))
def test_like_and_unlike_refine_the_query(demo_gallery: Path, demo_index: Path, strategy: Strategy) -> None:
    service = SearchService.open(None, demo_index, threads=1)
    items, _ = service.reader.page(0, 1000)
    liked = next(item.id for item in items if item.label == "coffee")
    disliked = next(item.id for item in items if item.label == "cat" and item.path != CAT)
    refine = Refinement((liked,), (disliked,), strategy)
    expected = service.queries.search([(demo_gallery / CAT).read_bytes()], SearchOptions(k=6, refine=refine))
    service.close()
    args = ["--like", str(liked), "--unlike", str(disliked), "--strategy", strategy.value]
    result = query(demo_gallery, demo_index, *args, "--json")
    assert result.exit_code == 0, result.output
    found = json.loads(result.output)["results"]
    assert [r["id"] for r in found] == [r.id for r in expected.queries[0].results]
    assert liked not in [r["id"] for r in found] and disliked not in [r["id"] for r in found]
    plain = json.loads(query(demo_gallery, demo_index, "--json").output)["results"]
    assert [r["id"] for r in found] != [r["id"] for r in plain]
    table = query(demo_gallery, demo_index, *args)
    assert table.exit_code == 0 and len(table.output.splitlines()) == 7  # a heading and six results


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--like", "999999"], "error: no item with id 999999 (named as an example)"),
        (["--like", "3", "--unlike", "3"], "error: item 3 is both a positive and a negative example"),
        (["--like", "3", "--strategy", "sum_scores"], "'sum_scores' is not one of"),
    ],
)
def test_a_bad_example_is_a_clear_error(
    demo_gallery: Path, demo_index: Path, args: list[str], says: str
) -> None:
    result = query(demo_gallery, demo_index, *args)
    assert result.exit_code == 2
    assert says in result.output
