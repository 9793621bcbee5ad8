"""Where a build hashes, decodes and embeds its files: the runner protocol, this process's runner, the embed
loop, and the committer that adds embedded batches to the index on a writer thread."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from engine.build.prefetch import WORKER_NICENESS, DecodedFile, decode_file, prefetch
from engine.build.report import BuildReport
from engine.decode.pool import DecodeLimits, DecodePool
from engine.gallery.files import resolves_inside
from engine.gallery.hashing import GalleryFile, file_hash, label_of
from engine.model.embedder import Embedder
from foundation import stopping
from foundation.defaults import DECODE_WORKERS
from foundation.progress import progress_bar
from index.protocol import Entry

# How a runner hashes files: ``(path, content hash or the error that made the file unreadable)``, any order.
Hasher = Callable[[list[Path]], Iterable[tuple[Path, str | Exception]]]


def hash_files(
    root: Path,
    files: Sequence[Path],
    report: BuildReport,
    progress: bool,
    *,
    workers: int = DECODE_WORKERS,
    hasher: Hasher | None = None,
) -> list[GalleryFile]:
    """Content hashes of ``files``, sorted by relative path; unreadable files go to ``report.skipped``.

    So do links to files outside the gallery folder: the server refuses to serve such files (a link
    could expose anything on the machine), so they would show in results as images that cannot be shown.
    """
    hashed = []
    inside = []
    for path in files:
        if resolves_inside(path, root):
            inside.append(path)
        else:
            relative = path.relative_to(root).as_posix()
            report.skipped.append((relative, f"links outside the gallery folder (to {path.resolve()})"))
    # On ``workers`` threads (hashlib and file reads release the GIL), as the model waits for every hash
    # before it embeds the first file: the plan needs them all. Or by ``hasher`` (a cluster's workers).
    hashes: Iterable[tuple[Path, str | Exception]]
    if hasher is None:
        hashes = prefetch(inside, file_hash, workers=workers, depth=2 * max(workers, 1))
    else:
        hashes = hasher(inside)
    for path, content_hash in progress_bar(
        hashes, total=len(inside), desc="hashing", unit="file", disable=not progress
    ):
        relative = path.relative_to(root).as_posix()
        if isinstance(content_hash, Exception):
            report.skipped.append((relative, str(content_hash)))
            continue
        hashed.append(GalleryFile(path, relative, label_of(relative), content_hash))
    return sorted(hashed, key=lambda f: f.relative)


class ItemSink(Protocol):
    """Where embedded files go: an index, or a writer that keeps the ids of the items it re-embeds."""

    def add(self, vectors: np.ndarray, entries: Sequence[Entry], signatures: Sequence[bytes]) -> object: ...


class EmbeddingRunner(Protocol):
    """Where a build hashes, decodes and embeds its files: this process (:class:`LocalRunner`) or a Ray
    cluster (``engine.build.ray_runner.RayRunner``). The plan (what to embed, move, remove) is made here
    either way.
    """

    def hash_files(
        self, root: Path, files: Sequence[Path], report: BuildReport, progress: bool
    ) -> list[GalleryFile]: ...

    def embed_files(
        self,
        index: ItemSink,
        embedder: Embedder,
        files: Sequence[GalleryFile],
        report: BuildReport,
        *,
        batch_size: int,
        progress: bool,
    ) -> None: ...


@dataclass(frozen=True)
class LocalRunner:
    """Hashing on threads, decoding in ``decode_workers`` processes (each image within ``decode_limits``),
    embedding in this process."""

    decode_workers: int = DECODE_WORKERS
    decode_limits: DecodeLimits = field(default_factory=DecodeLimits)

    def hash_files(
        self, root: Path, files: Sequence[Path], report: BuildReport, progress: bool
    ) -> list[GalleryFile]:
        return hash_files(root, files, report, progress, workers=self.decode_workers)

    def embed_files(
        self,
        index: ItemSink,
        embedder: Embedder,
        files: Sequence[GalleryFile],
        report: BuildReport,
        *,
        batch_size: int,
        progress: bool,
    ) -> None:
        embed_files(
            index,
            embedder,
            files,
            report,
            batch_size=batch_size,
            progress=progress,
            decode_workers=self.decode_workers,
            decode_limits=self.decode_limits,
        )


def embed_files(
    index: ItemSink,
    embedder: Embedder,
    files: Sequence[GalleryFile],
    report: BuildReport,
    *,
    batch_size: int,
    progress: bool,
    decode_workers: int = DECODE_WORKERS,
    decode_limits: DecodeLimits | None = None,
) -> None:
    """Decode, embed and add ``files`` batch by batch; each batch is durable once added, and a stop signal
    (``foundation.stopping``) ends the work there.

    ``decode_workers`` processes (``engine.decode.pool``: a file over its time or memory limit, the
    defaults or ``decode_limits``, is skipped with the reason) decode and preprocess the next batches (and
    compute their perceptual signatures) while the model embeds this one.
    """
    preprocessing = embedder.card.preprocessing
    batch: list[tuple[GalleryFile, DecodedFile]] = []

    def flush(committer: BatchCommitter) -> None:
        vectors = embedder.embed_tensor(np.stack([decoded.array for _, decoded in batch]))
        committer.add(
            vectors,
            [Entry(f.relative, f.label, f.content_hash, decoded.taken) for f, decoded in batch],
            [decoded.signature for _, decoded in batch],
        )
        batch.clear()
        stopping.checkpoint()  # a stop waits for the batch being committed: nothing embedded is lost

    # Two batches in flight: the next one is complete when the model finishes this one. One thread per
    # decode process waits for it.
    pool = DecodePool(max(decode_workers, 1), decode_limits, niceness=WORKER_NICENESS)
    loaded = prefetch(
        files,
        lambda f: pool.run(decode_file, f.path, preprocessing),
        workers=decode_workers,
        depth=2 * batch_size,
    )
    with pool, BatchCommitter(index, report) as committer, EmbeddingProgress(len(files), progress) as bar:
        for gallery_file, result in loaded:
            if isinstance(result, Exception):
                report.skipped.append((gallery_file.relative, str(result)))
                bar.count(skipped=1)
                continue
            batch.append((gallery_file, result))
            bar.count(embedded=1)
            if len(batch) == batch_size:
                flush(committer)
        if batch:
            flush(committer)


class EmbeddingProgress:
    """The embedding bar of a build: the files looked at, and of them how many were embedded and how many
    skipped (a file that cannot be decoded is looked at, not embedded), e.g. ``(6/6) [..., 5 embedded, 1
    skipped]``."""

    def __init__(self, total: int, progress: bool) -> None:
        self.bar = progress_bar(total=total, desc="embedding", unit="img", disable=not progress)
        self.embedded = 0
        self.skipped = 0

    def count(self, *, embedded: int = 0, skipped: int = 0) -> None:
        self.embedded += embedded
        self.skipped += skipped
        self.bar.set_postfix_str(f"{self.embedded} embedded, {self.skipped} skipped", refresh=False)
        self.bar.update(embedded + skipped)

    def __enter__(self) -> EmbeddingProgress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.bar.close()


class BatchCommitter:
    """Adds embedded batches to an :class:`ItemSink` on a writer thread, one at a time and in order, so
    that the model embeds the next batch while this one is committed (SQLite's fsync took 20-40 ms a
    batch here, a tenth of the model's time on a batch of 32 224-px images).

    A batch counts in ``report.indexed`` once its commit has returned; leaving the ``with`` block (also
    on an error or a stop) waits for the batch being committed, so an interrupted build loses at most the
    batch the model was embedding, as when batches were committed inline.
    """

    def __init__(self, sink: ItemSink, report: BuildReport) -> None:
        self.sink = sink
        self.report = report
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="commit")
        self._committing: tuple[Future[object], int] | None = None

    def add(self, vectors: np.ndarray, entries: Sequence[Entry], signatures: Sequence[bytes]) -> None:
        """Commit a batch once the one before it is committed (raising that one's error, if it failed)."""
        self.wait()
        self._committing = (
            self._writer.submit(self.sink.add, vectors, entries, signatures),
            len(entries),
        )

    def wait(self) -> None:
        if self._committing is not None:
            future, count = self._committing
            self._committing = None
            future.result()
            self.report.indexed += count

    def __enter__(self) -> BatchCommitter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.wait()
        finally:
            self._writer.shutdown()
