"""Replay stricter label-free gates on bench/label_free_gate.py's cases, without training again (issue 39).

Reads the cases of one or more label_free_gate.json (each check's selected checkpoint, verdict and true
gain per case) and adds the gate of two checks together (bench/lib/label_free_gate.both: the second
selects, and the run is served only where both served that same checkpoint) where the files lack it.
Results: OUT.md and OUT.json, every check's agreement row and every case, as bench/label_free_gate.py
writes them."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from lib.label_free_gate import Verdict, both, markdown, summary_rows, to_dicts
from lib.options import bench_parser, out_option


def main() -> None:
    parser = bench_parser(__doc__, out_option(Path("bench/results/label_free_gate_replay"), "OUT.md/.json"))
    parser.add_argument(
        "--cases",
        type=Path,
        nargs="+",
        default=[Path("bench/results/label_free_gate.json")],
        help="label_free_gate.json files (their cases together)",
    )
    parser.add_argument(
        "--both",
        nargs=2,
        action="append",
        metavar=("FIRST", "SECOND"),
        default=None,
        help="two checks gating together (repeatable; default: crop strong-neighbours)",
    )
    args = parser.parse_args()
    verdicts, commands = [], []
    for path in args.cases:
        recorded = json.loads(path.read_text())
        verdicts += [Verdict(**case) for case in recorded["cases"]]
        commands += recorded.get("commands", [recorded.get("command")])
    for first, second in args.both or [("crop", "strong-neighbours")]:
        if not any(v.check == f"{first}+{second}" for v in verdicts):  # newer files have it already
            verdicts += both(verdicts, first, second)
    command = "python bench/label_free_gate_replay.py " + shlex.join(sys.argv[1:])
    sources = ", ".join(map(str, args.cases))
    notes = f"Replayed from {sources} (their commands: {'; '.join(commands)}); nothing trained."
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(markdown(verdicts, command, notes))
    record = {"command": command, "cases_from": sources, "summary": summary_rows(verdicts)}
    args.out.with_suffix(".json").write_text(
        json.dumps({**record, "cases": to_dicts(verdicts)}, indent=2) + "\n"
    )
    print(markdown(verdicts, command, notes))


if __name__ == "__main__":
    main()
