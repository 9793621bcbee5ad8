"""Stop long jobs (build-index, watch, train) at a safe point on SIGTERM or SIGINT.

A command wraps its work in :func:`stop_on_signals`; the work calls :func:`checkpoint` where everything
done so far is durable (after an embedding batch is added, after a training step is saved), which raises
:class:`StopRequested` once a stop signal arrived. A second signal stops at once (the default action): the
work is written so that even ``kill -9`` loses nothing acknowledged, only the batch in progress.
Without :func:`stop_on_signals` (library use, tests in process) :func:`checkpoint` never raises.

The same signals often reach every process of the job (``pkill -f``, systemd's control group, Ctrl-C), its
worker processes included; a worker killed by them would fail the work its owner is finishing. Workers start
with them blocked (forked under :func:`stop_signals_blocked`) or ignored (forked by the decode pool's
forkserver, ``engine.decode.forkserver``) and call :func:`obey_stop_signals_from_owner` first: they end on
a SIGTERM from their owner only (how multiprocessing and torch's DataLoader end them), and their owner
decides when the job stops.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

_requested = threading.Event()
_signum: int = 0


class StopRequested(Exception):
    """A stop signal arrived; the work done up to the last checkpoint is saved."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """128 + the signal, as a shell reports a process stopped by it (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + self.signum


def requested() -> threading.Event:
    """Set once a stop signal arrived (under :func:`stop_on_signals`): a loop may wait on it."""
    return _requested


def checkpoint() -> None:
    """Raise :class:`StopRequested` if a stop signal arrived: call it where the work so far is durable."""
    if _requested.is_set():
        raise StopRequested(_signum)


def stop_now() -> None:
    """Raise :class:`StopRequested`: this process, or another of its multi-process job, was signalled."""
    raise StopRequested(_signum or signal.SIGTERM)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """SIGTERM and SIGINT request a stop at the next :func:`checkpoint` instead of killing the process.

    Only the main thread can install signal handlers; elsewhere this changes nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield _requested
        return

    def request(signum: int, frame: FrameType | None) -> None:
        global _signum
        if _requested.is_set():  # asked twice: stop now, as without this handler
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        _signum = signum
        _requested.set()
        name = signal.Signals(signum).name
        print(f"{name}: stopping at the next safe point (send it again to stop at once)", file=sys.stderr)

    previous = {sig: signal.signal(sig, request) for sig in STOP_SIGNALS}
    try:
        yield _requested
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _requested.clear()


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block SIGTERM and SIGINT in this thread meanwhile. Processes forked meanwhile start with them blocked
    (a process started through exec, such as a forkserver, does not), so a stop signal sent to the whole
    group before a worker took its stance (:func:`obey_stop_signals_from_owner`) waits for it instead of
    killing it. This thread receives a signal sent meanwhile once the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def obey_stop_signals_from_owner(owner: int) -> None:
    """In a worker process, before it starts any thread: ignore SIGINT, and end on a SIGTERM only when the
    process ``owner`` sent it. SIGTERM stays blocked for a thread that looks at who sent it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # an ignored signal is discarded, not kept for the thread
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    threading.Thread(target=_end_on_sigterm_from, args=(owner,), name="sigterm", daemon=True).start()


def _end_on_sigterm_from(owner: int) -> None:
    while True:
        if signal.sigwaitinfo([signal.SIGTERM]).si_pid == owner:
            os._exit(0)
