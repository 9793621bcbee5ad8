"""app.middleware around a plain ASGI app: servers call an app positionally, whatever its parameter names."""

import asyncio
import math

from starlette.testclient import TestClient

from app.middleware import BodyPace, BodyProgress, BodySizeLimitMiddleware, UploadSlots


async def body_length(scope, receive_message, send_message):
    """Answers the length of the request body; its parameters are not named ``receive`` and ``send``."""
    body, more = b"", True
    while more:
        message = await receive_message()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    await send_message({"type": "http.response.start", "status": 200, "headers": []})
    await send_message({"type": "http.response.body", "body": str(len(body)).encode()})


def test_body_size_limit_passes_a_body_within_the_limit_to_any_asgi_app():
    client = TestClient(BodySizeLimitMiddleware(body_length, limit=100))  # no lifespan: the app has none
    assert client.post("/", content=b"x" * 100).text == "100"
    assert client.post("/", content=b"x" * 101).status_code == 413


def test_upload_slots_go_to_a_new_upload_only_from_a_body_behind_the_rate():
    async def scenario():
        slots = UploadSlots(2, BodyPace(min_rate=1000, allowance=30, deadline=120))
        keeping, late = slots.take(), slots.take()
        keeping.received = 10_000  # 10 s ahead of 1000 bytes/s
        late.started -= 5  # 5 s old, nothing received: 5 s behind
        new = slots.take()
        assert late.cut and new is not None and not keeping.cut  # the late one gave its slot up
        new.complete = True  # in: its request runs, its body held, never cut
        assert slots.full() and slots.take() is None  # a fourth finds every slot held by bodies that keep up
        slots.give_back(keeping)
        assert not slots.full() and slots.take() is not None

    asyncio.run(scenario())


def test_body_pace_cuts_by_the_rate_after_the_allowance_and_by_the_deadline():
    pace = BodyPace(min_rate=1000, allowance=30, deadline=120)
    body = BodyProgress(started=0.0, received=50_000)  # 50 s bought at 1000 bytes/s
    assert pace.due(body) == 80.0 and "minimum rate" in pace.refusal(body, 80.0).detail
    body.received = 500_000
    assert pace.due(body) == 120.0 and "deadline" in pace.refusal(body, 120.0).detail
    assert BodyPace(min_rate=1000, allowance=0, deadline=0).due(body) == math.inf  # 0: no bound
