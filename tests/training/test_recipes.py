"""Training recipes: one source of truth shared by `dmlsearch train`, the benches and `--loss auto`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from bench.lib import recipes_cv as cv
from bench.lib import train_all
from cli.main import app
from training import auto
from training.bootstrap import Interval
from training.config import TrainConfig
from training.losses import LOSSES
from training.model import build_objective
from training.recipes import COMMON, FINETUNE, RECIPES, parse_assignments, recipe, resolve
from training.run_dir import RunDirectory, RunSummary

runner = CliRunner()
TINY = ["-p", "embedding_dim=16", "-p", "head_hidden=32", "-p", "views=0"]


def test_every_recipe_names_real_settings_with_reasons() -> None:
    for loss, choices in RECIPES.items():
        assert loss in LOSSES
        resolved = resolve(loss)  # raises on a key that is neither a loss hyperparameter nor a trainer field
        assert resolved.record["values"] == {
            key: choice.value for key, choice in {**COMMON, **choices}.items()
        }
        assert all(choice.reason.strip() for choice in choices.values())


def test_recommended_paper_and_overrides() -> None:
    recommended = resolve("magnet").config("magnet", "data")
    assert recommended.loss_hparams == {"global_scaling": 8.0} and recommended.views == COMMON["views"].value
    assert recommended.recipe["name"] == "recommended"

    paper = resolve("magnet", "paper").config("magnet", "data")
    assert paper.loss_hparams == {} and paper.views == TrainConfig.model_fields["views"].default
    assert LOSSES["magnet"].defaults["global_scaling"] == 1.0  # the printed Eq. 5

    overridden = resolve("magnet", overrides=parse_assignments("magnet", ["global_scaling=2", "max-steps=7"]))
    config = overridden.config("magnet", "data")
    assert config.loss_hparams == {"global_scaling": 2} and config.max_steps == 7
    assert config.views == COMMON["views"].value  # what the overrides do not name stays the recipe's
    assert config.recipe["overrides"] == {"global_scaling": 2, "max_steps": 7}
    assert resolve("pddm", "paper", {"lam": 3.0}).loss_hparams == {"lam": 3.0}
    assert resolve("pddm").settings["min_steps"] == RECIPES["pddm"]["min_steps"].value
    assert resolve("pddm", overrides={"min_steps": 7}).settings["min_steps"] == 7  # -p wins over the recipe
    # PDDM's unit takes the head's width: embedding_dim sets the head, never the unit alone.
    narrow = resolve("pddm", overrides={"embedding_dim": 16, "head_hidden": 32}).config("pddm", "data")
    assert narrow.embedding_dim == 16 and "embedding_dim" not in narrow.loss_hparams
    objective = build_objective(narrow, feature_dim=24)
    assert objective(torch.randn(8, 24), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])).isfinite()

    with pytest.raises(ValueError, match="unknown hyperparameter 'nope'"):
        resolve("ms", overrides={"nope": 1})
    with pytest.raises(ValueError, match="unknown recipe"):
        recipe("ms", "tuned")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown loss"):
        resolve("no-such-loss")


def test_finetune_choices_apply_only_when_the_whole_network_trains() -> None:
    frozen = resolve("angular").config("angular", "data")
    finetune = resolve("angular", mode="finetune").config("angular", "data")
    assert (frozen.mode, frozen.train_size) == ("frozen", None)
    assert (finetune.mode, finetune.train_size) == ("finetune", FINETUNE["train_size"].value)
    assert finetune.embedding_scale == frozen.embedding_scale == RECIPES["angular"]["embedding_scale"].value
    assert all(choice.reason.strip() for choice in FINETUNE.values())
    assert resolve("angular", "paper", mode="finetune").settings == {"mode": "finetune"}
    assert resolve("angular", overrides={"train_size": 224}, mode="finetune").settings["train_size"] == 224
    with pytest.raises(ValueError, match="unknown hyperparameter 'mode'"):
        resolve("ms", overrides={"mode": "finetune"})  # the mode is --mode's, never a recipe's


def test_cli_and_benches_build_the_same_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`dmlsearch train`, bench/train_all.py and bench/recipes_cv.py all read training/recipes.py."""
    seen: list[TrainConfig] = []

    def fake_train(config: TrainConfig, out: Path, **_: Any) -> dict[str, Any]:
        seen.append(config)
        raise SystemExit(0)

    monkeypatch.setattr("training.trainer.train", fake_train)
    data = tmp_path / "images"
    data.mkdir()
    # --mode frozen: without it, a CPU's mode follows a measured step and the time budget.
    command = [
        "train",
        "--loss",
        "almn",
        "--mode",
        "frozen",
        "--data",
        str(data),
        "--out",
        str(tmp_path / "r"),
    ]
    runner.invoke(app, command)

    monkeypatch.setattr(train_all, "train", fake_train)
    args = argparse.Namespace(
        data=data,
        cache_dir=tmp_path,
        runs_dir=tmp_path,
        mode="frozen",
        seed=0,
        recipe="recommended",
        set=[],
        device="cpu",
    )
    args.max_steps = args.patience = args.time_budget = None
    almn = next(method for method in train_all.all_methods() if method.label == "almn")
    with pytest.raises(SystemExit):
        train_all.run_method(almn, args)

    args.folds = 3
    cli, bench = seen
    fold = cv.fold_config(args, "almn", "recommended", 1)
    assert cli.loss_hparams == bench.loss_hparams == fold.loss_hparams == {"beta": 0.5}
    for field in ("embedding_scale", "views", "min_steps", "lr", "max_steps", "recipe"):
        assert getattr(cli, field) == getattr(bench, field) == getattr(fold, field), field
    assert (fold.fold, fold.folds) == (1, 3)
    assert cv.fold_config(args, "almn", "paper", 0).loss_hparams == {}


def test_cli_train_records_the_recipe(labelled_folder: Path, feature_cache: Path, tmp_path: Path) -> None:
    # --mode: without it, a CPU measures a fine-tuning step to choose one (tests/training/test_budget.py).
    common = ["--data", str(labelled_folder), "--cache-dir", str(feature_cache), "--mode", "frozen", *TINY]
    steps = ["-p", "max_steps=2", "-p", "eval_every=2"]
    out = tmp_path / "magnet"
    result = runner.invoke(app, ["train", "--loss", "angular", "--out", str(out), *common, *steps])
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "config.json").read_text())
    assert saved["recipe"]["name"] == "recommended"
    assert saved["embedding_scale"] == RECIPES["angular"]["embedding_scale"].value
    assert saved["views"] == 0 and saved["recipe"]["overrides"]["views"] == 0  # -p is recorded as such

    out = tmp_path / "paper"
    result = runner.invoke(
        app, ["train", "--loss", "angular", "--recipe", "paper", "--out", str(out), *common, *steps]
    )
    assert result.exit_code == 0, result.output
    config = RunDirectory(out).require_config()
    assert config.recipe["name"] == "paper" and config.embedding_scale == 1.0

    result = runner.invoke(
        app, ["train", "--loss", "angular", "--recipe", "tuned", "--out", str(out), *common]
    )
    assert result.exit_code == 2 and "unknown recipe" in result.output


def test_auto_races_candidates_and_records_the_winner(
    labelled_folder: Path, feature_cache: Path, tmp_path: Path
) -> None:
    out = tmp_path / "auto"
    overrides = {"embedding_dim": 16, "head_hidden": 32, "views": 0, "eval_every": 2, "max_steps": 6}
    auto_run = auto.train_auto(
        str(labelled_folder),
        out,
        overrides=overrides,
        race_steps=2,
        candidates=("contrastive", "ms", "angular"),
        progress=False,
        cache_dir=str(feature_cache),
    )
    summary, race = auto_run.summary, auto_run.race
    scores = race["val_recall@1"]
    assert set(scores) == {"contrastive", "ms", "angular"} and race["budget_steps"] == 2
    assert race["winner"] == max(scores, key=scores.__getitem__)
    for loss, score in scores.items():  # each candidate's score is its race run's best validation R@1
        assert RunDirectory(out / "race" / loss).read_summary().val["recall@1"] == score
        assert RunDirectory(out / "race" / loss).read_summary().steps == 2
    config = RunDirectory(out).require_config()
    assert config.loss == race["winner"] and config.recipe["name"] == "auto"
    assert config.recipe["race"] == race and config.max_steps == 6
    assert summary.steps == 6  # the winner went on from its race run to the full budget
    assert [record["step"] for record in RunDirectory(out).read_metrics()] == [0, 2, 4, 6]


def test_a_race_never_runs_past_the_budget_and_says_so(
    labelled_folder: Path, feature_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """-p max_steps below the race's steps: the race is the whole run, and every line says that number."""
    overrides = {"embedding_dim": 16, "head_hidden": 32, "views": 0, "eval_every": 2, "max_steps": 2}
    auto_run = auto.train_auto(
        str(labelled_folder),
        tmp_path / "auto",
        overrides=overrides,
        race_steps=5,
        candidates=("contrastive", "ms"),
        cache_dir=str(feature_cache),
    )
    printed = capsys.readouterr().out
    assert "racing contrastive, ms: 2 steps each" in printed
    assert "race: ms for 2 steps (" in printed and "5 steps" not in printed
    race = auto_run.race
    assert race["budget_steps"] == 2 and "after at most 2 steps each" in race["reason"]
    assert auto_run.summary.steps == 2


def test_auto_reason_says_when_the_winner_only_won_a_tie_or_gained_nothing() -> None:
    assert auto.race_reason({"ms": 0.8, "angular": 0.7}, "ms", 0.6, 5) == (
        "highest validation recall@1 after at most 5 steps each"
    )
    tied = auto.race_reason({"ms": 0.6, "angular": 0.6, "magnet": 0.5}, "ms", 0.6, 5)
    assert "tied with angular, kept as the earlier listed" in tied
    assert "no candidate beat the untrained model (60.00)" in tied


def test_cli_auto_states_its_budget_and_winner(
    labelled_folder: Path, feature_cache: Path, tmp_path: Path
) -> None:
    out = tmp_path / "auto"
    args = ["train", "--loss", "auto", "--data", str(labelled_folder), "--out", str(out)]
    args += ["--cache-dir", str(feature_cache), "--race-steps", "1", "-p", "max_steps=1", *TINY]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    winner = RunDirectory(out).require_config().recipe["race"]["winner"]
    assert "1 steps each" in result.output and f"kept {winner}" in result.output
    result = runner.invoke(app, [*args, "-p", "beta=2"])  # a loss hyperparameter fits only some candidates
    assert result.exit_code == 2 and "unknown hyperparameter 'beta'" in result.output


def test_train_without_loss_races_as_auto(labelled_folder: Path, feature_cache: Path, tmp_path: Path) -> None:
    """`--loss` defaults to auto: a labelled run that names no loss races the candidates."""
    out = tmp_path / "default"
    args = ["train", "--data", str(labelled_folder), "--out", str(out), "--cache-dir", str(feature_cache)]
    result = runner.invoke(app, [*args, "--race-steps", "1", "-p", "max_steps=1", *TINY])
    assert result.exit_code == 0, result.output
    assert RunDirectory(out).require_config().recipe["name"] == "auto" and "kept " in result.output


def test_losses_command_lists_every_loss_with_paper_layout_and_recipe() -> None:
    result = runner.invoke(app, ["losses"])
    assert result.exit_code == 0, result.output
    blocks: dict[str, str] = {}
    for line in result.output.splitlines():
        if not line.startswith(" "):
            name = line.strip()
            blocks[name] = ""
        else:
            blocks[name] += line + "\n"
    finetune = blocks.pop("every loss, fine-tuning (--mode finetune), also:")
    assert all(f"{key}={choice.value}: {choice.reason}" in finetune for key, choice in FINETUNE.items())
    assert set(blocks) == set(LOSSES)
    for name, spec in LOSSES.items():
        text = blocks[name]
        assert f"paper:  {spec.paper}" in text
        assert f"batch:  {spec.layout.classes} x {spec.layout.samples_per_class}" in text
        for key, choice in recipe(name).items():
            assert f"{key}={choice.value}: {choice.reason}" in text
    assert "global_scaling=1.0" in blocks["magnet"] and "global_scaling=8.0: " in blocks["magnet"]


def test_recipes_cv_prefers_the_candidate_that_helps_on_every_fold(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # "peaky" has the higher mean gain but loses on fold 2; "steady" helps on every fold.
    gains = {"paper": [-1.0, -2.0, -0.5], "recommended": [6.0, 5.0, -0.5], "steady": [2.0, 2.0, 1.0]}
    monkeypatch.setattr(cv, "METHODS", ("ms",))
    monkeypatch.setitem(cv.VARIANTS, "ms", {"steady": ("recommended", {"epsilon": 0.2})})
    args = argparse.Namespace(runs_dir=tmp_path, folds=3, set=["views=0"], methods=["ms"])
    for candidate, per_fold in gains.items():
        for fold, gain in enumerate(per_fold):
            run = RunDirectory(cv.run_path(tmp_path, candidate, "ms", fold))
            run.path.mkdir(parents=True)
            run.write_config(TrainConfig(loss="ms", data=str(tmp_path)))
            untrained = 0.5 + fold / 100
            # Validation tells the trained model from the untrained one only where it gained on test.
            low = 0.01 if gain > 0 else -0.01
            run.write_summary(
                RunSummary(
                    loss="ms",
                    mode="frozen",
                    steps=20,
                    stopped_early=False,
                    best_step=10,
                    train_seconds=1.0,
                    val={"recall@1": 0.7},
                    val_backbone={"recall@1": 0.68},
                    beats_backbone=low > 0,
                    validation_gain=Interval(0.02, low, 0.03, 0.95, 2000),
                    test={"recall@1": untrained + gain / 100},
                    test_backbone={"recall@1": untrained},
                    skipped_images=0,
                )
            )
    results = cv.collect(args)["methods"]["ms"]
    assert results["steady"]["preferred"] and results["steady"]["helps_every_fold"]
    assert not results["recommended"]["preferred"] and not results["recommended"]["helps_every_fold"]
    assert results["recommended"]["mean_gain"] == pytest.approx(3.5)
    assert results["recommended"]["range_gain"] == pytest.approx(6.5)  # how far it moved across folds
    assert results["steady"]["settings"] == "views=0, epsilon=0.2"  # --set wins, as in the runs
    # Served: the untrained model wherever validation did not show the trained one better (gain 0 there).
    assert results["recommended"]["served_min_gain"] == 0.0
    assert results["recommended"]["served_mean_gain"] == 3.67  # (6 + 5 + 0) / 3, rounded as the table
    assert results["paper"]["served_mean_gain"] == results["paper"]["served_min_gain"] == 0.0
    table = cv.markdown(cv.merge({}, cv.collect(args), "cmd", "budget"), 3)
    assert "| ms | **steady** | 52.00 (+2.00) | 53.00 (+2.00) | 53.00 (+1.00) | +1.67 |" in table
    assert "| 51.50 (-0.50) ‡ | +3.50 | 3.50 | -0.50 | 6.50 | no | +3.67 | +0.00 |" in table
    assert "1. `cmd`: budget" in table


def test_recipes_cv_keeps_the_rows_it_did_not_rerun(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows run now replace the same method's rows of the same budget; other methods' rows stay, naming
    the command that made them; a rerun method's rows of another budget go (they would not compare)."""

    def row(gains: list[float]) -> dict[str, Any]:
        folds = {str(k): {"r1": 50 + gain, "gain": gain} for k, gain in enumerate(gains)}
        return {"settings": "-", "folds": folds, **cv.spread(folds, 3)}

    previous = {
        "command": "old",
        "budget": "1000 steps",
        "untrained": {"0": 50.0, "1": 50.0, "2": 50.0},
        "methods": {
            "almn": {"paper": row([1.0, 1.0, 1.0])},
            "pddm": {"paper": row([1.0, -1.0, 1.0])},
            "loop-ms": {"paper": row([2.0, 2.0, 2.0]), "recommended": row([-1.0, 0.0, 0.0])},
        },
    }
    current = {"untrained": {"2": 50.0}, "methods": {"pddm": {"recommended": row([2.0, 2.0, 2.0])}}}
    merged = cv.merge(previous, current, "new", "3000 steps")["methods"]
    assert set(merged["pddm"]) == {"recommended"}  # pddm's 1000-step rows went
    assert merged["pddm"]["recommended"]["command"] == "new" and merged["pddm"]["recommended"]["preferred"]
    assert merged["almn"]["paper"]["command"] == "old" and merged["almn"]["paper"]["budget"] == "1000 steps"
    assert list(merged) == ["almn", "pddm", "loop-ms"]  # in the order of METHODS

    current = {"untrained": {}, "methods": {"loop-ms": {"recommended": row([3.0, 3.0, 3.0])}}}
    merged = cv.merge(previous, current, "new", "1000 steps")
    ms = merged["methods"]["loop-ms"]
    assert ms["paper"]["command"] == "old" and ms["recommended"]["command"] == "new"  # same budget: kept
    assert ms["recommended"]["preferred"] and not ms["paper"]["preferred"]
    table = cv.markdown(merged, 3)
    assert "1. `old`: 1000 steps" in table and "2. `new`: 1000 steps" in table
    assert "| loop-ms | **recommended** | 53.00 (+3.00) |" in table and table.count(" | 2 |\n") == 1
