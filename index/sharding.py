"""Deterministic shares of a gallery: ``I/N`` owns the paths whose hash is I modulo N.

Hashing the relative path (not a position in a listing) keeps every file in the same shard when others
are added or removed, so each shard can be re-run incrementally on its own.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from foundation.errors import InvalidInputError

_SHARD = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


@dataclass(frozen=True)
class Shard:
    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise InvalidInputError(f"shard {self.index}/{self.count} does not exist: I/N needs 0 <= I < N")

    @classmethod
    def parse(cls, text: str) -> Shard:
        match = _SHARD.match(text)
        if not match:
            raise InvalidInputError(f"cannot read shard {text!r}: write I/N, e.g. 0/4 for the first of four")
        return cls(int(match.group(1)), int(match.group(2)))

    def owns(self, relative_path: str) -> bool:
        digest = hashlib.sha256(relative_path.encode()).digest()
        return int.from_bytes(digest[:8], "big") % self.count == self.index

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"
