"""Index commands: build an index from a gallery folder, query it, and change it in place (``index ...``)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from cli.common import (
    echo_duplicate_files,
    echo_moves,
    fail,
    model_for_index,
    moves_heading,
    read_query_image,
    reports_errors,
    served_as_the_server_serves,
)
from engine.serve.refine import DEFAULT_STRATEGY, Strategy
from foundation import defaults
from foundation.families import Backend, IndexType
from foundation.names import readable_name
from index.connection import MilvusConnection
from index.manifest import MILVUS_COLLECTION
from index.selection import KEEP, IndexChanges, Keep

if TYPE_CHECKING:
    from engine.build.embedding import EmbeddingRunner
    from engine.build.report import BuildReport
    from engine.decode.regions import Box

commands = typer.Typer()
index_app = typer.Typer(
    help="Change and inspect an index: add, remove, stats, merge, rebuild.", no_args_is_help=True
)
commands.add_typer(index_app, name="index")


StoredModelOption = Annotated[
    Path | None,
    typer.Option(help="Exported model.onnx (default: the one the index carries; if given, it must match)."),
]
IndexTypeOption = Annotated[
    IndexType | None,
    typer.Option(help="FAISS index type; auto picks from gallery size, dimension and memory budget."),
]
BudgetOption = Annotated[
    str | None,
    typer.Option(
        help="RAM the index may use, e.g. 512MB or 2G; auto then compresses to fit. 'none' lifts an earlier "
        "budget."
    ),
]
RecallOption = Annotated[
    float | None,
    typer.Option(
        min=0.01, max=1.0, help="recall@10 vs exact search that nprobe/efSearch are tuned to reach."
    ),
]
# --ray's value that starts a Ray runtime on this machine instead of joining a cluster.
RAY_LOCAL = "local"
BoxOption = Annotated[
    str | None,
    typer.Option(
        help="Search by a region of the query image: x0,y0,x1,y1 (left, top, right, bottom) in pixels of the "
        "upright image (after EXIF rotation), or as fractions of its width and height when all four are "
        f"within [0, 1]; at least {defaults.MIN_BOX_SIDE} pixels a side.",
    ),
]
ProgressOption = Annotated[bool, typer.Option("--progress/--no-progress", help="Show progress bars.")]
# The ``index ...`` commands take their index as their first argument, as they always did, or with
# --index, as every other command does.
IndexFlag = Annotated[
    Path | None, typer.Option("--index", help="Index directory (or give it as the first argument).")
]
A = TypeVar("A", str, Path)


def index_and_arguments(flag: Path | None, arguments: Sequence[A]) -> tuple[Path, list[A]]:
    """The index (``--index``, else the first argument) and the arguments that follow it."""
    if flag is not None:
        return flag, list(arguments)
    if not arguments:
        raise fail("name the index: --index DIR (or as the first argument)")
    return Path(arguments[0]), list(arguments[1:])


def index_given(flag: Path | None, argument: Path | None) -> Path:
    """The index of a command whose one argument is the index."""
    index, rest = index_and_arguments(flag, [] if argument is None else [argument])
    if rest:
        raise fail(f"the index is given twice: {rest[0]} and --index {index}")
    return index


IndexArgument = Annotated[
    Path | None, typer.Argument(metavar="[INDEX]", help="Index directory (or --index).")
]


def _index_changes(
    index_type: IndexType | None, memory_budget: str | None, target_recall: float | None
) -> IndexChanges:
    """The index options given on the command line; those left out keep what the index was built with."""
    from index.selection import parse_size

    budget: int | Keep | None = KEEP
    if memory_budget is not None:
        budget = None if memory_budget.strip().lower() == "none" else parse_size(memory_budget)
    return IndexChanges(index_type or KEEP, budget, KEEP if target_recall is None else target_recall)


def _print_build_summary(out: Path, report: BuildReport) -> None:
    from index.manifest import Manifest

    manifest = Manifest.load(out)
    if report.previous_model is not None:
        kept = (
            f": its {report.reembedded} items were re-embedded under their ids (as index rebuild does)"
            if report.reembedded
            else ""
        )
        typer.echo(
            f"{out} was built with model {report.previous_model[:12]}, now {manifest.model_fingerprint[:12]}"
            f"{kept}"
        )
    typer.echo(
        f"indexed {report.indexed} images into {out} ({report.unchanged} unchanged, {report.moved} moved, "
        f"{report.removed} removed)"
    )
    if report.moves:
        typer.echo(moves_heading(report.moves))
        echo_moves(report.moves)
    if report.dated:
        typer.echo(f"read when {report.dated} items indexed before were taken (EXIF, else the file's time)")
    if report.duplicates:
        typer.echo(f"copies of indexed files ({len(report.duplicates)}):")
        echo_duplicate_files(report.duplicates)
    if manifest.shard is not None:  # a shard stores vectors only: `index merge` builds the search index
        typer.echo(
            f"{manifest.backend} shard {manifest.shard}, {manifest.count} items (searchable once merged: "
            "dmlsearch index merge)"
        )
        return
    built, wanted = manifest.built, manifest.requested.target_recall
    params = ", ".join(f"{name}={value}" for name, value in built.search_params.items())
    recall = "" if built.achieved_recall is None else f", recall@10 {built.achieved_recall:.3f}"
    target = "" if built.achieved_recall is None else f" (target {wanted:.2f})"
    typer.echo(
        f"{manifest.backend} index {built.index_type}"
        f"{f' [{built.index_spec}]' if built.index_spec else ''}"
        f"{f' {params}' if params else ''}{recall}{target}, {manifest.count} items"
        f"{', rebuilt' if report.rebuilt else ''}"
    )
    if built.achieved_recall is not None and built.achieved_recall < wanted:
        typer.secho(
            "the target recall is out of reach for this index type (its codes are too coarse): raise "
            "--memory-budget or choose --index-type ivf",
            fg=typer.colors.YELLOW,
            err=True,
        )
    if report.skipped:
        typer.secho(f"skipped {len(report.skipped)} files:", fg=typer.colors.YELLOW, err=True)
        for path, reason in report.skipped:
            typer.echo(f"  {readable_name(path)}: {reason}", err=True)


@commands.command("build-index")
@reports_errors
def build_index(
    gallery: Annotated[Path, typer.Argument(help="Folder of images; sub-folder names become labels.")],
    out: Annotated[Path, typer.Option(help="Index directory to write or bring up to date.")],
    model: Annotated[
        Path | None,
        typer.Option(help=f"Exported model.onnx (default: the one OUT carries, else {defaults.MODEL_PATH})."),
    ] = None,
    batch_size: Annotated[int, typer.Option(min=1, max=1024)] = defaults.BATCH_SIZE,
    threads: Annotated[int, typer.Option(min=0, help="onnxruntime threads (0 = all cores).")] = 0,
    decode_workers: Annotated[
        int, typer.Option(min=0, help="Threads decoding images while the model embeds (0 = none).")
    ] = defaults.DECODE_WORKERS,
    decode_cpu_seconds: Annotated[
        float,
        typer.Option(
            min=0.1,
            help="CPU seconds decoding one image may take; a file past it is skipped with the reason.",
        ),
    ] = defaults.DECODE_CPU_SECONDS,
    index_type: IndexTypeOption = None,
    memory_budget: BudgetOption = None,
    target_recall: RecallOption = None,
    backend: Annotated[Backend | None, typer.Option(help="Where vectors live (default faiss).")] = None,
    milvus_uri: Annotated[
        str | None,
        typer.Option(
            help="Milvus URI (http://host:19530, https:// for TLS) or Milvus Lite file (default "
            "OUT/milvus.db); credentials come from DMLSEARCH_MILVUS_USER and _PASSWORD or _TOKEN, never "
            "recorded (docs/milvus.md)."
        ),
    ] = None,
    milvus_collection: Annotated[str, typer.Option(help="Milvus collection name.")] = MILVUS_COLLECTION,
    shard: Annotated[
        str | None, typer.Option(help="I/N: embed only this deterministic share of the files (merge later).")
    ] = None,
    replace: Annotated[
        bool,
        typer.Option(
            "--replace",
            help="Repoint an OUT built from another folder at GALLERY (items not found there are removed).",
        ),
    ] = False,
    ray: Annotated[
        str | None,
        typer.Option(
            metavar="ADDRESS|local",
            help="Hash, decode and embed on the Ray cluster whose head is at ADDRESS (host:port), or on a "
            "Ray runtime started here ('local'). Needs dmlsearch[ray], and GALLERY at the same path on every "
            "node.",
        ),
    ] = None,
    progress: ProgressOption = True,
) -> None:
    """Embed the images under GALLERY into an index; re-running embeds only new or changed files."""
    from engine.build.embedding import LocalRunner
    from engine.build.indexing import build_index as run_build
    from engine.decode.pool import DecodeLimits
    from engine.model.embedder import Embedder
    from foundation.stopping import StopRequested, stop_on_signals
    from index.sharding import Shard

    if not gallery.is_dir():
        raise fail(f"gallery folder {gallery} does not exist")
    try:
        embedder = Embedder(model_for_index(out, model), threads=threads)
        limits = DecodeLimits(cpu_seconds=decode_cpu_seconds)
        runner: contextlib.AbstractContextManager[EmbeddingRunner]
        if ray is None:
            runner = contextlib.nullcontext(LocalRunner(decode_workers, limits))
        else:
            from engine.build.ray_runner import RayRunner

            runner = RayRunner(None if ray == RAY_LOCAL else ray, decode_limits=limits)
        # SIGTERM/SIGINT: stop after the batch being added (handlers set once Ray, which sets its own, is up)
        with runner as chosen, stop_on_signals():
            report = run_build(
                gallery,
                embedder,
                out,
                replace=replace,
                batch_size=batch_size,
                progress=progress,
                changes=_index_changes(index_type, memory_budget, target_recall),
                backend=backend,
                milvus=MilvusConnection(milvus_uri, milvus_collection),
                shard=Shard.parse(shard) if shard else None,
                runner=chosen,
            )
    except StopRequested as stop:
        typer.echo(f"{stop}: the images embedded so far are saved; run the same command again to continue")
        raise typer.Exit(stop.exit_code) from None
    _print_build_summary(out, report)


def parse_box(box: str | None) -> Box | None:
    """``--box``'s value as a box (None: the whole image), or a one-line error naming the option."""
    from engine.decode.images import ImageDecodeError
    from engine.decode.regions import Box

    try:
        return None if box is None else Box.parse(box)
    except ImageDecodeError as err:
        raise fail(f"--box: {err.message}") from None


@commands.command()
@reports_errors
def query(
    image: Annotated[Path, typer.Argument(help="Query image file.")],
    index: Annotated[Path, typer.Option(help="Index directory.")],
    model: StoredModelOption = None,
    k: Annotated[
        int, typer.Option("-k", "--k", min=1, max=defaults.MAX_K, help="How many results.")
    ] = defaults.TOP_K,
    min_score: Annotated[float, typer.Option(min=-1.0, max=1.0)] = defaults.MIN_SCORE,
    label: Annotated[
        list[str] | None, typer.Option(help="Only items with this label (repeat for any of several).")
    ] = None,
    path_prefix: Annotated[
        str | None,
        typer.Option(help="Only items whose gallery-relative path starts with this (a sub-folder)."),
    ] = None,
    taken_from: Annotated[
        datetime | None,
        typer.Option(
            help="Only photos taken at or after this time on the camera's clock (EXIF capture time, else "
            "the file's time; no zone), e.g. 2024-06-01."
        ),
    ] = None,
    taken_to: Annotated[datetime | None, typer.Option(help="Only photos taken before this time.")] = None,
    added_from: Annotated[
        datetime | None, typer.Option(help="Only items indexed at or after this time (UTC if no zone).")
    ] = None,
    added_to: Annotated[datetime | None, typer.Option(help="Only items indexed before this time.")] = None,
    box: BoxOption = None,
    like: Annotated[
        list[int] | None,
        typer.Option(
            min=0,
            metavar="ID",
            help="More like this item (its id; repeat for several): a positive example refining the search, "
            "left out of the results.",
        ),
    ] = None,
    unlike: Annotated[
        list[int] | None,
        typer.Option(
            min=0, metavar="ID", help="Less like this item (its id; repeat for several): a negative example."
        ),
    ] = None,
    strategy: Annotated[
        Strategy,
        typer.Option(
            help="How --like and --unlike combine with the query (Qdrant's recommendation strategies): "
            "average_vector searches by 2 avg(positives) - avg(negatives), the query being a positive; "
            "best_score rescores the neighbours of each positive by their best cosine to a positive, or "
            "minus the square of their best cosine to a negative where that is higher."
        ),
    ] = DEFAULT_STRATEGY,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Print the K gallery images most similar to IMAGE (or to a box on it) with their cosine scores
    (within the filters); with --like and --unlike, refined by those items, scored by --strategy."""
    from dataclasses import asdict

    from engine.decode.images import ImageDecodeError
    from engine.serve.query import SearchOptions
    from engine.serve.refine import Refinement
    from index.filters import ItemFilter

    image_bytes = read_query_image(image)
    region = parse_box(box)
    try:
        where = ItemFilter(tuple(label or ()), path_prefix, added_from, added_to, taken_from, taken_to)
        if where.empty_range:  # on the command line, surely a slip
            raise fail("--added-from/--taken-from must be earlier than --added-to/--taken-to")
        refine = Refinement(tuple(like or ()), tuple(unlike or ()), strategy) if like or unlike else None
        options = SearchOptions(k=k, min_score=min_score, where=where, refine=refine)
        with served_as_the_server_serves(model, index) as service:
            response = service.queries.search([image_bytes], options, [region])
    except ImageDecodeError as err:  # named by its file
        raise fail(f"{image}: {err.message}") from None
    (hits,) = response.queries
    if as_json:
        payload = {
            "results": [{**asdict(result), "path": readable_name(result.path)} for result in hits.results],
            "took_ms": response.took_ms,
            "model_fingerprint": response.model_fingerprint,
        }
        typer.echo(json.dumps(payload, indent=2))
        return
    if not hits.results:
        within = "" if where.empty else " within the filters"
        cut = f" scored at least {min_score}" if min_score > defaults.MIN_SCORE else ""
        typer.echo(f"no results: no item{within}{cut}", err=True)
        return
    typer.echo(f"{'rank':>4}  {'score':>7}  {'label':<24} path")
    for result in hits.results:
        typer.echo(
            f"{result.rank:>4}  {result.score:7.4f}  {result.label or '-':<24} {readable_name(result.path)}"
        )


@index_app.command("add")
@reports_errors
def add(
    arguments: Annotated[
        list[Path],
        typer.Argument(
            metavar="[INDEX] PATHS...",
            help="The index directory (unless --index names it), then image files or folders inside its "
            "gallery folder.",
        ),
    ],
    index: IndexFlag = None,
    model: StoredModelOption = None,
    batch_size: Annotated[int, typer.Option(min=1, max=1024)] = defaults.BATCH_SIZE,
    progress: ProgressOption = True,
) -> None:
    """Embed and add images to an index without rebuilding it."""
    from engine.build.indexing import add_images
    from engine.model.bundle import locate_model
    from engine.model.embedder import Embedder

    index, paths = index_and_arguments(index, arguments)
    if not paths:
        raise fail("name the images to add: files or folders inside the index's gallery folder")
    missing = [path for path in paths if not path.exists()]
    if missing:
        raise fail(f"{missing[0]} does not exist")
    located = locate_model(index, model)
    embedder = Embedder(located.path, card=located.card)
    report = add_images(index, embedder, paths, batch_size=batch_size, progress=progress)
    _print_build_summary(index, report)


@index_app.command("remove")
@reports_errors
def remove(
    arguments: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="[INDEX] [PATHS]...",
            help="The index directory (unless --index names it), then gallery-relative paths of items to "
            "remove.",
        ),
    ] = None,
    index: IndexFlag = None,
    ids: Annotated[list[int] | None, typer.Option("--id", help="Item id to remove (repeatable).")] = None,
) -> None:
    """Delete items by path or id so that they stay deleted: their gallery files (and byte copies of them)
    are moved into the gallery's trash folder, as the duplicate review sets images aside, so no later
    build-index or watch indexes them again; `dmlsearch duplicates --undo PLAN_ID` puts them back. An HNSW
    graph is rebuilt once a tenth of it is removed items."""
    from engine.duplicates.review import delete_items
    from foundation.defaults import TRASH_FOLDER
    from index.gallery import GalleryIndex

    index, paths = index_and_arguments(index, arguments or [])
    if not paths and not ids:
        raise fail("name the items to remove: gallery-relative paths and/or --id")
    gallery = GalleryIndex.open(index)
    try:
        wanted = list(ids or [])
        for path in paths:
            item = gallery.items.get_by_path(path)
            if item is None:
                raise fail(f"no item with path {path} in {index}")
            wanted.append(item.id)
        unknown = sorted(set(wanted) - set(gallery.items.get_many(wanted)))
        if unknown:
            raise fail(f"no items with ids {', '.join(map(str, unknown))} in {index}")
        deletion = delete_items(gallery, wanted)
        report = deletion.report
        for moved in [*report.moved, *report.already]:
            typer.echo(f"set aside {readable_name(moved)}")
        for where, why in report.left:
            typer.echo(f"left {readable_name(where)}: {why}", err=True)
        typer.echo(f"removed {report.removed} items; {len(gallery)} remain")
        if deletion.plan_id is not None:
            typer.echo(
                f"their files are in {TRASH_FOLDER}/{deletion.plan_id} of the gallery; undo with: dmlsearch "
                f"duplicates --index {index} --undo {deletion.plan_id}"
            )
    finally:
        gallery.close()


@index_app.command("stats")
@reports_errors
def stats(
    index_argument: IndexArgument = None,
    index: IndexFlag = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Backend, index type and parameters, achieved recall, counts and sizes of an index."""
    from index.gallery import GalleryIndex
    from index.selection import format_bytes

    gallery = GalleryIndex.open(index_given(index, index_argument))
    info = gallery.describe()
    gallery.close()
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    for key, value in info.items():
        if key == "files" and isinstance(value, dict):
            value = ", ".join(f"{name} {format_bytes(size)}" for name, size in value.items())
        elif key == "estimated_memory_bytes" and isinstance(value, int | float):
            value = format_bytes(value)
        typer.echo(f"{key:>22}: {value}")


@index_app.command("rebuild")
@reports_errors
def rebuild(
    model: Annotated[Path, typer.Option(help="The new exported model.onnx.")],
    out: Annotated[Path, typer.Option(help="New index directory to write.")],
    index_argument: IndexArgument = None,
    gallery: Annotated[
        Path | None, typer.Option(help="Where the gallery is now, if not where INDEX recorded it.")
    ] = None,
    batch_size: Annotated[int, typer.Option(min=1, max=1024)] = defaults.BATCH_SIZE,
    threads: Annotated[int, typer.Option(min=0, help="onnxruntime threads (0 = all cores).")] = 0,
    progress: ProgressOption = True,
    index: IndexFlag = None,
) -> None:
    """Re-embed INDEX's gallery with a new model into a new index: same items, labels and ids.

    Run it again after an interruption to continue. Serve the result, or switch a running server to it
    (POST /v1/admin/reload, or SIGHUP after repointing the served path).
    """
    from engine.build.rebuild import rebuild_index
    from engine.model.embedder import Embedder

    report = rebuild_index(
        index_given(index, index_argument),
        Embedder(model, threads=threads),
        out,
        gallery_root=gallery,
        batch_size=batch_size,
        progress=progress,
    )
    if report.unchanged:
        typer.echo(f"continued an interrupted rebuild: {report.unchanged} items were already re-embedded")
    _print_build_summary(out, report)


@index_app.command("merge")
@reports_errors
def merge(
    shards: Annotated[list[Path], typer.Argument(help="Shard index directories (build-index --shard I/N).")],
    out: Annotated[Path, typer.Option(help="Merged index directory to write.")],
    index_type: IndexTypeOption = None,
    memory_budget: BudgetOption = None,
    target_recall: RecallOption = None,
    progress: ProgressOption = True,
) -> None:
    """Merge the FAISS shard directories of one gallery into one index (faiss's IVF merge)."""
    from engine.model.bundle import model_writer, stored_model
    from index.manifest import Manifest
    from index.merge import merge_shards

    first = Manifest.load(shards[0])
    options = first.options.with_changes(_index_changes(index_type, memory_budget, target_recall))
    model = stored_model(shards[0], first)  # the merged index carries the shards' model too
    merged = merge_shards(
        shards,
        out,
        options=options,
        model=model_writer(model) if model is not None else None,
        progress=progress,
    )
    manifest = merged.manifest
    merged.close()
    built = manifest.built
    typer.echo(
        f"merged {len(shards)} shards into {out}: {manifest.count} items, {built.index_type} "
        f"[{built.index_spec}] recall@10 {built.achieved_recall:.3f}"
    )
