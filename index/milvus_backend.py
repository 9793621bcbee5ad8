"""The Milvus backend: one collection holds the vectors and the item metadata as fields.

``uri`` is a Milvus standalone or cluster address (``http://host:19530``) or a local file path, which
runs Milvus Lite in-process (the zero-set-up option). The collection records the model fingerprint, so
vectors of two models never mix.

Two collection layouts, chosen when a collection is created and read back from its schema afterwards:

- on Milvus Lite and servers from 2.6 on, Milvus allocates the ids (``auto_id``), an item without a label
  has a null label, and a move is a partial upsert;
- on servers before 2.6 (2.3 to 2.5: no partial upsert, no upsert into an ``auto_id`` collection, no
  nullable fields before 2.5), ids are given here (:class:`IdClock`), "no label" is stored as the empty
  string (never a label: labels are folder names) and a move rewrites the whole row.

Every call goes through expressions and requests that Milvus 2.3 understands (no expression templates:
``id in [...]`` literals), and every failure of Milvus is raised as :class:`BackendUnavailableError` with
the server's message. Reads use the ``Session`` consistency level: a process sees its own writes at
once, and other processes' writes once the server has applied them (see docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from foundation import defaults
from foundation.deadline import DeadlinePassedError, call_budget, request_deadline, within_deadline
from foundation.errors import InvalidInputError, MissingDependencyError
from index.connection import MilvusConnection
from index.filters import ItemFilter
from index.items import now_utc
from index.judgments import MilvusJudgments
from index.manifest import MILVUS_COLLECTION, BuiltIndex, Manifest
from index.milvus_access import ENV_PREFIX, MilvusAccess, public_uri, redact, uri_secrets
from index.milvus_flush import DeferredFlushes
from index.milvus_tombstones import MilvusTombstones, NotListedError, id_list
from index.protocol import (
    BackendUnavailableError,
    Capabilities,
    CapabilityError,
    Entry,
    Item,
    Move,
    check_dim,
    normalize_rows,
)
from index.selection import IndexOptions

MODEL_PROPERTY = "dmlsearch.model_fingerprint"
# The mark of the gallery folder that every replica writing to the collection shares (uploads go there).
GALLERY_PROPERTY = "dmlsearch.gallery"
METADATA_FIELDS = ["path", "label", "content_hash", "added"]
TAKEN = "taken"  # a field of collections made since capture times were kept (index.filters)
MAX_PATH = 4096
MAX_LABEL = 512
PAGE = 1000
MAX_TOP_K = 16_384  # Milvus's limit on k
# Read-your-writes within a process without Strong's wait for the server's next time tick (about 230 ms a
# request on Milvus 2.3 standalone, against 3-4 ms).
CONSISTENCY = "Session"
REQUEST_TIMEOUT_S = defaults.INDEX_DEADLINE_SECONDS  # one request to Milvus, retries included
# The first server version that upserts part of a row (and so moves items in an auto-id collection).
PARTIAL_UPSERT_VERSION = (2, 6)
NO_LABEL = ""  # how collections without nullable fields store "no label"
# A filtered graph search walks past the items the filter drops: with a 5% label filter over 3,000 items
# (tests/index/test_filtered_search.py), Milvus Lite's graph at ef 64 returned 9 of 10 results for some
# queries once it had indexed the collection, 10 from ef 128.
FILTERED_EF_FACTOR = 4
# Milvus index and search parameters per requested index type ("auto" lets Milvus choose; in Milvus Lite
# it builds a graph index on sealed segments, whose search beam "ef" must be at least k).
MILVUS_INDEXES: dict[str, tuple[str, dict[str, int], dict[str, int]]] = {
    "auto": ("AUTOINDEX", {}, {"ef": 64}),
    "flat": ("FLAT", {}, {}),
    "hnsw": ("HNSW", {"M": 32, "efConstruction": 200}, {"ef": 128}),
    "ivf": ("IVF_FLAT", {"nlist": 1024}, {"nprobe": 32}),
    "ivfsq": ("IVF_SQ8", {"nlist": 1024}, {"nprobe": 32}),
    "ivfpq": ("IVF_PQ", {"nlist": 1024, "m": 64, "nbits": 8}, {"nprobe": 32}),
}
DEFAULT_LITE_FILE = "milvus.db"
# How long opening an index may wait for a server just restarted to list its collection and answer a
# Strong read (~25-30 s after it answers at all), asked again every OPEN_POLL_S; a request waits no longer
# than its own budget.
OPEN_WAIT_S = 60.0
OPEN_POLL_S = 0.5
# Words of Milvus's answers to a login it refuses or a request without one ("missing authorization in header",
# "auth check failure, please check username and password are correct"), and of a TLS handshake that failed.
AUTH_FAILURES = ("auth", "password", "token")
TLS_FAILURES = ("tls", "ssl", "certificate", "handshake")
CREDENTIALS_HINT = (
    f"credentials: {ENV_PREFIX}USER and {ENV_PREFIX}PASSWORD, or {ENV_PREFIX}TOKEN (each also as *_FILE)"
)
TLS_HINT = f"TLS: an https:// URI, {ENV_PREFIX}CA_FILE and {ENV_PREFIX}SERVER_NAME"

log = logging.getLogger(__name__)


def _pymilvus():
    try:
        import pymilvus
    except ImportError as err:
        raise MissingDependencyError("pymilvus is not installed: pip install 'dmlsearch[milvus]'") from err
    # pymilvus logs each failed request and reconnection with a traceback (its import sets up its loggers,
    # hence here); those failures are raised as BackendUnavailableError and reported once by the caller.
    logging.getLogger("pymilvus").setLevel(logging.CRITICAL)
    return pymilvus


def resolve_uri(uri: str, directory: Path) -> str:
    """Remote URIs as they are; a Milvus Lite file path relative to the index directory."""
    if "://" in uri:
        return uri
    path = Path(uri)
    return str(path if path.is_absolute() else directory / path)


def _literal(value: str) -> str:
    """A string literal for a Milvus filter expression (Milvus accepts JSON's escapes)."""
    return json.dumps(value)


def supports_partial_upsert(server_version: str) -> bool:
    """Milvus Lite reports ``milvus_lite-3.x``; servers ``v2.3.5``, ``v2.6.0``, ``v2.3.5-lite`` (the
    ``milvus`` package's embedded 2.3 server)."""
    if server_version.startswith("milvus_lite"):
        return True
    match = re.match(r"v?(\d+)\.(\d+)", server_version)
    if match is None:
        raise BackendUnavailableError(f"Milvus reports an unknown version {server_version!r}")
    return (int(match[1]), int(match[2])) >= PARTIAL_UPSERT_VERSION


class IdClock:
    """Ids for collections whose ids are given here: milliseconds since 2024 in the high 41 bits (until
    2093) and, below them, a random start in 2^21 followed by one id per row of the batch.

    Rising and distinct within a process; two processes collide only when they write in the same
    millisecond and their random ranges overlap (about ``rows / 2^21`` for a batch of ``rows``).
    """

    EPOCH_MS = 1_704_067_200_000  # 2024-01-01T00:00:00Z
    SHIFT = 22

    def __init__(self) -> None:
        self._last = -1
        self._lock = threading.Lock()

    def take(self, count: int) -> list[int]:
        with self._lock:
            base = (int(time.time() * 1000) - self.EPOCH_MS) << self.SHIFT
            first = max(base + secrets.randbelow(1 << (self.SHIFT - 1)), self._last + 1)
            self._last = first + count - 1
            return list(range(first, first + count))


_LOCAL_METHODS = {"create_schema", "prepare_index_params"}  # build request objects: no server involved
# How often a process asks a server for its version, and how long the answer may take (``_Server.watch``):
# a restart in a quiet spell is noticed (it takes 10 s or more).
WATCH_EVERY_S = 2.0
WATCH_WITHIN_S = 5.0
# Worker threads that make one server's calls: a caller stops waiting at its deadline and a call still
# running then is ended by closing its connection. Calls beyond this many wait for a thread, within their
# deadline too.
CALL_THREADS = 16
# Part of what Milvus answers a search or query on a collection that is not in memory: after a restart
# (until the server has loaded it again itself) or after a release.
NOT_LOADED = "not loaded"
# Calls that read: answered again when :attr:`_Server.after_connect` ran after them.
_READS = {"query", "search", "get"}
# Reads that take a filter expression (:attr:`_Server.exclusion`).
_FILTERED_READS = {"query", "search"}


def _message(err: Exception) -> str:
    """A pymilvus or gRPC failure's own message."""
    message = getattr(err, "message", None)
    if isinstance(message, str):
        return message
    details = getattr(err, "details", None)
    return str(details()) if callable(details) else str(err)


def _close_quietly(client: Any) -> None:
    with contextlib.suppress(Exception):  # a connection already broken closes as it can
        client.close()


class _Server:
    """The pymilvus client with a hard deadline on every request and every Milvus failure raised as a
    :class:`BackendUnavailableError` that carries the server's own message.

    A request may take ``REQUEST_TIMEOUT_S``, or less where the API request it serves has less left
    (``foundation.deadline``), connecting and retries included (outside a request, connecting has
    ``REQUEST_TIMEOUT_S`` of its own). pymilvus's retry loop can start a last attempt just before its
    timeout and its reconnection waits on a lock other failing calls hold, so the call runs in a worker
    thread and the caller stops waiting at the deadline. The connection is this
    object's own (not pymilvus's shared one) and is opened afresh after a failure: gRPC's own reconnection
    backs off for up to two minutes, and a server that was restarted or replaced at the same address is
    then reached by the next call. A collection that is not loaded is loaded, and the call tried again,
    within the same deadline. After each new connection, :attr:`after_connect` runs before any answer is
    returned (the backend's reading of removed ids: ``index.milvus_tombstones``), and a read made before
    it is answered again; every read (``query``, ``search``) of a collection leaves out the ids
    :attr:`exclusion` names for it (removed ids while their re-deletion is under way).

    It logs in with ``options`` (``index.milvus_access``: credentials, TLS) and names the server by
    ``where``, its URI without credentials; no message carries one of ``hidden``, the credentials.
    """

    def __init__(
        self, uri: str, where: str, options: dict[str, object] | None = None, hidden: list[str] | None = None
    ) -> None:
        import grpc  # a dependency of pymilvus's

        self.uri = uri
        self.where = where
        # Imported here, not in the first call: an import (seconds on a loaded machine) is not the server's
        # time to answer.
        self._pymilvus = _pymilvus()
        self._failures = (self._pymilvus.MilvusException, grpc.RpcError)
        self._options = options or {}
        self._hidden = hidden or []
        self._client: Any = None
        self._lock = threading.Lock()
        self._calls = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="milvus-call")
        self.after_connect: Callable[[], object] | None = None
        self.exclusion: Callable[[str], str | None] | None = None
        self._connections = 0  # connections opened so far
        self._connected_seen = 0  # the last of them after_connect ran for
        self._after_connect_lock = threading.RLock()
        self._in_after_connect = False
        self._closed = threading.Event()

    def failure(self, err: Exception) -> BackendUnavailableError:
        """``err`` (pymilvus's or gRPC's) as the error dmlsearch reports, with what to set where the server
        refused a login or TLS failed; no credential in it."""
        import grpc

        message = _message(err)
        if isinstance(err.__cause__, grpc.RpcError):  # pymilvus's "Fail connecting" hides why
            message = f"{message}: {_message(err.__cause__).splitlines()[0]}"
        message = redact(message, self._hidden)
        hints = [
            hint
            for hint, words in ((CREDENTIALS_HINT, AUTH_FAILURES), (TLS_HINT, TLS_FAILURES))
            if any(word in message.lower() for word in words)
        ]
        if hints:
            message += f" ({'; '.join(hints)}; see docs/milvus.md)"
        return BackendUnavailableError(f"Milvus at {self.where}: {message}")

    # pymilvus ships no type information: its client takes and returns untyped dicts, lists and objects.
    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in _LOCAL_METHODS:
            return getattr(self._pymilvus.MilvusClient, name)

        def call(*args: object, **kwargs: object) -> Any:
            answer = self._loaded(name, args, self._excluding(name, args, kwargs))
            if self._run_after_connect() and name in _READS:
                answer = self._loaded(name, args, self._excluding(name, args, kwargs))
            return answer

        return call

    def _excluding(self, name: str, args: tuple, kwargs: dict) -> dict:
        """``kwargs`` with a read's filter narrowed by :attr:`exclusion` for its collection."""
        if name not in _FILTERED_READS or self.exclusion is None or not args or not isinstance(args[0], str):
            return kwargs
        left_out = self.exclusion(args[0])
        if left_out is None:
            return kwargs
        given = kwargs.get("filter") or ""
        return {**kwargs, "filter": f"({given}) and {left_out}" if given else left_out}

    def _loaded(self, name: str, args: tuple, kwargs: dict) -> Any:
        """:meth:`_bounded`, loading the collection and calling again where it was not loaded."""
        try:
            return self._bounded(name, args, kwargs)
        except BackendUnavailableError as err:
            if NOT_LOADED not in str(err) or not args or not isinstance(args[0], str):
                raise
        self._bounded("load_collection", args[:1], {})
        return self._bounded(name, args, kwargs)

    def watch(self) -> None:
        """Ask the server for its version every ``WATCH_EVERY_S``, each answer due within
        ``WATCH_WITHIN_S``, in a thread of its own: a server restarted while this process made no call
        (down ~10 s at least) fails an ask, which drops the connection, and the next ask connects afresh and
        runs :attr:`after_connect` (the re-deletion of removed ids), where otherwise only a request made
        during the outage would have. A server merely slow to answer costs one more reconnection."""
        thread = threading.Thread(target=self._watch_forever, name="milvus-watch", daemon=True)
        thread.start()

    def _watch_forever(self) -> None:
        while not self._closed.wait(WATCH_EVERY_S):
            with request_deadline(WATCH_WITHIN_S):
                try:
                    self.get_server_version()
                except BackendUnavailableError as err:
                    log.debug("Milvus did not answer the watch: %s", err)

    def sibling(self) -> _Server:
        """Another client of the same server, logged in the same way, on a connection of its own."""
        return _Server(self.uri, self.where, self._options, self._hidden)

    def _run_after_connect(self) -> bool:
        """Run :attr:`after_connect` for the newest connection unless it ran for it (a run that failed is
        run again by the next call); whether it ran now. A call waits for another's run no longer than its
        own budget."""
        if self.after_connect is None or self._connected_seen == self._connections:
            return False
        try:
            budget = call_budget(REQUEST_TIMEOUT_S)
        except DeadlinePassedError as err:
            raise BackendUnavailableError(f"Milvus at {self.where}: {err}") from err
        if not self._after_connect_lock.acquire(timeout=budget):
            raise BackendUnavailableError(
                f"Milvus at {self.where}: no answer within {budget:.1f} s (removed ids being read again)"
            )
        try:
            connection = self._connections
            if self._in_after_connect or self._connected_seen == connection:
                return False
            self._in_after_connect = True  # its own calls come back through here
            try:
                self.after_connect()
            finally:
                self._in_after_connect = False
            self._connected_seen = connection
            return True
        finally:
            self._after_connect_lock.release()

    def _bounded(self, name: str, args: tuple, kwargs: dict) -> Any:
        """``name(*args, **kwargs)`` on the server, answered within the call's budget or failed."""
        try:
            budget = call_budget(REQUEST_TIMEOUT_S)
        except DeadlinePassedError as err:
            raise BackendUnavailableError(f"Milvus at {self.where}: {err}") from err
        if not within_deadline():  # at start-up and on the command line, connecting has a limit of its own
            budget += REQUEST_TIMEOUT_S
        due = time.monotonic() + budget
        used: list[Any] = []  # the connection the call got, once it has one
        future = self._calls.submit(self._run, due, used, name, args, kwargs)
        try:
            return future.result(timeout=budget)
        except FutureTimeout:
            if used:
                self._drop(used[0])  # ends the call left running; the next one connects afresh
            raise BackendUnavailableError(
                f"Milvus at {self.where}: no answer to {name} within {budget:.1f} s"
            ) from None

    def _run(self, due: float, used: list[Any], name: str, args: tuple, kwargs: dict) -> Any:
        client = None
        try:
            client = self._connected(due)
            used.append(client)
            # Without a timeout pymilvus waits forever and retries 75 times.
            timeout = min(due - time.monotonic(), REQUEST_TIMEOUT_S)
            return getattr(client, name)(*args, **kwargs, timeout=max(timeout, 0.01))
        except self._failures as err:
            if client is not None:
                self._drop(client)
            raise self.failure(err) from None  # the cause's text may name the URI as given

    def _connected(self, due: float) -> Any:
        """The open connection, or a new one (made outside the lock: a connection that hangs holds up no
        other call)."""
        with self._lock:
            if self._client is not None:
                return self._client
        timeout = max(min(due - time.monotonic(), REQUEST_TIMEOUT_S), 0.01)
        client = self._pymilvus.MilvusClient(self.uri, timeout=timeout, dedicated=True, **self._options)
        with self._lock:
            if self._client is None:
                self._client = client
                self._connections += 1
                return client
            opened = self._client  # another call connected meanwhile: share its connection
        client.close()
        return opened

    def _drop(self, client: Any) -> None:
        """Close ``client`` (None: whichever connection is open), and forget it if it is the open one."""
        with self._lock:
            if client is None or self._client is client:
                client, self._client = self._client, None
        if client is not None:  # pymilvus closes under a process-wide lock its reconnections hold for seconds
            threading.Thread(target=_close_quietly, args=(client,), daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        self._drop(None)
        self._calls.shutdown(wait=False, cancel_futures=True)


def _open_client(uri: str) -> _Server:
    """The server at ``uri``, connected to by its first request, logged in with the credentials of the
    environment (:class:`index.milvus_access.MilvusAccess`) or, failing those, those ``uri`` carries."""
    options = MilvusAccess().client_options(uri) if "://" in uri else {}
    token = str(options.get("token", ""))
    hidden = [secret for secret in (*uri_secrets(uri), token, token.partition(":")[2]) if secret]
    if uri_secrets(uri):
        log.warning(
            "the Milvus URI of this index carries credentials: used to log in, never recorded (a manifest "
            "that holds them drops them at its next save); give them in the environment: %s",
            CREDENTIALS_HINT,
        )
    return _Server(uri, public_uri(uri), options, hidden)


class MilvusBackend:
    built = True  # the Milvus server indexes its collection itself
    CAPABILITIES: ClassVar[Capabilities] = Capabilities(
        local_build=False,
        removes_in_place=True,
        mergeable=False,  # ids and times added are the server's (auto_id) or this process's clock
        gpu_capable=False,  # a GPU index is the server's business
        tuning_parameter=None,  # the search parameters are fixed per index type (MILVUS_INDEXES)
        lives_in_folder=False,  # the collection is the server's (Milvus Lite: a file it holds open)
        reopen_to_see_saves=False,  # reads go to the live collection
        lists_items_cheaply=False,  # a scan of the collection, page by page
    )

    def __init__(self, client: _Server, manifest: Manifest, collection: str) -> None:
        self.client = client
        self.model_fingerprint = manifest.model_fingerprint
        self.collection = collection
        self.dim = manifest.dim
        _, _, self.search_params = MILVUS_INDEXES[manifest.requested.index_type]
        self.index_type = "none"  # the collection's, read from the server
        # The collection's layout (see the module's docstring), read from its schema.
        self.auto_id = True
        self.nullable = True
        self.has_taken = True  # False for a collection made before: its items have no capture time
        self._ids = IdClock()
        # Collections written to between saves (judgments, removed ids), flushed soon after their writes.
        self.flushes = DeferredFlushes(client, background=client.sibling)
        # Deletes the server may bring back after a restart, deleted again at every new connection.
        self.tombstones = MilvusTombstones(
            client, collection, background=client.sibling, flushes=self.flushes
        )
        client.after_connect = self.tombstones.reconnected
        client.exclusion = self.tombstones.exclusion
        self.judgments = MilvusJudgments(
            client, collection, self.dim, IdClock(), CONSISTENCY, self.tombstones, self.flushes
        )

    @classmethod
    def connect(
        cls, directory: Path, manifest: Manifest, connection: MilvusConnection, *, create: bool
    ) -> MilvusBackend:
        """Connect to the index's collection (``connection``: where it is). A new index (``create``)
        creates it where it does not exist yet; an index that was built waits for the server to list it
        (:meth:`_wait_until_listed`) and never creates it over one the server has not listed yet."""
        client = _open_client(resolve_uri(connection.uri or DEFAULT_LITE_FILE, directory))
        backend = cls(client, manifest, connection.collection or MILVUS_COLLECTION)
        try:
            due = time.monotonic() + call_budget(OPEN_WAIT_S)
            backend.tombstones.expected = not create  # before the first call, which reads the removed ids
            if create and not client.has_collection(backend.collection):
                backend._create_collection(manifest.options)
            elif not create:
                backend._wait_until_listed(due)
            backend._check_collection()
            backend.judgments.create(_pymilvus().DataType)  # beside the items, for every replica to see
            backend.tombstones.create(_pymilvus().DataType)
            client.load_collection(backend.collection)
            backend.judgments.load()
            backend._wait_for_earlier_writes(due)
            if "://" in client.uri:  # a server of its own, which can restart (Milvus Lite is this process's)
                client.watch()
        except DeadlinePassedError as err:
            backend.close()
            raise BackendUnavailableError(f"Milvus at {client.where}: {err}") from err
        except BaseException:
            backend.close()  # its connections and threads
            raise
        return backend

    def _wait_until_listed(self, due: float) -> None:
        """Return once the server lists the collection; after ``due`` (monotonic),
        :class:`BackendUnavailableError`. Under load, a restarted Milvus 2.3.5 answered while it did not
        list yet a collection it held (tests/index/test_milvus_restart.py in a full run): creating it then
        (a no-op on a server that knows it, an empty collection on one that does not) or reading no
        removed ids would be wrong. A built index's collection is missing for good only from a server that
        lost it (a new one at the same address, a dropped collection)."""
        while not self._listed():
            if time.monotonic() >= due:
                raise BackendUnavailableError(
                    f"Milvus at {self.client.where} does not list the collection {self.collection!r} of this "
                    "index: a server just started may not list it yet (try again), or it has lost it (a new "
                    "server, a dropped collection): build the index again on it (docs/milvus.md)"
                )
            time.sleep(OPEN_POLL_S)

    def _listed(self) -> bool:
        try:
            return bool(self.client.has_collection(self.collection))
        except NotListedError:  # the first call on a connection reads the removed ids (after_connect)
            return False

    def _wait_for_earlier_writes(self, due: float) -> None:
        """Session reads see this process's writes, and others' only once the server has applied them: one
        Strong read waits for that, so whatever was written before this process opened the collection (a
        replica's uploads, before a build-index that must not index their files again) is seen. A server
        restarted moments ago answers Strong reads only ~25-30 s after it answers at all
        (bench/results/milvus_restart_reads.md): tried again until ``due``."""
        while True:
            try:
                self.client.query(
                    self.collection, filter="", output_fields=["count(*)"], consistency_level="Strong"
                )
                return
            except BackendUnavailableError:
                if time.monotonic() >= due:
                    raise
                time.sleep(OPEN_POLL_S)

    def _create_collection(self, options: IndexOptions) -> None:
        data_type = _pymilvus().DataType
        modern = supports_partial_upsert(str(self.client.get_server_version()))
        schema = self.client.create_schema(auto_id=modern, enable_dynamic_field=False)
        schema.add_field("id", data_type.INT64, is_primary=True)
        schema.add_field("vector", data_type.FLOAT_VECTOR, dim=self.dim)
        schema.add_field("path", data_type.VARCHAR, max_length=MAX_PATH)
        # Older servers take the nullable flag without complaint and then refuse nulls: only ask for it here.
        null_options = {"nullable": True} if modern else {}
        schema.add_field("label", data_type.VARCHAR, max_length=MAX_LABEL, **null_options)
        schema.add_field("content_hash", data_type.VARCHAR, max_length=64)
        schema.add_field("added", data_type.VARCHAR, max_length=40)
        schema.add_field(TAKEN, data_type.VARCHAR, max_length=40, **null_options)
        index_type, build_params, _ = MILVUS_INDEXES[options.index_type]
        index_params = self.client.prepare_index_params()
        index_params.add_index("vector", index_type=index_type, metric_type="COSINE", params=build_params)
        self.client.create_collection(
            self.collection,
            schema=schema,
            index_params=index_params,
            properties={MODEL_PROPERTY: self.model_fingerprint},
        )

    def _check_collection(self) -> None:
        description = self.client.describe_collection(self.collection)
        fingerprint = (description.get("properties") or {}).get(MODEL_PROPERTY)
        if fingerprint != self.model_fingerprint:
            raise InvalidInputError(
                f"Milvus collection {self.collection!r} holds vectors of model {str(fingerprint)[:12]}, "
                f"not {self.model_fingerprint[:12]}: use another --milvus-collection"
            )
        fields = {field["name"]: field for field in description["fields"]}
        if int(fields["vector"]["params"]["dim"]) != self.dim:
            raise InvalidInputError(
                f"Milvus collection {self.collection!r} has dimension {fields['vector']['params']['dim']}"
            )
        self.auto_id = bool(description["auto_id"])
        self.nullable = bool(fields["label"].get("nullable", False))
        self.index_type = self.client.describe_index(self.collection, "vector")["index_type"]
        # An existing collection keeps the schema it was made with (changing it is the operator's call on a
        # shared server): one from before capture times were kept has no `taken`, and its date filters use
        # the time indexed (index.filters).
        self.has_taken = TAKEN in fields

    @property
    def _metadata_fields(self) -> list[str]:
        return [*METADATA_FIELDS, TAKEN] if self.has_taken else METADATA_FIELDS

    @property
    def capabilities(self) -> Capabilities:
        return self.CAPABILITIES

    def built_index(self) -> BuiltIndex:
        return BuiltIndex(index_type=self.index_type)

    def build(
        self,
        options: IndexOptions,
        *,
        retune: bool,
        partitions: Sequence[np.ndarray] | None = None,
        progress: bool = False,
    ) -> bool:
        """Nothing to do: the server indexes the collection as it fills."""
        return False

    def copy_in(
        self,
        vectors: np.ndarray,
        entries: Sequence[Entry],
        signatures: Sequence[bytes | None],
        *,
        added: Sequence[str],
        ids: Sequence[int] | None = None,
    ) -> list[int]:
        raise CapabilityError("a Milvus collection takes no items copied in under their ids and times")

    def reserve_ids(self, last_id: int) -> None:
        raise CapabilityError("a Milvus collection's ids are not reserved ahead")

    def last_id(self) -> int:
        raise CapabilityError("a Milvus collection does not record the highest id it handed out")

    @property
    def items(self) -> MilvusBackend:
        return self

    def add(
        self, vectors: np.ndarray, entries: Sequence[Entry], signatures: Sequence[bytes | None] | None = None
    ) -> list[int]:
        """``signatures`` are not kept: the collection's schema predates them (see ``signatures``)."""
        vectors = normalize_rows(vectors)
        check_dim(vectors, self.dim)
        if len(vectors) != len(entries):
            raise ValueError(f"{len(vectors)} vectors but {len(entries)} metadata rows")
        added = now_utc()
        rows = []
        for vector, entry in zip(vectors, entries, strict=True):
            if len(entry.path.encode()) > MAX_PATH:
                raise InvalidInputError(f"path {entry.path[:60]}... is longer than Milvus's {MAX_PATH} bytes")
            rows.append(self._row(vector, entry.path, entry.label, entry.content_hash, added, entry.taken))
        if not rows:
            return []
        if not self.auto_id:
            for row, item_id in zip(rows, self._ids.take(len(rows)), strict=True):
                row["id"] = item_id
        return [int(i) for i in self.client.insert(self.collection, rows)["ids"]]

    def _row(
        self, vector: object, path: str, label: str | None, content_hash: str, added: str, taken: str | None
    ) -> dict:
        row = {
            "vector": vector,
            "path": path,
            "label": label if self.nullable else (label or NO_LABEL),
            "content_hash": content_hash,
            "added": added,
        }
        if self.has_taken:  # without nulls, the time indexed stands in for an unknown capture time
            row[TAKEN] = taken if self.nullable else (taken or added)
        return row

    def search(
        self, queries: np.ndarray, k: int, where: ItemFilter | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        queries = normalize_rows(queries)
        check_dim(queries, self.dim, "queries")
        if k > MAX_TOP_K:
            raise InvalidInputError(f"Milvus returns at most {MAX_TOP_K} neighbours a query, not {k}")
        ids = np.full((len(queries), k), -1, dtype=np.int64)
        scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
        if len(queries) == 0:
            return ids, scores
        params = dict(self.search_params)
        if "ef" in params:  # a graph search returns at most ef results
            filtered = where is not None and not where.empty
            params["ef"] = max(params["ef"] * (FILTERED_EF_FACTOR if filtered else 1), k)
        results = self.client.search(
            self.collection,
            data=list(queries),
            limit=k,
            output_fields=["id"],
            search_params={"metric_type": "COSINE", "params": params},
            filter=where.milvus_expression(TAKEN if self.has_taken else "added") if where is not None else "",
            consistency_level=CONSISTENCY,
        )
        for row, hits in enumerate(results):
            for column, hit in enumerate(hits):
                ids[row, column] = hit["id"]
                scores[row, column] = hit["distance"]
        return ids, scores

    def remove(self, ids: Sequence[int]) -> int:
        present = sorted(self.get_many(list(ids)))
        self.tombstones.record(self.collection, present)  # first: a delete the server loses is made again
        for start in range(0, len(present), PAGE):
            self.client.delete(self.collection, filter=id_list(present[start : start + PAGE]))
        if present and not self.tombstones.covering():
            # A delete does not move the session's timestamp (Milvus 2.3 returns none): one Strong read
            # waits until the server has applied it, so this process's next Session reads miss the items.
            # While a re-deletion is due (after a reconnection), reads leave them out until it is applied.
            self.client.query(
                self.collection,
                filter=id_list(present[:1]),
                output_fields=["id"],
                consistency_level="Strong",
            )
        if present:
            self.judgments.forget_items(present)
        return len(present)

    def _rows(self, ids: Sequence[int], fields: list[str]) -> list[dict]:
        """The rows of ``ids`` that exist, by literal ``id in [...]`` queries (2.3 has no templates)."""
        unique = sorted({int(i) for i in ids})
        rows: list[dict] = []
        for start in range(0, len(unique), PAGE):
            chunk = unique[start : start + PAGE]
            rows += self.client.query(
                self.collection,
                filter=id_list(chunk),
                output_fields=fields,
                limit=len(chunk),
                consistency_level=CONSISTENCY,
            )
        return rows

    def vectors(self, ids: Sequence[int]) -> np.ndarray:
        """The collection's stored vector field (float32, as inserted)."""
        if len(ids) == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        by_id = {int(row["id"]): row["vector"] for row in self._rows(ids, ["vector"])}
        missing = [int(i) for i in ids if int(i) not in by_id]
        if missing:
            raise KeyError(f"no stored vector for ids {missing[:5]}")
        return np.array([by_id[int(i)] for i in ids], dtype=np.float32)

    def signatures(self, ids: Sequence[int] | None = None) -> dict[int, bytes]:
        """None: a collection has no field for them, and adding one would break existing collections."""
        return {}

    def stats(self) -> dict[str, object]:
        return {}

    def gallery_mark(self) -> str | None:
        properties = self.client.describe_collection(self.collection).get("properties") or {}
        return properties.get(GALLERY_PROPERTY) or None

    def record_gallery_mark(self, mark: str) -> None:
        self.client.alter_collection_properties(self.collection, properties={GALLERY_PROPERTY: mark})

    def move(self, moves: Sequence[Move]) -> int:
        return self._update({m.id: {"path": m.path, "label": m.label} for m in moves})

    def set_taken(self, taken: Mapping[int, str]) -> int:
        if not self.has_taken:
            return 0
        return self._update({item_id: {TAKEN: time} for item_id, time in taken.items()})

    def _update(self, changes: Mapping[int, dict]) -> int:
        """Change metadata fields of the items in ``changes`` that exist, keeping their ids and vectors."""
        present = self._rows(list(changes), ["vector", *self._metadata_fields])
        if not present:
            return 0
        if self.auto_id:  # a partial upsert keeps each row's id and vector
            rows = [{"id": int(row["id"]), **changes[int(row["id"])]} for row in present]
            self.client.upsert(self.collection, rows, partial_update=True)
        else:  # servers before 2.6 upsert whole rows only, into collections whose ids are given here
            rows = []
            for old in present:
                item_id = int(old["id"])
                new = {**old, **changes[item_id]}
                row = self._row(
                    np.asarray(old["vector"], np.float32),
                    new["path"],
                    new["label"] or None,
                    new["content_hash"],
                    new["added"],
                    new.get(TAKEN) or None,
                )
                rows.append({"id": item_id, **row})
            self.client.upsert(self.collection, rows)
        return len(present)

    # -- ItemCatalog -------------------------------------------------------------------------------

    def get_many(self, ids: Sequence[int]) -> dict[int, Item]:
        if not ids:
            return {}
        return {int(row["id"]): self._item(row) for row in self._rows(ids, self._metadata_fields)}

    def get(self, item_id: int) -> Item | None:
        return self.get_many([item_id]).get(item_id)

    def get_by_path(self, path: str) -> Item | None:
        return self._first(f"path == {_literal(path)}")

    def get_by_content(self, content_hash: str) -> Item | None:
        return self._first(f"content_hash == {_literal(content_hash)}")

    def _first(self, condition: str) -> Item | None:
        """One item that meets the Milvus filter ``condition``, or None."""
        rows = self.client.query(
            self.collection,
            filter=condition,
            output_fields=self._metadata_fields,
            limit=1,
            consistency_level=CONSISTENCY,
        )
        return self._item(rows[0]) if rows else None

    def page(self, offset: int, limit: int) -> list[Item]:
        rows = self.client.query(
            self.collection,
            filter="id >= 0",
            output_fields=self._metadata_fields,
            offset=offset,
            limit=limit,
            consistency_level=CONSISTENCY,
        )
        return sorted((self._item(row) for row in rows), key=lambda item: item.id)

    def scan(self) -> Iterator[Item]:
        """Pages of ids above the last one seen (Milvus returns a limited query's smallest ids)."""
        last = -1
        while rows := self.client.query(
            self.collection,
            filter=f"id > {last}",
            output_fields=self._metadata_fields,
            limit=PAGE,
            consistency_level=CONSISTENCY,
        ):
            items = sorted((self._item(row) for row in rows), key=lambda item: item.id)
            yield from items
            last = items[-1].id

    def label_counts(self) -> dict[str, int]:
        # Milvus groups only search results: count over a scan (callers such as the UI cache the answer).
        counts = Counter(item.label for item in self.scan() if item.label is not None)
        return dict(sorted(counts.items()))

    def __len__(self) -> int:
        rows = self.client.query(
            self.collection, filter="", output_fields=["count(*)"], consistency_level=CONSISTENCY
        )
        return int(rows[0]["count(*)"])

    @staticmethod
    def _item(row: dict) -> Item:
        # None in nullable collections, NO_LABEL in the others: both mean "no label".
        label = row.get("label") or None
        return Item(int(row["id"]), row["path"], label, row["content_hash"], row["added"], row.get(TAKEN))

    # -- persistence -------------------------------------------------------------------------------

    def save(self) -> None:
        """Flush the items' collection (the judgments and removed ids are flushed by ``flushes``, soon
        after their writes).

        A server restarted moments ago refuses flushes (``node not found``) until its data node has
        registered again: while the re-deletion after a reconnection is due, a refused flush is left to the
        background, which tries again. Nothing is lost meanwhile: the server keeps what it acknowledged in
        its log, unflushed rows included (they are only read late after another restart)."""
        try:
            self.client.flush(self.collection)
        except BackendUnavailableError as err:
            if not self.tombstones.covering():
                raise
            self.flushes.written(self.collection)
            log.info("flush left to the background after a reconnection: %s", err)

    def close(self) -> None:
        self.tombstones.close()
        self.flushes.close()
        self.client.close()
