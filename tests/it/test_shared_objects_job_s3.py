"""A whole job on the local executor with its checkpoints on S3 (moto's server in this
process): subtasks share one channel-state object per group and checkpoint,
unaligned checkpoints, induced task failures, a checkpoint whose objects S3 refuses,
and a restore at another parallelism. The output is exact, and every retained
checkpoint holds one channel-state object per group."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from spillover.storage.location import Location
from spillover.verify import VerifySpec, verify
from support import s3_faults as faults
from support.s3_faults import Fault, FaultyMotoServer

faulty_s3 = faults.faulty_s3  # the module's server (a fixture)
s3_faults = faults.s3_faults  # it, without faults before and after each test (a fixture)

pytestmark = [pytest.mark.s3, pytest.mark.slow]

PER_FILE = 3  # max-subtasks-per-channel-state-file


def channel_files(server: FaultyMotoServer, root: Location) -> dict[str, list[str]]:
    """``{checkpoint directory: its channel-state objects}`` of every completed
    checkpoint (one with ``_metadata``) under ``root``."""
    prefix = root.path.partition("/")[2] + "/"
    keys = server.keys(prefix)
    done = {k.rpartition("/")[0] for k in keys if k.endswith("/_metadata")}
    files: dict[str, list[str]] = defaultdict(list)
    for k in keys:
        if k.endswith(".spill"):
            chk = next((d for d in done if k.startswith(d + "/")), None)
            if chk is not None:
                files[chk].append(k)
    return {d: files.get(d, []) for d in sorted(done)}


def test_a_job_on_s3_shares_one_object_per_group(
    s3_faults: FaultyMotoServer, tmp_path: Path
) -> None:
    root = Location.parse(s3_faults.fresh_uri())
    # S3 refuses the channel-state objects of one checkpoint: it is declined, the
    # job goes on, and later checkpoints complete.
    refused = Fault(key="/chk-4/channels/", method="PUT")
    s3_faults.faults.append(refused)
    spec = VerifySpec(
        topology="pipeline",
        policy="unaligned",
        parallelism=3,
        rescale_to=2,
        records=60_000,
        failures=2,
        rate_per_subtask=30_000,
        seed=35,
        num_retained=3,
        checkpoint_dir=root.uri,
        options={
            "execution.checkpointing.unaligned.max-subtasks-per-channel-state-file": PER_FILE,
            "execution.checkpointing.tolerable-failed-checkpoints": 1000,
        },
    )
    report = verify(spec, str(tmp_path))
    assert report.exact, report.text()
    # Restores after the induced failures, and the rescaled one, replayed in-flight
    # data read from S3.
    assert report.inflight_replayed > 0 and report.restored_inflight > 0, report.text()
    files = channel_files(s3_faults, root)
    assert files, "no checkpoint completed"
    # Every retained checkpoint: its gates are sections of shared objects, one object
    # per group (a group whose members had no in-flight data writes none).
    sections: list[dict[str, object]] = []
    for chk in files:
        meta = json.loads(
            s3_faults.client()
            .get_object(Bucket=s3_faults.bucket, Key=chk + "/_metadata")["Body"]
            .read()
        )
        for entry in meta["tasks"].values():
            for st in entry["subtasks"].values():
                cs = st.get("channel_state") or {}
                sections += [h for h in cs.get("input", []) + cs.get("output", [])]
    # (a group of one, as after the rescale to p = 2, keeps files of its own)
    assert any("offset" in h for h in sections), sections
    # Nine tasks at p = 3 (source, running-total and the sink behind a rebalance),
    # three groups of three, and six at p = 2, two groups: at most one object per
    # group and checkpoint, never one per subtask (a member later than the group's
    # wait would make its group a second object, ``<group>.1.spill``: still one
    # group's). A group whose members held no in-flight data writes none, so a
    # checkpoint may have fewer.
    for chk, objects in files.items():
        assert all("/channels/" in k for k in objects), objects
        groups = {k.rpartition("/")[2].split(".")[0] for k in objects}
        assert len(groups) <= 3, (chk, objects)
    assert any(len(o) >= 2 for o in files.values()), files
    assert refused.hits > 0  # the refused checkpoint was tried, and is not retained
