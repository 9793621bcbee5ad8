"""A build's hashing, decoding and embedding on a Ray cluster (``build-index --ray [ADDRESS]``).

The driver (the ``build-index`` process) lists the gallery, plans the sync from the content hashes and
commits every embedded batch to the index, as a local build does: only where files are hashed, decoded and
embedded changes. Two Ray Data pipelines do that work:
- hashing: the listed files, hashed by stateless tasks;
- decoding and embedding: the files the plan embeds, through a pool of actors that each hold one
  onnxruntime session and decode in ``engine.decode.pool`` processes (the same limits as a local build).
The model travels in Ray's object store, so nodes need no copy of it; the gallery folder must be readable
at the same path on every node (a shared mount), and every node needs dmlsearch installed.

Ray Data retries the work of an actor or node that dies (actors are restarted, their tasks run again); the
driver commits each file at most once, so the index ends with one item per content whatever was retried.
Ray is the optional extra ``.[ray]``, imported only here and only when a build asks for it.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from engine.build.embedding import BatchCommitter, EmbeddingProgress, ItemSink, hash_files
from engine.build.prefetch import FILE_ERRORS, WORKER_NICENESS, DecodedFile, decode_file, prefetch
from engine.build.report import BuildReport
from engine.decode.pool import DecodeLimits, DecodePool
from engine.gallery.hashing import GalleryFile, file_hash
from engine.model.embedder import Embedder
from engine.model.model_card import ModelCard
from foundation import stopping
from foundation.errors import MissingDependencyError, UnavailableError
from index.protocol import Entry

# Files per hashing task: enough that a task's start (milliseconds) is small beside its reads.
HASH_BATCH = 256
# How long a build waits for a cluster's head to answer; ray.init alone retries for many minutes.
HEAD_ANSWER_SECONDS = 10.0


class FileError(Exception):
    """A file a Ray worker could not hash or decode, with the worker's reason (the report lists it)."""


def _ray() -> ModuleType:
    try:
        import ray
        import ray.data
    except ImportError as err:
        raise MissingDependencyError("Ray is not installed: pip install 'dmlsearch[ray]'") from err
    return ray


class RayRunner:
    """Hash, decode and embed on a Ray cluster: the one at ``address`` (``host:port`` of its head, as ``ray
    start --head`` prints it), else a local Ray runtime started for this build and stopped after it.

    ``actors``: at most this many embedding actors (default: as many as the cluster has CPUs over
    ``cpus_per_actor``); each runs onnxruntime on ``cpus_per_actor`` threads and decodes in
    ``decode_workers`` processes, each image within ``decode_limits`` (default: the decode pool's). Use as
    a context manager: it connects on entry and disconnects on exit.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        actors: int | None = None,
        cpus_per_actor: int = 1,
        decode_workers: int = 1,
        decode_limits: DecodeLimits | None = None,
    ) -> None:
        self.address = address
        self.actors = actors
        self.cpus_per_actor = cpus_per_actor
        self.decode_workers = decode_workers
        self.decode_limits = decode_limits
        self._ray = _ray()

    def __enter__(self) -> RayRunner:
        ray = self._ray
        # Ray's own INFO lines would bury the build's output; its warnings and errors still show, but for
        # the notices about choices made here: Ray's progress bars are off (the driver shows the build's
        # own), and a local runtime (started for this build, stopped after it) has token authentication.
        quiet = {"log_to_driver": False, "logging_level": "warning"}
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
        if self.address is None:  # a runtime of its own ("local": never a cluster RAY_ADDRESS names)
            logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(
                logging.ERROR
            )
            ray.init(address="local", include_dashboard=False, **quiet)
        else:
            if self.address != "auto":  # "auto" (the cluster started on this machine): Ray fails fast itself
                _wait_for_head(self.address, HEAD_ANSWER_SECONDS)
            ray.init(address=self.address, **quiet)
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False  # the driver shows the build's own bars
        context.print_on_execution_start = False
        self._restore_notices = _one_line_per_cluster_notice()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._ray.shutdown()
        self._restore_notices()

    def hash_files(
        self, root: Path, files: Sequence[Path], report: BuildReport, progress: bool
    ) -> list[GalleryFile]:
        return hash_files(root, files, report, progress, hasher=self._hashes)

    def _hashes(self, paths: list[Path]) -> Iterator[tuple[Path, str | Exception]]:
        if not paths:
            return
        rows = [{"path": str(path)} for path in paths]
        dataset = self._ray.data.from_items(rows, override_num_blocks=math.ceil(len(rows) / HASH_BATCH))
        hashed = dataset.map_batches(_hash_batch, batch_size=HASH_BATCH, num_cpus=1)
        for batch in hashed.iter_batches(batch_size=None, batch_format="numpy"):
            for path, digest, error in zip(batch["path"], batch["hash"], batch["error"], strict=True):
                yield Path(path), FileError(error) if error else str(digest)

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
        """Embed ``files`` on the cluster and add them to ``index`` batch by batch as they come back; each
        batch is durable once added, and a stop signal (``foundation.stopping``) ends the work there. Files
        the workers could not decode are listed in ``report.skipped`` (in path order, as a local build lists
        them)."""
        if not files:
            return
        ray = self._ray
        rows = [{"file": position, "path": str(f.path)} for position, f in enumerate(files)]
        model = {name: path.read_bytes() for name, path in _model_files(embedder).items()}
        actors = self.actors or self._cluster_actors()
        embedded = ray.data.from_items(
            rows, override_num_blocks=math.ceil(len(rows) / batch_size)
        ).map_batches(
            EmbedActor,
            batch_size=batch_size,
            fn_constructor_kwargs={
                "model": ray.put(model),
                "fingerprint": embedder.fingerprint,
                "threads": self.cpus_per_actor,
                "decode_workers": self.decode_workers,
                "decode_limits": self.decode_limits,
            },
            # Every actor from the start (an autoscaled pool grows one actor at a time, which a build of a
            # few thousand images spends on one node), and down to one where nodes leave.
            compute=ray.data.ActorPoolStrategy(min_size=1, max_size=actors, initial_size=actors),
            num_cpus=self.cpus_per_actor,
        )
        done: set[int] = set()
        skipped: list[tuple[str, str]] = []
        try:
            with (
                BatchCommitter(index, report) as committer,
                EmbeddingProgress(len(files), progress) as bar,
            ):
                for batch in embedded.iter_batches(batch_size=None, batch_format="numpy"):
                    keep = []
                    failed = len(skipped)
                    for row, position in enumerate(batch["file"]):
                        if position in done:  # delivered twice (a retried task): committed once
                            continue
                        done.add(position)
                        if batch["error"][row]:
                            skipped.append((files[position].relative, str(batch["error"][row])))
                        else:
                            keep.append(row)
                    if keep:
                        committer.add(
                            batch["vector"][keep],
                            [
                                Entry(f.relative, f.label, f.content_hash, str(batch["taken"][row]))
                                for row in keep
                                for f in [files[batch["file"][row]]]
                            ],
                            [bytes(batch["signature"][row]) for row in keep],
                        )
                    bar.count(embedded=len(keep), skipped=len(skipped) - failed)
                    stopping.checkpoint()  # after the batch is handed to the committer, which finishes it
        finally:
            report.skipped.extend(sorted(skipped))

    def _cluster_actors(self) -> int:
        cpus = int(self._ray.cluster_resources().get("CPU", 1))
        return max(1, cpus // self.cpus_per_actor)


def _wait_for_head(address: str, seconds: float) -> None:
    """Return once a gRPC server (a Ray head's GCS, or its Ray Client server for ``ray://``) answers at
    ``address`` and a head's GCS takes this process's token, if it asks for one; else raise
    :class:`UnavailableError`: after ``seconds`` for a wrong address, a cluster that is not up or a port
    that speaks another protocol, at once for a token missing or refused (``ray.init`` would only say
    "Failed to connect", 20 s later)."""
    import grpc  # a dependency of Ray's

    channel = grpc.insecure_channel(address.removeprefix("ray://"))
    try:
        grpc.channel_ready_future(channel).result(timeout=seconds)
        if not address.startswith("ray://"):
            _check_token(channel, address, seconds)
    except grpc.FutureTimeoutError:
        raise UnavailableError(
            f"no Ray cluster answers at {address} (waited {seconds:g} s): start one with `ray start --head` "
            "and pass the address it prints, or use --ray local",
            code="ray_unavailable",
        ) from None
    finally:
        channel.close()


# A GCS request every Ray client makes first; it carries the token as ray.init's requests do.
CLUSTER_ID_METHOD = "/ray.rpc.NodeInfoGcsService/GetClusterId"


def _check_token(channel: Any, address: str, seconds: float) -> None:
    """Ask the head's GCS for the cluster's id with the token Ray would send (RAY_AUTH_MODE=token and
    RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token; none otherwise)."""
    import grpc
    from ray._private.authentication.grpc_authentication_client_interceptor import (
        SyncAuthenticationMetadataClientInterceptor,
    )

    with_token = grpc.intercept_channel(channel, SyncAuthenticationMetadataClientInterceptor())
    ask = with_token.unary_unary(CLUSTER_ID_METHOD, request_serializer=bytes, response_deserializer=bytes)
    try:
        ask(b"", timeout=seconds)
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.UNAUTHENTICATED:
            return  # not a token matter: ray.init reports it
        sent = (
            "sent a token it refused"
            if os.environ.get("RAY_AUTH_MODE") == "token"
            else "sent none, as RAY_AUTH_MODE=token is not set here"
        )
        raise UnavailableError(
            f"the Ray cluster at {address} requires an authentication token (its head runs with "
            f"RAY_AUTH_MODE=token) and this build {sent}: run the build with RAY_AUTH_MODE=token and the "
            "head's token in RAY_AUTH_TOKEN, in the file RAY_AUTH_TOKEN_PATH names, or in ~/.ray/auth_token "
            "(the head keeps its token in ~/.ray/auth_token on its machine unless its own RAY_AUTH_TOKEN or "
            "RAY_AUTH_TOKEN_PATH gave it)",
            code="ray_token_refused",
        ) from None


def _one_line_per_cluster_notice() -> Callable[[], None]:
    """Ray's notices about the cluster (a raylet terminated, a node marked dead), each once and cut to its
    first line; returns what undoes it.

    The driver prints every error the cluster publishes (``ray._private.worker.listen_error_messages``,
    whatever ``log_to_driver`` says): a raylet killed mid-build came with its last 20 log lines and state
    dump, twice (49 lines). Ray offers no setting for it: its printer is wrapped here.
    """
    worker = importlib.import_module("ray._private.worker")
    original = getattr(worker, "print_to_stdstream", None)
    if original is None:  # another Ray: its own output stays
        return lambda: None
    seen: set[str] = set()

    def first_lines(data: dict, ignore_prefix: bool) -> None:
        if data.get("pid") == "raylet":
            notices = [str(message).strip() for message in data["lines"]]
            lines = [notice.splitlines()[0] for notice in notices if notice]
            lines = [line for line in lines if line not in seen]
            seen.update(lines)
            if not lines:
                return
            data = {**data, "lines": lines}
        original(data, ignore_prefix)

    setattr(worker, "print_to_stdstream", first_lines)  # noqa: B010 (a module typed as ModuleType)

    def restore() -> None:
        setattr(worker, "print_to_stdstream", original)  # noqa: B010

    return restore


def _model_files(embedder: Embedder) -> dict[str, Path]:
    """The files an embedder needs: the ONNX model and its card."""
    return {"model.onnx": embedder.model_path, "model.json": ModelCard.path_for(embedder.model_path)}


def _hash_batch(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Content hashes of a batch of paths (on a Ray worker); an unreadable file gets its reason instead."""
    hashes, errors = [], []
    for path in batch["path"]:
        try:
            hashes.append(file_hash(Path(path)))
            errors.append("")
        except FILE_ERRORS as err:
            hashes.append("")
            errors.append(str(err))
    return {"path": batch["path"], "hash": np.array(hashes), "error": np.array(errors)}


class EmbedActor:
    """One onnxruntime session and its decode processes on a Ray worker: batches of paths in, vectors out.

    The model comes from the object store and is written once per machine (under its fingerprint) where
    onnxruntime can open it.
    """

    def __init__(
        self,
        model: Any,
        fingerprint: str,
        threads: int,
        decode_workers: int,
        decode_limits: DecodeLimits | None = None,
    ) -> None:
        ray = _ray()
        files = ray.get(model) if isinstance(model, ray.ObjectRef) else model
        folder = Path(tempfile.gettempdir()) / "dmlsearch-ray-models" / fingerprint
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            target = folder / name
            if not target.exists():  # written aside and renamed: actors on one machine share it
                aside = folder / f".{name}.{os.getpid()}"
                aside.write_bytes(data)
                aside.replace(target)
        self.embedder = Embedder(folder / "model.onnx", threads=threads)
        self.decode_workers = max(decode_workers, 1)
        self.pool = DecodePool(self.decode_workers, decode_limits, niceness=WORKER_NICENESS)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        preprocessing = self.embedder.card.preprocessing
        decoded: list[DecodedFile | None] = []
        errors: list[str] = []
        loaded = prefetch(
            [Path(path) for path in batch["path"]],
            lambda path: self.pool.run(decode_file, path, preprocessing),
            workers=self.decode_workers,
            depth=len(batch["path"]),
        )
        for _, result in loaded:
            if isinstance(result, Exception):
                decoded.append(None)
                errors.append(str(result))
            else:
                decoded.append(result)
                errors.append("")
        arrays = [d.array for d in decoded if d is not None]
        vectors = np.zeros((len(decoded), self.embedder.dim), dtype=np.float32)
        if arrays:
            vectors[[i for i, d in enumerate(decoded) if d is not None]] = self.embedder.embed_tensor(
                np.stack(arrays)
            )
        return {
            "file": batch["file"],
            "vector": vectors,
            "signature": np.array([d.signature if d else b"" for d in decoded], dtype=object),
            "taken": np.array([d.taken if d else "" for d in decoded]),
            "error": np.array(errors),
        }
