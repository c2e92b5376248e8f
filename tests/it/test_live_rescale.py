"""A live rescale on the local executor: a backpressured keyed job rescaled from 2 to
3 while it runs ends with every record committed exactly once, in order per key and
source partition; a rescale whose savepoint fails leaves the job at its parallelism;
and the refusals leave the job alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from spillover.deploy.local import LocalExecutor
from spillover.errors import ConfigError
from spillover.rest import JobServer
from spillover.runtime.connectors.collecting import CollectingSink
from support import rest_jobs
from support.keyed_jobs import assert_exact, keyed_config, keyed_job, start
from support.operators import DecliningSnapshots
from support.rest_jobs import poll

served = rest_jobs.served


def test_a_backpressured_keyed_job_rescaled_live_from_2_to_3_loses_nothing(
    tmp_path: Path,
) -> None:
    name = f"live-rescale-{tmp_path.name}"
    CollectingSink.clear(name)
    ex = LocalExecutor(keyed_job(name), keyed_config(tmp_path))
    job_id = ex.job_id
    runner, out = start(ex)
    request = ex.rescale_live(3)
    status = request.wait(120)
    runner.join(180)
    (result,) = out
    assert status.status == "COMPLETED", status
    assert (status.from_parallelism, status.to_parallelism) == (2, 3)
    assert status.first_record_ms is not None and status.first_record_ms > 0
    assert result.status == "finished", result.failures
    assert ex.job_id == job_id and result.attempts == 2
    assert [v.parallelism for v in ex.graph.vertices] == [3, 3]
    assert ex.status.snapshot().num_restarts == 0, "a rescale is not a restart"
    savepoint = [c for c in result.checkpoints if c["checkpoint_id"] == status.savepoint_id]
    assert savepoint[0]["savepoint"] and savepoint[0]["inflight_bytes"] > 0, "nothing in flight"
    assert result.restored_from == [status.savepoint_id]
    assert result.replayed_bytes > 0
    assert_exact(name)
    CollectingSink.clear(name)


def test_a_rescale_whose_savepoint_fails_leaves_the_job_at_its_parallelism(
    tmp_path: Path,
) -> None:
    name = f"live-rescale-failed-{tmp_path.name}"
    CollectingSink.clear(name)
    cfg = keyed_config(tmp_path, **{"restart-strategy.type": "none"})
    ex = LocalExecutor(keyed_job(name, declining=True), cfg)
    runner, out = start(ex, "declining")
    DecliningSnapshots.arm(name, 1)
    status = ex.rescale_live(3).wait(120)
    runner.join(180)
    (result,) = out
    assert status.status == "FAILED" and "the savepoint failed" in str(status.failure), status
    assert result.status == "finished", result.failures
    assert {v.parallelism for v in ex.graph.vertices} == {2}
    assert_exact(name)
    CollectingSink.clear(name)


def test_refused_rescales_leave_the_job_alone(served: JobServer) -> None:
    jid = served.job.job_id
    c = httpx.Client(base_url=served.url, timeout=30)
    auth = {"Authorization": f"Bearer {served.token}"}
    poll(c, f"/jobs/{jid}/checkpoints", lambda b: b["counts"]["completed"] >= 1)
    path = f"/jobs/{jid}/resource-requirements"

    def body(p: Any, lower: Any = 1) -> dict[str, Any]:
        bounds = {"lowerBound": lower, "upperBound": p}
        return {"source": {"parallelism": bounds}, "sink": {"parallelism": bounds}}

    assert c.put(path, json=body(3)).status_code == 401
    cases = {
        "runs at that parallelism already": body(2),
        "must be at least 1": body(0, 0),
        "exceeds the job's max parallelism 128": body(129),
        "lowerBound 3 exceeds upperBound 2": body(2, 3),
        "no vertex 'nope'": {"nope": {"parallelism": {"lowerBound": 1, "upperBound": 3}}},
        "integer lowerBound and upperBound": {"sink": {"parallelism": {"upperBound": "3"}}},
        "names no vertex": {},
    }
    for message, b in cases.items():
        r = c.put(path, json=b, headers=auth)
        assert r.status_code == 400 and message in r.json()["errors"][0], (message, r.text)
    assert c.get(f"/jobs/{jid}").json()["rescale"] is None
    assert served.job.executor.status.snapshot().state == "RUNNING"
    with pytest.raises(ConfigError, match="at least 1"):
        served.job.executor.rescale_live(0)


def test_a_rescale_through_rest_reports_its_time_to_the_first_record(served: JobServer) -> None:
    jid = served.job.job_id
    c = httpx.Client(base_url=served.url, timeout=30)
    auth = {"Authorization": f"Bearer {served.token}"}
    poll(c, f"/jobs/{jid}/checkpoints", lambda b: b["counts"]["completed"] >= 1)
    bounds = {"parallelism": {"lowerBound": 1, "upperBound": 3}}
    r = c.put(
        f"/jobs/{jid}/resource-requirements", json={"source": bounds, "sink": bounds}, headers=auth
    )
    assert r.status_code == 200, r.text
    rid = r.json()["request-id"]
    job = poll(c, f"/jobs/{jid}", lambda b: b["rescale"]["status"] != "IN_PROGRESS")
    rescale = job["rescale"]
    assert rescale["request-id"] == rid and rescale["status"] == "COMPLETED", rescale
    assert rescale["request-to-first-record-ms"] > 0
    assert [v["parallelism"] for v in job["vertices"]] == [3, 3]
    assert c.get(f"/jobs/{jid}/resource-requirements").json()["sink"]["parallelism"] == {
        "lowerBound": 1,
        "upperBound": 3,
    }
    assert job["state"] == "RUNNING" and job["jid"] == jid
    assert [cmd.command for cmd in served.job.commands] == ["rescale"]
