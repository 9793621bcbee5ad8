"""Compute slots: at most N blocking jobs at once, the rest wait (and say how long)."""

from __future__ import annotations

import threading
import time

import anyio

from app.compute import ComputeSlots


def test_slots_bound_concurrent_work_and_report_the_wait() -> None:
    running, most = [0], [0]
    guard = threading.Lock()

    def job(seconds: float) -> str:
        with guard:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(seconds)
        with guard:
            running[0] -= 1
        return "done"

    async def main() -> list[tuple[str, float]]:
        slots = ComputeSlots(2)
        results: list[tuple[str, float]] = []

        async def submit() -> None:
            results.append(await slots.run(job, 0.1))

        async with anyio.create_task_group() as group:
            for _ in range(5):
                group.start_soon(submit)
        return results

    results = anyio.run(main)
    assert [value for value, _ in results] == ["done"] * 5
    assert most[0] == 2
    waits = sorted(queued for _, queued in results)
    assert waits[0] < 50 and waits[-1] >= 150  # the fifth job waited for two rounds of two
