"""Compute slots: at most N blocking jobs at once, at most a share of them for one client; the rest wait
(and say how long)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import anyio
import pytest
from starlette.requests import Request
from starlette.types import Message

from app.compute import ComputeSlots, SlotWaitTimeoutError
from foundation.deadline import request_deadline


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
        slots = ComputeSlots(2, share=2)  # work no client asked for, all of one
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


def request_from(address: str, key: str | None = None) -> Request:
    """A request's scope as uvicorn hands it (the forwarded address, when from a trusted proxy)."""
    headers = [(b"x-api-key", key.encode())] if key else []
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/search",
        "headers": headers,
        "client": (address, 5),
    }

    async def receive() -> Message:  # a client that stays connected and sends nothing more
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    return Request(scope, receive)


class Jobs:
    """Jobs that say when they run; ``hold`` ones run until released."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.released = threading.Event()

    def hold(self, name: str) -> None:
        self.log.append(f"{name} starts")
        self.released.wait(30)
        self.log.append(f"{name} ends")

    def quick(self, name: str) -> None:
        self.log.append(name)


async def until(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(30):
        while not condition():
            await anyio.sleep(0.01)


def test_a_second_client_is_admitted_while_one_client_holds_its_share() -> None:
    """Hostile (issue 43, class 2): one client's costly decodes (a batch of 64 slow JPEGs and two slow
    uploads) held every slot, and another client's search waited behind them for minutes. Now one client
    holds at most half the slots; its next query waits for its own, the other client's goes at once."""
    jobs = Jobs()

    async def main() -> dict[str, int]:
        slots = ComputeSlots(2)
        async with anyio.create_task_group() as group:
            group.start_soon(slots.run_for, request_from("10.0.0.66"), jobs.hold, "attacker 1")
            await until(lambda: slots.in_use == 1)
            group.start_soon(slots.run_for, request_from("10.0.0.66"), jobs.quick, "attacker 2")
            await anyio.sleep(0.3)
            assert "attacker 2" not in jobs.log  # at its share: the free slot stays for someone else
            await slots.run_for(request_from("10.0.0.1"), jobs.quick, "user")
            assert "attacker 1 ends" not in jobs.log  # admitted while the attacker held its share
            jobs.released.set()
        return dict(slots.held)

    assert anyio.run(main) == {}
    assert jobs.log == ["attacker 1 starts", "user", "attacker 1 ends", "attacker 2"]


def test_holders_of_the_api_key_are_one_client_and_a_made_up_key_is_its_address() -> None:
    jobs = Jobs()

    async def main() -> None:
        slots = ComputeSlots(2, api_key="secret")
        async with anyio.create_task_group() as group:
            group.start_soon(slots.run_for, request_from("10.0.0.7", "secret"), jobs.hold, "key holder")
            await until(lambda: slots.in_use == 1)
            group.start_soon(slots.run_for, request_from("10.0.0.8", "secret"), jobs.quick, "other holder")
            await anyio.sleep(0.3)
            assert "other holder" not in jobs.log  # one client, at its share
            await slots.run_for(request_from("10.0.0.7", "guessed"), jobs.quick, "guesser")
            jobs.released.set()

    anyio.run(main)
    assert jobs.log == ["key holder starts", "guesser", "key holder ends", "other holder"]


def test_a_share_may_be_set_and_a_cancelled_waiter_leaves_nothing_held() -> None:
    jobs = Jobs()

    async def main() -> None:
        slots = ComputeSlots(3, share=2)
        async with anyio.create_task_group() as group:
            for name in ("first", "second"):
                group.start_soon(slots.run_for, request_from("10.0.0.66"), jobs.hold, name)
            await until(lambda: slots.in_use == 2)
            with anyio.move_on_after(0.3):  # a third of the same client's: waits, then is given up
                await slots.run_for(request_from("10.0.0.66"), jobs.quick, "third")
            await slots.run_for(request_from("10.0.0.1"), jobs.quick, "user")
            jobs.released.set()
        assert slots.in_use == 0 and not slots._waiting

    anyio.run(main)
    assert "third" not in jobs.log and jobs.log.index("user") < jobs.log.index("first ends")


def test_a_request_waits_for_a_slot_no_longer_than_its_deadline() -> None:
    """Issue 42, finding 4: with the index server hung, the searches holding both slots waited out their
    10 s deadline in it, and the searches behind them waited that long for a slot and more: 503 only after
    10.25-12.6 s. Now the deadline bounds the wait: 503 ``deadline_exceeded`` once it passes, the slot
    never taken."""
    jobs = Jobs()

    async def main() -> tuple[float, dict[str, int]]:
        slots = ComputeSlots(1)
        async with anyio.create_task_group() as group:
            group.start_soon(slots.run_for, request_from("10.0.0.66"), jobs.hold, "hung search")
            await until(lambda: slots.in_use == 1)
            started = time.perf_counter()
            with request_deadline(0.5), pytest.raises(SlotWaitTimeoutError) as refused:
                await slots.run_for(request_from("10.0.0.1"), jobs.quick, "late search")
            waited = time.perf_counter() - started
            assert refused.value.code == "deadline_exceeded" and not slots._waiting
            jobs.released.set()
        return waited, dict(slots.held)

    waited, held = anyio.run(main)
    assert 0.4 < waited < 5.0, waited  # before: until the holder ended (30 s here)
    assert held == {} and "late search" not in jobs.log
