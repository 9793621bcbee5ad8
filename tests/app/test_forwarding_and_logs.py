"""Forwarded headers are believed only from configured proxies; the access log never holds query values."""

from __future__ import annotations

import logging

import pytest
from typer.testing import CliRunner

from app.access_log import RedactQueryValues, redact_query


@pytest.mark.parametrize(
    ("flags", "env", "expected"),
    [
        ([], {}, (False, None)),  # uvicorn's own default would believe 127.0.0.1
        (
            ["--trusted-proxy", "10.0.0.5", "--trusted-proxy", "10.1.0.0/16"],
            {},
            (True, ["10.0.0.5", "10.1.0.0/16"]),
        ),
        ([], {"DMLSEARCH_TRUSTED_PROXIES": "127.0.0.1, ::1"}, (True, ["127.0.0.1", "::1"])),
    ],
)
def test_serve_believes_forwarded_headers_only_from_trusted_proxies(
    monkeypatch: pytest.MonkeyPatch, flags: list[str], env: dict[str, str], expected: tuple
) -> None:
    import app.server
    from cli.main import app as cli

    calls: list[dict] = []
    # serve hands uvicorn's options to app.server.run_server (its own server class); capture them there.
    monkeypatch.setattr(app.server, "run_server", lambda _app, _settings, **kwargs: calls.append(kwargs))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(cli, ["serve", "--index", "nowhere", "--wait-for-index", *flags])
    assert result.exit_code == 0, result.output
    (kwargs,) = calls
    assert (kwargs["proxy_headers"], kwargs["forwarded_allow_ips"]) == expected


@pytest.mark.parametrize(
    ("target", "logged"),
    [
        ("/v1/stats", "/v1/stats"),
        ("/v1/search?k=5&api_key=s3cret", "/v1/search?k=REDACTED&api_key=REDACTED"),
        ("/v1/items?s3cret-t0ken=1", "/v1/items?REDACTED"),
        ("/v1/items?x=1&&s3cretT0ken", "/v1/items?x=REDACTED&REDACTED&REDACTED"),
    ],
)
def test_query_values_are_redacted(target: str, logged: str) -> None:
    assert redact_query(target) == logged
    record = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d', None, None)
    record.args = ("127.0.0.1:5000", "GET", target, "1.1", 200)
    assert RedactQueryValues().filter(record)
    assert record.getMessage() == f'127.0.0.1:5000 - "GET {logged} HTTP/1.1" 200'
