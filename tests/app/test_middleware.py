"""app.middleware around a plain ASGI app: servers call an app positionally, whatever its parameter names."""

from starlette.testclient import TestClient

from app.middleware import BodySizeLimitMiddleware


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
