"""Proof commands: evaluate a run against the untrained backbone, and write its HTML report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from cli.common import fail, reports_errors, require_training
from cli.model_commands import METRIC_ORDER, _metrics_line

if TYPE_CHECKING:
    from training.comparison import Comparison

commands = typer.Typer()

EvalSplitOption = Annotated[
    Literal["test", "val", "all"], typer.Option(help="Which classes: the unseen test half, val, or all.")
]
DataOption = Annotated[
    Path | None, typer.Option(help="Images to evaluate on (default for a run: its training data).")
]


def _percent(value: float) -> str:
    return f"{100 * value:+.2f}"


def _comparison_text(comparison: Comparison, run: Path | None = None) -> str:
    """The metrics, the interval and the verdict; for a ``run`` that export refuses, that it is not served."""
    interval = comparison.recall_at_1
    names = [name for name in METRIC_ORDER if name in comparison.trained]
    rows = [f"{'':10}" + "".join(f"{name:>10}" for name in names)]
    for label, metrics in (("trained", comparison.trained), ("untrained", comparison.untrained)):
        rows.append(f"{label:10}" + "".join(f"{100 * metrics[name]:10.2f}" for name in names))
    if comparison.knc is not None:
        knc = comparison.knc
        rows.append(
            f"kNC accuracy (Magnet Eq. 6): trained {100 * knc['trained']:.2f}, "
            f"untrained {100 * knc['untrained']:.2f}"
        )
    rows.append(
        f"recall@1 difference {_percent(interval.difference)} points, {100 * interval.level:.0f}% CI "
        f"[{_percent(interval.low)}, {_percent(interval.high)}] (paired bootstrap, {interval.resamples} "
        f"resamples of the queries; {comparison.images} {comparison.split} images)"
    )
    if comparison.learned_nothing is not None:
        rows.append(
            f"verdict: the run learned nothing ({comparison.learned_nothing}); its selected checkpoint is "
            "step 0, the untrained head, so the difference above is that head's, not training's"
        )
    else:
        rows.append(f"verdict: {comparison.verdict} (trained vs the untrained backbone)")
    from training.comparison import serving_check

    served = None if run is None else serving_check(run)
    if served is not None and not served.passed:
        rows.append(f"not served: `dmlsearch export` refuses it ({served.detail})")
    return "\n".join(rows)


@commands.command("eval")
@reports_errors
def evaluate(
    target: Annotated[Path, typer.Argument(help="A training run directory or an exported model.onnx.")],
    data: DataOption = None,
    split: EvalSplitOption = "test",
    train_classes: Annotated[
        int | None, typer.Option(min=1, help="model.onnx: the first N classes count as training classes.")
    ] = None,
    resamples: Annotated[int, typer.Option(min=100, help="Run: paired bootstrap resamples.")] = 2000,
    seed: Annotated[int, typer.Option(help="Run: seed of the bootstrap and the clustering.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Recall@K, NMI, F1 and MAP@R by the papers' protocol (query = each image, gallery = the others).

    A run is compared with the untrained backbone on the same images: both models' metrics, a paired
    bootstrap 95% interval on the Recall@1 difference, a verdict (better / not distinguishable / worse),
    kNC accuracy for Magnet runs; saved as RUN/eval.json.
    """
    require_training()
    from training.comparison import compare_run, save_comparison
    from training.evaluation import evaluate_onnx

    if target.is_dir():
        comparison, _ = compare_run(target, data, split=split, resamples=resamples, seed=seed)
        saved = save_comparison(target, comparison)
        if as_json:
            typer.echo(json.dumps(comparison.to_dict(), indent=2))
        else:
            typer.echo(_comparison_text(comparison, target))
            typer.echo(f"saved {saved}")
        return
    if not (target.is_file() and target.suffix == ".onnx"):
        raise fail(f"{target} is neither a run directory nor a .onnx model")
    if data is None:
        raise fail("--data is required to evaluate a model.onnx")
    metrics = evaluate_onnx(target, data, split=split, train_classes=train_classes)
    typer.echo(json.dumps(metrics, indent=2) if as_json else _metrics_line(metrics))


@commands.command()
@reports_errors
def report(
    run_dir: Annotated[Path, typer.Argument(help="A training run directory.")],
    data: DataOption = None,
    resamples: Annotated[int, typer.Option(min=100, help="Paired bootstrap resamples.")] = 2000,
    seed: Annotated[
        int, typer.Option(help="Seed of the bootstrap, the clustering and the sampled plots.")
    ] = 0,
) -> None:
    """Write RUN/report.html: one self-contained page of plots comparing the run with the untrained backbone.

    Training loss and validation Recall@1 against step, Recall@K curves, per-class Recall@1 change, a
    t-SNE map of the test embeddings, and queries whose top-1 the training fixed or broke. Also refreshes
    RUN/eval.json; the plots are kept as PNGs under RUN/report/ for the API's Model page.
    """
    require_training()
    from training.comparison import compare_run, save_comparison
    from training.report import write_report

    comparison, embedded = compare_run(run_dir, data, resamples=resamples, seed=seed)
    save_comparison(run_dir, comparison)
    written = write_report(run_dir, comparison, embedded, seed=seed)
    typer.echo(_comparison_text(comparison, run_dir))
    typer.echo(f"wrote {written.html_path} ({len(written.plots)} plots; open it in a browser)")
