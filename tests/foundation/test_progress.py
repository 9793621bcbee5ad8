"""Plain progress lines (foundation.progress.LineProgress) for a pipe or a log file."""

from __future__ import annotations

import io
import re
import time

from foundation.progress import LineProgress


def test_a_line_gives_the_average_rate_not_the_last_bursts() -> None:
    """Images are counted a batch at a time: ten updates in a few microseconds, then a pause while the
    next batch decodes. tqdm's smoothed rate followed the bursts, so a log alternated between about
    100 and 20,000 img/s for one build; each line now gives the count over the time elapsed."""
    out = io.StringIO()
    bar = LineProgress(total=50, file=out, desc="embedding", unit="img")
    for _ in range(5):
        time.sleep(0.1)  # a batch decodes: at most 10 images per 0.1 s, 100 img/s
        for _ in range(10):
            bar.update(1)
    bar.close()
    rates = [float(rate) for rate in re.findall(r"([\d.]+)img/s", out.getvalue())]
    assert len(rates) >= 5 and max(rates) <= 100, out.getvalue()
