"""Model commands: train an embedding with a metric-learning loss, evaluate it, export it to ONNX."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from cli.common import fail, reports_errors, require_training
from foundation import defaults

if TYPE_CHECKING:
    from training.config import TrainConfig
    from training.recipes import Resolved

commands = typer.Typer()

METRIC_ORDER = ("recall@1", "recall@2", "recall@4", "recall@8", "nmi", "f1", "map@r")


def _metrics_line(metrics: dict[str, float]) -> str:
    return "  ".join(f"{name} {100 * metrics[name]:.2f}" for name in METRIC_ORDER if name in metrics)


@commands.command()
@reports_errors
def export(
    run_dir: Annotated[
        Path | None, typer.Argument(help="Training run to export (default: the pretrained backbone only).")
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            help=f"Where to write model.onnx (default: RUN_DIR/model.onnx, else {defaults.MODEL_PATH})."
        ),
    ] = None,
    backbone: Annotated[str, typer.Option(help="Backbone name (without RUN_DIR).")] = defaults.BACKBONE,
    force: Annotated[
        bool, typer.Option(help="Export a run even if it did not beat the untrained model on validation.")
    ] = False,
    int8: Annotated[
        bool,
        typer.Option("--int8", help="Quantise to int8 (static QDQ), calibrated on --calibration images."),
    ] = False,
    calibration: Annotated[
        Path | None, typer.Option(help="Folder of gallery or training images to calibrate --int8 on.")
    ] = None,
    calibration_count: Annotated[
        int, typer.Option(min=1, help="How many of those images (drawn at random, seeded) calibrate.")
    ] = defaults.CALIBRATION_IMAGES,
) -> None:
    """Export the search model to ONNX: backbone (+ trained head) + L2 normalisation, with its model.json.

    A run is refused (exit 2) unless its selected checkpoint is better than the untrained backbone on the
    validation classes (the 95% interval of the Recall@1 difference above zero) and, trained on judgments
    (--feedback), better than the served model on the judgments held out from it (the 95% interval of the
    ranking precision's difference above zero); --force exports it anyway.
    """
    require_training()
    from engine.model.model_card import ValidationCheck
    from training.backbone import BACKBONES, create_backbone
    from training.comparison import serving_check
    from training.export import export_onnx, export_run
    from training.model import EmbeddingModel

    if int8:
        from training.quantize import calibration_files, quantize_int8

        if calibration is None or not calibration.is_dir():
            raise fail("--int8 needs --calibration DIR, a folder of gallery or training images")
        calibration_set = calibration_files(calibration, calibration_count)  # before the long export

    if run_dir is not None:
        out = out or run_dir / "model.onnx"
        verdict = serving_check(run_dir)
        if not verdict.passed and not force:
            than = (
                "the served model on the judgments held out from it"
                if verdict.on_judgments
                else "the untrained model on both checks of its held-out photos, as a run without labels "
                "must be: it learned nothing usable without labels"
                if verdict.label_free
                else "the untrained model on validation"
            )
            label_free = verdict.label_free and not verdict.on_judgments
            more = "photos" if label_free else "labelled images or judgments"
            raise fail(
                f"{run_dir} is not better than {than} ({verdict.detail}): "
                f"serving it is not shown to improve search. Train with more {more} "
                "or another recipe, or export anyway with --force"
            )
        check = ValidationCheck(passed=verdict.passed, detail=verdict.detail)
        card = export_run(run_dir, out, check=check)
    else:
        out = out or defaults.MODEL_PATH
        spec = BACKBONES[backbone]  # an unknown backbone: the registry's error lists the known ones
        model = EmbeddingModel(create_backbone(backbone))
        card = export_onnx(model, out, preprocessing=spec.preprocessing, backbone=backbone)
    if int8:
        card = quantize_int8(out, calibration_set)
    precision = f", int8 calibrated on {card.calibration_images} images" if card.precision == "int8" else ""
    typer.echo(f"wrote {out} ({card.embedding_dim}-d{precision}, fingerprint {card.fingerprint[:12]})")
    if card.validation_check is not None and not card.validation_check.passed:
        typer.secho(
            "exported with --force: model.json records that this model failed the validation check "
            "(the UI's Model page and GET /v1/model say so)",
            fg=typer.colors.YELLOW,
            err=True,
        )
    if card.reranker is not None:
        reranker = card.reranker
        typer.echo(
            f"wrote {reranker.path_beside(out)} ({reranker.kind} unit for rerank={reranker.kind}, "
            f"fingerprint {reranker.fingerprint[:12]})"
        )


@commands.command()
@reports_errors
def train(
    out: Annotated[Path, typer.Option(help="Run directory (an existing run there is resumed).")],
    loss: Annotated[
        str,
        typer.Option(
            help="Loss name (`dmlsearch losses` lists them), or `auto`: race the strongest recipes on the "
            "validation classes and keep the best; without labels, train the label-free recommended loss; "
            "with --feedback, the loss cross-validated on judgments (bench/results/feedback_losses_cv.md)."
        ),
    ] = "auto",
    data: Annotated[
        Path | None,
        typer.Option(
            help="Image folder (label = sub-folder; photos directly under it are pseudo-labelled) or CSV "
            "path,label[,split]; without it, --feedback's judgments alone."
        ),
    ] = None,
    feedback: Annotated[
        Path | None,
        typer.Option(
            help="Index directory whose judgments (👍/👎 on search results) also train the run, as pairs "
            "(a judgment outweighs a label or pseudo-label); whole queries are held out, and the run is "
            "exported only where it ranks their judgments better than the index's model. Frozen or "
            "finetune (--mode), chosen on a CPU as for a folder."
        ),
    ] = None,
    recipe: Annotated[
        str | None,
        typer.Option(
            help="recommended (default): the settings validated by class-fold cross-validation "
            "(training/recipes.py); paper: the values as printed in the loss's paper."
        ),
    ] = None,
    mode: Annotated[
        Literal["frozen", "partial", "finetune"] | None,
        typer.Option(
            help="frozen: train the head on cached features; partial: also the backbone's last stage, on "
            "cached maps entering it; finetune: the whole network "
            "(default: finetune with a GPU; without one, finetune if enough steps fit --time-budget on "
            "this CPU, measured, else frozen)."
        ),
    ] = None,
    time_budget: Annotated[
        float | None,
        typer.Option(
            min=0.1,
            help="Minutes of training: picks the mode on a CPU (see --mode), sets the fine-tuning steps "
            "and stops the run there with its best validated checkpoint (default: 60 for that choice, "
            "none otherwise).",
        ),
    ] = None,
    hparam: Annotated[
        list[str] | None,
        typer.Option(
            "--hparam",
            "-p",
            help="key=value for the loss or the trainer, over the recipe, e.g. -p lr=1e-4 -p beta=0.",
        ),
    ] = None,
    train_classes: Annotated[
        int | None, typer.Option(min=1, help="Train on the first N classes (default: half; CSV split wins).")
    ] = None,
    cache_dir: Annotated[Path | None, typer.Option(help="Feature cache to share between runs.")] = None,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    race_steps: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="--loss auto: steps each candidate trains before the race is judged (default: printed).",
        ),
    ] = None,
    labels: Annotated[
        Literal["folders", "none"],
        typer.Option(
            help="folders: class folders label their photos, photos directly under --data train on "
            "pseudo-labels; none: ignore class folders, train every photo without labels."
        ),
    ] = "folders",
) -> None:
    """Train an embedding head (and, fine-tuning, the backbone) with a deep-metric-learning loss.

    Classes are split as in the papers: training (and validation) on the first half, test on the rest.
    A folder of photos without class folders (or --labels none) trains without labels: pseudo-labels from
    k-means clusters of the embedding, two augmented views of each photo, byte and edited copies merged;
    checkpoints are chosen, and the run judged, on held-out photos found again from an augmented view.
    With --feedback INDEX_DIR the judgments kept with that index train the run too, as pairs and
    triplets of the pair-based losses, beside --data or alone; some queries' judgments are held out, and
    the summary says how many judgments trained and which held-out ones the run fixed and broke.
    Works under torchrun for multi-process DistributedDataParallel training.
    """
    require_training()
    import torch
    from pydantic import ValidationError

    from foundation.stopping import StopRequested, stop_on_signals
    from training.auto import train_auto
    from training.backbone import BACKBONES
    from training.comparison import serving_check
    from training.label_free_data import is_label_free
    from training.recipes import (
        AUTO_CANDIDATES,
        AUTO_RACE_STEPS,
        DEFAULT_RECIPE,
        FEEDBACK_LOSS,
        LABEL_FREE_AUTO_LOSS,
        parse_assignments,
        parse_recipe_name,
        resolve,
    )
    from training.run_dir import RunDirectory
    from training.trainer import NoGainWarning, mostly_zero_loss
    from training.trainer import train as run_training

    if data is None and feedback is None:
        raise fail(
            "give the images to train on, --data FOLDER, the judgments of --feedback INDEX_DIR, or both"
        )
    if data is not None and not data.exists():
        raise fail(f"data {data} does not exist")
    if feedback is not None:
        if not (feedback / "manifest.json").is_file():
            raise fail(f"--feedback {feedback} is not an index directory (no manifest.json)")
        if mode == "partial":
            raise fail("training on judgments (--feedback) takes --mode frozen or finetune")
        if loss == "auto":  # no race: the judgments' gate, not validation classes, judges these runs
            loss = FEEDBACK_LOSS
            typer.echo(f"--loss auto on judgments trains {loss}, the loss cross-validated on judgments")
    label_free = data is not None and is_label_free(data, labels)
    if label_free:
        typer.echo("training without labels (photos outside class folders, or --labels none)")
        if loss == "auto":
            if race_steps is not None:
                raise fail("--race-steps: a run without labels does not race, drop it or name a --loss")
            loss = LABEL_FREE_AUTO_LOSS
            typer.echo(
                f"--loss auto without labels trains {loss}, the label-free recommended loss (no race: "
                "without labels validation cannot tell which loss groups kinds of photos better)"
            )
    fields: dict[str, Any] = {
        "mode": mode or ("finetune" if torch.cuda.is_available() else "frozen"),
        "train_classes": train_classes,
        "cache_dir": str(cache_dir.resolve()) if cache_dir else None,
        "seed": seed,
        "labels": labels,
    }
    if feedback is not None and data is None:
        # Judgments alone: a head as wide as the backbone's features starts as a rotation of them, so an
        # untrained run ranks as the served model does (the width bench/feedback_loop.py cross-validated
        # FEEDBACK_LOSS at); a narrower head's random projection alone broke held-out judgments.
        fields["embedding_dim"] = BACKBONES[defaults.BACKBONE].feature_dim
    try:
        # SIGTERM/SIGINT: save last.pt after the current step and stop. The trainer's NoGainWarning is
        # said plainly below, from the run's validation gain, not as a Python warning with a source line.
        with stop_on_signals(), warnings.catch_warnings():
            warnings.simplefilter("ignore", NoGainWarning)
            if loss == "auto":
                if recipe not in (None, DEFAULT_RECIPE):
                    raise fail(f"--loss auto races the {DEFAULT_RECIPE} recipes; drop --recipe")
                race_steps = race_steps or AUTO_RACE_STEPS
                overrides = parse_assignments(AUTO_CANDIDATES[0], hparam or [])
                assert data is not None  # --feedback refuses auto, and a run without either is refused
                auto_run = train_auto(  # which says what it races, within each candidate's max_steps
                    str(data.resolve()), out, overrides=overrides, race_steps=race_steps, **fields
                )
                summary, race = auto_run.summary, auto_run.race
                scores = ", ".join(
                    f"{name} {100 * value:.2f}" for name, value in race["val_recall@1"].items()
                )
                typer.echo(f"race (validation recall@1): {scores}; kept {race['winner']}: {race['reason']}")
            else:
                recipe_name = parse_recipe_name(recipe or DEFAULT_RECIPE)
                overrides = parse_assignments(loss, hparam or [])
                if time_budget is not None:
                    fields["time_budget"] = 60 * time_budget
                if mode is None and not torch.cuda.is_available():
                    plan_on = resolve(loss, recipe_name, overrides, "finetune", label_free=label_free)
                    fields.update(_plan_cpu_mode(plan_on, loss, data, feedback, out, fields, time_budget))
                resolved = resolve(loss, recipe_name, overrides, fields.pop("mode"), label_free=label_free)
                config = resolved.config(
                    loss,
                    str(data.resolve()) if data is not None else None,
                    feedback=str(feedback.resolve()) if feedback is not None else None,
                    **fields,
                )
                if mode == "finetune" and not torch.cuda.is_available():
                    _say_estimate(config, out)
                summary = run_training(config, out)
    except ValidationError as err:
        raise fail(f"invalid training setting: {err}") from None
    except StopRequested as stop:
        # A stop during feature extraction comes before any checkpoint: the finished shards are what is kept.
        saved = "checkpoints/last.pt is saved"
        if not (out / "checkpoints" / "last.pt").exists():
            saved = "the backbone features extracted so far are cached"
        typer.echo(f"{stop}: {saved}; run the same command again to continue")
        raise typer.Exit(stop.exit_code) from None
    if summary.failure is not None:  # its step-0 head's metrics would read as a trained model's
        raise fail(f"the run in {out} failed, it learned nothing: {summary.failure}")
    typer.echo(f"best step {summary.best_step} of {summary.steps} ({summary.train_seconds} s training)")
    typer.echo(f"validation  {_metrics_line(summary.val)}")
    typer.echo(f"test        {_metrics_line(summary.test)}")
    typer.echo(f"untrained   {_metrics_line(summary.test_backbone)}")
    run = RunDirectory(out)
    idle = mostly_zero_loss(run.require_config().loss, run.read_metrics())
    if idle is not None:
        typer.echo(f"note: {idle}")
    if summary.label_free is not None:
        record = summary.label_free
        last = record.refreshes[-1] if record.refreshes else None
        clusters = f", {last.clusters} clusters at its last refresh (step {last.step})" if last else ""
        typer.echo(
            f"without labels: {record.loose_photos} photos pseudo-labelled ({record.labelled_photos} "
            f"labelled){clusters}; validation and test score {record.score}"
        )
    if summary.feedback is not None:
        gate = summary.feedback
        typer.echo(f"judgments   {gate.describe()}; {gate.uploads_left_out} of uploaded queries left out")
        for name, judged in (("fixed", gate.fixed), ("broke", gate.broke)):
            if judged:
                shown = ", ".join(
                    f"{'👍' if j.sign > 0 else '👎'} {j.query}->{j.result}" for j in judged[:10]
                )
                more = f" and {len(judged) - 10} more" if len(judged) > 10 else ""
                typer.echo(f"  {name} (held out, query->result): {shown}{more}")
    verdict = serving_check(out)
    if not verdict.passed and verdict.label_free and not verdict.on_judgments:
        typer.echo(
            f"run in {out}: it learned nothing usable without labels: NOT better than the untrained backbone "
            f"on both checks of its held-out photos ({verdict.detail}), so `dmlsearch export` refuses it and "
            "the untrained model stays the one to serve; more photos or another recipe may learn more"
        )
    elif not verdict.passed:
        than = (
            "the served model on the held-out judgments" if verdict.on_judgments else "the untrained backbone"
        )
        typer.echo(
            f"run in {out}: NOT better than {than} ({verdict.detail}), so `dmlsearch export` refuses it; "
            "keep serving the model you have, or train with more images or judgments or another recipe"
        )
    else:
        typer.echo(f"run in {out}; export it with: dmlsearch export {out}")


def _plan_cpu_mode(
    resolved: Resolved,
    loss: str,
    data: Path | None,
    feedback: Path | None,
    out: Path,
    fields: dict[str, Any],
    minutes: float | None,
) -> dict[str, Any]:
    """The mode (and fine-tuning steps) that fit the time budget on this CPU, said with the reason; a run
    already in ``out`` keeps its own mode."""
    from training.budget import plan_for
    from training.recipes import DEFAULT_TIME_BUDGET_MINUTES
    from training.run_dir import RunDirectory

    saved = RunDirectory(out).read_config()
    if saved is not None:
        return {"mode": saved.mode, "time_budget": saved.time_budget, "max_steps": saved.max_steps}
    budget_s = 60 * (minutes or DEFAULT_TIME_BUDGET_MINUTES)
    typer.echo("no --mode and no GPU: measuring a fine-tuning step on this CPU to choose the mode ...")
    folder = str(data.resolve()) if data is not None else None
    judged = str(feedback.resolve()) if feedback is not None else None
    config = resolved.config(loss, folder, feedback=judged, **fields)  # the recipe's mode (finetune) wins
    plan = plan_for(config, budget_s)
    typer.echo(plan.reason)
    if plan.mode == "finetune":
        return {"mode": "finetune", "max_steps": plan.max_steps, "time_budget": budget_s}
    return {"mode": plan.mode}


def _say_estimate(config: TrainConfig, out: Path) -> None:
    """Before a fine-tuning run starts on a CPU: how long it will take, from a step measured here."""
    from training.budget import estimate
    from training.run_dir import RunDirectory

    if RunDirectory(out).read_config() is None:  # a resumed run already said it
        typer.echo("measuring a fine-tuning step on this CPU ...")
        typer.echo(estimate(config))


@commands.command()
def losses() -> None:
    """Every loss: its paper, the batch layout it trains on, and its recommended recipe (`--recipe`)."""
    require_training()
    from training.losses import LOSSES
    from training.recipes import FINETUNE, format_values, recipe

    for name, spec in sorted(LOSSES.items()):
        layout = spec.layout
        typer.secho(name, bold=True)
        typer.echo(f"  paper:  {spec.paper}")
        typer.echo(f"  about:  {spec.summary}")
        typer.echo(
            f"  batch:  {layout.classes} x {layout.samples_per_class} ({layout.kind}): {layout.description}"
        )
        typer.echo(f"  paper values (--recipe paper): {format_values(spec.defaults)}")
        typer.echo("  recommended recipe (default):")
        for key, choice in recipe(name).items():
            typer.echo(f"    {key}={choice.value}: {choice.reason}")
    typer.secho("every loss, fine-tuning (--mode finetune), also:", bold=True)
    for key, choice in FINETUNE.items():
        typer.echo(f"    {key}={choice.value}: {choice.reason}")
