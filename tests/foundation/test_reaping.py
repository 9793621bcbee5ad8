"""``kill_and_release`` frees a killed process's memory before the process itself runs again."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from foundation import reaping
from foundation.reaping import kill_and_release

HELD_BYTES = 200 * 1024**2
# A process that touches HELD_BYTES, says so, and waits.
HOLDER = f"""
import sys, time
held = bytearray({HELD_BYTES})
held[::4096] = b"x" * len(held[::4096])
print("ready", flush=True)
time.sleep(120)
"""
SPINNER = "while True: pass"
CPU = min(os.sched_getaffinity(0))


def _anon_bytes(pid: int) -> int:
    """The anonymous memory ``pid`` still holds (0 once it has none)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


@contextmanager
def _process(code: str, *, starved: bool = False) -> Iterator[subprocess.Popen[str]]:
    """Python running ``code``; ``starved``: on one core beside a process that spins there, at the lowest
    priority there is (SCHED_IDLE), so that it cannot free its own memory for a long while once killed."""
    started = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        if starved:
            os.sched_setaffinity(started.pid, {CPU})
        yield started
    finally:
        started.kill()
        started.wait()


@contextmanager
def _starved_holder() -> Iterator[subprocess.Popen[str]]:
    with _process(HOLDER, starved=True) as holder, _process(SPINNER) as spinner:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        os.sched_setaffinity(spinner.pid, {CPU})
        os.sched_setscheduler(holder.pid, os.SCHED_IDLE, os.sched_param(0))
        assert _anon_bytes(holder.pid) >= HELD_BYTES
        yield holder


def test_a_killed_process_holds_its_memory_until_it_runs() -> None:
    """The case the release is for: a plain SIGKILL leaves a starved process's memory held (what the test
    below would see without the release)."""
    with _starved_holder() as holder:
        holder.kill()
        assert _anon_bytes(holder.pid) >= HELD_BYTES // 2


def test_the_killers_thread_frees_the_memory_of_a_starved_process() -> None:
    with _starved_holder() as holder:
        assert kill_and_release(holder.pid)
        assert _anon_bytes(holder.pid) < HELD_BYTES // 10  # before the process has run again
        assert holder.wait(timeout=60) == -9


def test_a_process_that_already_exited_is_left_to_its_waiter() -> None:
    with _process("pass") as exited:
        os.waitid(os.P_PID, exited.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet waited for
        assert not kill_and_release(exited.pid)  # no memory left to free, and no error
        assert exited.wait() == 0
    assert not kill_and_release(exited.pid)  # waited for: no such process, and no error


def test_a_machine_without_the_syscall_still_kills(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reaping, "_PROCESS_MRELEASE", None)
    with _process("import time; time.sleep(120)") as sleeper:
        assert not kill_and_release(sleeper.pid)
        assert sleeper.wait(timeout=60) == -9
