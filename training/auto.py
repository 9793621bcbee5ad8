"""``dmlsearch train --loss auto``: race the strongest recipes on the validation classes, keep the best.

Each candidate in :data:`training.recipes.AUTO_CANDIDATES` trains ``race_steps`` steps (or its whole budget,
``max_steps``, when that is smaller: then its race run is its full run) with its recommended recipe in
``OUT/race/<loss>`` (all sharing one feature cache). The candidate with the highest validation
Recall@1 (its best checkpoint so far) wins; its race run is copied into ``OUT`` and continues there to the
full budget, so the race's steps are not wasted. ``config.json`` records the race: every candidate's
validation Recall@1, the budget and the winner. Re-running the command resumes every part.
"""

from __future__ import annotations

import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.config import TrainConfig
from training.label_free_data import is_label_free
from training.recipes import AUTO_CANDIDATES, AUTO_RACE_STEPS, format_values, resolve
from training.run_dir import RunDirectory, RunSummary
from training.trainer import SELECTION_METRIC, NoGainWarning, train


@dataclass(frozen=True)
class AutoRun:
    """The winner's summary and the race that chose it (also in the run's ``config.json`` recipe)."""

    summary: RunSummary
    race: dict[str, Any]


def race_configs(
    data: str, out: Path, overrides: dict[str, Any], fields: dict[str, Any], candidates: tuple[str, ...]
) -> dict[str, TrainConfig]:
    """Each candidate's full-budget config: its recommended recipe, ``overrides`` (trainer settings
    only: the candidates' losses take different hyperparameters) and ``fields``, with one shared cache."""
    fields = {"cache_dir": str(out / "cache"), **{k: v for k, v in fields.items() if v is not None}}
    mode = fields.pop("mode", "frozen")
    label_free = is_label_free(Path(data), fields.get("labels", "folders"))
    resolved = {
        loss: resolve(loss, overrides=overrides, mode=mode, label_free=label_free) for loss in candidates
    }
    return {loss: recipe.config(loss, data, **fields) for loss, recipe in resolved.items()}


def _settings(config: TrainConfig) -> str:
    """``key=value, ...`` a candidate trains with: its recipe's values under the overrides."""
    record = config.recipe
    assert record is not None  # race_configs gives each candidate its recipe
    return format_values({**record["values"], **record["overrides"]})


def race_reason(scores: dict[str, float], winner: str, untrained: float, race_steps: int) -> str:
    """Why ``winner`` won, saying so when it only won a tie or did not beat the untrained model."""
    reason = f"highest validation {SELECTION_METRIC} after at most {race_steps} steps each"
    tied = [loss for loss, score in scores.items() if score == scores[winner] and loss != winner]
    if tied:
        reason += f"; tied with {', '.join(tied)}, kept as the earlier listed (candidates go strongest first)"
    if scores[winner] <= untrained:
        reason += f"; no candidate beat the untrained model ({100 * untrained:.2f}) in the race"
    return reason


def train_auto(
    data: str,
    out: Path,
    *,
    overrides: dict[str, Any] | None = None,
    race_steps: int = AUTO_RACE_STEPS,
    candidates: tuple[str, ...] = AUTO_CANDIDATES,
    progress: bool = True,
    **fields: Any,
) -> AutoRun:
    """Race ``candidates`` for ``race_steps`` steps each, then train the winner to its full budget in
    ``out``; returns the winner's summary and the race."""
    configs = race_configs(data, out, dict(overrides or {}), fields, candidates)
    # What each candidate races: never past its budget (-p max_steps=300 under 600 race steps races 300).
    steps = {loss: min(race_steps, config.max_steps) for loss, config in configs.items()}
    if progress:
        each = f"{steps[candidates[0]]} steps" if len(set(steps.values())) == 1 else "up to their budgets"
        print(f"racing {', '.join(configs)}: {each} each, judged on validation Recall@1", flush=True)
    scores, untrained = {}, 0.0
    for loss, config in configs.items():
        if progress:
            print(f"race: {loss} for {steps[loss]} steps ({_settings(config)})", flush=True)
        raced = config.model_copy(update={"max_steps": steps[loss]})
        with warnings.catch_warnings():  # a candidate is only raced, never exported: the scores say enough
            warnings.simplefilter("ignore", NoGainWarning)
            summary = train(raced, out / "race" / loss, progress=progress)
        scores[loss] = summary.val[SELECTION_METRIC]
        untrained = summary.require_val_backbone()[SELECTION_METRIC]  # the same classes for every candidate
    winner = max(scores, key=scores.__getitem__)  # ties go to the earlier (stronger-listed) candidate
    race = {
        "budget_steps": max(steps.values()),
        "val_" + SELECTION_METRIC: scores,
        "winner": winner,
        "reason": race_reason(scores, winner, untrained, max(steps.values())),
    }
    final = configs[winner]
    assert final.recipe is not None  # race_configs gives each candidate its recipe
    final = final.model_copy(update={"recipe": {**final.recipe, "name": "auto", "race": race}})
    run = RunDirectory(out)
    if run.read_config() is None:  # continue the winner's race run rather than start it again
        for item in (out / "race" / winner).iterdir():
            if item.is_dir():
                shutil.copytree(item, out / item.name, dirs_exist_ok=True)
            else:
                shutil.copy2(item, out / item.name)
        run.write_config(final)  # also when the race run stopped early and training has nothing to add
    return AutoRun(train(final, out, progress=progress), race)
