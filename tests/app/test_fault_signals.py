"""Fault suite, process half: signals, slow clients and connection caps against real uvicorn processes.

Timeouts are set short through the settings, so every wait here is bounded by a few seconds.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.lib.images import image_bytes, make_image
from bench.lib.servers import ServerProcess, free_port
from tests.support.served import Served
from tests.support.servers import API_KEY, capped_serving, serve_args, uvicorn_process
from tests.support.waiting import wait_until
from tests.tiers import starts

MB = 1024**2
# Short limits so that every cut happens within seconds (the defaults are 10 s, 30 s and 10 s).
LIMITS = [
    "--rate-limit",
    "0",
    "--header-timeout-seconds",
    "2",
    "--body-timeout-seconds",
    "2",
    "--max-connections",
    "4",
    "--max-concurrent-uploads",
    "1",
    "--body-deadline-seconds",
    "4",
]


def _search_request(base: str) -> tuple[bytes, bytes]:
    """A real multipart search: its header block and its body, to send by hand at any pace."""
    request = httpx.Request(
        "POST", f"{base}/v1/search?k=3", files={"image": ("q.png", image_bytes(make_image(3)), "image/png")}
    )
    body = request.read()
    port = base.rsplit(":", 1)[1]
    head = f"POST /v1/search?k=3 HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
    head += f"Content-Type: {request.headers['content-type']}\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode(), body


def _connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=15)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (bounded by the socket timeout)."""
    chunks = []
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _port_closed(base: str) -> bool:
    try:
        _connect(base).close()
    except OSError:
        return True
    return False


@pytest.fixture(scope="module")
@starts("server")
def limited_server(served_module: Served) -> Iterator[ServerProcess]:
    """A server with the short limits above, under the fault suite's 2 GB address-space cap."""
    with capped_serving(served_module, *LIMITS) as server:
        yield server


@pytest.fixture
def limited(limited_server: ServerProcess) -> str:
    return limited_server.url


@pytest.mark.server
def test_sigterm_lets_an_in_flight_request_finish_then_exits_0(served: Served) -> None:
    with uvicorn_process(serve_args(served, "--shutdown-grace-seconds", "20")) as (base, process):
        head, body = _search_request(base)
        sock = _connect(base)
        sock.sendall(head + body[: len(body) // 2])
        time.sleep(0.5)  # the request is in flight: headers parsed, body half there
        process.send_signal(signal.SIGTERM)
        wait_until(lambda: _port_closed(base), 10, "the listening socket to close")
        sock.sendall(body[len(body) // 2 :])
        answer = _read_until_closed(sock)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        assert process.wait(timeout=20) == 0


@pytest.mark.server
def test_sigterm_with_a_stalled_client_exits_0_after_the_grace(served: Served) -> None:
    # No body timeout: only the shutdown grace can end the stalled upload.
    args = serve_args(served, "--shutdown-grace-seconds", "1", "--body-timeout-seconds", "0")
    with uvicorn_process(args) as (base, process):
        head, body = _search_request(base)
        sock = _connect(base)
        sock.sendall(head + body[:100])  # ... and never the rest
        time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0  # before: "Waiting for connections to close" for ever
        assert _port_closed(base)


@pytest.mark.server
def test_a_request_cut_short_by_the_stop_is_answered_in_the_json_error_format(served: Served) -> None:
    args = serve_args(served, "--shutdown-grace-seconds", "1", "--body-timeout-seconds", "0")
    with uvicorn_process(args) as (base, process):
        head, body = _search_request(base)
        sock = _connect(base)
        sock.sendall(head + body[:100])  # the app waits for the rest of the body past the grace
        time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        answer = _read_until_closed(sock)
        assert process.wait(timeout=20) == 0
    # Before: "HTTP/1.1 500 Internal Server Error", text/plain, "Internal Server Error".
    assert answer.startswith(b"HTTP/1.1 503"), answer[:300]
    assert b"application/json" in answer and b'{"error":{"code":"shutting_down"' in answer, answer[:300]


@pytest.mark.server
def test_sigint_exits_0(served: Served) -> None:
    with uvicorn_process(serve_args(served)) as (base, process):
        assert httpx.get(f"{base}/healthz", timeout=10).status_code == 200
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=20) == 0
        assert _port_closed(base)


def test_slowloris_headers_are_cut_within_the_header_timeout(limited: str) -> None:
    sock = _connect(limited)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    started = time.monotonic()
    answer = b""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        for i in range(100):  # one header line every 0.2 s: 20 s if nobody cuts it
            sock.sendall(f"X-Drip-{i}: 1\r\n".encode())
            time.sleep(0.2)
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                answer = sock.recv(65536)
                break
            sock.setblocking(True)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert time.monotonic() - started < 10


def test_a_stalled_upload_gets_408_and_is_closed(limited: str) -> None:
    head, body = _search_request(limited)
    sock = _connect(limited)
    sock.sendall(head + body[: len(body) // 2])
    started = time.monotonic()
    answer = _read_until_closed(sock)  # the server closes it: nothing is held for this client
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"request_timeout" in answer
    assert time.monotonic() - started < 10


def test_a_stalled_large_upload_releases_its_memory(limited_server: ServerProcess) -> None:
    # Before: 8 stalled uploads held +127 MB (multipart) and +321 MB (JSON) for over a minute.
    port = limited_server.url.rsplit(":", 1)[1]
    declared = 60 * MB
    head = (
        f"POST /v1/search HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {declared}\r\n\r\n"
    ).encode()
    before = limited_server.status("VmRSS")
    sock = _connect(limited_server.url)
    sock.sendall(head + b'{"image": "' + b"A" * (40 * MB))  # two thirds of a base64 image, then silence
    holding = limited_server.status("VmRSS")
    assert _read_until_closed(sock).startswith(b"HTTP/1.1 408")
    wait_until(lambda: limited_server.status("VmRSS") < before + 20 * MB, 10, "the stalled body to be freed")
    assert holding > before  # the body was buffered while it arrived, so the release is a real one


def test_connections_over_the_cap_get_503_with_retry_after(limited: str) -> None:
    idle = [_connect(limited) for _ in range(4)]
    try:
        time.sleep(0.2)
        answer = httpx.get(f"{limited}/healthz", timeout=10)
        assert answer.status_code == 503
        assert answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["code"] == "busy"
    finally:
        for sock in idle:
            sock.close()
    wait_until(lambda: httpx.get(f"{limited}/healthz", timeout=10).status_code == 200, 10, "room again")


def test_uploads_over_the_cap_get_503_with_retry_after(limited: str) -> None:
    # It keeps ahead of the minimum rate (64 KB sent: 4 s of 16 KB/s), so no new upload may take its slot.
    stalled = _slow_upload(limited, MB, SLOW_PART + b"x" * 65536)  # holds the one slot until the timeout
    try:
        time.sleep(0.3)
        files = {"image": ("q.png", image_bytes(make_image(4)), "image/png")}
        answer = httpx.post(f"{limited}/v1/search", files=files, timeout=10)
        assert answer.status_code == 503
        assert answer.headers["retry-after"] == "1"
        assert httpx.get(f"{limited}/v1/stats", timeout=10).status_code == 200  # no body: not an upload
        assert _read_until_closed(stalled).startswith(b"HTTP/1.1 408")
        answer = httpx.post(f"{limited}/v1/search", files=files, timeout=30)
        assert answer.status_code == 200
    finally:
        stalled.close()


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.server
def test_sigterm_of_demo_stops_the_api_and_the_ui_and_exits_0(
    tmp_path: Path, demo_gallery: Path, exported_model: Path
) -> None:
    workdir = tmp_path / "artifacts"
    (workdir / "gallery").mkdir(parents=True)
    for path in sorted(demo_gallery.rglob("*.jpg"))[:4]:  # a few photos: the build is not what is tested
        (workdir / "gallery" / path.name).write_bytes(path.read_bytes())
    api_port, ui_port = free_port(), free_port()
    command = [
        sys.executable,
        "-m",
        "cli.main",
        "demo",
        "--workdir",
        str(workdir),
        "--api-port",
        str(api_port),
        "--ui-port",
        str(ui_port),
    ]
    demo = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in demo.stdout:  # bounded: the demo fails on its own if a child does not come up
            if line.startswith("UI:"):
                break
        assert _listening(api_port) and _listening(ui_port)
        children = subprocess.run(
            ["pgrep", "-P", str(demo.pid)], capture_output=True, text=True, check=False
        ).stdout.split()
        # The API and the UI; besides them, the decode forkserver of the demo's build-index and its
        # resource tracker (multiprocessing's), which must end too.
        servers = [
            pid for pid in children if b"multiprocessing" not in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        assert len(servers) == 2
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(timeout=40) == 0
        for pid in servers:  # before: both kept running with their ports answering
            assert not Path(f"/proc/{pid}").exists() or _zombie(pid)
        # multiprocessing's end once they see the demo gone (their pipe from it closed)
        gone = lambda: all(not Path(f"/proc/{pid}").exists() or _zombie(pid) for pid in children)  # noqa: E731
        wait_until(gone, 10, "the decode forkserver and its resource tracker to end")
        assert not _listening(api_port) and not _listening(ui_port)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()


def _zombie(pid: str) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


# Slow bodies (issue 43, class 1): a minimum upload rate, a deadline per body, and slots that a body behind
# the rate gives up to a new upload.
SLOW_PART = b'--b\r\nContent-Disposition: form-data; name="image"; filename="q"\r\n\r\n'


def _slow_upload(
    base: str, declared: int, first: bytes, path: str = "/v1/search", **headers: str
) -> socket.socket:
    """An upload to ``path`` that declares ``declared`` body bytes (0: chunked) and sends ``first``; the
    rest is what the test sends, at its own pace."""
    port = base.rsplit(":", 1)[1]
    fields = {"Content-Type": "multipart/form-data; boundary=b", **headers}
    fields.update({"Content-Length": str(declared)} if declared else {"Transfer-Encoding": "chunked"})
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in fields.items()) + "\r\n"
    sock = _connect(base)
    sock.sendall(head.encode() + first)
    return sock


def _answer(sock: socket.socket, wait: float) -> bytes:
    """What the server sent on ``sock`` within ``wait`` seconds (b"" if nothing)."""
    ready, _, _ = select.select([sock], [], [], wait)
    return _read_until_closed(sock) if ready else b""


def _drip(sock: socket.socket, chunk: bytes, every: float, until: float) -> bytes:
    """Send ``chunk`` every ``every`` seconds for at most ``until`` seconds or until the server answers;
    the answer (b"" if none)."""
    deadline = time.monotonic() + until
    while time.monotonic() < deadline:
        try:
            sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            return _answer(sock, 1)
        answer = _answer(sock, every)
        if answer:
            return answer
    return b""


def _timed_search(base: str) -> tuple[float, httpx.Response]:
    files = {"image": ("q.png", image_bytes(make_image(5)), "image/png")}
    started = time.monotonic()
    answer = httpx.post(f"{base}/v1/search", params={"k": 3}, files=files, timeout=60)
    return time.monotonic() - started, answer


@pytest.fixture(scope="module")
@starts("server")
def default_limits(served_module: Served) -> Iterator[ServerProcess]:
    """A server with the default limits on bodies and uploads (8 slots), under the 2 GB cap."""
    with capped_serving(served_module, "--rate-limit", "0") as server:
        yield server


def test_eight_slow_uploads_do_not_keep_a_search_out(default_limits: ServerProcess) -> None:
    # The attack: 8 uploads that declare 1 MB and then send a byte now and then hold every upload
    # slot. Before: every search, batch and explain answered 503 busy for as long as they went on.
    base = default_limits.url
    usual = sorted(_timed_search(base)[0] for _ in range(3))[1]
    slow = [_slow_upload(base, MB, SLOW_PART + b"x" * 1024) for _ in range(8)]
    try:
        time.sleep(1)  # each holds an upload slot, and is behind the minimum rate
        took, answer = _timed_search(base)
        load = os.getloadavg()[0]
        print(f"search alone {usual:.2f} s, beside 8 slow uploads {took:.2f} s (load average {load:.2f})")
        assert answer.status_code == 200, answer.text
        assert took < usual + 2, (usual, took, load)
        # A batch and an explain of an upload get in the same way: the slot the search left is taken by one
        # more slow upload first, so each of them takes the slot of a slow one too.
        image = ("q.png", image_bytes(make_image(6)), "image/png")
        slow.append(_slow_upload(base, MB, SLOW_PART + b"x" * 1024))
        time.sleep(1)
        batch = httpx.post(f"{base}/v1/search/batch", files=[("images", image)] * 2, timeout=60)
        assert batch.status_code == 200, batch.text
        slow.append(_slow_upload(base, MB, SLOW_PART + b"x" * 1024))
        time.sleep(1)
        item = answer.json()["results"][0]["id"]
        explain = httpx.post(f"{base}/v1/explain", params={"item": item}, files={"image": image}, timeout=60)
        assert explain.status_code == 200, explain.text
        answers = [_answer(sock, 0.5) for sock in slow]
        cut = [answer for answer in answers if answer.startswith(b"HTTP/1.1 408")]
        assert len(cut) == 3, answers  # those whose slots the three took, told why
        assert all(b"request_timeout" in answer and b"connection: close" in answer.lower() for answer in cut)
    finally:
        for sock in slow:
            sock.close()


def test_a_body_under_the_minimum_rate_is_cut(limited: str) -> None:
    # A byte every 0.5 s never pauses past the 2 s body timeout. Before: held until the client stopped.
    sock = _slow_upload(limited, MB, SLOW_PART)
    started = time.monotonic()
    answer = _drip(sock, b"x", 0.5, 15)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b"minimum" in answer  # the message says which rule
    assert time.monotonic() - started < 6  # 2 s behind the rate, then 408
    sock.close()


def test_a_chunked_body_under_the_minimum_rate_is_cut(limited: str) -> None:
    sock = _slow_upload(limited, 0, b"%x\r\n%s\r\n" % (len(SLOW_PART), SLOW_PART))
    answer = _drip(sock, b"1\r\nx\r\n", 0.5, 15)  # one-byte chunks: no Content-Length to judge by
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    sock.close()


def test_a_body_over_the_deadline_is_cut_however_fast_it_comes(limited: str) -> None:
    # 64 KB every 0.25 s is 16 times the minimum rate, but 32 MB takes 2 minutes at that pace.
    sock = _slow_upload(limited, 32 * MB, SLOW_PART)
    started = time.monotonic()
    answer = _drip(sock, b"x" * 65536, 0.25, 30)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b"deadline" in answer
    assert time.monotonic() - started < 10  # the 4 s deadline of LIMITS
    sock.close()


def test_a_slow_json_body_parsed_by_fastapi_is_a_408_not_a_400(limited_server: ServerProcess) -> None:
    # The reload's body is read by FastAPI, which turns a failure while reading into 400 "error parsing".
    sock = _slow_upload(
        limited_server.url, 4096, b'{"index_path": "', path="/v1/admin/reload", **{"X-API-Key": API_KEY}
    )
    answer = _drip(sock, b"a", 0.5, 15)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    sock.close()


def test_readyz_says_busy_while_every_upload_slot_is_held(limited: str) -> None:
    # The limited server has one upload slot. A body that keeps ahead of the rate holds it: new uploads get
    # 503 busy, and so does /readyz, so that a load balancer sends them elsewhere. Before: /readyz 200.
    sock = _slow_upload(limited, 16 * MB, SLOW_PART + b"x" * 256 * 1024)  # 16 s ahead of 16 KB/s
    try:
        time.sleep(0.3)
        ready = httpx.get(f"{limited}/readyz", timeout=10)
        assert ready.status_code == 503, ready.text
        assert ready.json()["error"]["code"] == "busy"
        assert "upload" in ready.json()["error"]["message"]
    finally:
        sock.close()
    wait_until(lambda: httpx.get(f"{limited}/readyz", timeout=10).status_code == 200, 10, "a free slot")
