"""The search service used by the API, the UI and ``dmlsearch query`` alike.

It joins an :class:`Embedder` to a :class:`GalleryIndex` built with the same model, and owns the rules of
serving: decoding untrusted uploads, batching, paging, the kNN label vote, re-ranking with the model's
PDDM unit, and adding/removing items under a readers-writer lock (searches run side by side; a write waits
for them and runs alone).
"""

from __future__ import annotations

import hashlib
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine import defaults
from engine.bundle import resolve_model
from engine.decoding import RUN_IMAGES, PixelBudget, batch_tensor, open_uploads
from engine.embedder import Embedder
from engine.images import FORMAT_SUFFIXES, decode_image, thumbnail_jpeg
from engine.labels import InvalidLabelError, check_label
from engine.locks import ReadWriteLock
from engine.reranker import PDDMReranker
from engine.voting import Prediction, knn_vote
from index.atomic import atomic_write_bytes
from index.duplicates import DuplicateGroup, find_duplicates
from index.filters import ItemFilter
from index.gallery import GalleryIndex, Hit
from index.items import ItemStore
from index.manifest import MANIFEST_NAME
from index.protocol import Item

# rerank=pddm re-scores the top max(rerank_pool, RERANK_POOL_FACTOR x k) cosine neighbours: deep enough
# that the unit can lift items the cosine ranked a few pages down, and a fixed pool for a fixed k, so that
# paging with ``offset`` walks through one re-ranked list.
RERANK_POOL_FACTOR = 4


class ItemNotFoundError(LookupError):
    """No indexed item has this id."""


class RerankUnavailableError(ValueError):
    """A re-ranking was asked for that the served model cannot do."""


class InvalidItemError(ValueError):
    """An item to add is unacceptable (a bad label, no gallery folder to store it in)."""


class DuplicateItemError(ValueError):
    """An item with the same content and label is already indexed."""


class StorageError(RuntimeError):
    """The gallery or index folder cannot be written (read-only, full): the server's problem, not the
    client's. Searches go on; the message says what was and was not written."""


@contextmanager
def _storage(outcome: str) -> Iterator[None]:
    """Turn a failed write of the gallery or the index into a :class:`StorageError` saying ``outcome``.

    Once items.sqlite has committed a change it is durable: a FAISS file not saved after it is brought in
    step from items.sqlite at the next save or start (see ``index.faiss_backend``).
    """
    try:
        yield
    except (OSError, sqlite3.OperationalError) as err:
        raise StorageError(f"{outcome}: the index or gallery folder cannot be written ({err})") from err


@dataclass(frozen=True)
class SearchResult:
    id: int
    path: str
    label: str | None
    score: float  # cosine similarity to the query
    rank: int
    pddm_score: float | None = None  # S(query, item) of the PDDM unit, with rerank="pddm"


@dataclass(frozen=True)
class SearchOptions:
    k: int = defaults.TOP_K
    min_score: float = defaults.MIN_SCORE
    offset: int = 0  # skip this many of the best results (paging); ranks stay global
    predict: bool = False
    rerank: str | None = None
    where: ItemFilter | None = None  # only items it lets through (label, path prefix, time added)


@dataclass(frozen=True)
class QueryHits:
    results: list[SearchResult]
    prediction: Prediction | None = None


@dataclass(frozen=True)
class SearchResponse:
    results: list[SearchResult]
    took_ms: float
    model_fingerprint: str
    timings_ms: dict[str, float] = field(default_factory=dict)
    prediction: Prediction | None = None


@dataclass(frozen=True)
class BatchResponse:
    queries: list[QueryHits]
    took_ms: float
    model_fingerprint: str
    timings_ms: dict[str, float]


@dataclass(frozen=True)
class NewItem:
    data: bytes
    label: str | None = None


class StageTimer:
    """Wall-clock milliseconds per named stage of one request."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.ms: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.ms[name] = self.ms.get(name, 0.0) + (time.perf_counter() - start) * 1000.0

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1000.0


class SearchService:
    """An embedder joined to an index built with the same model."""

    def __init__(
        self,
        embedder: Embedder,
        index: GalleryIndex,
        *,
        max_pixels: int = defaults.MAX_IMAGE_PIXELS,
        max_batch_pixels: int = defaults.MAX_BATCH_PIXELS,
        jpeg_draft: bool = defaults.JPEG_DRAFT,
        vote_sigma2: float = defaults.VOTE_SIGMA2,
        reranker: PDDMReranker | None = None,
        rerank_pool: int = defaults.RERANK_POOL,
    ) -> None:
        """``reranker``: the model's PDDM unit (:meth:`open` loads it when the model card names one)."""
        index.check_model(embedder.fingerprint, embedder.dim)
        if rerank_pool < 1:
            raise ValueError(f"rerank_pool must be at least 1, got {rerank_pool}")
        self.embedder = embedder
        self.index = index
        self.reranker = reranker
        self.rerank_pool = rerank_pool
        self.max_pixels = max_pixels
        # JPEG draft decoding: libjpeg scales by 1/2..1/8 while decoding, keeping the short side at least
        # the model's resize size, so a 12-MP photo is not decoded in full only to be shrunk to 224 px.
        self.draft_size = embedder.card.preprocessing.resize_size if jpeg_draft else None
        self.budget = PixelBudget(max_pixels, max_batch_pixels, self.draft_size)
        self.vote_sigma2 = vote_sigma2
        self.lock = ReadWriteLock()
        self._index_stamp = self._read_index_stamp()
        self._duplicates: dict[tuple[object, ...], list[DuplicateGroup]] = {}  # of the index as loaded

    @classmethod
    def open(
        cls,
        model_path: Path | None,
        index_dir: Path,
        *,
        threads: int = 0,
        backend: str | None = None,
        milvus_uri: str | None = None,
        **options: object,
    ) -> SearchService:
        """``backend``: refuse an index of another backend; ``milvus_uri``: where its Milvus collection is.

        ``model_path``: None serves the model the index carries. The model's PDDM unit is loaded too when
        its card names one (a model exported from a pddm run).
        """
        embedder = Embedder(resolve_model(index_dir, model_path), threads=threads)
        index = GalleryIndex.open(index_dir, backend=backend, milvus_uri=milvus_uri)
        reranker = PDDMReranker.for_model(embedder.model_path, embedder.card, threads=threads)
        return cls(embedder, index, reranker=reranker, **options)

    @property
    def model_fingerprint(self) -> str:
        return self.embedder.fingerprint

    @property
    def rerankers(self) -> list[str]:
        """The ``rerank`` values this service can answer: ``pddm`` when the model carries its PDDM unit
        and the index gives back the stored vectors of its candidates."""
        return ["pddm"] if self.reranker is not None and self._stored_vectors is not None else []

    @property
    def _stored_vectors(self) -> ItemStore | None:
        """Where the candidates' exact embeddings are read from: the FAISS backend's item store keeps the
        vector of every item (any FAISS index type, quantised ones included). The Milvus backend does not
        give vectors back (yet), and re-embedding the candidates' images per query is out of the question."""
        store = self.index.items
        return store if isinstance(store, ItemStore) else None

    def rerank_depth(self, k: int) -> int:
        """How many cosine neighbours rerank=pddm re-scores for a page of ``k``: max(rerank_pool, 4k)."""
        return max(self.rerank_pool, RERANK_POOL_FACTOR * k)

    def _read_index_stamp(self) -> tuple[int, int] | None:
        """Identifies the manifest on disk: every save replaces it atomically (a new inode)."""
        try:
            stat = (self.index.directory / MANIFEST_NAME).stat()
        except OSError:
            return None
        return stat.st_ino, stat.st_mtime_ns

    def reload_if_changed(self) -> bool:
        """Swap in the FAISS index from disk when another process saved it (``dmlsearch watch``,
        ``build-index``, ``index add``); returns whether it did.

        The new index is opened beside the old one while searches go on; they wait only for the swap.
        (Milvus collections are live: their changes are seen without this.)
        """
        stamp = self._read_index_stamp()
        if stamp is None or stamp == self._index_stamp or self.index.manifest.backend != "faiss":
            return False
        fresh = GalleryIndex.open(self.index.directory, backend="faiss")
        try:
            fresh.check_model(self.embedder.fingerprint, self.embedder.dim)
        except ValueError:
            fresh.close()
            raise
        with self.lock.write():
            stale, self.index, self._index_stamp = self.index, fresh, stamp
        stale.close()
        return True

    # -- queries -----------------------------------------------------------------------------------

    def search(
        self,
        image_bytes: bytes,
        k: int = defaults.TOP_K,
        min_score: float = defaults.MIN_SCORE,
        *,
        offset: int = 0,
        predict: bool = False,
        rerank: str | None = None,
        where: ItemFilter | None = None,
    ) -> SearchResponse:
        """Decode, embed and search one image; raises ``ImageDecodeError`` for a bad upload."""
        options = SearchOptions(k, min_score, offset, predict, rerank, where)
        batch = self.search_batch([image_bytes], options)
        (hits,) = batch.queries
        return SearchResponse(
            hits.results, batch.took_ms, batch.model_fingerprint, batch.timings_ms, hits.prediction
        )

    def search_batch(self, images: Sequence[bytes], options: SearchOptions) -> BatchResponse:
        """Many query images: decoded one by one, embedded as one batch, searched as one batch.

        A bad image fails the whole batch with an ``ImageDecodeError`` naming its position (``image 2:``),
        before any model work is done; so does a batch over the pixel budget, before any image is decoded.
        """
        self._check_options(options)
        timer = StageTimer()
        with timer.stage("decode"):
            headers = open_uploads(images, self.budget)
        tensor = batch_tensor(headers, self.embedder.card.preprocessing, stage=timer.stage)
        with timer.stage("embed"):
            vectors = self.embedder.embed_tensor(tensor, run_size=RUN_IMAGES)
        queries = self._search_vectors(vectors, options, timer)
        return BatchResponse(queries, timer.elapsed_ms(), self.model_fingerprint, timer.ms)

    def similar(self, item_id: int, options: SearchOptions) -> SearchResponse:
        """Search by an indexed item: its stored image is the query, and the item itself is left out."""
        self._check_options(options)
        timer = StageTimer()
        path = self.image_path(item_id)
        with timer.stage("decode"):
            image = decode_image(path.read_bytes(), max_pixels=self.max_pixels, draft_size=self.draft_size)
        with timer.stage("preprocess"):
            tensor = self.embedder.preprocess([image])
        with timer.stage("embed"):
            vector = self.embedder.embed_tensor(tensor, run_size=RUN_IMAGES)
        (hits,) = self._search_vectors(vector, options, timer, exclude=item_id)
        return SearchResponse(
            hits.results, timer.elapsed_ms(), self.model_fingerprint, timer.ms, hits.prediction
        )

    def _check_options(self, options: SearchOptions) -> None:
        if options.k < 1 or options.offset < 0:
            raise ValueError(f"k must be >= 1 and offset >= 0, got k={options.k}, offset={options.offset}")
        if options.rerank is None or options.rerank in self.rerankers:
            return
        if options.rerank != "pddm" or self.reranker is None:
            raise RerankUnavailableError(
                f"the served model ({self.embedder.card.backbone}, loss {self.embedder.card.loss or 'none'}) "
                f"cannot re-rank with {options.rerank!r}: rerank=pddm needs a model exported with its PDDM "
                "scoring unit (dmlsearch export of a run trained with --loss pddm)"
            )
        raise RerankUnavailableError(
            f"rerank=pddm needs the stored vectors of the candidates, and this {self.index.manifest.backend} "
            "index does not give them back: serve a FAISS index to re-rank"
        )

    def _search_vectors(
        self, vectors: np.ndarray, options: SearchOptions, timer: StageTimer, exclude: int | None = None
    ) -> list[QueryHits]:
        """Search, drop the excluded item and those below ``min_score`` (a cosine cut, re-ranked or not),
        re-rank when asked, rank, vote and cut the page.

        With rerank, the page is taken from the re-ranked pool (:meth:`rerank_depth`): an ``offset`` past
        the pool gives short or empty pages, and the vote is over the top ``offset + k`` of the re-ranked
        list, weighted by their cosine scores like any vote.
        """
        depth = self.rerank_depth(options.k) if options.rerank else options.offset + options.k
        # One extra neighbour when the query item itself will be dropped from its own results.
        depth += exclude is not None
        with self.lock.read():  # the candidates' vectors are read before a write can remove them
            with timer.stage("search"):
                hit_lists = [
                    [hit for hit in hits if hit.item.id != exclude and hit.score >= options.min_score]
                    for hits in self.index.search(vectors, depth, options.where)
                ]
            pddm_lists: list[np.ndarray | None] = [None] * len(hit_lists)
            if options.rerank:
                with timer.stage("rerank"):
                    pddm_lists = [
                        self._pddm_scores(v, hits) for v, hits in zip(vectors, hit_lists, strict=True)
                    ]
        queries = []
        for hits, pddm in zip(hit_lists, pddm_lists, strict=True):
            # A stable sort: equal PDDM scores keep their cosine order.
            order = range(len(hits)) if pddm is None else np.argsort(-pddm, kind="stable")
            pddm_scores = [None] * len(hits) if pddm is None else pddm.tolist()
            ranked = []
            for rank, i in enumerate(order, start=1):
                hit = hits[i]
                ranked.append(
                    SearchResult(hit.item.id, hit.item.path, hit.item.label, hit.score, rank, pddm_scores[i])
                )
            prediction = None
            if options.predict:
                voters = ranked[: options.offset + options.k]
                prediction = knn_vote(
                    [r.label for r in voters], [r.score for r in voters], sigma2=self.vote_sigma2
                )
            page = ranked[options.offset : options.offset + options.k]
            queries.append(QueryHits(page, prediction))
        return queries

    def _pddm_scores(self, query: np.ndarray, hits: list[Hit]) -> np.ndarray:
        """S(query, candidate) for each hit, from the candidates' stored (exact, not re-embedded) vectors."""
        ids = np.array([hit.item.id for hit in hits], dtype=np.int64)
        return self.reranker.score(query, self._stored_vectors.vectors(ids))

    def duplicates(
        self, threshold: float, offset: int, limit: int
    ) -> tuple[list[list[tuple[Item, float]]], int]:
        """A page of near-duplicate groups, largest first (each item with its highest cosine to another
        member), and the number of groups. Groups are computed once per threshold and index state."""
        with self.lock.read():
            state = (self._index_stamp, id(self.index), len(self.index))
            groups = self._duplicates.get((*state, threshold))
            if groups is None:
                groups = find_duplicates(self.index, threshold)
                self._duplicates = {
                    key: value for key, value in self._duplicates.items() if key[:3] == state
                } | {(*state, threshold): groups}
            page = groups[offset : offset + limit]
            items = self.index.items.get_many([int(i) for group in page for i in group.ids])
        rows = [
            [
                (items[int(i)], float(score))
                for i, score in zip(group.ids, group.scores, strict=True)
                if int(i) in items
            ]
            for group in page
        ]
        return rows, len(groups)

    # -- items -------------------------------------------------------------------------------------

    def item(self, item_id: int) -> Item:
        with self.lock.read():  # not while a write is half done on the shared SQLite connection
            return self._find(item_id)

    def _find(self, item_id: int) -> Item:
        item = self.index.items.get(item_id)
        if item is None:
            raise ItemNotFoundError(f"no item with id {item_id}")
        return item

    def image_path(self, item_id: int) -> Path:
        """The gallery file of an item, refusing anything that resolves outside the gallery root."""
        item = self.item(item_id)
        root = self.index.manifest.gallery_root
        if root is None:
            raise ItemNotFoundError(f"item {item_id} has no stored image (the index records no gallery)")
        root_path = Path(root).resolve()
        path = (root_path / item.path).resolve()
        # resolve() follows symlinks and "..", so a path or link pointing outside the gallery is refused.
        if not path.is_relative_to(root_path) or not path.is_file():
            raise ItemNotFoundError(f"the image of item {item_id} is not available in the gallery")
        return path

    def thumbnail(self, item_id: int, size: int) -> bytes:
        """A JPEG of the item's image, at most ``size`` pixels on its longer side."""
        return thumbnail_jpeg(self.image_path(item_id).read_bytes(), size, max_pixels=self.max_pixels)

    def list_items(self, offset: int, limit: int) -> tuple[list[Item], int]:
        """A page of items in id order, and the total count."""
        with self.lock.read():
            return self.index.items.page(offset, limit), len(self.index)

    def add_items(self, new_items: Sequence[NewItem]) -> list[Item]:
        """Store the images under the gallery root (``<label>/<content hash>.<ext>``) and index them.

        Everything is validated, decoded and embedded before the index is touched, so a bad image leaves
        the index unchanged. Files are written atomically; the index is saved before returning.
        """
        root = self._gallery_root()
        headers = open_uploads([new.data for new in new_items], self.budget)
        prepared = []
        for position, (new, header) in enumerate(zip(new_items, headers, strict=True)):
            label = self._label_folder(root, new.label, position)
            digest = hashlib.sha256(new.data).hexdigest()
            relative = Path(label or ".") / f"{digest[:20]}{FORMAT_SUFFIXES[header.format]}"
            target = root / relative
            if target.exists() and (not target.is_file() or target.read_bytes() != new.data):
                raise InvalidItemError(f"image {position}: {relative} already holds another file")
            if any(relative.as_posix() == earlier[0] for earlier in prepared):
                raise DuplicateItemError(f"image {position} repeats an earlier image of this request")
            prepared.append((relative.as_posix(), label, digest, target, new.data))
        preprocessing = self.embedder.card.preprocessing
        vectors = self.embedder.embed_tensor(batch_tensor(headers, preprocessing), run_size=RUN_IMAGES)
        with self.lock.write():
            for relative, *_ in prepared:
                if self.index.items.get_by_path(relative) is not None:
                    raise DuplicateItemError(f"{relative} is already indexed")
            written = []
            try:
                with _storage("nothing was added"):
                    for _, _, _, target, data in prepared:
                        if not target.exists():
                            atomic_write_bytes(target, data)
                            written.append(target)
                    ids = self.index.add(
                        vectors, [(relative, label, digest) for relative, label, digest, *_ in prepared]
                    )
            except BaseException:
                for target in written:  # files of items that never made it into the index
                    target.unlink(missing_ok=True)
                raise
            with _storage(f"items {ids} were stored and are searchable, but the index files were not saved"):
                self.index.save()
            self._index_stamp = self._read_index_stamp()  # our own write: nothing to reload
        return [self.item(item_id) for item_id in ids]

    def remove_item(self, item_id: int) -> Item:
        """Remove an item from the index (its gallery file stays on disk) and save the index."""
        with self.lock.write():
            item = self._find(item_id)
            with _storage("nothing was removed"):
                self.index.remove([item_id])
            with _storage(f"item {item_id} was removed, but the index files were not saved"):
                self.index.save()
            self._index_stamp = self._read_index_stamp()
        return item

    def _label_folder(self, root: Path, label: str | None, position: int) -> str | None:
        """The label (NFC) once it is a safe folder name of its own under ``root``; else InvalidItemError."""
        if label is None:
            return None
        try:
            label = check_label(label)
        except InvalidLabelError as err:
            raise InvalidItemError(f"image {position}: {err}") from None
        folder = root / label
        # A symlinked folder could lead anywhere; a file (LICENSES.md) cannot hold images.
        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            raise InvalidItemError(f"image {position}: label {label!r} names a file in the gallery folder")
        if self.index.directory.resolve().is_relative_to(folder.resolve()):
            raise InvalidItemError(f"image {position}: label {label!r} names the index's own folder")
        return label

    def _gallery_root(self) -> Path:
        root = self.index.manifest.gallery_root
        if root is None:
            raise InvalidItemError("the index records no gallery folder to store new images in")
        return Path(root).resolve()
