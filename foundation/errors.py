"""The one error taxonomy: every error a user can cause or fix is a :class:`DmlsearchError` with a kind
and a stable code.

The API maps the kind to an HTTP status and answers ``{"error": {"code", "message"}}`` (``app/errors.py``);
the command line prints ``error: message`` and exits 2 (``cli/common.py``). Anything else is a bug and
keeps its traceback. It lives in ``index``, the package every other one may import.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorKind(StrEnum):
    """What kind of failure an error is, whoever reports it."""

    INVALID = "invalid"  # readable, but not acceptable as asked
    MALFORMED = "malformed"  # cannot be read at all
    UNSUPPORTED = "unsupported"  # a format not taken
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"  # at odds with what is stored (another model, another gallery, a copy)
    TOO_LARGE = "too_large"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    CANCELLED = "cancelled"  # the client went away
    UNAVAILABLE = "unavailable"  # a server, a dependency or the storage failed: retry later


class DmlsearchError(Exception):
    """An error the user can understand and act on. ``kind`` and ``code`` are class defaults a subclass
    sets; ``code`` may be given per instance where one class covers several reasons."""

    kind: ErrorKind = ErrorKind.INVALID
    code: str = "invalid_request"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


# Generic errors of each kind. Each keeps the built-in base it replaced, so that callers (and tests)
# catching ValueError, FileNotFoundError... still catch it.
class InvalidInputError(DmlsearchError, ValueError):
    """An argument, a file's content or a setting is not acceptable."""


class NotFoundError(DmlsearchError, FileNotFoundError):
    """A file, directory or item named does not exist."""

    kind = ErrorKind.NOT_FOUND
    code = "not_found"


class ConflictError(DmlsearchError, FileExistsError):
    """Writing would overwrite or contradict what is stored."""

    kind = ErrorKind.CONFLICT
    code = "conflict"


class DamagedFileError(DmlsearchError, RuntimeError):
    """A stored file cannot be read (truncated or corrupt)."""

    code = "damaged_file"


class MissingDependencyError(DmlsearchError, ImportError):
    """An optional package a feature needs is not installed; the message says which extra to install."""

    kind = ErrorKind.UNAVAILABLE
    code = "missing_dependency"


class UnavailableError(DmlsearchError, RuntimeError):
    """Hardware or a service asked for is not there."""

    kind = ErrorKind.UNAVAILABLE
    code = "unavailable"
