"""Progress bars that suit where the output goes: tqdm's bar on a terminal, plain lines elsewhere.

A tqdm bar redraws itself with carriage returns, which a file or a pipe keeps as one endless line (and
clears with blank ones). :func:`progress_bar` is the one way the project makes a bar: on a terminal it
is tqdm's own; otherwise a :class:`LineProgress`, the same tqdm object (``update``, ``set_postfix`` and
``tqdm.write`` work alike) that prints a whole line now and then instead: when the bar starts, every
:data:`~foundation.defaults.PROGRESS_LINE_PERCENT` percent, at least every
:data:`~foundation.defaults.PROGRESS_LINE_SECONDS` seconds while it moves, and once when it ends.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import Any, TypeVar

from tqdm import tqdm

from foundation.defaults import PROGRESS_LINE_PERCENT, PROGRESS_LINE_SECONDS

T = TypeVar("T")
# tqdm's meter without the bar itself, whose block characters are noise in a log.
LINE_FORMAT = "{desc}: {percentage:.0f}% ({n_fmt}/{total_fmt}) [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


class LineProgress(tqdm):
    """A tqdm bar that writes whole lines, each ending in a newline, and never a carriage return."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._printed_at = -float("inf")  # monotonic time of the last line
        self._printed_step = -1  # the PROGRESS_LINE_PERCENT step of the last line
        self._printed_n: float | None = None  # the count of the last line
        total = kwargs.get("total")
        if total is None and args and hasattr(args[0], "__len__"):
            total = len(args[0])
        if total:  # without a total, tqdm's meter (count and rate) has no bar already
            kwargs.setdefault("bar_format", LINE_FORMAT)
        # Every update reaches display(), which decides (tqdm's own pacing could skip a percent step).
        kwargs.setdefault("mininterval", 0)
        kwargs.setdefault("miniters", 1)
        # The count over the time elapsed: tqdm's smoothed rate follows the last update, and images are
        # counted a batch at a time, so it swings between the batch's speed and thousands a second.
        kwargs.setdefault("smoothing", 0)
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        # tqdm clears a bar by displaying "" (and moves nested bars with cursor codes): a line stays.
        if msg is not None:
            return False
        now = time.monotonic()
        step = int(100 * self.n / self.total // PROGRESS_LINE_PERCENT) if self.total else -1
        due = step > self._printed_step or now - self._printed_at >= PROGRESS_LINE_SECONDS
        if due and self.n != self._printed_n:
            self._write_line(now, step)
        return True

    def clear(self, nolock: bool = False) -> None:
        """Nothing to clear: ``tqdm.write`` prints its message between two lines."""

    def close(self) -> None:
        if not self.disable and self.n != self._printed_n:
            self._write_line(time.monotonic(), -1)  # the final count, rate and postfix
        self.leave = False  # tqdm would end the bar's line with "\n" (a blank line here) or clear it
        super().close()

    def _write_line(self, now: float, step: int) -> None:
        self._printed_at, self._printed_step, self._printed_n = now, max(step, self._printed_step), self.n
        self.fp.write(f"{self}\n")
        self.fp.flush()


def progress_bar(iterable: Iterable[T] | None = None, **options: Any) -> tqdm:
    """A tqdm bar (``options`` are tqdm's), or :class:`LineProgress` when its stream is not a terminal."""
    stream = options.get("file") or sys.stderr
    isatty = getattr(stream, "isatty", None)
    factory = tqdm if callable(isatty) and isatty() else LineProgress
    return factory(iterable, **options)
