"""Issue 40's new-user trial: judge about 30 results in the UI, train on them, promote, search again.

    # 1. with `dmlsearch serve` (API key set) and `dmlsearch ui` running on an index of a folder whose
    #    true classes are in a private class map (bench.lib.class_map):
    python bench/feedback_trial.py judge --ui http://127.0.0.1:8501 --api http://127.0.0.1:8000 \
        --classes classmap.json --state trial.json [--queries 5] [--per-query 6] [--screenshots DIR]
    # 2. dmlsearch train --feedback INDEX ..., export, index rebuild, POST /v1/admin/reload, then:
    python bench/feedback_trial.py score --api http://127.0.0.1:8000 --state trial.json \
        [--out bench/results/feedback_trial.md]

``judge`` does what a person does in Debian's chromium, driven by Playwright as the browser tests drive it
(tests/app/test_ui.py): for each query it picks "Pick a gallery item", chooses the photo, waits for the
results, and clicks 👍 on each of the top ``--per-query`` results of the query's true class and 👎 on the
others; on the last query it presses "Refine" once. The server keeps each judgment (the UI's API key, from
``DMLSEARCH_API_KEY`` where the UI was started). The queries are drawn (``--seed``) among the photos whose
top ``--per-query`` results, as served, hold both a right and a wrong one: what a person would bother to
judge, and what the gate can rank (a query needs a 👍 and a 👎). Before judging, it records each query's
plain search (``GET /v1/items/{id}/similar``, 10 results) as the served model answers it.

``score`` asks the same searches again of the server as it is now (after the reload) and writes the
table: precision@10 by the true class before and after, per query and on average, with each model's
fingerprint. These are the searches that were judged, so a model trained on their judgments has seen
their photos: the table says what the user sees, not how the model does on photos nobody judged (for
that: ``bench/index_recall.py`` on the index before and after).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

import httpx
from lib.class_map import load_class_map
from lib.options import bench_parser, seed_option

RESULTS = Path(__file__).parent / "results"
CHROMIUM = Path("/usr/bin/chromium")
PAGE = 10  # the results whose precision the table gives
RESULT_CAPTION = re.compile(r" · (\S+)$")  # a result's caption: "label · path"
WAIT_MS = 120_000  # a page step on a loaded machine
# the served model's gate, from GET /v1/model (None: no record, e.g. the pretrained model)
GATE_WORDS = {
    None: ".",
    True: ", which its gate passed.",
    False: ", exported with --force: its gate refused it.",
}


def catalogue(api: str) -> dict[str, int]:
    """Every indexed photo's path -> item id, paged from ``GET /v1/items``."""
    ids: dict[str, int] = {}
    offset = 0
    while True:
        page = httpx.get(f"{api}/v1/items", params={"offset": offset, "limit": 500}, timeout=60).json()
        ids.update({item["path"]: item["id"] for item in page["items"]})
        offset += len(page["items"])
        if not page["items"] or offset >= page["total"]:
            return ids


def similar(api: str, item: int, k: int) -> tuple[list[str], str]:
    """The paths of the plain search by ``item``'s ``k`` results, and the served model's fingerprint."""
    response = httpx.get(f"{api}/v1/items/{item}/similar", params={"k": k}, timeout=120)
    response.raise_for_status()
    body = response.json()
    return [result["path"] for result in body["results"]], body["model_fingerprint"]


def precision(paths: list[str], query: str, classes: dict[str, int]) -> float:
    return sum(classes[path] == classes[query] for path in paths[:PAGE]) / PAGE


def draw_queries(api: str, classes: dict[str, int], count: int, per_query: int, seed: int) -> list[str]:
    """``count`` photos whose top ``per_query`` results hold a right and a wrong one (module docstring)."""
    ids = catalogue(api)
    candidates = sorted(path for path in ids if path in classes)
    random.Random(seed).shuffle(candidates)
    drawn: list[str] = []
    for path in candidates:
        top = similar(api, ids[path], per_query)[0]
        right = sum(classes[result] == classes[path] for result in top)
        if 0 < right < per_query:
            drawn.append(path)
        if len(drawn) == count:
            return drawn
    raise SystemExit(f"only {len(drawn)} photos have a right and a wrong result in their top {per_query}")


def judge_in_browser(args: argparse.Namespace, queries: list[str], classes: dict[str, int]) -> list[dict]:
    """Pick each query in the UI, judge its top results by class, refine the last (module docstring)."""
    from playwright.sync_api import sync_playwright

    judged: list[dict] = []
    shots = args.screenshots
    if shots is not None:
        shots.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            view = browser.new_page(viewport={"width": 1400, "height": 1900})
            view.goto(args.ui)
            view.get_by_text("Pick a gallery item").click(timeout=WAIT_MS)
            for number, query in enumerate(queries, 1):
                chooser = view.get_by_test_id("stSelectbox").filter(has_text="Gallery item")
                chooser.click(timeout=WAIT_MS)
                view.keyboard.type(query)
                view.get_by_role("option", name=re.compile(re.escape(query) + "$")).click(timeout=WAIT_MS)
                view.get_by_text(f"query: item {args.ids[query]}").wait_for(timeout=WAIT_MS)
                view.get_by_text(re.compile(r"^#12 · score")).wait_for(timeout=WAIT_MS)
                captions = view.locator('[data-testid="stCaptionContainer"]').all_inner_texts()
                results = [
                    m.group(1) for c in captions if (m := RESULT_CAPTION.search(c)) and m.group(1) in classes
                ]
                likes = unlikes = 0
                for rank, path in enumerate(results[: args.per_query]):
                    sign = 1 if classes[path] == classes[query] else -1
                    likes, unlikes = likes + (sign > 0), unlikes + (sign < 0)
                    view.get_by_role("button", name="👍" if sign > 0 else "👎", exact=True).nth(rank).click(
                        timeout=WAIT_MS
                    )
                    view.get_by_text(f"Your judgments: 👍 {likes} · 👎 {unlikes}").wait_for(timeout=WAIT_MS)
                    judged.append({"query": query, "result": path, "sign": sign})
                if shots is not None:
                    view.screenshot(path=str(shots / f"query{number}-judged.png"), full_page=True)
                if number == len(queries):
                    view.get_by_role("button", name="Refine", exact=True).click(timeout=WAIT_MS)
                    view.get_by_text(re.compile(r"^Results refined by \d+ judgment\(s\)")).wait_for(
                        timeout=WAIT_MS
                    )
                    if shots is not None:
                        view.screenshot(path=str(shots / f"query{number}-refined.png"), full_page=True)
        finally:
            browser.close()
    return judged


def searches(api: str, ids: dict[str, int], queries: list[str], classes: dict[str, int]) -> dict:
    """Each query's plain search as served now: its results, precision@10, and the model's fingerprint."""
    answers = {query: similar(api, ids[query], PAGE) for query in queries}
    fingerprints = {fingerprint for _, fingerprint in answers.values()}
    if len(fingerprints) != 1:
        raise SystemExit(f"the served model changed during the searches: {sorted(fingerprints)}")
    return {
        "model": fingerprints.pop(),
        "queries": {
            query: {"results": paths, "precision@10": precision(paths, query, classes)}
            for query, (paths, _) in answers.items()
        },
    }


def judge(args: argparse.Namespace) -> None:
    classes = load_class_map(args.classes)
    args.ids = catalogue(args.api)
    queries = draw_queries(args.api, classes, args.queries, args.per_query, args.seed)
    before = searches(args.api, args.ids, queries, classes)
    judged = judge_in_browser(args, queries, classes)
    kept = httpx.get(f"{args.api}/v1/feedback", params={"offset": 0, "limit": 1000}, timeout=60).json()
    state = {
        "classes": str(args.classes),
        "queries": queries,
        "judged": judged,
        "kept_by_server": kept["total"],
        "before": before,
    }
    args.state.write_text(json.dumps(state, indent=1))
    likes = sum(judgment["sign"] > 0 for judgment in judged)
    print(
        f"judged {len(judged)} results of {len(queries)} queries in the UI ({likes} 👍, "
        f"{len(judged) - likes} 👎); the server keeps {kept['total']} judgments; wrote {args.state}"
    )


def table(state: dict, after: dict) -> str:
    before = state["before"]
    lines = [
        "# The feedback trial (issue 40): the same searches before and after training on the judgments",
        "",
        f"{len(state['judged'])} judgments made in the UI (chromium, Playwright) on {len(state['queries'])} "
        f"queries, {sum(j['sign'] > 0 for j in state['judged'])} 👍; the server kept "
        f"{state['kept_by_server']}.",
        f"Served before: model `{before['model'][:12]}`; after: model `{after['model'][:12]}`"
        + GATE_WORDS[after.get("gate")],
        "These searches are the judged ones: the model after has trained on (some of) their judgments.",
        "",
        "| query | precision@10 before | precision@10 after |",
        "|---|---:|---:|",
    ]
    for query in state["queries"]:
        lines.append(
            f"| {query} | {100 * before['queries'][query]['precision@10']:.0f} | "
            f"{100 * after['queries'][query]['precision@10']:.0f} |"
        )
    mean_before = sum(q["precision@10"] for q in before["queries"].values()) / len(state["queries"])
    mean_after = sum(q["precision@10"] for q in after["queries"].values()) / len(state["queries"])
    lines.append(f"| **mean** | **{100 * mean_before:.1f}** | **{100 * mean_after:.1f}** |")
    return "\n".join(lines) + "\n"


def score(args: argparse.Namespace) -> None:
    state = json.loads(args.state.read_text())
    classes = load_class_map(Path(state["classes"]))
    after = searches(args.api, catalogue(args.api), state["queries"], classes)
    check = httpx.get(f"{args.api}/v1/model", timeout=60).json().get("validation_check")
    after["gate"] = None if check is None else check["passed"]  # False: exported with --force
    if after["model"] == state["before"]["model"]:
        print(f"note: the server still serves the model judged with ({after['model'][:12]})")
    text = table(state, after) + (f"\n{args.note}\n" if args.note else "")
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({**state, "after": after}, indent=1))
    print(text, end="")


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    judging = commands.add_parser("judge", parents=[seed_option()], help="judge in the UI (chromium)")
    judging.add_argument("--ui", required=True, help="the Streamlit page's address")
    judging.add_argument("--queries", type=int, default=5)
    judging.add_argument("--per-query", type=int, default=6, help="the top results judged per query")
    judging.add_argument("--screenshots", type=Path, help="a folder for the page's screenshots")
    judging.set_defaults(run=judge)
    scoring = commands.add_parser("score", help="the same searches again, and the table")
    scoring.add_argument("--out", type=Path, default=RESULTS / "feedback_trial.md")
    scoring.add_argument("--note", default="", help="a line under the table: which run the model came from")
    scoring.set_defaults(run=score)
    for command in (judging, scoring):
        command.add_argument("--api", required=True, help="the API's address")
        command.add_argument("--state", type=Path, required=True, help="the trial's record (JSON)")
    judging.add_argument("--classes", type=Path, required=True, help="the class map (bench.lib.class_map)")
    args = parser.parse_args(argv)
    args.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
