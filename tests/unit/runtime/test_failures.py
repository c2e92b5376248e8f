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


def test_a_commit_failure_can_wait_for_a_later_checkpoint() -> None:
    """``after_checkpoint`` lets the completions before it pass, so a test can restore
    from a checkpoint taken once the job is under way."""
    from spillover.runtime.failures import FailureInjector, FailureSpec, InducedFailure

    script = FailureInjector([FailureSpec("commit", "sink", 0, after_checkpoint=3)])
    script.check("commit", 0, "sink", 0, checkpoint=1)
    script.check("commit", 0, "sink", 0, checkpoint=2)
    assert script.pending == 1
    with pytest.raises(InducedFailure, match="checkpoint 3 or later"):
        script.check("commit", 0, "sink", 0, checkpoint=4)
