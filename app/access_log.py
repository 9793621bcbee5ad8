"""uvicorn's access log with query values redacted: a key sent as ``?api_key=...`` is never written."""

from __future__ import annotations

import logging
import re

ACCESS_LOGGER = "uvicorn.access"
REDACTED = "REDACTED"
# Parameter names are kept when they look like names (k, offset, api_key), so the log still says what
# was asked; anything else in a query (a bare token, a name that could be one) is redacted whole.
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,31}$")


def redact_query(target: str) -> str:
    """``/v1/search?k=5&api_key=s3cret`` -> ``/v1/search?k=REDACTED&api_key=REDACTED``."""
    path, separator, query = target.partition("?")
    if not separator:
        return target
    parts = []
    for part in query.split("&"):
        name, has_value, _ = part.partition("=")
        parts.append(f"{name}={REDACTED}" if has_value and _NAME.match(name) else REDACTED)
    return f"{path}?{'&'.join(parts)}"


class RedactQueryValues(logging.Filter):
    """Rewrites uvicorn's access records: ``(client, method, path with query, http version, status)``."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and len(record.args) == 5:
            client, method, target, version, status = record.args
            if isinstance(target, str):
                record.args = (client, method, redact_query(target), version, status)
        return True


_FILTER = RedactQueryValues()


def redact_access_log() -> None:
    """Install the filter on uvicorn's access logger (once per process, however many apps are made)."""
    logging.getLogger(ACCESS_LOGGER).addFilter(_FILTER)
