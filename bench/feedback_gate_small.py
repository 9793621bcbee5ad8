"""The judgments gate over a few held-out queries (issue 40): how often each rule calls a model better when
it is not, and when it is.

    python bench/feedback_gate_small.py [--draws 2000] [--seed 0]

A run on about 30 judgments holds out one or two queries (a fifth of the judged queries with a 👍 and a
👎). For each number of held-out queries ``n`` (1-12, 20, 40), ``--draws`` times, it draws the per-query
change of ranking precision (trained minus served) and applies the two rules of
``training.feedback_gate``:

- ``interval``: the paired bootstrap's 95% interval above zero (the gate before this script);
- ``interval + sign-flip``: also the paired randomization test's one-sided p-value under 2.5% (the gate
  now).

Two worlds. **No gain**: each query's change is ``s * u`` with ``s`` a fair random sign and ``u`` uniform in
(0, 1), so a model is as likely to move a query down as up; a rule that calls it better does so falsely, and
at 95% should in at most 2.5% of draws. **A gain**: the same with the sign positive 80% of the time (a model
that helps 4 held-out queries in 5). Writes ``bench/results/feedback_gate_small.md`` and ``.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from lib.options import bench_parser, out_option, seed_option

from training.bootstrap import paired_bootstrap, sign_flip_p_value

RESULTS = Path(__file__).parent / "results"
QUERIES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 20, 40)
WORLDS = {"no gain": 0.5, "a gain": 0.8}  # the chance that a query moves up


def pass_rates(queries: int, up: float, draws: int, rng: np.random.Generator) -> dict[str, float]:
    interval = both = 0
    for draw in range(draws):
        signs = np.where(rng.random(queries) < up, 1.0, -1.0)
        change = signs * rng.random(queries)
        better = paired_bootstrap(change, np.zeros(queries), seed=draw).verdict == "better"
        interval += better
        both += better and sign_flip_p_value(change, np.zeros(queries), seed=draw) < 0.025
    return {"interval": interval / draws, "interval + sign-flip": both / draws}


def markdown(rows: list[dict], command: str) -> str:
    lines = [
        "# The judgments gate over a few held-out queries (issue 40)",
        "",
        f"`{command}`. Share of draws each rule calls better; a query's change of ranking precision is a "
        "random sign times a uniform size, up with the chance of the world (bench/feedback_gate_small.py).",
        "No gain: at 95% a rule should call at most 2.5% better.",
        "",
        "| held-out queries | no gain: interval | no gain: interval + sign-flip | a gain (80% up): interval "
        "| a gain: interval + sign-flip |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        null, gain = row["no gain"], row["a gain"]
        lines.append(
            f"| {row['queries']} | {100 * null['interval']:.1f}% | {100 * null['interval + sign-flip']:.1f}% "
            f"| {100 * gain['interval']:.1f}% | {100 * gain['interval + sign-flip']:.1f}% |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, out_option(RESULTS / "feedback_gate_small.md"), seed_option())
    parser.add_argument("--draws", type=int, default=2000)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    rows = [
        {"queries": n, **{world: pass_rates(n, up, args.draws, rng) for world, up in WORLDS.items()}}
        for n in QUERIES
    ]
    command = "python bench/feedback_gate_small.py " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.write_text(markdown(rows, command.strip()))
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print(markdown(rows, command.strip()), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
