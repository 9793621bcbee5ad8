"""Training on the judgments kept with an index (issue 40, part 3): alone, with a labelled folder and with
a label-free run; the certain pairs judgments imply; the gate on held-out judgments."""

from __future__ import annotations

from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from bench.lib.simulated_user import index_gallery, judge_top
from cli.main import app
from engine.model.embedder import Embedder
from engine.model.model_card import ModelCard
from index.gallery import GalleryIndex
from index.judgments import JudgedQuery
from tests.support.train_config import tiny_train_config
from training.backbone import BACKBONES
from training.bootstrap import Interval
from training.config import TrainConfig
from training.data import DataError, load_labelled_images
from training.feedback_advice import judge_more, queries_for_a_clear_gain
from training.feedback_data import Closure, JudgedPair, load_feedback
from training.feedback_gate import feedback_gate, rank_judgments, unjudged_check
from training.feedback_rows import JUDGED_SPLIT, UNJUDGED_SPLIT
from training.recipes import FEEDBACK_LOSS
from training.run_dir import RunDirectory
from training.trainer import finetune_inputs, prepare_data, train
from training.workloads import ImageFiles


@pytest.fixture(scope="module")
def judged_index(
    labelled_folder: Path, feature_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The labelled folder indexed by the pretrained model, 30 queries' top 5 judged by class (150)."""
    images = load_labelled_images(labelled_folder)
    directory = tmp_path_factory.mktemp("judged") / "index"
    labels = [images.class_names[label] for label in images.labels]
    count = index_gallery(labelled_folder, images.files(), labels, directory, feature_cache)
    queries = np.random.default_rng(0).choice(np.arange(1, count + 1), size=30, replace=False)
    assert judge_top(directory, [int(q) for q in queries], top=5) == 150
    return directory


def alone(index: Path, cache: Path, **overrides: object) -> TrainConfig:
    """A tiny run on the judgments of ``index`` alone."""
    config = tiny_train_config(index, cache, feedback=str(index), **overrides)
    return config.model_copy(update={"data": None})


def test_judgments_imply_certain_pairs_and_leave_the_rest_unknown() -> None:
    pairs = [JudgedPair(1, 2, 1), JudgedPair(1, 3, -1), JudgedPair(4, 2, 1), JudgedPair(5, 6, -1)]
    closure = Closure(pairs)
    signs = closure.signs([1, 2, 4, 3, 7, 1])
    assert signs[0, 1] == signs[1, 2] == signs[0, 2] == 1  # 4 is like 2, which is like 1
    assert signs[2, 3] == signs[1, 3] == -1  # 3 is unlike 1, so unlike its whole component
    assert not signs[4].any() and not signs[:, 4].any()  # no judgment names item 7
    assert signs[0, 5] == 1 and signs.diagonal().tolist() == [0] * 6  # two views of one photo are alike
    # a direct 👎 inside a 👍 component wins for that pair alone
    conflicted = Closure([*pairs, JudgedPair(4, 1, -1)]).signs([1, 2, 4])
    assert conflicted[0, 2] == conflicted[2, 0] == -1 and conflicted[0, 1] == 1


def test_held_out_judgments_are_whole_queries_and_uploads_are_counted(judged_index: Path) -> None:
    with closing(GalleryIndex.open(judged_index)) as index:
        index.judgments.add(JudgedQuery(content_hash="ab" * 32), 1, 1, "fp", "2026-01-01T00:00:00+00:00")
        index.save()
    feedback = load_feedback(judged_index, seed=0, validation=True)
    queries = {name: {p.query for p in getattr(feedback, name)} for name in ("train", "val", "test")}
    assert not queries["train"] & queries["test"] and not queries["val"] & (
        queries["train"] | queries["test"]
    )
    assert len(feedback.train) + len(feedback.val) + len(feedback.test) == 150 and feedback.uploads == 1
    for name in ("val", "test"):  # each held-out query can be ranked: a 👍 and a 👎
        for query in queries[name]:
            assert {p.sign for p in getattr(feedback, name) if p.query == query} == {1, -1}


def test_the_gate_counts_what_training_fixed_and_broke() -> None:
    pairs = [JudgedPair(0, 1, 1), JudgedPair(0, 2, -1), JudgedPair(3, 4, 1), JudgedPair(3, 5, -1)]
    axis = np.eye(3)
    before = {0: axis[0], 1: axis[1], 2: axis[0] + 0.1 * axis[1], 3: axis[0], 4: axis[0], 5: axis[1]}
    after = {**before, 1: axis[0], 2: axis[2]}  # query 0's 👍 now nearest; query 3 unchanged
    precision, right = rank_judgments(before, pairs)
    assert precision.tolist() == [0.0, 1.0] and not right[pairs[0]] and right[pairs[2]]
    precision, right = rank_judgments(after, pairs)
    assert precision.tolist() == [1.0, 1.0] and right[pairs[0]] and right[pairs[1]]


def _unit_rows(rng: np.random.Generator, count: int, dim: int) -> np.ndarray:
    rows = rng.normal(size=(count, dim))
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def test_the_gate_refuses_a_run_that_spoils_the_unjudged_photos() -> None:
    """Better on the held-out judgments is not enough: a model under which the unjudged photos no longer
    find their own augmented view (here: it maps them all near one point) is refused."""
    rng = np.random.default_rng(0)
    photos = np.arange(100, 140)
    served = _unit_rows(rng, len(photos), 16)
    before = np.concatenate([served, served + 0.05 * _unit_rows(rng, len(photos), 16)])  # view near its photo
    collapsed = np.ones((2 * len(photos), 16)) + 0.5 * _unit_rows(rng, 2 * len(photos), 16)
    spoiled = unjudged_check(photos, before, collapsed, baseline="served", seed=0)
    assert spoiled.recall_before == 1.0 and spoiled.recall_after < 0.5 and spoiled.interval.verdict == "worse"
    assert not spoiled.passed and spoiled.neighbours_kept < 0.5
    kept = unjudged_check(photos, before, before @ np.eye(16)[::-1], baseline="served", seed=0)  # a rotation
    assert kept.passed and kept.neighbours_kept == 1.0 and kept.recall_after == kept.recall_before

    pairs, judged_before, judged_after = _ranked_queries(6, improved=6)  # every held-out query fixed

    def gate(unjudged: object) -> object:
        return feedback_gate(
            index="i", trained=8, validation=0, held_out=pairs, uploads=0, before=judged_before,
            after=judged_after, unjudged=unjudged, seed=0,
        )  # fmt: skip

    assert gate(kept).passed and gate(kept).judgments_better
    refused = gate(spoiled)
    assert refused.judgments_better and not refused.passed
    assert "unjudged photos (40" in refused.describe() and "worse" in refused.describe()


def test_the_unjudged_sample_leaves_out_every_judged_photo(partly_judged_index: Path) -> None:
    with closing(GalleryIndex.open(partly_judged_index)) as index:  # an upload's result is judged too
        index.judgments.add(JudgedQuery(content_hash="ab" * 32), 2, 1, "fp", "2026-01-01T00:00:00+00:00")
        index.save()
        judgments = list(index.judgments.scan())
        everything = {item.id for item in index.items.scan()}
    feedback = load_feedback(partly_judged_index, seed=0, validation=True)
    named = {j.result for j in judgments} | {j.query.item for j in judgments if j.query.item is not None}
    assert 2 in named and len(everything - named) >= 5
    assert set(feedback.unjudged) == everything - named  # fewer than the sample's 500: all of them
    assert all(item in feedback.served and item in feedback.paths for item in feedback.unjudged)


def test_a_run_on_judgments_checks_the_unjudged_photos(
    partly_judged_index: Path, feature_cache: Path, tmp_path: Path
) -> None:
    config = alone(partly_judged_index, feature_cache, loss="triplet", max_steps=20, eval_every=10)
    summary = train(config, tmp_path / "run", progress=False)
    gate = summary.feedback
    unjudged = load_feedback(partly_judged_index, seed=0, validation=True).unjudged
    assert gate is not None and gate.unjudged is not None and gate.unjudged.baseline == "served"
    assert gate.unjudged.photos == len(unjudged) and 0 <= gate.unjudged.neighbours_kept <= 1
    assert gate.passed == (gate.judgments_better and gate.unjudged.passed)
    assert "unjudged photos" in gate.describe()


def test_judge_more_counts_the_wrong_results_near_the_top() -> None:
    axis = np.eye(3)
    served = {0: axis[0], 1: axis[0] + axis[1], 2: axis[0] + 0.1 * axis[1], 3: axis[1], 4: axis[2]}
    # query 0: 👎 2 scores above the 👍 1 (wrong near the top), 👎 3 below it
    pairs = [JudgedPair(0, 1, 1), JudgedPair(0, 2, -1), JudgedPair(0, 3, -1), JudgedPair(4, 3, -1)]
    unclear = Interval(difference=0.25, low=-0.25, high=0.75, level=0.95, resamples=100)
    assert queries_for_a_clear_gain(unclear, 10) == 40  # (0.5 / 0.25)^2 times as many
    advice = judge_more(pairs, served, interval=unclear, held_out_queries=10, held_out_share=0.2)
    assert "4 judgments (1 👍, 3 👎) of 2 queries" in advice and "1 of its 👎" in advice
    assert "about 40 held-out queries instead of 10" in advice and "the top 2 of about 150 more" in advice
    assert "Judge about 300 more results" in advice
    flat = Interval(difference=-0.01, low=-0.03, high=0.01, level=0.95, resamples=100)
    advice = judge_more(pairs, served, interval=flat, held_out_queries=10, held_out_share=0.2)
    assert "did not improve" in advice and "the top 2 of about 2 more queries" in advice
    easy = [JudgedPair(0, 2, 1), JudgedPair(0, 3, -1)]  # the served model ranks it right already
    assert "nothing to learn" in judge_more(
        easy, served, interval=flat, held_out_queries=1, held_out_share=0.2
    )


def test_too_few_judgments_say_how_many_more(
    labelled_folder: Path, feature_cache: Path, tmp_path: Path
) -> None:
    images = load_labelled_images(labelled_folder)
    directory = tmp_path / "index"
    labels = [images.class_names[label] for label in images.labels]
    index_gallery(labelled_folder, images.files(), labels, directory, feature_cache)
    assert judge_top(directory, [1, 12], top=5) == 10
    with pytest.raises(DataError, match=r"judge more: at least \d+ more quer(y|ies) with both"):
        load_feedback(directory, seed=0, validation=True)


@pytest.mark.parametrize("loss", ["triplet", "loop-triplet", "pddm"])
def test_a_run_trains_on_judgments_alone(
    judged_index: Path, feature_cache: Path, tmp_path: Path, loss: str
) -> None:
    config = alone(
        judged_index,
        feature_cache,
        loss=loss,
        max_steps=40,
        eval_every=10,
    )
    if loss == "pddm":
        config = config.model_copy(update={"loss_hparams": {"embedding_dim": 16}})
    summary = train(config, tmp_path / "run", progress=False)
    gate = summary.feedback
    assert gate is not None and summary.steps == 40
    used = gate.judgments_trained + gate.judgments_validation + gate.judgments_held_out
    assert used == 150 and gate.judgments_held_out > 0 and gate.queries_held_out > 0
    assert 0 <= gate.precision_before <= 1 and 0 <= gate.precision_after <= 1
    assert gate.interval.low <= gate.interval.difference <= gate.interval.high
    assert {(j.query, j.sign) for j in gate.fixed} <= {(p.query, p.sign) for p in _held_out(judged_index)}
    assert summary.label_free is None and "val" in summary.model_dump()
    assert (gate.judge_more is None) == gate.judgments_better  # advice exactly where judgments showed no gain


def _held_out(index: Path) -> tuple[JudgedPair, ...]:
    return load_feedback(index, seed=0, validation=True).test


def test_judged_photos_join_a_labelled_folder(
    judged_index: Path, labelled_folder: Path, feature_cache: Path, tmp_path: Path
) -> None:
    config = tiny_train_config(
        labelled_folder, feature_cache, loss="ms", feedback=str(judged_index), max_steps=20, eval_every=10
    )
    summary = train(config, tmp_path / "run", progress=False)
    assert summary.feedback is not None and summary.feedback.judgments_validation == 0
    assert summary.feedback.judgments_trained + summary.feedback.judgments_held_out == 150
    # the served model already ranks every held-out judgment right: nothing to gain, and the run says so
    assert summary.feedback.precision_before == 1.0 and not summary.feedback.judgments_better
    assert summary.feedback.judge_more is not None and summary.feedback.judge_more.startswith("judge more")
    assert summary.feedback.judge_more in summary.feedback.describe()
    reported = CliRunner().invoke(app, ["report", str(tmp_path / "run")])
    assert reported.exit_code == 0, reported.output
    page = (tmp_path / "run" / "report.html").read_text()
    assert "<dt>judgments</dt>" in page and "judge more: it trained on" in page


def test_judged_photos_join_a_label_free_run(
    judged_index: Path, flat_folder: Path, feature_cache: Path, tmp_path: Path
) -> None:
    config = tiny_train_config(
        flat_folder,
        feature_cache,
        loss="triplet",
        labels="none",
        views=1,
        feedback=str(judged_index),
        max_steps=20,
        eval_every=10,
    )
    summary = train(config, tmp_path / "run", progress=False)
    assert summary.feedback is not None and summary.label_free is not None
    assert summary.label_free.refreshes  # the pseudo-labels were made, past the judged rows


def test_a_loss_without_pairs_is_refused_on_judgments(
    judged_index: Path, feature_cache: Path, tmp_path: Path
) -> None:
    config = alone(judged_index, feature_cache, loss="magnet")
    with pytest.raises(DataError, match="does not train on judged pairs"):
        train(config, tmp_path / "run", progress=False)


def test_the_cli_trains_on_judgments_and_export_follows_the_gate(
    judged_index: Path, feature_cache: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    words = ["train", "--loss", "triplet", "--feedback", str(judged_index), "--out", str(out)]
    words += ["--cache-dir", str(feature_cache), "-p", "max_steps=20", "-p", "eval_every=10"]
    words += ["-p", "embedding_dim=16", "-p", "head_hidden=32", "--mode", "frozen"]  # no fine-tuning measured
    result = CliRunner().invoke(app, words)
    assert result.exit_code == 0, result.output
    gate = RunDirectory(out).read_summary().feedback
    assert gate is not None and f"trained on {gate.judgments_trained} judgments" in result.output
    exported = CliRunner().invoke(app, ["export", str(out), "--out", str(tmp_path / "model.onnx")])
    if gate.passed:
        assert exported.exit_code == 0, exported.output
    else:
        assert exported.exit_code == 2 and "on the judgments held out from it" in exported.output
    forced = CliRunner().invoke(app, ["export", str(out), "--out", str(tmp_path / "forced.onnx"), "--force"])
    assert forced.exit_code == 0, forced.output
    card = ModelCard.load(tmp_path / "forced.onnx")
    assert card.validation_check is not None and card.validation_check.passed == gate.passed
    assert "held-out judgments" in card.validation_check.detail
    if gate.judge_more is not None:  # what to judge next: in the CLI's output and the card the API serves
        assert gate.judge_more in card.validation_check.detail and "judge more" in result.output


def test_the_cli_refuses_judgments_it_cannot_train_on(judged_index: Path, tmp_path: Path) -> None:
    nothing = CliRunner().invoke(app, ["train", "--loss", "triplet", "--out", str(tmp_path / "a")])
    assert nothing.exit_code == 2 and "--feedback" in nothing.output
    not_an_index = ["train", "--loss", "triplet", "--feedback", str(tmp_path), "--out", str(tmp_path / "b")]
    result = CliRunner().invoke(app, not_an_index)
    assert result.exit_code == 2 and "not an index directory" in result.output
    partial = ["train", "--loss", "triplet", "--feedback", str(judged_index), "--mode", "partial"]
    result = CliRunner().invoke(app, [*partial, "--out", str(tmp_path / "c")])
    assert result.exit_code == 2 and "--mode frozen or finetune" in result.output


def test_without_loss_the_cli_trains_judgments_with_the_cross_validated_loss(
    judged_index: Path, feature_cache: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    words = ["train", "--feedback", str(judged_index), "--out", str(out), "--cache-dir", str(feature_cache)]
    words += ["-p", "max_steps=10", "-p", "eval_every=5", "-p", "head_hidden=32", "--mode", "frozen"]
    result = CliRunner().invoke(app, words)
    assert result.exit_code == 0, result.output
    run = RunDirectory(out)
    config = run.require_config()
    assert config.loss == FEEDBACK_LOSS
    assert f"--loss auto on judgments trains {FEEDBACK_LOSS}" in result.output
    # As wide as the backbone's features: the untrained head ranks the held-out judgments as served.
    assert config.embedding_dim == BACKBONES[config.backbone].feature_dim
    summary = run.read_summary()
    assert summary is not None and summary.feedback is not None
    if summary.best_step == 0:
        assert not summary.feedback.fixed and not summary.feedback.broke


@pytest.mark.parametrize("with_folder", [False, True])
def test_a_fine_tuning_run_embeds_the_judged_and_unjudged_photos_the_gate_was_cached_on(
    partly_judged_index: Path, labelled_folder: Path, feature_cache: Path, with_folder: bool
) -> None:
    """Fine-tuning on judgments embeds every row from its photo: the training rows (the folder's, then the
    judged photos past them), the held-out judgments' photos and the unjudged sample as served and as the
    check's view must be the pictures whose cached features the run and its gate's baseline were made of."""
    if with_folder:
        config = tiny_train_config(
            labelled_folder, feature_cache, feedback=str(partly_judged_index), mode="finetune"
        )
    else:
        config = alone(partly_judged_index, feature_cache, mode="finetune")
    data = prepare_data(config, feature_cache, progress=False)
    files, views = finetune_inputs(data)
    assert data.judged is not None and (views[UNJUDGED_SPLIT].positions >= 0).sum() == len(
        data.judged.unjudged.items
    )
    embedder = Embedder(feature_cache / "backbones" / config.backbone / "model.onnx")
    preprocessing = BACKBONES[config.backbone].preprocessing
    for split in ("train", "val", "test", JUDGED_SPLIT, UNJUDGED_SPLIT):
        shown = ImageFiles(files[split], preprocessing, views=views.get(split))
        pictures = np.stack([shown[row][1].numpy() for row in range(len(shown))])
        np.testing.assert_allclose(embedder.embed_tensor(pictures), data.features[split], atol=1e-4)


@pytest.mark.slow  # measures and runs real fine-tuning steps on the CPU
def test_without_mode_the_cpu_budget_fine_tunes_on_judgments_and_the_gate_judges_it(
    partly_judged_index: Path, feature_cache: Path, tmp_path: Path
) -> None:
    """--feedback was frozen-only: now the CPU's budget picks the mode as for a folder (a fine-tuning step
    measured here, the judged photos counted), and the fine-tuned run goes through the same gate."""
    out = tmp_path / "run"
    command = ["train", "--loss", "triplet", "--feedback", str(partly_judged_index), "--out", str(out)]
    command += ["--cache-dir", str(feature_cache), "--time-budget", "30", "-p", "embedding_dim=16"]
    command += ["-p", "max_steps=2", "-p", "eval_every=1", "-p", "workers=0", "-p", "train_size=64"]
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0, result.output
    assert "measuring a fine-tuning step" in result.output and "finetune: 2 steps fit" in result.output
    run = RunDirectory(out)
    config = run.require_config()
    assert (config.mode, config.max_steps, config.time_budget) == ("finetune", 2, 1800.0)
    summary = run.read_summary()
    assert summary is not None and summary.mode == "finetune" and summary.steps == 2
    assert summary.frozen_stage is not None  # fine-tuned from a head first trained on the judgments, frozen
    gate = summary.feedback
    assert (
        gate is not None
        and gate.unjudged is not None
        and f"trained on {gate.judgments_trained}" in result.output
    )
    exported = CliRunner().invoke(app, ["export", str(out), "--out", str(tmp_path / "model.onnx")])
    assert exported.exit_code == (0 if gate.passed else 2), exported.output


def _ranked_queries(queries: int, improved: int) -> tuple[list[JudgedPair], dict, dict]:
    """``queries`` held-out queries (a 👍 and a 👎 each) ranked wrong by the served vectors; the trained ones
    rank the first ``improved`` of them right and leave the others as they were."""
    axis = np.eye(3)
    pairs, before, after = [], {}, {}
    for query in range(queries):
        q, like, unlike = 3 * query, 3 * query + 1, 3 * query + 2
        pairs += [JudgedPair(q, like, 1), JudgedPair(q, unlike, -1)]
        served = {q: axis[0], like: axis[1], unlike: axis[0]}
        before.update(served)
        after.update({q: axis[0], like: axis[0], unlike: axis[1]} if query < improved else served)
    return pairs, before, after


@pytest.mark.parametrize("queries", [1, 2, 3, 5])
def test_too_few_held_out_queries_are_no_proof_however_they_moved(queries: int) -> None:
    """Each held-out query improved: the bootstrap interval over so few queries is [+1, +1], but a model no
    better than the served one improves all of 1, 2 or 3 queries by chance in 1 of 2, 4 or 8 runs; no test
    at 95% can tell a gain from fewer than 6 (2^-6 < 2.5%), so the gate has no verdict and says so."""
    pairs, before, after = _ranked_queries(queries, improved=queries)
    gate = feedback_gate(
        index="i", trained=8, validation=0, held_out=pairs, uploads=0, before=before, after=after,
        unjudged=None, seed=0,
    )  # fmt: skip
    assert gate.interval.low == 1.0  # what the interval alone says
    assert not gate.judgments_better and not gate.passed
    assert f"no verdict from {queries} held-out quer" in gate.describe() and "at least 6" in gate.describe()
    advice = judge_more(pairs, before, interval=gate.interval, held_out_queries=queries, held_out_share=0.2)
    more = -(-(6 - queries) * 5)  # ceil((6 - queries) / 0.2): to hold out 6
    assert "cannot show a gain however they moved: it takes at least 6" in advice
    assert f"the top 2 of about {more} more queries" in advice


def test_enough_held_out_queries_that_all_improved_pass_and_a_mixed_few_do_not() -> None:
    pairs, before, after = _ranked_queries(6, improved=6)
    gate = feedback_gate(
        index="i", trained=8, validation=0, held_out=pairs, uploads=0, before=before, after=after,
        unjudged=None, seed=0,
    )  # fmt: skip
    assert gate.judgments_better and gate.p_value == pytest.approx(1 / 64)
    pairs, before, after = _ranked_queries(8, improved=6)  # two unchanged: ties no sign flip moves
    gate = feedback_gate(
        index="i", trained=8, validation=0, held_out=pairs, uploads=0, before=before, after=after,
        unjudged=None, seed=0,
    )  # fmt: skip
    assert gate.interval.low > 0 and gate.p_value == pytest.approx(1 / 64) and gate.judgments_better


def test_a_gain_on_a_few_moved_queries_among_ties_says_how_many_queries_would_show_it() -> None:
    """The trial of issue 40 with 180 judgments: 6 held-out queries, 3 ranked better, 3 as before. The
    interval cleared zero, the sign-flip test (p = 2^-3) did not; the advice said "did not improve"."""
    pairs, before, after = _ranked_queries(6, improved=3)
    gate = feedback_gate(
        index="i", trained=8, validation=0, held_out=pairs, uploads=0, before=before, after=after,
        unjudged=None, seed=0,
    )  # fmt: skip
    assert gate.interval.low > 0 and gate.p_value == pytest.approx(1 / 8) and not gate.judgments_better
    assert gate.queries_moved == 3
    advice = judge_more(
        pairs, before, interval=gate.interval, held_out_queries=6, held_out_share=0.2, moved_queries=3
    )
    assert "did not improve" not in advice
    assert "only 3 of the 6 held-out queries moved" in advice and "about 12 held-out queries" in advice
    assert "the top 2 of about 30 more queries" in advice
