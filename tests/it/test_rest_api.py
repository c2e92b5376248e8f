"""The job master's REST API against a real uvicorn on loopback and a real local job:
Flink's paths and field names, values that agree with the checkpoints on disk,
savepoint and stop triggers, the token, and bad requests that leave the job alone."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import httpx

from spillover.rest import JobServer, registry
from spillover.runtime.jobevents import JobEventLog
from support import rest_jobs
from support.rest_jobs import poll

served = rest_jobs.served  # the fixture: the backpressured job, served

HISTORY_FIELDS = {
    "id",
    "status",
    "is_savepoint",
    "checkpoint_type",
    "trigger_timestamp",
    "end_to_end_duration",
    "state_size",
    "checkpointed_size",
    "processed_data",
    "persisted_data",
    "num_subtasks",
    "num_acknowledged_subtasks",
}
SUMMARY_KEYS = {"min", "max", "avg", "p50", "p90", "p95", "p99", "p999"}


def _client(server: JobServer) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=30)


def _auth(server: JobServer) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.token}"}


def test_checkpoint_statistics_are_flinks_and_match_the_checkpoints_on_disk(
    served: JobServer,
) -> None:
    jid = served.job.job_id
    c = _client(served)
    # INITIALIZING until its first attempt starts, then RUNNING.
    jobs = poll(c, "/jobs", lambda b: b["jobs"][0]["status"] != "INITIALIZING")
    assert jobs == {"jobs": [{"id": jid, "status": "RUNNING"}]}
    body = poll(
        c, f"/jobs/{jid}/checkpoints", lambda b: b["counts"]["completed"] >= 3, what="3 checkpoints"
    )
    counts = body["counts"]
    assert counts["total"] == counts["completed"] + counts["failed"] + counts["in_progress"]
    assert set(body["summary"]) >= {"end_to_end_duration", "state_size", "persisted_data"}
    assert all(set(v) == SUMMARY_KEYS for v in body["summary"].values())
    history = body["history"]
    assert all(set(h) >= HISTORY_FIELDS for h in history)
    ids = [h["id"] for h in history]
    assert ids == sorted(ids, reverse=True) and len(set(ids)) == len(ids)
    assert {h["checkpoint_type"] for h in history} == {"UNALIGNED_CHECKPOINT"}
    # Under backpressure an unaligned checkpoint persists in-flight data.
    assert any(h["persisted_data"] > 0 for h in history if h["status"] == "COMPLETED")

    details = c.get(f"/jobs/{jid}/checkpoints/details/{ids[-1]}").json()
    assert details["id"] == ids[-1] and set(details["tasks"]) == {"source", "sink"}
    subtasks = c.get(f"/jobs/{jid}/checkpoints/details/{ids[-1]}/subtasks/source").json()
    assert [s["index"] for s in subtasks["subtasks"]] == [0, 1]
    assert {"start_delay", "alignment", "checkpoint"} <= set(subtasks["subtasks"][0])
    assert c.get(f"/jobs/{jid}/checkpoints/config").json()["unaligned_checkpoints"] is True
    assert c.get(f"/jobs/{jid}/exceptions").json()["exceptionHistory"]["entries"] == []
    job = c.get(f"/jobs/{jid}").json()
    assert job["state"] == "RUNNING" and [v["id"] for v in job["vertices"]] == ["source", "sink"]

    metrics = c.get("/metrics").text
    for name in (
        "flink_jobmanager_job_numberOfCompletedCheckpoints",
        "flink_jobmanager_job_lastCheckpointPersistedData",
        "flink_jobmanager_job_numRestarts",
        f'flink_taskmanager_job_task_numRecordsIn{{job_id="{jid}"',
        "flink_taskmanager_job_task_backPressuredTimeMsPerSecond",
        "flink_taskmanager_job_task_checkpointStartDelayNanos",
    ):
        assert name in metrics, name

    stopped = c.post(f"/jobs/{jid}/stop", json={"unaligned": True}, headers=_auth(served))
    assert stopped.status_code == 202
    tid = stopped.json()["request-id"]
    op = poll(c, f"/jobs/{jid}/savepoints/{tid}", lambda b: b["status"]["id"] == "COMPLETED")
    assert Path(op["operation"]["location"], "_metadata").exists()
    assert served.job.wait(60)
    final = c.get(f"/jobs/{jid}/checkpoints").json()
    completed = {h["id"]: h for h in final["history"] if h["status"] == "COMPLETED"}
    storage = served.job.executor.storage
    assert storage is not None
    on_disk = set(storage.completed_ids())
    assert on_disk and on_disk <= set(completed)
    latest = final["latest"]["completed"]
    assert latest["id"] == max(completed)
    assert latest["external_path"] == op["operation"]["location"]
    assert c.get(f"/jobs/{jid}").json()["state"] == "FINISHED"


def test_savepoint_without_stopping_and_the_token(served: JobServer, tmp_path: Path) -> None:
    jid = served.job.job_id
    c = _client(served)
    poll(c, f"/jobs/{jid}/checkpoints", lambda b: b["counts"]["completed"] >= 1)
    target = str(tmp_path / "savepoints")
    assert c.post(f"/jobs/{jid}/savepoints", json={"target-directory": target}).status_code == 401
    wrong = {"Authorization": "Bearer not-the-token"}
    assert c.post(f"/jobs/{jid}/savepoints", json={}, headers=wrong).status_code == 401
    token_file = Path(served.token_file)
    assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600

    r = c.post(f"/jobs/{jid}/savepoints", json={"target-directory": target}, headers=_auth(served))
    assert r.status_code == 202
    tid = r.json()["request-id"]
    op = poll(c, f"/jobs/{jid}/savepoints/{tid}", lambda b: b["status"]["id"] == "COMPLETED")
    location = op["operation"]["location"]
    assert location.startswith(target) and Path(location, "_metadata").exists()
    body = c.get(f"/jobs/{jid}/checkpoints").json()
    assert body["latest"]["savepoint"]["external_path"] == location
    assert body["latest"]["savepoint"]["checkpoint_type"] == "SAVEPOINT"
    assert c.get(f"/jobs/{jid}").json()["state"] == "RUNNING"  # it did not stop

    assert (
        c.patch(f"/jobs/{jid}", params={"mode": "cancel"}, headers=_auth(served)).status_code == 202
    )
    assert served.job.wait(60)
    assert c.get(f"/jobs/{jid}").json()["state"] == "CANCELED"
    storage = served.job.executor.storage
    assert storage is not None
    # The commands are in the registry entry (`spillover list --json`), which outlives
    # the job; the event log holds only what a restarted master needs.
    commands = registry.read(jid).commands
    assert [c.command for c in commands] == ["savepoint", "cancel"]
    assert f"target={target}" in commands[0].detail and tid in commands[0].detail
    assert [c.command for c in served.job.commands] == ["savepoint", "cancel"]
    kinds = {
        type(e.event).KIND for e in JobEventLog.open(storage.location.child("_events")).entries()
    }
    assert "savepoint-completed" in kinds and "job-cancelled" in kinds


def test_bad_requests_leave_the_job_running(served: JobServer, tmp_path: Path) -> None:
    jid = served.job.job_id
    c = _client(served)
    poll(c, f"/jobs/{jid}/checkpoints", lambda b: b["counts"]["completed"] >= 1)
    assert c.get("/jobs/0123456789abcdef/checkpoints").status_code == 404
    assert c.get(f"/jobs/{jid}/checkpoints/details/999999").status_code == 404
    assert c.get(f"/jobs/{jid}/savepoints/no-such-trigger").status_code == 404
    blocker = tmp_path / "a-file"  # a folder cannot be made under a file, even by root
    blocker.write_text("")
    r = c.post(
        f"/jobs/{jid}/savepoints",
        json={"target-directory": str(blocker / "savepoints")},
        headers=_auth(served),
    )
    assert r.status_code == 400
    assert "cannot write the folder of target-directory" in r.json()["errors"][0]
    assert c.get(f"/jobs/{jid}").json()["state"] == "RUNNING"
