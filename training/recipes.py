"""Each loss's recommended training recipe: the one place where validated settings live.

A recipe is the set of loss hyperparameters and trainer settings that ``dmlsearch train --loss NAME``
uses unless told otherwise, each with the reason and the measurement behind it. ``bench/train_all.py``,
``bench/recipes_cv.py`` and ``dmlsearch train --loss auto`` read the same table.

Two recipes per loss:

* ``recommended`` (the default): the paper's values changed only where measured on validation classes,
  never on test classes; ``bench/recipes_cv.py`` checks each against the printed values over class folds of
  the Cars196 training classes (``bench/results/recipes_cv.md``), preferring what helps on every fold;
* ``paper``: the values as printed (the loss registry's defaults and :class:`TrainConfig`'s).

``-p key=value`` overrides either. Measurements are Recall@1 in % on frozen EfficientNet-Lite0 features
unless stated; "val" means the Cars196 validation classes 79-98 (untrained 72.0).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from foundation.errors import InvalidInputError
from training.config import Mode, TrainConfig
from training.losses import LOSSES

RecipeName = Literal["recommended", "paper"]
RECIPE_NAMES: tuple[RecipeName, ...] = ("recommended", "paper")
DEFAULT_RECIPE: RecipeName = "recommended"
# `dmlsearch train` on a CPU without --mode: fine-tune when enough steps fit this budget (training/budget.py).
# Of the order of an hour: about 20 Cars196 epochs on a bfloat16 CPU (docs/measurements.md).
DEFAULT_TIME_BUDGET_MINUTES = 60.0
FIXED_KEYS = frozenset({"loss", "data", "loss_hparams", "recipe", "mode"})  # never set by a recipe or -p


@dataclass(frozen=True)
class Choice:
    """One recommended value with why it was chosen and the measurement behind it."""

    value: Any
    reason: str


# Settings every loss's recommended recipe shares.
COMMON: dict[str, Choice] = {
    "views": Choice(
        0,
        "no cached augmented views (random resized crops + flips): in class-fold CV, 4 views lowered the "
        "mean gain of 8 of 9 paper methods (by 0.1-1.4 points) and took ALMN and PDDM below untrained on "
        "fold 2 (recipes_cv_views4.md, recipes_cv_views4_3000.md against recipes_cv.md)",
    ),
}

# Settings every loss's recommended recipe adds when the whole network trains (mode=finetune).
# Chosen on Cars196 class fold 0 (bench/results/finetune_pilots.md: angular, 18-30 minutes of steps, one
# core, validation classes of the fold; untrained validation Recall@1 72.92); the backbone's rate after
# the frozen stage then checked on folds 1 and 2.
FINETUNE: dict[str, Choice] = {
    "frozen_first": Choice(
        True,
        "train the head in frozen mode first (a minute on a CPU), then fine-tune from it: fine-tuning from "
        "the PCA head for 30 minutes ended at fold-0 test 53.87 (validation 75.11), below the frozen "
        "recipe's 58.47 (validation 79.87, recipes_cv.md) that this starts from; validation then keeps the "
        "frozen stage's head unless fine-tuning beats it",
    ),
    "backbone_lr_factor": Choice(
        0.1,
        "backbone at the papers' lr x 0.1 once the frozen stage has fitted the head: fold test R@1 "
        "61.59/71.35/70.22 vs 60.29/71.35/67.03 at x 0.01 (+1.30/+0.00/+3.19, never lower; 18 minutes of "
        "steps, one seed); from the PCA head, without the frozen stage, x 0.01 was needed (fold-0 "
        "validation 75.11 vs 71.00 at 0.1, which kept falling)",
    ),
    "train_size": Choice(
        160,
        "160-pixel training crops, evaluated at 224: 2.6-3x the images per second of 224-pixel crops on a "
        "CPU, and validation after one epoch 71.18 vs 70.08 at 224 (evaluating at 224 beat evaluating at "
        "160 by 4.2 points: larger test than training images suit random-resized-crop training)",
    ),
    "min_crop_area": Choice(
        0.8,
        "mild crops (80-100% of the image): the papers' 35% lowered 8 of 9 methods' class-fold gains as "
        "cached views (recipes_cv_views4.md); fine-tuning at the papers' backbone rate, 71.00 vs 71.18",
    ),
}

# Settings a run without labels adds, whatever its loss and recipe (training/pseudo_labels.py): they are
# what its positives are made of, not tuning.
LABEL_FREE: dict[str, Choice] = {
    "views": Choice(
        4,
        "a label-free batch holds two augmented views of each photo drawn, its one certain positive pair: "
        "cached mode needs views to draw them from (4, the views the class-fold CV measured; not tuned "
        "label-free yet)",
    ),
}

# What a run without labels changes of that when the whole network trains.
LABEL_FREE_FINETUNE: dict[str, Choice] = {
    "views": Choice(
        1,
        "fine-tuning makes fresh crops of each photo at every step, so its two views need no cache; one "
        "cached view lets the frozen first stage draw two different pictures of a photo (served and "
        "augmented): two backbone passes over every photo instead of the five of 4 views (each pass "
        "takes minutes on a CPU for thousands of photos)",
    ),
}

# Dot-product losses on unnormalised embeddings take the squared norm as softmax temperature; the
# PCA-initialised head starts with norms below 1, so their logits stay within +-1 unless scaled.
_DOT_SCALE = Choice(
    4.0,
    "the loss sees 4x the head output (logits within +-1 otherwise); without it N-pair and Angular "
    "degrade (Angular test 62.53 at 1x vs 70.82 at 4x, train_all.md; class-fold CV gains, Angular "
    "+6.23/+6.27/+1.97 vs +2.22/-0.23/-2.08 printed, NL&AL +6.12/+6.35/+1.89 vs +1.85/-0.23/-2.67)",
)

RECIPES: dict[str, dict[str, Choice]] = {
    "almn": {
        "beta": Choice(
            0.5,
            "virtual-point factor: val after 800 steps 73.3 (3, printed), 74.3 (1), 75.5 (0.5); with "
            "scale 16, class-fold CV gains +4.56/+3.83/+1.71 vs +1.37/-0.23/-1.67 printed (recipes_cv.md)",
        ),
        "embedding_scale": Choice(16.0, "centre logits need a wide range: val peak 72.7 at 4x, 73.3 at 16x"),
    },
    "magnet": {
        "global_scaling": Choice(
            8.0,
            "Appendix B's tuned 'global scaling' (2.3-14.2 there); Eq. 5 as printed (1) fell from val 72.0 "
            "to 60-66 within 300 steps; val peak 71.0 at 4, 76.8 at 8, 74.1 at 16, 72.5 at 64; class-fold CV "
            "gains +3.86/+5.22/+0.41 vs +1.37/-0.23/-4.72 printed (recipes_cv.md)",
        ),
        "min_steps": Choice(
            300,
            "a small folder's epoch is a step or two (45 training photos, 48-example batches), and patience "
            "counts per-epoch validations: runs ended after 8-27 steps, before the head moved. 25 Cars196 "
            "classes of 6-14 photos: stopped at step 27 (validation R@1 87.0 -> 91.3) vs 280 (-> 100.0, best "
            "step 207); 40 classes of 8-20: best step 85. On Cars196 patience cannot stop a run before "
            "step 712 (8 epochs), so it changes nothing there",
        ),
    },
    "pddm": {
        "quadruplets": Choice(
            "per_sample",
            "one hard quadruplet per sample: val peak 75.6 vs 72.3 with the printed per-batch one",
        ),
        "beta": Choice(0.2, "embedding margin 0.2 with per-sample quadruplets (val 75.6)"),
        "lam": Choice(
            3.0,
            "embedding term weight: class-fold CV gains +2.78/+4.02/+0.67 at 3 (fold 2 -0.97 with seed 1) vs "
            "fold 2 -0.19 at 1, -0.74 at 2, -1.56 at 4, -0.89 at 5 (recipes_cv.md); with 4 views, test over "
            "seeds 0/1/2 63.28/63.89/63.15 vs 63.68/63.08/63.41 at 1; val 75.6 at 1 vs 74.0 at 10",
        ),
        "min_steps": Choice(
            1500,
            "the unit starts random, so early quadruplets are poor: val dips to 70-71 around steps "
            "200-500 in every run before recovering; early stopping must not end a run inside the dip",
        ),
    },
    "loop-triplet": {
        "views": Choice(
            4,
            "the one method whose class-fold CV gains rose with 4 views: +4.34/+2.70/+0.71 vs "
            "+4.75/+1.99/+0.56 without (recipes_cv_views4.md, recipes_cv.md)",
        ),
        "classes_per_batch": Choice(
            32,
            "32 classes x 4: val peak 76.4 vs 75.5 for the authors' 16 x 2; class-fold CV gains "
            "+4.75/+1.99/+0.56 vs +4.63/+2.29/-0.85 (recipes_cv.md)",
        ),
        "samples_per_class": Choice(4, "see classes_per_batch"),
    },
    # loop-hphn-triplet keeps the printed 4 x 8: at 3000 steps its class-fold CV gains +5.93/+5.63/+1.08
    # help on every fold, above 16 x 4's +2.97/+1.43/+2.64 (recipes_cv.md; seeds in train_all_seeds.md).
    "npair": {"embedding_scale": _DOT_SCALE},
    "angular": {"embedding_scale": _DOT_SCALE},
    "npair-angular": {"embedding_scale": _DOT_SCALE},
}

# Magnet's cluster index (training/samplers.py) splits a class into at most clusters_per_class k-means
# clusters, each holding on average this many times the D examples a batch draws from a cluster (D draws
# need no repeats, and k-means clusters are uneven). Smaller clusters degenerate: they cut a small class into
# its few near-identical photos, the batch variance (the loss's unit) becomes their small spread, every other
# class's mean looks far in those units and nearly every example's loss is 0. Measured on Cars196 photos in
# class folders, the recommended recipe otherwise: 10 classes of 15, 4 clusters a class held 1-9 photos (3
# alone) and 2 of 44 cached example losses were above 0; 25 classes of 6-14, 12 of 40 clusters held one
# photo, 1 of 113 losses above 0. One cluster a class (what this gives both) started at a mean loss of 0.36
# and 0.16. The paper's Table 1 keeps clusters large too (Flowers, 10 photos a class: 1 cluster; Pets: 8 of
# about 12 photos); Cars196's smallest training class (59 photos) still gets its 4 clusters, so Cars196 runs
# are unchanged.
MAGNET_CLUSTER_FILL = 2


def magnet_clusters(class_size: int, clusters_per_class: int, samples_per_cluster: int) -> int:
    """The k-means clusters Magnet's index makes of a class of ``class_size`` examples: at most
    ``clusters_per_class``, at least 1, and no more than its examples fill at MAGNET_CLUSTER_FILL x D each."""
    fillable = class_size // (MAGNET_CLUSTER_FILL * samples_per_cluster)
    return max(1, min(clusters_per_class, fillable))


# `--loss auto` races these: the four strongest recipes of the frozen Cars196 table (train_all.md, seed 0:
# ms 71.06, angular 70.82, npair-angular 69.04, loop-lifted 67.90; untrained 60.62).
AUTO_CANDIDATES: tuple[str, ...] = ("ms", "angular", "npair-angular", "loop-lifted")
# `--loss auto` on a run without labels trains this loss instead of racing: the race judges candidates on
# validation Recall@1, which without labels is the held-out photos' check (training/label_free_data.py), near
# its ceiling on real photos: it cannot tell which loss groups kinds of photos better. So the loss is chosen
# by class-fold cross-validation, labels used only to score (bench/label_free_cv.py,
# bench/results/label_free_cv.md: 3 folds of 32 Cars196 classes x 3 seeds, every loss, frozen, 400 steps):
# angular had the best mean class Recall@1 gain, +1.26 own-gallery and +0.76 unseen (ms -1.21 and -0.80), and
# was above ms on every fold in both settings; the winner per fold and seed moved between angular,
# npair-angular, the LoOp losses, almn and hphn-triplet. Fine-tuning was not cross-validated without labels.
LABEL_FREE_AUTO_LOSS = "angular"
# `--loss auto` (the default) on judgments (--feedback): the pair loss with the best mean Recall@1 gain on
# class folds of judgments (bench/feedback_loop.py --folds, bench/results/feedback_losses_cv.md).
FEEDBACK_LOSS = "pddm"
# Steps each candidate trains before the race is judged on validation Recall@1: a fifth of the default
# budget (not tuned); the winner then continues to the full budget from where its race ended.
AUTO_RACE_STEPS = 600


def parse_recipe_name(name: str) -> RecipeName:
    """``name`` as a recipe's name; an unknown one fails, listing the known ones."""
    for known in RECIPE_NAMES:
        if name == known:
            return known
    raise InvalidInputError(f"unknown recipe {name!r}; choose one of {list(RECIPE_NAMES)}")


def recipe(
    loss: str, name: RecipeName = DEFAULT_RECIPE, mode: Mode = "frozen", *, label_free: bool = False
) -> dict[str, Choice]:
    """The choices ``name`` makes for ``loss`` trained in ``mode`` (for ``paper``, the printed defaults
    apply), plus, ``label_free``, what a run without labels needs (:data:`LABEL_FREE`, and
    :data:`LABEL_FREE_FINETUNE` when fine-tuning)."""
    LOSSES[loss]  # an unknown loss fails here, with the known names
    parse_recipe_name(name)  # and an unknown recipe here
    needed = {**LABEL_FREE, **(LABEL_FREE_FINETUNE if mode == "finetune" else {})} if label_free else {}
    if name == "paper":
        return dict(needed)
    return {**COMMON, **(FINETUNE if mode == "finetune" else {}), **RECIPES.get(loss, {}), **needed}


def split_values(loss: str, values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``{key: value}`` into (trainer settings, loss hyperparameters); an unknown key is an error."""
    # A loss's embedding_dim (PDDM's unit width) is always the head's (training.model.loss_hparams): the key
    # sets the head, or the two would disagree and the first batch would fail.
    loss_keys = set(LOSSES[loss].defaults) - {"embedding_dim"}
    settings: dict[str, Any] = {}
    hparams: dict[str, Any] = {}
    for key, value in values.items():
        if key in loss_keys:
            hparams[key] = value
        elif key in TrainConfig.model_fields and key not in FIXED_KEYS:
            settings[key] = value
        else:
            raise InvalidInputError(
                f"unknown hyperparameter {key!r}: loss {loss!r} takes {sorted(loss_keys)}; training takes "
                f"{sorted(set(TrainConfig.model_fields) - FIXED_KEYS)}"
            )
    return settings, hparams


def parse_assignments(loss: str, assignments: list[str]) -> dict[str, Any]:
    """``key=value`` strings as a dict; values are JSON where possible (numbers, booleans, null), else
    strings, and ``max-steps`` means ``max_steps`` unless the loss has a hyperparameter of that name."""
    loss_keys = LOSSES[loss].defaults  # an unknown loss fails here, with the known names
    values: dict[str, Any] = {}
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InvalidInputError(f"hyperparameters are key=value, got {assignment!r}")
        if key not in loss_keys:
            key = key.replace("-", "_")
        try:
            values[key] = json.loads(raw)
        except json.JSONDecodeError:
            values[key] = raw
    return values


@dataclass(frozen=True)
class Resolved:
    """A loss's settings after the recipe and the overrides: what goes into :class:`TrainConfig`."""

    settings: dict[str, Any]  # trainer fields
    loss_hparams: dict[str, Any]
    record: dict[str, Any]  # for config.json: the recipe's name, what it set and what was overridden

    def config(self, loss: str, data: str | None, **fields: Any) -> TrainConfig:
        """The run's config: ``fields`` (data-independent defaults such as the cache) under the recipe."""
        return TrainConfig(
            loss=loss,
            data=data,
            loss_hparams=self.loss_hparams,
            recipe=self.record,
            **{**fields, **self.settings},
        )


def resolve(
    loss: str,
    name: RecipeName = DEFAULT_RECIPE,
    overrides: dict[str, Any] | None = None,
    mode: Mode = "frozen",
    *,
    label_free: bool = False,
) -> Resolved:
    """The recipe ``name`` for ``loss`` in ``mode`` (``label_free``: for a run without labels), with
    ``overrides`` (e.g. from ``-p``) on top; the settings include the mode."""
    chosen = {key: choice.value for key, choice in recipe(loss, name, mode, label_free=label_free).items()}
    overrides = dict(overrides or {})
    settings, hparams = split_values(loss, {**chosen, **overrides})
    settings["mode"] = mode
    record = {"name": name, "values": chosen, "overrides": overrides}
    return Resolved(settings, hparams, record)


def format_values(values: dict[str, Any]) -> str:
    """``key=value, ...``, or ``-`` when there are none: how recipes and overrides are printed."""
    return ", ".join(f"{key}={value}" for key, value in values.items()) or "-"


def describe(loss: str, name: RecipeName = DEFAULT_RECIPE, mode: Mode = "frozen") -> str:
    """``key=value, ...`` of a recipe, or ``-`` when it changes nothing."""
    return format_values({key: choice.value for key, choice in recipe(loss, name, mode).items()})
