"""The test suite's two tiers: ``make test`` runs the fast one (``pytest -m "not slow"``), ``make test-all``
everything.

A test is in the slow tier when it starts a server process, a cluster, a browser or a container, or reads
the shared data set. Each of these has its marker (:data:`KINDS`, and ``shared_data``), and every test that
carries one also gets ``slow``, the one marker the fast tier leaves out (``slow`` alone also does, for a
test that is long for another reason). A test gets a kind's marker

- from itself, its class or its module (``@pytest.mark.server``, ``pytestmark = pytest.mark.server``), or
  from one of its parameters (``pytest.param("milvus-server", marks=pytest.mark.server)``);
- from the fixtures it uses, directly or through other fixtures: a fixture that starts such a process says
  so where it is defined, with :func:`starts`.

A guard holds the rule: while a test outside the slow tier runs (its setup and teardown included),
starting a process whose command line is a server's, a cluster node's, a browser's or a container tool's
(:func:`process_kind`) fails the test before the process starts, naming the marker it needs. So a new
slow test cannot slip into the fast tier, whether it starts its process through a fixture, a helper of
``tests/support`` or its own ``subprocess.Popen``; ``tests/test_tiers.py`` checks the guard and the
marking.

This module is the pytest plugin that does all this (``tests/conftest.py`` registers it; ``-p tests.tiers``
loads it elsewhere).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Generator, Iterable
from typing import Any, TypeVar

import pytest

# What puts a test in the slow tier, by what it starts: a server process (`dmlsearch serve`, `ui`, `demo`,
# `watch`, Streamlit, uvicorn, the real Milvus server), a cluster (Ray nodes), a browser, a container.
KINDS = ("server", "cluster", "browser", "container")
# The markers of the slow tier: each kind, the shared data set, and `slow` itself.
SLOW_TIER = ("slow", *KINDS, "shared_data")
# The fast tier's marker expression, what `make test` runs.
FAST_TIER = "not slow"

# A program at the start of a command or of a shell's command: after a separator, maybe with its path.
_PROGRAM = r"(?:^|[\s;&|(])(?:\S*/)?"
_END = r"(?=\s|$)"
# The command lines of each kind of process: the program (or Python module) that is one, not a test's
# arguments that merely name one (a path under docker/, a collection called "server").
PROCESS_PATTERNS: dict[str, tuple[re.Pattern[str], ...]] = {
    "server": (
        # The long-running commands of the CLI, as `dmlsearch CMD` or `python -m cli.main CMD`.
        # (`demo --no-serve` only exports the model and builds the index.)
        re.compile(
            _PROGRAM
            + r"(?:dmlsearch|cli\.main)(?:\s+--?[\w-]+(?:=\S+)?)*"
            + r"\s+(?:serve|ui|demo(?!.*\s--no-serve\b)|watch)"
            + _END
        ),
        re.compile(_PROGRAM + r"(?:streamlit|uvicorn|milvus-server)" + _END),
        re.compile(r"\bmilvus\.main\("),  # the real Milvus server's launcher, run with `python -c`
        re.compile(_PROGRAM + r"make\s(?:.*\s)?demo" + _END),
    ),
    "cluster": (
        re.compile(_PROGRAM + r"ray\s+start" + _END),
        # What `ray.init()` starts for a local cluster.
        re.compile(_PROGRAM + r"(?:gcs_server|raylet)" + _END),
        # torchrun: a rendezvous and a process group of trainers.
        re.compile(_PROGRAM + r"torchrun" + _END + r"|\s-m\s+torch\.distributed\.run" + _END),
    ),
    "browser": (
        re.compile(_PROGRAM + r"(?:chromium|chromium-browser|chrome|google-chrome|headless_shell)" + _END),
        re.compile(r"playwright\S*/cli\.js\s+run-driver"),
    ),
    "container": (re.compile(_PROGRAM + r"(?:podman|podman-compose|docker|docker-compose|buildah)" + _END),),
}

# The markers of the tiers, registered by this plugin (with --strict-markers, a misspelt one is an error).
MARKERS = {
    "slow": "the slow tier, left out by `make test` (given to every test with one of the markers below)",
    "server": "starts a server process (dmlsearch serve, ui, demo or watch; Streamlit; the Milvus server)",
    "cluster": "starts a cluster (Ray nodes, torchrun's process group)",
    "browser": "needs Debian chromium and playwright",
    "container": "builds and runs the images with podman (DMLSEARCH_IMAGE_TESTS=1, set by .ci/run)",
    "shared_data": "needs the Cars196 data set (opt-in with DMLSEARCH_SHARED_TESTS=1)",
}

# The attribute :func:`starts` sets on a fixture's function.
_STARTS = "dmlsearch_tier_starts"

F = TypeVar("F", bound=Callable[..., Any])


def starts(kind: str) -> Callable[[F], F]:
    """Declare that a fixture starts a process of ``kind`` (one of :data:`KINDS`): every test that uses the
    fixture, directly or through another fixture, joins the slow tier with that kind's marker. Put it
    directly above the ``def``, under ``@pytest.fixture``."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}: one of {', '.join(KINDS)}")

    def declare(function: F) -> F:
        if hasattr(function, "_get_wrapped_function"):  # a pytest fixture definition already
            raise TypeError("put @starts(...) under @pytest.fixture, directly above the def")
        setattr(function, _STARTS, kind)
        return function

    return declare


def process_kind(command: object) -> str | None:
    """The kind of process (one of :data:`KINDS`) ``command`` starts, from its command line; None for any
    other (a CLI command that runs and exits, a Python script, Milvus Lite's embedded engine)."""
    line = command_line(command)
    for kind, patterns in PROCESS_PATTERNS.items():
        if any(pattern.search(line) for pattern in patterns):
            return kind
    return None


def command_line(command: object) -> str:
    """A command (a string, bytes, or a sequence of arguments) as one line."""
    if isinstance(command, bytes):
        return command.decode(errors="replace")
    if isinstance(command, (list, tuple)):
        return " ".join(command_line(part) for part in command)
    return str(command)


def fixture_kinds(item: pytest.Item) -> set[str]:
    """The kinds declared with :func:`starts` by the fixtures ``item`` uses (its whole fixture closure)."""
    info = getattr(item, "_fixtureinfo", None)  # pytest's own record of the fixtures an item needs
    if info is None:
        return set()
    kinds = set()
    for name in getattr(item, "fixturenames", ()):
        for fixturedef in info.name2fixturedefs.get(name, ()):
            kind = getattr(fixturedef.func, _STARTS, None)
            if kind is not None:
                kinds.add(kind)
    return kinds


def mark_tiers(items: Iterable[pytest.Item]) -> None:
    """Give each item the markers of what its fixtures start, and ``slow`` to every item in the slow tier."""
    for item in items:
        for kind in sorted(fixture_kinds(item)):
            if item.get_closest_marker(kind) is None:
                item.add_marker(kind)
        if item.get_closest_marker("slow") is None and any(item.get_closest_marker(m) for m in SLOW_TIER):
            item.add_marker("slow")


def in_slow_tier(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(marker) is not None for marker in SLOW_TIER)


class SlowTierRequired(pytest.fail.Exception):
    """A test outside the slow tier started a server, a cluster, a browser or a container."""


class Guard:
    """Refuses, while a test outside the slow tier runs, to start a process that would put it in the slow
    tier: a ``subprocess.Popen`` (``os.posix_spawn``, ``os.exec*``) audit hook, installed once per process.

    It raises :class:`SlowTierRequired` from the call that would start the process (a pytest failure, which
    ``except Exception`` does not swallow), and keeps what it refused, so that the test still fails when the
    refusal is caught or raised in another thread."""

    EVENTS = frozenset({"subprocess.Popen", "os.posix_spawn", "os.exec"})

    def __init__(self) -> None:
        self.item: pytest.Item | None = None
        self.refused: list[str] = []
        self._installed = False

    def install(self) -> None:
        if not self._installed:
            sys.addaudithook(self._audit)
            self._installed = True

    def _audit(self, event: str, args: tuple[Any, ...]) -> None:
        if event not in self.EVENTS or self.item is None:
            return
        # subprocess.Popen: (executable, args, cwd, env); os.posix_spawn and os.exec: (path, argv, env).
        command = args[1] if len(args) > 1 and args[1] is not None else args[0]
        kind = process_kind(command_line(command))
        if kind is None or in_slow_tier(self.item):
            return
        message = refusal(self.item, kind, command)
        self.refused.append(message)
        raise SlowTierRequired(message, pytrace=False)

    def start(self, item: pytest.Item) -> None:
        self.item, self.refused = item, []

    def take(self) -> list[str]:
        """What was refused since the test started or since the last call, which forgets it."""
        refused, self.refused = self.refused, []
        return refused

    def finish(self) -> None:
        """The test has ended: the guard rests until the next one starts."""
        self.item, self.refused = None, []


def refusal(item: pytest.Item, kind: str, command: object) -> str:
    return (
        f"{item.nodeid} starts a {kind} process ({command_line(command)[:200]!r}) but is in the fast tier "
        f"(`make test`): mark the test @pytest.mark.{kind} (or its module: pytestmark = "
        f"pytest.mark.{kind}), or, if a fixture starts it, declare the fixture with @starts({kind!r}) "
        "from tests.tiers (see its docstring)"
    )


GUARD = Guard()


def pytest_configure(config: pytest.Config) -> None:
    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")
    GUARD.install()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_tiers(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    GUARD.start(item)
    try:
        return (yield)
    finally:
        GUARD.finish()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if call.excinfo is not None and call.excinfo.errisinstance(SlowTierRequired):
        GUARD.take()  # this report says it
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    yield
    refused = GUARD.take()  # caught by the test, or raised in another of its threads: still a failure
    if refused:
        raise SlowTierRequired("\n".join(refused), pytrace=False)
