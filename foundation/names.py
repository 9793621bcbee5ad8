"""File names as people read them: a name that is not UTF-8 shown with backslash escapes.

Python holds a file name that is not valid UTF-8 (Latin-1 bytes from an old zip file: ``caf\\xe9.jpg``)
with surrogate escapes (``os.fsdecode``), which open the same file again but cannot be written as UTF-8:
not to a terminal, a JSON response or SQLite. What is shown or sent is :func:`readable_name`'s form; what
opens the file stays the escaped name (``index.items`` stores its bytes).
"""

from __future__ import annotations

import os


def readable_name(name: str) -> str:
    """``name`` as UTF-8 text: unchanged when it is, else each byte that is not UTF-8 as ``\\xNN``."""
    try:
        name.encode()
    except UnicodeEncodeError:
        return os.fsencode(name).decode("utf-8", "backslashreplace")
    return name
