"""Recall@K of a built index by a private class map (the new-user trials of issues 39 and 40).

    python bench/index_recall.py --index artifacts/index --classes classmap.json [--json]

Every photo the map names is searched among the index's other photos by its stored vector (the vector
the served model gave it), and a hit is a photo of its true class: what the index's model gives a user
whose folder has no labels, scored with labels they never gave it. ``bench.lib.class_map`` says what a
class map is.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lib.class_map import class_recall, load_class_map
from lib.options import bench_parser


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--index", type=Path, required=True, help="the index directory scored")
    parser.add_argument("--classes", type=Path, required=True, help="the class map (JSON)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args: argparse.Namespace = parser.parse_args(argv)
    figures = class_recall(args.index, load_class_map(args.classes))
    if args.json:
        print(json.dumps(figures))
    else:
        print(
            f"{args.index}: {int(figures['items'])} items; "
            + ", ".join(f"{name} {100 * value:.2f}" for name, value in figures.items() if name != "items")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
