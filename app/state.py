"""The engine the server shares across requests, loaded once at start-up."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from app.settings import Settings
from engine.decode.pool import Decoder
from engine.gallery.files import own_folders
from engine.gallery.shared import require_shared_gallery
from engine.model.bundle import ModelFile, locate_model
from engine.serve.loaded_bundle import LoadedBundle, ServingConfig
from engine.serve.probe import prove_index
from engine.serve.search import SearchService
from foundation.atomic import remove_abandoned
from foundation.errors import DmlsearchError
from index.gallery import GalleryIndex
from index.protocol import BackendUnavailableError

log = logging.getLogger("dmlsearch.app")


class NothingToServeError(DmlsearchError):
    """At start, there is no index to serve at the configured path, or no model for it, and the server was
    not asked to wait for one."""

    code = "nothing_to_serve"


def failure_reason(err: Exception) -> str:
    """What went wrong, as the user reads it: the error's message, never the name of our class."""
    return str(err) or "an unexpected error (the server's log has its traceback)"


@dataclass
class EngineState:
    """Either a ready :class:`SearchService` or the reason there is none (reported by ``/readyz``)."""

    service: SearchService | None = None
    not_ready_reason: str | None = "not loaded yet"
    index_server_down: bool = False  # the load failed on the index's server (Milvus): worth retrying

    @staticmethod
    def config(settings: Settings, decoder: Decoder) -> ServingConfig:
        """How bundles are served; ``decoder``: where their images are decoded (the app's decode
        processes)."""
        return ServingConfig(
            max_pixels=settings.max_image_pixels,
            max_batch_pixels=settings.max_batch_pixels,
            jpeg_draft=settings.jpeg_draft,
            vote_sigma2=settings.vote_sigma2,
            rerank_pool=settings.rerank_pool,
            decoder=decoder,
        )

    @staticmethod
    def locate(
        settings: Settings, index_path: Path | None = None, model_path: Path | None = None
    ) -> tuple[Path, ModelFile]:
        """The index directory (default: the configured one) and the model to serve it with, checked to
        be the one it was built with (``model_path`` None: the configured model for the configured index,
        else the model the index carries), its card read once for the whole load."""
        if index_path is None:
            index_path, model_path = settings.index_path, model_path or settings.model_path
        return index_path, locate_model(index_path, model_path)

    @staticmethod
    def open_index(settings: Settings, index_path: Path) -> GalleryIndex:
        return LoadedBundle.open_index(index_path, backend=settings.backend, milvus=settings.milvus)

    @staticmethod
    def open_bundle(settings: Settings, index_path: Path, model: ModelFile) -> LoadedBundle:
        """The embedder, its PDDM unit and the index, loaded as one bundle (swapped as one)."""
        return LoadedBundle.open(
            model,
            index_path,
            threads=settings.threads,
            backend=settings.backend,
            milvus=settings.milvus,
            run_seconds=settings.embed_run_seconds,
        )

    @classmethod
    def open(cls, settings: Settings, *, decoder: Decoder) -> EngineState:
        """A ready engine over the configured bundle, or an exception saying why not. The bundle first
        passes the probe a reload's does (engine.serve.probe), here in this process, where nothing is served
        yet: the model's run deadline (``embed_run_seconds``) stops a model that never returns."""
        bundle = cls.open_bundle(settings, *cls.locate(settings))
        try:
            prove_index(bundle, stored_vectors=True)
            if settings.writes_enabled:  # uploads and deletes go to the gallery every replica shares
                require_shared_gallery(bundle.index)
        except Exception:
            bundle.index.close()
            raise
        return cls(SearchService(bundle, cls.config(settings, decoder)), None)

    @classmethod
    def require_bundle(cls, settings: Settings) -> None:
        """Refuse to start where there is nothing to serve (a typo in the index path, an index not built
        yet, its model missing or not the index's), unless ``wait_for_index`` asks to wait for it: only the
        manifest and the model card are read. An index that is there but fails to load or to answer its
        probe is the start-up load's to report (:meth:`load`: not ready, with the reason)."""
        if settings.wait_for_index:
            return
        try:
            cls.locate(settings)
        except (DmlsearchError, OSError) as err:
            raise NothingToServeError(
                f"{failure_reason(err)}; to start anyway and serve the index once it is there, give "
                "--wait-for-index (DMLSEARCH_WAIT_FOR_INDEX=true)"
            ) from err

    @classmethod
    def load(cls, settings: Settings, *, decoder: Decoder) -> EngineState:
        """The configured engine, or a not-ready state with the reason (the process stays up)."""
        try:
            state = cls.open(settings, decoder=decoder)
        except Exception as err:  # any load failure leaves the process up and not ready
            reason = failure_reason(err)
            log.error("search engine not ready: %s", reason, exc_info=not isinstance(err, DmlsearchError))
            return cls(None, reason, isinstance(err, BackendUnavailableError))
        assert state.service is not None  # open returns a ready state or raises
        if state.service.index.manifest.gallery_root is not None:
            _remove_abandoned_uploads(Path(state.service.index.manifest.gallery_root))
        return state

    def on_index_server(self) -> bool:
        """Whether the served index is on an index server (Milvus), whose calls a request's deadline bounds,
        and so its wait for a compute slot (``app.compute``)."""
        return self.service is not None and not self.service.index.capabilities.lives_in_folder

    def size(self) -> int:
        return len(self.service.index) if self.service is not None else -1


def _remove_abandoned_uploads(gallery: Path) -> None:
    """Temporary files of added images whose write was interrupted: the API writes them into the gallery
    folder and its label folders (the index folder cleans itself when opened)."""
    remove_abandoned(gallery)
    try:
        folders = own_folders(gallery)
    except OSError:
        return
    for folder in folders:
        remove_abandoned(folder)
