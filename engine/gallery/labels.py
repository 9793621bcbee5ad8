"""Labels given through the API become folder names under the gallery root: a safe, bounded alphabet.

Folder names that build-index finds keep whatever name they have; a label a client sends must not be a
path, a hidden name, a name that only looks like another (bidi controls such as U+202E, invisible
characters, surrounding spaces), a URL-encoded name (``%2F``) or longer than file systems allow.
"""

from __future__ import annotations

import unicodedata
from typing import Annotated

from pydantic import StringConstraints, TypeAdapter, ValidationError

from foundation.errors import InvalidInputError

MAX_LABEL_CHARS = 100
MAX_LABEL_BYTES = 200  # in UTF-8; file systems allow 255 bytes per name, and the API says so up front
# Besides letters, combining marks and digits of any script: spaces inside, and this punctuation.
LABEL_PUNCTUATION = " -_.,()&'+"


# Letters, combining marks and digits of any script, and the punctuation (as a regular-expression class).
_LABEL_CLASS = r"\p{L}\p{M}\p{N}" + LABEL_PUNCTUATION.replace(" ", "").replace(".", "").replace("-", r"\-")
# The rule below as a regular expression (ECMA-262 / Rust syntax) for the API schema: a label the schema
# allows is one the server takes. The length in UTF-8 bytes and the NFC form are beyond a pattern.
LABEL_PATTERN = f"^[{_LABEL_CLASS}](?:[{_LABEL_CLASS} .]*[{_LABEL_CLASS}.])?$"


def _matcher(pattern: str) -> TypeAdapter[str]:
    """The pattern as pydantic-core judges it: Rust's regex, the engine of the schema's validators, with
    Unicode tables of its own (Python's unicodedata can be older and call a newer letter unassigned)."""
    return TypeAdapter(Annotated[str, StringConstraints(pattern=pattern)])


_LABEL_SHAPE = _matcher(LABEL_PATTERN)
_LABEL_CHAR = _matcher(f"^[{_LABEL_CLASS} .]$")


def _matches(matcher: TypeAdapter[str], text: str) -> bool:
    try:
        matcher.validate_python(text)
    except ValidationError:
        return False
    return True


class InvalidLabelError(InvalidInputError):
    """A label that cannot safely be a folder name."""


def check_label(label: str) -> str:
    """The label in Unicode NFC form (so one name is one folder); raises :class:`InvalidLabelError`."""
    normal = unicodedata.normalize("NFC", label)
    if not normal or len(normal) > MAX_LABEL_CHARS or len(normal.encode()) > MAX_LABEL_BYTES:
        raise InvalidLabelError(
            f"label {label[:MAX_LABEL_CHARS]!r} must be 1-{MAX_LABEL_CHARS} characters and at most "
            f"{MAX_LABEL_BYTES} bytes in UTF-8"
        )
    if _matches(_LABEL_SHAPE, normal):
        return normal
    bad = sorted({c for c in normal if not _matches(_LABEL_CHAR, c)})
    if bad:
        shown = ", ".join(f"U+{ord(c):04X}" if not c.isprintable() else repr(c) for c in bad)
        raise InvalidLabelError(
            f"label {label!r} contains {shown}: use letters, digits, spaces and {LABEL_PUNCTUATION.strip()}"
        )
    raise InvalidLabelError(f"label {label!r} must not start or end with a space or start with '.'")
