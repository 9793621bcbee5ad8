"""The options most bench scripts take, as argparse parents: ``--out``, ``--data``, ``--model``,
``--threads`` and ``--seed``, each with the script's own default."""

from __future__ import annotations

import argparse
from pathlib import Path


def bench_parser(description: str | None, *parents: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A script's parser: its docstring as the description (kept as written), then the shared ``parents``."""
    return argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter, parents=list(parents)
    )


def _parent() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(add_help=False)


def out_option(default: Path | None = None, help: str | None = None) -> argparse.ArgumentParser:
    """``--out PATH``: where the script writes its results (``default``: under bench/results)."""
    parent = _parent()
    parent.add_argument("--out", type=Path, default=default, help=help)
    return parent


def data_option(help: str | None = None, required: bool = True) -> argparse.ArgumentParser:
    """``--data FOLDER``: the images measured on (Cars196 in the committed results)."""
    parent = _parent()
    parent.add_argument("--data", type=Path, required=required, help=help)
    return parent


def model_option(
    help: str | None = None, required: bool = False, default: Path | None = None
) -> argparse.ArgumentParser:
    """``--model model.onnx``: the exported model measured (by default the pretrained backbone, exported)."""
    if help is None and not required and default is None:
        help = "model.onnx (default: the pretrained backbone)"
    parent = _parent()
    parent.add_argument("--model", type=Path, required=required, default=default, help=help)
    return parent


def threads_option(default: int, help: str | None = None) -> argparse.ArgumentParser:
    """``--threads N``: the threads the measured computation may use."""
    parent = _parent()
    parent.add_argument("--threads", type=int, default=default, help=help)
    return parent


def seed_option(default: int = 0, help: str | None = None) -> argparse.ArgumentParser:
    """``--seed N``: the seed of the script's sampling (the same seed gives the same sample)."""
    parent = _parent()
    parent.add_argument("--seed", type=int, default=default, help=help)
    return parent
