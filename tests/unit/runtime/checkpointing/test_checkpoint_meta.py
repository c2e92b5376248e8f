"""The checkpoint metadata as one typed value: what the coordinator writes reads back
into it and out again unchanged, and every value survives its JSON."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillover.errors import FormatError
from spillover.rescale import KeyGroupFilter, Piece, Reference
from spillover.runtime.checkpointing.channel_state import channel_state_groups, open_channel_state
from spillover.runtime.checkpointing.checkpoint_meta import (
    ChannelStateMeta,
    CheckpointMetadata,
    InputInfo,
    OperatorMeta,
    SubtaskMeta,
    VertexInfo,
)
from spillover.runtime.checkpointing.metadata import (
    METADATA_FILE,
    CheckpointStorage,
    new_metadata,
    read_checkpoint,
)
from spillover.runtime.connectors.collecting import CollectingSink
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.graph import StreamEnvironment
from spillover.runtime.recovery.plan import graph_info, vertex_infos
from spillover.storage.location import Location


def _written(tmp_path: Path) -> dict:  # type: ignore[type-arg]
    """A checkpoint as the coordinator writes it: a real graph, channel state with a
    filtered reference into an older checkpoint, and an exited subtask's entry."""
    env = StreamEnvironment("meta", parallelism=2, max_parallelism=128)
    src = env.from_source(GeneratorSource(partitions=2, records_per_partition=10), uid="src")
    src.key_by("key").map(lambda b: b, uid="m").sink(CollectingSink("meta"), uid="sink")
    g = env.build()
    storage = CheckpointStorage(str(tmp_path), "meta")
    groups = channel_state_groups([("m", 0), ("m", 1)], 5, storage.checkpoint_dir)
    w = open_channel_state(storage.subtask_dir, 1, "m", 0, None, groups[("m", 0)])
    w.add_input(0, 1, b"in flight")
    old = w.close()
    w = open_channel_state(storage.subtask_dir, 2, "m", 0, None, groups[("m", 0)])
    w.add_input(0, 0, b"more")
    cs = w.close()
    piece = Piece.from_dict({"handle": old["input"][0], "channel": 1, "skip": 3})
    cs["references"] = [Reference(0, 1, (piece,), KeyGroupFilter(0, 63, 128, 0)).to_dict()]
    entry = {"operators": {"m": {"n": 1}}, "handles": {}, "keyed": {}, "metrics": {"x": 1.0}}
    meta = new_metadata(
        job_name="meta",
        checkpoint_id=2,
        trigger_ms=5,
        fingerprint=g.fingerprint(),
        settings={"max-parallelism": 128, "codec": "none"},
        tasks={
            "m": OperatorMeta.from_json(
                {
                    "subtasks": {
                        "0": {**entry, "channel_state": cs, "finished": False},
                        "1": {**entry, "channel_state": {}, "finished": True},  # exited
                    },
                    "parallelism": 2,
                    "finished": "partially",
                }
            )
        },
        final=False,
        graph=vertex_infos(g),
    )
    assert meta.references == (1,)  # the reference's file is checkpoint 1's
    storage.write_metadata(2, meta)
    return read_checkpoint(storage.checkpoint_dir(2))


def test_written_metadata_reads_back_and_out_unchanged(tmp_path: Path) -> None:
    raw = _written(tmp_path)
    meta = CheckpointMetadata.from_json(raw, "chk-2")
    assert meta.to_json() == raw
    sub = meta.operator("m").subtask(0)
    assert sub.channel_state is not None and sub.references[0].filter == KeyGroupFilter(
        0, 63, 128, 0
    )
    assert meta.references == (1,) and meta.max_parallelism == 128
    assert meta.operator("m").subtask(1).finished and meta.operator("gone").subtasks == {}
    assert meta.graph is not None and meta.graph["m"].inputs[0].key_field == "key"


def test_a_savepoint_reads_as_one(tmp_path: Path) -> None:
    _written(tmp_path)
    saved = CheckpointStorage(str(tmp_path), "meta").export(2, str(tmp_path / "sp"))
    raw = read_checkpoint(saved)
    meta = CheckpointMetadata.from_json(raw, saved)
    assert meta.is_savepoint and meta.to_json() == raw


@pytest.mark.parametrize(
    "damage",
    [
        lambda m: m.update(version=99),
        lambda m: m.update(checkpoint_id="x"),
        lambda m: m["tasks"]["m"]["subtasks"].update({"0": {"channel_state": {"input": [3]}}}),
        lambda m: m["graph"]["vertices"]["m"].pop("nodes"),
    ],
)
def test_damaged_metadata_is_one_format_error_naming_the_file(tmp_path: Path, damage) -> None:  # type: ignore[no-untyped-def]
    raw = _written(tmp_path)
    damage(raw)
    with pytest.raises(FormatError) as e:
        CheckpointMetadata.from_json(raw, "/c/chk-2/_metadata")
    assert e.value.path == "/c/chk-2/_metadata"


names = st.text("abcxyz-", min_size=1, max_size=6)
inputs = st.builds(
    InputInfo,
    names,
    st.sampled_from(["key_by", "rebalance", "forward"]),
    st.integers(0, 3),
    st.none() | names,
    st.none() | st.integers(0, 64),
    st.integers(0, 3),
    st.booleans(),
)
vertices = st.builds(
    VertexInfo,
    st.integers(1, 8),
    st.lists(names, max_size=3).map(tuple),
    st.lists(inputs, max_size=2).map(tuple),
    st.lists(names, max_size=2).map(tuple),
    st.none() | st.integers(0, 3),
    st.booleans(),
)
subtasks = st.builds(
    SubtaskMeta,
    st.dictionaries(names, st.integers()),
    st.dictionaries(names, st.dictionaries(names, st.integers())),
    st.dictionaries(names, st.integers()),
    st.none() | st.builds(ChannelStateMeta, bytes=st.integers(0, 10**9)),
    st.dictionaries(names, st.floats(allow_nan=False)),
    st.booleans(),
)
operators = st.builds(
    OperatorMeta,
    st.dictionaries(st.integers(0, 4), subtasks, max_size=3),
    st.none() | st.integers(1, 8),
    st.sampled_from(["fully", "partially", "running"]),
)
metadata = st.builds(
    CheckpointMetadata,
    version=st.just(1),
    job=names,
    checkpoint_id=st.integers(1, 10**6),
    trigger_ms=st.integers(0, 2**40),
    completed_ms=st.integers(0, 2**40),
    graph_fingerprint=names,
    settings=st.dictionaries(names, st.integers()),
    final=st.booleans(),
    tasks=st.dictionaries(names, operators, max_size=3),
    graph=st.none() | st.dictionaries(names, vertices, max_size=3),
    references=st.lists(st.integers(1, 100), max_size=3).map(tuple),
    savepoint_from=st.none() | names,
)


@given(metadata)
def test_metadata_round_trips_through_json(meta: CheckpointMetadata) -> None:
    assert CheckpointMetadata.from_json(json.loads(json.dumps(meta.to_json()))) == meta


def test_the_graph_a_job_records_is_the_graph_it_reads_back() -> None:
    env = StreamEnvironment("g", parallelism=3, max_parallelism=64)
    env.from_source(
        GeneratorSource(partitions=3, records_per_partition=1), uid="s"
    ).rebalance().sink(CollectingSink("g"), uid="k")
    g = env.build()
    raw = json.loads(json.dumps(graph_info(g)))
    assert {uid: VertexInfo.from_json(v) for uid, v in raw["vertices"].items()} == vertex_infos(g)


@settings(max_examples=25, deadline=None)
@given(
    dirs=st.dictionaries(
        st.integers(min_value=1, max_value=40),
        st.tuples(st.booleans(), st.booleans()),  # (complete, its name zero-padded)
        max_size=8,
    ),
    strays=st.lists(st.sampled_from(["shared", "chk-x", "chk-", "taskowned", "chk-7.tmp"])),
)
def test_one_listing_gives_every_checkpoint_and_the_complete_ones(
    dirs: dict[int, tuple[bool, bool]], strays: list[str]
) -> None:
    """A sweep (the coordinator's after an abort, a resume's of what a dead master left)
    lists the folder once: on an object store each listing is a paid round trip.
    ``listing()`` gives every checkpoint directory's id and those whose metadata is
    there, looked up under the name the directory was listed by (``chk-007`` is
    checkpoint 7, its metadata not in ``chk-7``)."""
    with tempfile.TemporaryDirectory() as tmp:
        storage = CheckpointStorage(tmp, "job")
        root = Path(storage.location.path)
        for cid, (complete, padded) in dirs.items():
            folder = root / (f"chk-{cid:03d}" if padded else f"chk-{cid}")
            folder.mkdir(parents=True)
            if complete:
                (folder / METADATA_FILE).write_bytes(b"{}")
        for name in strays:
            (root / name).mkdir(parents=True, exist_ok=True)
        calls: list[str] = []
        real = Location.list

        def counted(self: Location, what: str = "directory") -> list[str]:
            calls.append(what)
            return real(self, what)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(Location, "list", counted)
            ids, completed = storage.listing()
        assert len(calls) == 1
        assert ids == sorted(dirs) == storage.all_ids()
        assert completed == sorted(c for c, (ok, _) in dirs.items() if ok)
        assert completed == storage.completed_ids()
