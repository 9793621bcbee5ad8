"""A request's deadline for index-server calls: each call gets the smaller of its own limit and what is
left, and none once it has passed."""

from __future__ import annotations

import re
import time

import pytest

from foundation.deadline import DeadlinePassedError, call_budget, request_deadline


def test_outside_a_request_a_call_has_its_own_limit() -> None:
    assert call_budget(10.0) == 10.0
    with request_deadline(0):  # 0: no deadline
        assert call_budget(10.0) == 10.0


def test_calls_share_the_deadline_from_its_start_and_none_is_left_after_it() -> None:
    with request_deadline(0.3) as deadline:
        assert deadline is not None
        time.sleep(0.2)  # not started yet: the clock starts with the body, or the first call
        assert 0.25 < call_budget(10.0) <= 0.3
        assert call_budget(0.1) == 0.1  # a call's own limit when it is the smaller
        time.sleep(0.35)
        with pytest.raises(DeadlinePassedError, match=re.escape("deadline of 0.3 s")):
            call_budget(10.0)
    assert call_budget(10.0) == 10.0  # the block's end restores the outer context


def test_a_started_deadline_counts_from_its_start() -> None:
    with request_deadline(1.0) as deadline:
        assert deadline is not None
        deadline.start()
        time.sleep(0.2)
        assert call_budget(10.0) <= 0.8
