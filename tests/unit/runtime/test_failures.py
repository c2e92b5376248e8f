"""Induced failures: a copy of the failure script (as a Spark worker holds) reports
what fires, and the script plays once."""

from __future__ import annotations

import pytest


def test_a_copy_of_the_failure_script_reports_what_fires_and_it_plays_once() -> None:
    """A worker's copy reports a failure before raising it; the original records it
    once, so the next attempt goes on with the next failure of the script."""
    import pickle

    from spillover.runtime.failures import FailureInjector, FailureSpec, InducedFailure

    original = FailureInjector([FailureSpec("commit"), FailureSpec("restore")])
    original.on_fire = lambda i, a: None
    copy = pickle.loads(pickle.dumps(original))
    assert copy.on_fire is None  # a copy reports to whoever sets its own
    seen: list[tuple[int, int]] = []
    copy.on_fire = lambda index, attempt: seen.append((index, attempt))
    with pytest.raises(InducedFailure):
        copy.check("commit", 1, "sink", 0)
    assert seen == [(0, 1)] and original.pending == 2
    original.mark_fired(0, 1)
    original.mark_fired(0, 1)  # another worker's copy fired it too: counted once
    assert [s.fired_in for s in original.fired] == [1]
    original.check("restore", 1, "sink", 0)  # never twice in one attempt
    with pytest.raises(InducedFailure):
        original.check("restore", 2, "sink", 0)
