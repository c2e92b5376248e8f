"""Checkpoint metadata version 3 names every gate's per-channel maps in the entry its
task wrote beside the state; version 2 kept them in the channel index beside
``_metadata`` and version 1 listed them inline, and both still restore. The golden
checkpoints of every version (tests/golden/checkpoint/) must read, resolve and plan
a restore alike, and what a writer writes now must be the version 3 golden."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spillover.errors import CorruptIndexError, FormatError
from spillover.runtime.checkpointing.checkpoint_meta import (
    ChannelStateMeta,
    CheckpointMetadata,
    OperatorMeta,
    SubtaskMeta,
)
from spillover.runtime.checkpointing.metadata import (
    METADATA_VERSION,
    CheckpointStorage,
    check_metadata,
    read_checkpoint,
    split_channel_index,
)
from spillover.runtime.checkpointing.simulated import MAP, SOURCE, SimulatedJob, Simulation
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.graph import JobGraph, StreamEnvironment
from spillover.runtime.recovery.plan import graph_info, plan_restore
from spillover.storage.channel_index import INDEX_FILE, resolve_all
from spillover.storage.handle import GateKind, GateStateHandle
from support.checkpoint_golden import (
    CHECKPOINT_ID,
    GOLDEN_CHECKPOINTS,
    carried_entry,
    golden_files,
    relocated,
)

CHK = f"chk-{CHECKPOINT_ID}"


def _golden(version: int) -> CheckpointMetadata:
    d = GOLDEN_CHECKPOINTS / f"v{version}" / CHK
    raw = json.loads((d / "_metadata").read_bytes())
    # relocated to where the golden index (v2) or entries (v3) lie, as an export does
    if "channel_index" in raw:
        raw["channel_index"]["uri"] = str(d / INDEX_FILE)
    if version >= 3:
        raw = relocated(raw, version)
    return CheckpointMetadata.from_json(raw, str(d / "_metadata"))


def _graph(p: int) -> JobGraph:
    env = StreamEnvironment("sim", parallelism=p, max_parallelism=128)
    env.from_source(GeneratorSource(partitions=p, records_per_partition=1), uid=SOURCE).key_by(
        "key"
    ).map(lambda b: b, uid=MAP)
    return env.build()


def _keys(obj: Any) -> set[str]:
    if isinstance(obj, dict):
        return set(obj).union(*(_keys(v) for v in obj.values()))
    if isinstance(obj, list):
        return set().union(*(_keys(v) for v in obj))
    return set()


def test_the_golden_files_are_what_the_writer_writes_now() -> None:
    for name, data in golden_files().items():
        assert (GOLDEN_CHECKPOINTS / name).read_bytes() == data, name
    assert METADATA_VERSION == 3


def test_versions_2_and_3_list_no_channel_in_their_metadata() -> None:
    v1, v2, v3 = (
        json.loads((GOLDEN_CHECKPOINTS / f"v{v}" / CHK / "_metadata").read_bytes())
        for v in (1, 2, 3)
    )
    assert {"channels", "channel_ranges"} <= _keys(v1)
    assert not {"channels", "channel_ranges", "index_entry"} & (_keys(v2) | _keys(v3))
    assert (v1["version"], v2["version"], v3["version"]) == (1, 2, 3)
    assert "channel_index" not in v3 and not (GOLDEN_CHECKPOINTS / "v3" / CHK / INDEX_FILE).exists()


@pytest.mark.parametrize("new", [2, 1, 3])
def test_every_version_plans_the_same_restore(new: int) -> None:
    plans = [plan_restore(_golden(v), _graph(new), validate=False) for v in (1, 2, 3)]
    assert plans[0].keys() == plans[1].keys() == plans[2].keys()
    for key in plans[0]:
        old, v2, v3 = (p[key].channel_state.resolved() for p in plans)
        assert old == v2, key
        # the same maps; version 3's gates name the shared files they were written to
        assert [(h.channels, h.channel_ranges) for h in old.handles] == [
            (h.channels, h.channel_ranges) for h in v3.handles
        ], key
        assert all(h.index is None for h in (*v2.handles, *v3.handles))
    # the maps were really there to compare
    v1 = _golden(1).operator(MAP).subtask(0).channel_state
    assert v1 is not None and v1.input[0].channels


@pytest.mark.parametrize("version", [2, 3])
def test_versions_2_and_3_round_trip_through_their_types(version: int) -> None:
    raw = json.loads((GOLDEN_CHECKPOINTS / f"v{version}" / CHK / "_metadata").read_bytes())
    assert CheckpointMetadata.from_json(raw).to_json() == raw


def test_a_newer_version_is_refused() -> None:
    with pytest.raises(FormatError, match="unsupported checkpoint metadata version"):
        check_metadata({"format": "spillover-checkpoint", "version": 4}, "x")


def test_a_gate_index_without_the_checkpoints_index_is_malformed() -> None:
    raw = json.loads((GOLDEN_CHECKPOINTS / "v2" / CHK / "_metadata").read_bytes())
    del raw["channel_index"]
    with pytest.raises(FormatError, match="malformed"):
        CheckpointMetadata.from_json(raw, "x")


def test_a_damaged_index_fails_the_restore_of_its_gates_only(tmp_path: Path) -> None:
    d = GOLDEN_CHECKPOINTS / "v2" / CHK
    index = tmp_path / INDEX_FILE
    data = bytearray((d / INDEX_FILE).read_bytes())
    data[-1] ^= 0xFF  # the last entry's checksum: the last gate written
    index.write_bytes(bytes(data))
    raw = json.loads((d / "_metadata").read_bytes())
    raw["channel_index"]["uri"] = str(index)
    plans = plan_restore(CheckpointMetadata.from_json(raw), _graph(2), validate=False)
    plans[(SOURCE, 0)].channel_state.resolved()  # another gate's entry: intact
    with pytest.raises(CorruptIndexError) as e:
        plans[(MAP, 1)].channel_state.resolved()
    assert e.value.path == str(index)


def test_the_coordinator_writes_version_3_and_an_export_carries_the_entries(
    tmp_path: Path,
) -> None:
    job = SimulatedJob(3, max_parallelism=128)
    with Simulation(job, str(tmp_path / "ckpt"), graph=graph_info(_graph(3))) as sim:
        cid = sim.checkpoint().checkpoint_id
        storage = sim.storage
    chk = tmp_path / "ckpt" / "sim" / f"chk-{cid}"
    raw = json.loads((chk / "_metadata").read_bytes())
    assert raw["version"] == 3 and "channels" not in _keys(raw)
    assert "channel_index" not in raw and not (chk / INDEX_FILE).exists()
    saved = Path(storage.export(cid, str(tmp_path / "sp")))
    for f in (chk / "channels").iterdir():  # the savepoint holds its own copies
        f.unlink()
    meta = CheckpointMetadata.from_json(read_checkpoint(str(saved)))  # relative paths resolved
    plans = plan_restore(meta, _graph(3), validate=False)
    replay = plans[(MAP, 1)].channel_state.resolved()
    (gate,) = replay.inputs
    assert gate.uri.startswith(str(saved))
    assert gate.channels == job.gate(str(chk), MAP, 1, 0).channels
    assert CheckpointStorage(str(tmp_path / "ckpt"), "sim").read_metadata(cid)["version"] == 3


@st.composite
def _gates(draw: st.DrawFn) -> list[GateStateHandle]:
    out = []
    for gate in range(draw(st.integers(0, 3))):
        chans = draw(st.lists(st.integers(0, 2**20), unique=True, max_size=12))
        channels = {c: (draw(st.integers(0, 9)), draw(st.integers(0, 2**40))) for c in chans}
        ranges = {c: (64 + c, 64 + 2 * c) for c in chans} if draw(st.booleans()) else {}
        out.append(
            GateStateHandle(
                f"/x/chk-1/channels/g-{gate}.spill",
                gate,
                GateKind.INPUT,
                1,
                0,
                f"{gate:032x}",
                128,
                sum(f for f, _ in channels.values()),
                0,
                0,
                channels=channels,
                channel_ranges=ranges,
                offset=draw(st.none() | st.integers(0, 2**40)),
            )
        )
    return out


@settings(max_examples=50, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_gates(), max_size=5), st.lists(st.booleans(), min_size=5, max_size=5))
def test_moving_maps_into_the_index_and_back_loses_nothing(
    tmp_path: Path, subtasks: list[list[GateStateHandle]], encoded: list[bool]
) -> None:
    """Whatever gates the acks hold, encoded (as version 2 tasks sent them) or inline,
    the metadata and its index give every handle back exactly."""
    index = tmp_path / f"index-{uuid.uuid4().hex}"
    tasks = {
        "op": OperatorMeta(
            {
                i: SubtaskMeta(
                    channel_state=ChannelStateMeta.from_json(
                        {"input": [carried_entry(h) if encoded[i] else h.to_dict() for h in gates]}
                    )
                )
                for i, gates in enumerate(subtasks)
            }
        )
    }
    meta = CheckpointMetadata(2, "j", 1, 0, 0, "f", {}, False, tasks)
    written, data = split_channel_index(meta, str(index))
    assert "index_entry" not in _keys(written) and "entry" not in _keys(written)
    index.write_bytes(data)
    back = CheckpointMetadata.from_json(json.loads(json.dumps(written)))
    for i, gates in enumerate(subtasks):
        cs = back.operator("op").subtask(i).channel_state
        assert cs is not None
        assert resolve_all(cs.input) == gates
