"""What a Spark worker adds to a subtask's acknowledgement for the checkpoint
breakdown: when its threads took the checkpoint's word, and from the checkpoint's
first trigger on the worker, the time and the process's CPU time it took (how
busy the worker's core was with the checkpoint, bench/checkpoint_breakdown.py)."""

from __future__ import annotations

import time

from spillover.deploy.spark.worker import _Arrivals
from spillover.runtime.checkpointing.messages import Ack


def _ack(cid: int, uid: str = "count", subtask: int = 0) -> Ack:
    return Ack(cid, uid, subtask, {}, {}, {}, {})


def test_an_ack_on_a_worker_a_trigger_reached_carries_its_time_and_cpu_since() -> None:
    arrivals = _Arrivals()
    arrivals.stamp(("source", 0), 7, "trigger_in_at")
    arrivals.stamp(("source", 0), 7, "trigger_in_at")  # the first one counts
    began = time.thread_time()
    while time.thread_time() - began < 0.02:  # 20 ms of this thread's work meanwhile
        pass
    source = arrivals.taken(_ack(7, "source"))
    count = arrivals.taken(_ack(7, "count"))  # another subtask of the same worker
    assert source["trigger_in_at"] <= time.time()
    for m in (source, count):
        assert m["worker_cpu_ms"] >= 20  # the process's, this thread's in it
        assert m["worker_wall_ms"] >= 20  # one thread's 20 ms of CPU took that long at least
    assert count["worker_wall_ms"] >= source["worker_wall_ms"]
    assert "trigger_in_at" not in count  # only the root's trigger was stamped for it
    assert "worker_busy_before" not in source  # the worker's first: no ack before it


def test_a_window_comes_with_the_cpu_share_since_the_acknowledgement_before() -> None:
    """The baseline beside a checkpoint's window: the process's CPU share from the
    worker's acknowledgement before to the trigger, bounded by what the test itself
    measured around that span (whatever the machine's load)."""
    arrivals = _Arrivals()
    arrivals.stamp(("source", 0), 1, "trigger_in_at")
    cpu0 = time.process_time()
    arrivals.taken(_ack(1, "source"))
    time.sleep(0.05)  # at rest: the span lasts at least this
    arrivals.stamp(("source", 0), 2, "trigger_in_at")
    idle_cpu = time.process_time() - cpu0  # at least the process's CPU in the span
    wall0 = time.monotonic()
    idle = arrivals.taken(_ack(2, "source"))["worker_busy_before"]
    began = time.thread_time()
    while time.thread_time() - began < 0.05:  # at work: this much CPU inside the span
        pass
    arrivals.stamp(("source", 0), 3, "trigger_in_at")
    busy_wall = time.monotonic() - wall0  # the span, or longer
    busy = arrivals.taken(_ack(3, "source"))["worker_busy_before"]
    assert 0 <= idle <= idle_cpu / 0.05
    assert busy >= 0.05 / busy_wall


def test_a_checkpoint_no_trigger_reached_here_has_no_window() -> None:
    """A worker without a root of the checkpoint: nothing to measure from."""
    arrivals = _Arrivals()
    arrivals.stamp(("count", 0), 3, "barrier_in_at")
    m = arrivals.taken(_ack(3))
    assert "barrier_in_at" in m
    assert "worker_wall_ms" not in m and "worker_cpu_ms" not in m


def test_windows_of_checkpoints_never_acknowledged_are_dropped() -> None:
    """An aborted checkpoint's stamps do not pile up on a long-running worker."""
    arrivals = _Arrivals()
    for cid in range(1, 40):
        arrivals.stamp(("source", 0), cid, "trigger_in_at")
    arrivals.taken(_ack(40, "source"))
    assert "worker_wall_ms" in arrivals.taken(_ack(39, "source"))
    assert "worker_wall_ms" not in arrivals.taken(_ack(20, "source"))
