"""Decoding untrusted images in worker processes that a deadline can kill and a memory limit confines.

What a decoder costs is not written in the header: a 290 KB progressive JPEG whose one scan repeats a
thousand times decodes for 20 s, a 34-byte WebP that declares 49 MP takes 750 MB, an AVIF whose ``ispe``
box says 64x64 decodes a 16384x16384 frame. A thread can neither be stopped nor kept from the server's
memory, so every decode of untrusted bytes (uploads, thumbnails, ``add``, ``build-index``, ``watch``) runs
in one of a few worker processes, each
- under an address-space limit (``RLIMIT_AS``) of ``memory_bytes`` above what it maps once started: what
  the decoder really allocates is capped, whatever the header said (a decode that fails as corrupt is tried
  once more under twice the limit: decoders report failed allocations as corrupt data);
- under a CPU-time limit (``RLIMIT_CPU``, moved as each image starts: :func:`image_started`): the kernel
  ends the worker when one image has spent ``cpu_seconds``, or the whole task (a request's images, all
  together) ``request_cpu_seconds``;
- and a wall-clock deadline (``wall_seconds`` per image, ``request_wall_seconds`` per task, for a CPU
  shared with others), past which the caller ends the worker; so does a caller whose client went away
  (:func:`cancelled_by`), and closing the pool (a server's shutdown).
A limit's error names the image of the task that was decoding when it ran out (the task says which:
:func:`image_started`): a batch that exhausts its request's budget is refused at the image that did, not
decoded for 64 times one image's limit.
A decode started in ``foundation.priority.lowered_by`` an event runs at the lowest CPU priority (niceness
19) once the event is set, even midway: the caller that shares out the CPU (``app.compute``) lowers a
request that has held its slot long while other clients wait, so that their decodes get the cores first
and its own goes on with what is left. A worker that was lowered, was ended, ran out of its memory or grew
large is replaced by a fresh one (an unprivileged process cannot raise its priority again). An ended
worker's memory is freed by the thread that ended it, at that thread's priority (``foundation.reaping``),
not by the worker at niceness 19. A SIGTERM or SIGINT to the whole process group ends neither the workers
nor their forkserver: the decodes under way finish for the owner that is stopping (``foundation.stopping``,
``engine.decode.forkserver``). The caller gets
``ImageDecodeError("image_too_costly")`` for an image over its limits (:class:`DecodeMemoryError` for
memory), ``ImageDecodeError("request_too_costly")`` for a task over its budget,
:class:`DecodeCancelledError` when its client went away, and ``MemoryError`` when something else ended
the worker (the kernel's OOM killer): the machine's shortage, not the image's fault.

Workers are forked from a ``forkserver`` that has imported the decoders once (a fork from the server itself
would copy its threads' locks): starting one takes milliseconds, not an interpreter's start-up (3.8-5 s
here to import the decoders).
"""

from __future__ import annotations

import math
import mmap
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import resource
import signal
import struct
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol, TypeVar

from engine.decode.images import ImageDecodeError, ImageSource
from foundation import defaults
from foundation.errors import DmlsearchError, ErrorKind
from foundation.priority import LOWERED_NICENESS, lowering
from foundation.reaping import kill_and_release
from foundation.stopping import obey_stop_signals_from_owner

T = TypeVar("T")

# Imported once by the forkserver, so that every worker forked from it starts with the decoders loaded
# (and so that the forkserver outlives a stop of the whole process group: ``engine.decode.forkserver``).
# scipy.fftpack too: imagehash imports it at its first perceptual hash (the signatures of ``add`` and of the
# duplicate review), which took a fresh worker 0.8 s idle and 2.3-3 s on a loaded machine, at every task
# that was the first of its worker (every worker of the pool in turn, and each one replaced).
PRELOAD = ["engine.decode.forkserver", "engine.decode.model_input", "engine.build.prefetch", "scipy.fftpack"]
# How often a caller waiting on a worker looks at its client and at the pool's state.
POLL_SECONDS = 0.05
# A worker whose peak use grew past this above its start is replaced after its task, so that an idle
# worker holds only its start-up memory (freed heap stays with a process) and the next task finds all of
# its memory limit.
RETIRE_GROWTH_BYTES = 256 * 1024**2
# A decode that fails as corrupt under its memory limit is tried again under this many times the limit,
# to tell a decoder that ran out of memory (it says "corrupt") from a corrupt file.
RETRY_FACTOR = 2
_PAGE = os.sysconf("SC_PAGE_SIZE")
# Shared memory per worker for the arrays of its answers (pickle protocol 5 buffers): a request's model
# input (64 images at 600 KB each) is copied once, not pushed through a pipe 64 KB at a time, each piece
# waiting for the reader to be scheduled (a 600 KB array took 3-40 ms a round trip on a loaded machine,
# a few bytes 0.3 ms). Larger answers go through the pipe.
SHARED_BYTES = 64 * 1024**2
# After the answers' shared memory, what the worker's task is at (:class:`_Progress`): the image it
# decodes, since when, and which limit its CPU limit is.
_PROGRESS = struct.Struct("<qdq")

_main_swap = threading.Lock()
_cancel: ContextVar[threading.Event | None] = ContextVar("decode_cancel", default=None)
# In a decode process, what its task is at (None elsewhere: a task run in-process has no limits to move).
_progress: _Progress | None = None


class DecodeCancelledError(DmlsearchError, RuntimeError):
    """The decode was stopped because its client went away."""

    kind = ErrorKind.CANCELLED
    code = "client_closed_request"


class DecodePoolClosedError(DmlsearchError, RuntimeError):
    """The decode pool was closed (the process is stopping) while a decode waited or ran."""

    kind = ErrorKind.UNAVAILABLE
    code = "shutting_down"


class DecodeMemoryError(ImageDecodeError):
    """An image whose decode needs more memory than a decode may use (``image_too_costly``); ``position``:
    the image of its task that was decoding (0 when the task named none)."""

    def __init__(self, message: str, position: int = 0) -> None:
        super().__init__("image_too_costly", message)
        self.position = position


class GalleryMemoryError(MemoryError):
    """A gallery file needs more memory to decode than a decode may use: the server's state, 503."""


@contextmanager
def gallery_memory_is_the_servers(images: Sequence[ImageSource]) -> Iterator[None]:
    """A decode of ``images`` in which a gallery file (a path: uploads are bytes) needed more than a
    decode's memory raises :class:`GalleryMemoryError`, the server's state (503), not the image's cost
    (422): the file is the server's own, which no client sent and none can change (before, a thumbnail of
    such a file was 422 ``image_too_costly``)."""
    try:
        yield
    except DecodeMemoryError as err:
        if err.position < len(images) and isinstance(images[err.position], Path):
            message = f"a gallery file could not be decoded within the decode limit: {err.message}"
            raise GalleryMemoryError(message) from None
        raise


@dataclass(frozen=True)
class DecodeLimits:
    """What one image's decode may cost, and what one task (a request's images) may cost in all."""

    cpu_seconds: float = defaults.DECODE_CPU_SECONDS
    wall_seconds: float = defaults.DECODE_WALL_SECONDS
    memory_bytes: int = defaults.DECODE_MEMORY_BYTES
    request_cpu_seconds: float = defaults.DECODE_REQUEST_CPU_SECONDS
    request_wall_seconds: float = defaults.DECODE_REQUEST_WALL_SECONDS


class Decoder(Protocol):
    """Runs a decode task (a module-level function of picklable arguments) and returns its result;
    ``images``: how many images the task decodes (its errors name one by position when more than one)."""

    def run(self, task: Callable[..., T], *args: Any, images: int = 1, **kwargs: Any) -> T: ...


class InProcessDecoder:
    """Decodes in the calling thread, without limits: for trusted files (training sets, benchmarks)."""

    def run(self, task: Callable[..., T], *args: Any, images: int = 1, **kwargs: Any) -> T:
        return task(*args, **kwargs)


def image_started(position: int) -> None:
    """Said by a task as it starts on its ``position``-th image: in a decode process, that image's own limits
    run from now (the task's budget runs on), and an error of a limit names it; elsewhere, nothing."""
    if _progress is not None:
        _progress.image_started(position)


@contextmanager
def cancelled_by(event: threading.Event) -> Iterator[None]:
    """Decodes started in this context (this thread) stop, their workers ended, once ``event`` is set."""
    token = _cancel.set(event)
    try:
        yield
    finally:
        _cancel.reset(token)


class _Progress:
    """What a worker's task is at, in memory that the worker and its caller both map: the image it decodes
    (its position in the task), since when (``time.monotonic``: one clock for every process), and whether
    the CPU limit set now is the task's budget rather than the image's own limit. The worker writes it,
    the caller reads it to time the image and to name it in an error."""

    def __init__(self, shared: mmap.mmap) -> None:
        self._shared = shared
        self._limits = DecodeLimits()
        self._task_cpu_end = 0.0  # the worker's CPU time at which its task's budget is spent

    def start(self, now: float) -> None:
        """The caller's: a task starts now, on its first image."""
        _PROGRESS.pack_into(self._shared, SHARED_BYTES, 0, now, 0)

    def read(self) -> tuple[int, float, bool]:
        """``(position, since, request_limit)``."""
        position, since, request_limit = _PROGRESS.unpack_from(self._shared, SHARED_BYTES)
        return position, since, bool(request_limit)

    @property
    def position(self) -> int:
        return self.read()[0]

    def task_started(self, limits: DecodeLimits) -> None:
        """The worker's: its task's budget runs from now."""
        self._limits = limits
        self._task_cpu_end = _cpu_used() + limits.request_cpu_seconds
        self.image_started(0)

    def image_started(self, position: int) -> None:
        """The worker's: the CPU limit becomes this image's own, or what is left of the task's budget
        when less (the kernel ends the worker at once when nothing is left)."""
        image_cpu_end = _cpu_used() + self._limits.cpu_seconds
        request_limit = self._task_cpu_end <= image_cpu_end
        _limit(resource.RLIMIT_CPU, math.ceil(min(image_cpu_end, self._task_cpu_end)))
        _PROGRESS.pack_into(self._shared, SHARED_BYTES, position, time.monotonic(), int(request_limit))


class _Worker:
    def __init__(self, context: Any, memory_bytes: int, niceness: int) -> None:
        self.lowered = False  # set to the lowest priority for a task: replaced after it
        # The pool's close and a request replacing this worker may end it at once: closing a pipe twice
        # at the same moment closes a file descriptor number another thread may already reuse.
        self._ending = threading.Lock()
        self._ended = False
        tasks, self.tasks = context.Pipe(duplex=False)
        self.results, results = context.Pipe(duplex=False)
        shared = os.memfd_create("dmlsearch-decode", os.MFD_CLOEXEC)
        try:
            os.ftruncate(shared, SHARED_BYTES + _PROGRESS.size)
            self.shared = mmap.mmap(shared, SHARED_BYTES + _PROGRESS.size)
            self.progress = _Progress(self.shared)
            self.process = context.Process(
                target=_serve,
                args=(tasks, results, _SharedFd(shared), memory_bytes, niceness, os.getpid()),
                name="dmlsearch-decode",
                daemon=True,
            )
            with _without_main():
                self.process.start()
        finally:
            os.close(shared)
            tasks.close()
            results.close()

    def lower(self) -> None:
        """Its priority the lowest, at once (midway through its task)."""
        if not self.lowered:
            self.lowered = True
            with suppress(ProcessLookupError):  # it died meanwhile: the caller finds out from its sentinel
                os.setpriority(os.PRIO_PROCESS, self.process.pid, LOWERED_NICENESS)

    def receive(self) -> tuple[str, Any, bool]:
        """The worker's answer: ``(status, value, retire)``."""
        payload, sizes, retire = self.results.recv()
        buffers, offset = [], 0
        for size in sizes or ():  # copied out: the next task overwrites the shared memory
            buffers.append(bytearray(memoryview(self.shared)[offset : offset + size]))
            offset += size
        if offset:
            # Its pages freed once copied out: an idle worker's shared memory would otherwise keep its last
            # answer (a batch's model input: 12 MB for 20 images), resident in this process as well, for
            # each worker of the pool in turn (the server grew 11 MB per failed batch over 4 workers).
            self.shared.madvise(mmap.MADV_REMOVE, 0, -(-offset // _PAGE) * _PAGE)
        status, value = pickle.loads(payload, buffers=buffers)
        return status, value, retire

    def end(self) -> None:
        with self._ending:
            if self._ended:
                return
            self._ended = True
        # Freed here, at this thread's priority: a lowered worker freeing its hundreds of MB itself at
        # niceness 19 kept the request that ended it (and its compute slot) in the join for seconds. Not
        # once it has been reaped: its number may be another process's.
        if self.process.pid is not None and self.process.exitcode is None:
            kill_and_release(self.process.pid)
        self.process.join()
        self.tasks.close()
        self.results.close()
        self.shared.close()


@contextmanager
def _without_main() -> Iterator[None]:
    """Start processes without the parent's ``__main__``: multiprocessing runs it again in each child (and
    in the forkserver) so that functions defined there unpickle; the tasks here are all defined in engine
    modules, and the server's main module imports the whole application (seconds and hundreds of MB more
    in each worker, a failure when it is ``<stdin>``)."""
    with _main_swap:
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            yield
        finally:
            sys.modules["__main__"] = main


class DecodePool:
    """``workers`` decode processes under :class:`DecodeLimits`; ``run`` blocks until one is free.

    ``niceness``: added to the workers' (``build-index`` lowers them below the model, see
    engine.build.prefetch).
    """

    def __init__(self, workers: int, limits: DecodeLimits | None = None, *, niceness: int = 0) -> None:
        if workers < 1:
            raise ValueError(f"a decode pool needs at least one worker, got {workers}")
        self.limits = limits or DecodeLimits()
        self._niceness = niceness
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(PRELOAD)
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._live: set[_Worker] = set()
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        for _ in range(workers):
            self._idle.put(self._start())

    def run(self, task: Callable[..., T], *args: Any, images: int = 1, **kwargs: Any) -> T:
        """``task(*args, **kwargs)`` in a worker, within each image's limits and the task's budget;
        ``images``: how many the task decodes (an error names the image by its position when more than
        one)."""
        worker = self._take()
        healthy = False
        try:
            status, value, retire = self._call(worker, task, args, kwargs, max(images, 1))
            position = worker.progress.position  # the image it was at (before the worker may end)
            # It answered (a corrupt image too): it takes the next task, unless lowered for this one.
            healthy = not retire and not worker.lowered
        finally:
            if healthy:
                self._idle.put(worker)
            else:
                self._replace(worker)
        if status == "ok":
            return value
        if status == "memory":
            megabytes = self.limits.memory_bytes // 1024**2
            message = f"decoding it needs more than the {megabytes} MB a decode may use"
            raise DecodeMemoryError(_naming(position, images, message), position)
        raise value

    def close(self) -> None:
        """End every worker: decodes running or waiting raise :class:`DecodePoolClosedError`."""
        self._closed.set()
        with self._lock:
            workers, self._live = list(self._live), set()
        for worker in workers:
            worker.end()

    def __enter__(self) -> DecodePool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _start(self) -> _Worker:
        try:
            worker = _Worker(self._context, self.limits.memory_bytes, self._niceness)
        except OSError as err:  # fork failed: the machine's memory or process table, not the image's
            raise MemoryError(f"could not start a decode process: {err}") from None
        with self._lock:
            self._live.add(worker)
        return worker

    def _take(self) -> _Worker:
        while True:
            if self._closed.is_set():
                raise DecodePoolClosedError("the decoders are shutting down")
            try:
                worker = self._idle.get(timeout=POLL_SECONDS)
            except queue.Empty:
                continue
            if worker.process.is_alive():
                return worker
            self._replace(worker)  # it died idle (the kernel's OOM killer): a fresh one takes its place

    def _replace(self, worker: _Worker) -> None:
        with self._lock:
            self._live.discard(worker)
        worker.end()
        if not self._closed.is_set():
            self._idle.put(self._start())

    def _call(
        self, worker: _Worker, task: Callable[..., Any], args: tuple, kwargs: dict, images: int
    ) -> tuple[str, Any, bool]:
        """The worker's answer ``(status, value, retire)``; raises when it did not answer (ended for a
        limit, a cancel or the pool's close, or dead)."""
        cancel, lower = _cancel.get(), lowering()
        limits = self.limits
        started = time.monotonic()
        worker.progress.start(started)
        if lower is not None and lower.is_set():  # a request lowered before: its next decodes too
            worker.lower()
        try:
            worker.tasks.send((task, args, kwargs, limits))
        except (OSError, ValueError):  # the worker was ended meanwhile (close) or died idle
            self._raise_if_closed()
            raise MemoryError("a decode process ended before it took its task") from None
        while True:
            ready = multiprocessing.connection.wait([worker.results, worker.process.sentinel], POLL_SECONDS)
            if worker.results in ready:
                try:
                    status, value, retire = worker.receive()
                except (EOFError, OSError):  # it died with its answer unsent: its exit code says why
                    worker.process.join()
                    self._raise_if_closed()
                    raise _ended(worker, limits, images) from None
                return status, value, retire
            if ready:  # only the sentinel: the worker died
                worker.process.join()
                self._raise_if_closed()
                raise _ended(worker, limits, images)
            self._raise_if_closed()
            if cancel is not None and cancel.is_set():
                raise DecodeCancelledError("the client went away")
            if lower is not None and lower.is_set():
                worker.lower()
            now = time.monotonic()
            position, image_since, _ = worker.progress.read()
            if now > started + limits.request_wall_seconds:
                raise _request_too_costly(
                    position, images, f"took longer than {limits.request_wall_seconds:g} s"
                )
            if now > image_since + limits.wall_seconds:
                message = f"decoding took longer than {limits.wall_seconds:g} s, the limit for one image"
                raise ImageDecodeError("image_too_costly", _naming(position, images, message))

    def _raise_if_closed(self) -> None:
        if self._closed.is_set():
            raise DecodePoolClosedError("the decoders are shutting down")


def _naming(position: int, images: int, message: str) -> str:
    """``message`` about the ``position``-th of a task's ``images``, naming it when there are several."""
    return message if images == 1 else f"image {position}: {message}"


def _request_too_costly(position: int, images: int, spent: str) -> ImageDecodeError:
    return ImageDecodeError(
        "request_too_costly",
        _naming(
            position,
            images,
            f"decoding the request's images {spent} in all, the limit per request: the request was cut "
            f"off at this image (send fewer or cheaper images)",
        ),
    )


def _ended(worker: _Worker, limits: DecodeLimits, images: int) -> Exception:
    """Why a worker died, as the error its caller raises."""
    exitcode = worker.process.exitcode
    position, _, request_limit = worker.progress.read()
    if exitcode == -signal.SIGXCPU:
        if request_limit:
            return _request_too_costly(
                position, images, f"took more than {limits.request_cpu_seconds:g} s of CPU"
            )
        message = f"decoding took more than {limits.cpu_seconds:g} s of CPU, the limit for one image"
        return ImageDecodeError("image_too_costly", _naming(position, images, message))
    if exitcode == -signal.SIGKILL:  # not ours (we wait for ours): the kernel's OOM killer
        return MemoryError("a decode process was killed (the machine ran out of memory)")
    message = f"the decoder crashed on this image (exit code {exitcode})"
    return ImageDecodeError("corrupt_image", _naming(position, images, message))


# --- the worker process -------------------------------------------------------------------------------


class _SharedFd:
    """A file descriptor handed to a worker as it starts (duplicated into it, as multiprocessing does for
    its pipes)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Callable[[Any], int], tuple[Any]]:
        return _detach, (reduction.DupFd(self.fd),)


def _detach(duplicate: Any) -> int:
    return duplicate.detach()


def _serve(
    tasks: Connection, results: Connection, shared_fd: int, memory_bytes: int, niceness: int, owner: int
) -> None:
    """A worker's loop: take a task, run it under its limits, send back ``(status, value, retire)``."""
    global _progress
    # A stop of the whole group (systemd's stop, Ctrl-C) must let the decodes under way finish: the owner
    # (a server draining its requests, a build finishing its batch) ends its workers. Its SIGTERM must
    # still end one: at exit, multiprocessing ends the daemon workers of a pool never closed, then waits.
    obey_stop_signals_from_owner(owner)
    if niceness:
        os.nice(niceness)
    shared = mmap.mmap(shared_fd, SHARED_BYTES + _PROGRESS.size)
    os.close(shared_fd)
    _progress = _Progress(shared)
    start = _mapped_bytes()
    _limit(resource.RLIMIT_AS, start + memory_bytes, hard=start + RETRY_FACTOR * memory_bytes)
    # SIGXCPU (and a decoder's crash) would dump the worker's memory, up to the limit, into the cwd.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    while True:
        try:
            task, args, kwargs, limits = tasks.recv()
        except (EOFError, OSError):
            return
        _progress.task_started(limits)
        answer = _attempt(task, args, kwargs)
        if _corrupt(answer):
            # Decoders report a failed allocation as a failed decode (libwebp: "could not create decoder
            # object", libavif: "Decoding of color planes failed"): tried again with more room, a file
            # that then decodes (or fails otherwise) failed for want of memory, not for its bytes.
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
            again = _attempt(task, args, kwargs)
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
            if not _corrupt(again):
                answer = ("memory", None)
        retire = answer[0] == "memory" or _peak_bytes() - start > RETIRE_GROWTH_BYTES
        try:
            results.send((*_packed(answer, shared), retire))
        except Exception as err:  # an error that does not pickle: its message does
            failed = ("error", RuntimeError(f"{type(err).__name__}: {err}"))
            results.send((pickle.dumps(failed), None, retire))
        if retire:
            return


def _attempt(task: Callable[..., object], args: tuple, kwargs: dict) -> tuple[str, object]:
    try:
        return "ok", task(*args, **kwargs)
    except MemoryError:
        return "memory", None
    except Exception as err:  # the caller's to raise (ImageDecodeError, OSError of a file...)
        return "error", err


def _corrupt(answer: tuple[str, object]) -> bool:
    return isinstance(answer[1], ImageDecodeError) and answer[1].code == "corrupt_image"


def _packed(answer: tuple[str, object], shared: mmap.mmap) -> tuple[bytes, list[int] | None]:
    """The answer pickled with its large buffers (numpy arrays) in ``shared`` when they fit, and their
    sizes (None: all in the pickle)."""
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(answer, protocol=5, buffer_callback=buffers.append)
    views = [buffer.raw() for buffer in buffers]
    if sum(view.nbytes for view in views) > SHARED_BYTES:
        return pickle.dumps(answer, protocol=5), None
    offset = 0
    for view in views:
        shared[offset : offset + view.nbytes] = view
        offset += view.nbytes
    return payload, [view.nbytes for view in views]


def _limit(kind: int, soft: int, hard: int | None = None) -> None:
    """Set a resource limit (``hard`` None: the one inherited), never above the limit inherited (the
    server's ``prlimit``)."""
    _, inherited = resource.getrlimit(kind)
    if inherited != resource.RLIM_INFINITY:
        soft, hard = min(soft, inherited), min(hard or inherited, inherited)
    resource.setrlimit(kind, (soft, inherited if hard is None else hard))


def _cpu_used() -> float:
    """CPU seconds this process has used, as ``RLIMIT_CPU`` counts them (user and system)."""
    return sum(resource.getrusage(resource.RUSAGE_SELF)[:2])


def _mapped_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[0]) * _PAGE


def _peak_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmPeak:"):
            return int(line.split()[1]) * 1024
    return 0
