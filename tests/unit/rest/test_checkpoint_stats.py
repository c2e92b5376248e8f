"""The checkpoint statistics tracker and Flink's summaries, without a job."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from spillover.rest.views import checkpoints_json, min_max_avg
from spillover.runtime.checkpointing.coordinator import CheckpointStats
from spillover.runtime.checkpointing.stats import CheckpointStatsTracker


def _stats(cid: int, status: str, inflight: float = 0.0) -> CheckpointStats:
    s = CheckpointStats(cid, 1_000 * cid)
    s.subtasks = {
        "src#0": {"inflight_bytes": inflight, "state_bytes": 10.0, "acked_ms": 5.0},
        "src#1": {"inflight_bytes": inflight, "state_bytes": 10.0, "acked_ms": 7.0},
    }
    s.status, s.duration_ms = status, 9.0
    return s


@given(st.lists(st.integers(min_value=0, max_value=10**12), min_size=1, max_size=200))
def test_summary_orders_min_percentiles_max(values: list[int]) -> None:
    s = min_max_avg(values)
    assert s["min"] == min(values) and s["max"] == max(values)
    assert s["min"] <= s["p50"] <= s["p90"] <= s["p95"] <= s["p99"] <= s["p999"] <= s["max"]
    assert s["min"] <= s["avg"] <= s["max"]


def test_tracker_counts_latest_and_history() -> None:
    tracker = CheckpointStatsTracker(lambda cid: f"/ckpt/chk-{cid}")
    for cid, status in ((1, "completed"), (2, "aborted"), (3, "completed")):
        s = _stats(cid, "pending", inflight=100.0)
        tracker.checkpoint_triggered(s, 1, 2)
        s.status = status
        s.reason = "declined" if status == "aborted" else ""
        tracker.checkpoint_ended(s)
    pending = _stats(4, "pending")
    tracker.checkpoint_triggered(pending, 0, 2)
    tracker.savepoint_triggered(4)
    tracker.exported(4, "/sp/savepoint-4/chk-4")
    body = checkpoints_json(tracker.snapshot())
    assert body["counts"] == {
        "restored": 0,
        "total": 4,
        "in_progress": 1,
        "completed": 2,
        "failed": 1,
    }
    assert [h["id"] for h in body["history"]] == [4, 3, 2, 1]
    assert [h["status"] for h in body["history"]] == [
        "IN_PROGRESS",
        "COMPLETED",
        "FAILED",
        "COMPLETED",
    ]
    assert body["history"][0]["checkpoint_type"] == "SAVEPOINT"
    assert body["history"][1]["checkpoint_type"] == "UNALIGNED_CHECKPOINT"
    assert body["latest"]["completed"]["external_path"] == "/ckpt/chk-3"
    assert body["latest"]["failed"]["failure_message"] == "declined"
    assert body["latest"]["completed"]["persisted_data"] == 200
    assert body["summary"]["persisted_data"]["max"] == 200
    # As in Flink, a completed checkpoint's end_to_end_duration runs from the trigger to
    # its last acknowledgement (7 ms); its completion, the metadata durable, is apart.
    completed = body["latest"]["completed"]
    assert completed["end_to_end_duration"] == 7
    assert completed["latest_ack_timestamp"] - completed["trigger_timestamp"] == 7
    assert completed["completion_duration"] == 9
    assert body["summary"]["end_to_end_duration"]["max"] == 7
    assert body["summary"]["completion_duration"]["max"] == 9
    failed = body["latest"]["failed"]
    assert failed["end_to_end_duration"] == 9  # to the failure, as its timestamp says
    assert failed["failure_timestamp"] - failed["trigger_timestamp"] == 9

    pending.status = "completed"
    tracker.checkpoint_ended(pending)  # exported before it ended: the export's path
    latest = checkpoints_json(tracker.snapshot())["latest"]
    assert latest["savepoint"]["id"] == 4
    assert latest["savepoint"]["external_path"] == "/sp/savepoint-4/chk-4"
    assert latest["savepoint"]["is_savepoint"] is True
