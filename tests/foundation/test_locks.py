"""The readers-writer lock that guards index writes."""

from __future__ import annotations

import threading
import time

from foundation.locks import ReadWriteLock


def test_readers_share_the_lock_and_a_writer_excludes_them() -> None:
    lock = ReadWriteLock()
    readers = 4
    # Every reader waits inside the lock for all the others: this only completes if they hold it together.
    all_inside = threading.Barrier(readers, timeout=10)
    readers_in = threading.Event()
    inside, writer_saw, failures = [0], [], []
    guard = threading.Lock()

    def reader() -> None:
        with lock.read():
            with guard:
                inside[0] += 1
            try:
                all_inside.wait()
            except threading.BrokenBarrierError:
                failures.append("readers were serialised")
            readers_in.set()
            time.sleep(0.1)  # stay inside while the writer asks for the lock
            with guard:
                inside[0] -= 1

    def writer() -> None:
        with lock.write(), guard:
            writer_saw.append(inside[0])

    threads = [threading.Thread(target=reader) for _ in range(readers)]
    for thread in threads:
        thread.start()
    assert readers_in.wait(timeout=20)
    writing = threading.Thread(target=writer)
    writing.start()
    for thread in [*threads, writing]:
        thread.join(timeout=20)
    assert not failures
    assert writer_saw == [0], "the writer ran while readers were inside"
