"""Ending a process and freeing its memory in the caller's context: ``process_mrelease(2)``.

A SIGKILLed process frees its address space itself, in its own context, at its own niceness: a decode worker
lowered to niceness 19 (``foundation.priority``) that held hundreds of MB, beside other niceness-19 work on a
loaded machine, took seconds to die, and the request that ended it waited that long in its join while it held
its compute slot (bench/results/hostile_owed_ab.md). ``process_mrelease`` (Linux >= 5.15, what Android's lmkd
uses) lets the caller free a dying process's memory itself, at the caller's priority. Where the kernel cannot
(an older kernel, another architecture, a process that already freed its memory) the process frees it as
before; the caller's join then waits for that.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import signal

# process_mrelease's number in the generic syscall table, which x86_64 and aarch64 both follow from 424 on.
_PROCESS_MRELEASE = {"x86_64": 448, "aarch64": 448}.get(platform.machine())


def _process_mrelease(pidfd: int) -> int:
    """``process_mrelease(pidfd, 0)``: 0, or the errno it failed with (ENOSYS where this machine has none)."""
    if _PROCESS_MRELEASE is None:
        return errno.ENOSYS
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(ctypes.c_long(_PROCESS_MRELEASE), ctypes.c_int(pidfd), ctypes.c_uint(0)) == 0:
        return 0
    return ctypes.get_errno()


def kill_and_release(pid: int) -> bool:
    """SIGKILL process ``pid`` and free its memory in this thread; False where it could not be freed here
    (no such syscall, no pidfd, a process already gone or already freed): then the process frees it itself.

    The kill goes through a pidfd opened first, so it cannot reach another process that reused the number.
    """
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except OSError:  # no pidfd here (a kernel before 5.3): a plain kill, the process frees its memory
        os.kill(pid, signal.SIGKILL)
        return False
    try:
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except ProcessLookupError:  # it exited meanwhile
            return False
        return _process_mrelease(pidfd) == 0
    finally:
        os.close(pidfd)
