"""Switch a running server to another bundle (an index directory and the model it carries) without
dropping a request, after the bundle has proven it can answer.

Every change of the served bundle goes through :class:`Reloader` and ``SearchService.swap``
(``CurrentBundle.swap``): ``POST /v1/admin/reload`` and SIGHUP (:meth:`Reloader.reload`: the configured
path again, a symlink the operator repointed, say, or another directory), and the index poller
(:meth:`Reloader.refresh`: the served index saved by another process). The new bundle is loaded beside
the served one and probed (``engine.serve.probe``: a query through its model in a child process that is killed
when it overruns, and through its index); then it is swapped in under the lock writes take, so that no
write is half done and every acknowledged write is in it, and the old index is closed. A bundle that
fails to load or to prove itself is refused with the reason, and the served one stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from starlette.concurrency import run_in_threadpool

from app.state import EngineState, failure_reason
from engine.model.bundle import ModelFile
from engine.serve.loaded_bundle import LoadedBundle
from engine.serve.probe import probe_output, prove_bundle, prove_index
from engine.serve.search import SearchService
from foundation.errors import DmlsearchError
from index.gallery import IndexMismatchError
from index.manifest import DiskChange

if TYPE_CHECKING:  # the context holds the reloader
    from app.context import AppContext

log = logging.getLogger("dmlsearch.app")


class ReloadError(DmlsearchError):
    """The new bundle could not be loaded or failed its probe: the served one stays. 422 whatever the
    reason, a directory or model named that does not exist included: the request names it in its body,
    and the route itself is there."""

    code = "reload_failed"

    @classmethod
    def of(cls, err: Exception) -> ReloadError:
        return cls(failure_reason(err))


@dataclass(frozen=True)
class Reloaded:
    index_path: Path
    model_fingerprint: str
    previous_model_fingerprint: str | None
    count: int
    took_ms: float


class Reloader:
    """Loads, proves and swaps in bundles for one app, one change at a time."""

    def __init__(self, context: AppContext) -> None:
        self.context = context
        self._lock = threading.Lock()  # two reloads at once would race for the last word

    def reload(self, index_path: Path | None = None, model_path: Path | None = None) -> Reloaded:
        """Load ``index_path`` (default: the configured one), prove it and swap it in; raises
        :class:`ReloadError`.

        ``model_path`` None: the model the index carries (the configured model for the configured path).
        """
        with self._lock:
            return self._reload(index_path, model_path)

    def refresh(self) -> Reloaded | None:
        """Serve the served index again when another process saved it and seeing that takes opening it
        again (FAISS; None: neither), with the model already served; an index rebuilt in place with
        another model is reloaded whole, with the model it carries. Raises :class:`ReloadError` when the
        saved index cannot be served."""
        with self._lock:
            service = self.context.engine.service
            # Saved or replaced alike: the served model is tried first, and an index of another model is
            # reloaded whole below.
            if service is None or service.current.bundle.unseen_change() is DiskChange.UNCHANGED:
                return None
            directory = service.index.directory
            started = time.perf_counter()
            try:
                index = LoadedBundle.open_index(directory, backend=service.index.manifest.backend)
            except Exception as err:  # a save in progress or a bad index: keep serving the one loaded
                raise ReloadError.of(err) from err
            try:
                bundle = service.current.bundle.with_index(index)
            except IndexMismatchError:
                index.close()
                return self._reload(directory, None)
            self._prove(bundle, directory, partial(prove_index, stored_vectors=False))
            return self._serve(bundle, directory, started)

    def _reload(self, index_path: Path | None, model_path: Path | None) -> Reloaded:
        started = time.perf_counter()
        settings = self.context.settings
        where = index_path or settings.index_path
        service = self.context.engine.service
        try:
            index_path, model = EngineState.locate(settings, index_path, model_path)
            if service is not None and model.card.fingerprint == service.model_fingerprint:
                output = None  # the model served already (the same bytes): its session serves the new index
            else:
                output = probe_output(model.path, settings.reload_probe_seconds)  # before it is loaded here
        except Exception as err:  # whatever is wrong with the new bundle, keep serving the old one
            raise _refused(where, err) from err
        # No write of the served index saves while the new bundle is read and probed: a save replaces
        # items.sqlite's rows before the FAISS file, and a snapshot of the two in between is torn (the
        # probe then finds only items the store no longer holds). Searches go on meanwhile; a write
        # acknowledged after this and before the swap is read again by the swap.
        with service.current.reading() if service is not None else contextlib.nullcontext():
            bundle, prove = self._load(service, index_path, model, output, where)
            self._prove(bundle, where, prove)
        return self._serve(bundle, where, started)

    def _load(
        self,
        service: SearchService | None,
        index_path: Path,
        model: ModelFile,
        output: np.ndarray | None,
        where: Path,
    ) -> tuple[LoadedBundle, Callable[[LoadedBundle], None]]:
        """The new bundle, beside the served one, and how to prove it (``output``: the new model's probe
        output; None: the served model's session is kept)."""
        settings = self.context.settings
        try:
            if output is not None:
                bundle = EngineState.open_bundle(settings, index_path, model)
                return bundle, partial(prove_bundle, output=output)
            assert service is not None  # no probe output only where a model is served already
            index = EngineState.open_index(settings, index_path)
            try:
                bundle = service.current.bundle.with_index(index)
            except ValueError:
                index.close()
                raise
            return bundle, partial(prove_index, stored_vectors=True)
        except Exception as err:  # whatever is wrong with the new bundle, keep serving the old one
            raise _refused(where, err) from err

    @staticmethod
    def _prove(bundle: LoadedBundle, where: Path, prove: Callable[[LoadedBundle], None]) -> None:
        try:
            prove(bundle)
        except Exception as err:  # whatever is wrong with the new bundle, keep serving the old one
            bundle.index.close()
            raise _refused(where, err) from err

    def _serve(self, bundle: LoadedBundle, where: Path, started: float) -> Reloaded:
        state = self.context.engine
        previous = state.service.model_fingerprint if state.service is not None else None
        try:
            if state.service is not None:
                served = state.service.swap(bundle)
            else:  # nothing served yet (the start-up load failed): this bundle is the first
                state.service = SearchService(
                    bundle, EngineState.config(self.context.settings, self.context.decoder)
                )
                state.not_ready_reason, state.index_server_down = None, False
                served = bundle
        except Exception as err:  # whatever is wrong with the new bundle, keep serving the old one
            bundle.index.close()
            raise _refused(where, err) from err
        result = Reloaded(
            index_path=Path(where),
            model_fingerprint=served.embedder.fingerprint,
            previous_model_fingerprint=previous,
            count=len(served.index),
            took_ms=(time.perf_counter() - started) * 1000.0,
        )
        log.info(
            "reloaded %s: model %s, %d items (%.0f ms)",
            where,
            result.model_fingerprint[:12],
            result.count,
            result.took_ms,
        )
        return result


def _refused(where: Path, err: Exception) -> ReloadError:
    """A new bundle that failed to load, prove itself or swap in: logged, and the served one stays."""
    log.error("reload of %s failed, still serving the loaded index: %s", where, err)
    return ReloadError.of(err)


def reload_on_sighup(reloader: Reloader) -> Callable[[], None]:
    """SIGHUP reloads the configured index path; returns the function that stops listening.

    Signals reach only the main thread's event loop (uvicorn's): elsewhere (an in-process test client)
    and on platforms without SIGHUP this does nothing.
    """
    if not hasattr(signal, "SIGHUP") or threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task] = set()

    async def reload() -> None:
        with contextlib.suppress(ReloadError):  # logged by the reloader
            await run_in_threadpool(reloader.reload)

    def on_sighup() -> None:
        log.info("SIGHUP: reloading the configured index")
        task = loop.create_task(reload())
        tasks.add(task)  # keep a reference until it is done
        task.add_done_callback(tasks.discard)

    loop.add_signal_handler(signal.SIGHUP, on_sighup)

    def stop_listening() -> None:
        loop.remove_signal_handler(signal.SIGHUP)

    return stop_listening
