"""Name -> spec tables for the things a run names in its config (losses, backbones).

One table type, so that both registries read the same way: ``register_*(name, factory, **metadata)`` adds
a spec, ``TABLE[name]`` looks one up, and an unknown name fails in this one place with the known names.
"""

from __future__ import annotations

from typing import TypeVar

from foundation.errors import InvalidInputError

Spec = TypeVar("Spec")


class Registry(dict[str, Spec]):
    """A dict of specs by name whose lookup of an unknown name raises one clear ``ValueError``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def __missing__(self, name: str) -> Spec:
        raise InvalidInputError(f"unknown {self.kind} {name!r}; choose one of {sorted(self)}")

    def add(self, name: str, spec: Spec) -> Spec:
        if name in self:
            raise ValueError(f"{self.kind} {name!r} registered twice")
        self[name] = spec
        return spec
