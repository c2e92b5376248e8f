"""The verdict: a run with failures against one without, record by record
(lost, duplicated, reordered, misplaced) and on what each topology promises."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spillover.keygroups import key_groups
from spillover.runtime.jobmaster import JobResult
from spillover.verify.output import (
    RunOutput,
    _read_rows,
    final_state,
)
from spillover.verify.spec import (
    VerifySpec,
)
from spillover.verify.topologies import (
    BROADCAST_DTYPE,
    BROADCAST_VIEW_DIR,
    KEYED_CHECKS,
    ORDER_FREE_TOPOLOGIES,
    WINDOW_DTYPE,
    WINDOW_VIEW_DIR,
    _broadcast_records,
)


@dataclass
class Report:
    """The verdict: ``exact`` only when nothing was lost, duplicated or reordered."""

    spec: VerifySpec
    exact: bool
    records: int
    lost: list[tuple[int, int]]
    duplicated: list[tuple[int, int, int]]
    reordered: list[tuple[int, int]]
    wrong_totals: list[tuple[int, int, int]]
    state_mismatch: list[tuple[int, int | None, int | None]]
    failures_fired: list[str]
    inflight_persisted: int
    inflight_replayed: int
    restored_inflight: int
    attempts: int
    checkpoints_completed: int
    duration_s: float
    status: str
    # (node uid.state, key, expected, found) of order-free topologies (check_promises)
    keyed_state_mismatch: list[tuple[str, int, int | None, int | None]] = field(
        default_factory=list
    )
    # (new subtask, partition, seq, times) of broadcast records not seen exactly once
    broadcast_wrong: list[tuple[int, int, int, int]] = field(default_factory=list)
    # (key, window end, expected count, found count) of finishing's event-time windows
    windows_wrong: list[tuple[int, int, int | None, int | None]] = field(default_factory=list)
    # ``finishing`` after a drain: (short partition, summarised, committed)
    summaries_wrong: list[tuple[int, int, int]] = field(default_factory=list)
    # (partition, seq) committed with failures but never without
    unexpected: list[tuple[int, int]] = field(default_factory=list)
    # (partition, seq, key, key group, subtask, parallelism): a key outside the key
    # groups of the subtask that emitted it
    misplaced: list[tuple[int, int, int, int, int, int]] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)  # what an exact verdict proves
    errors: list[str] = field(default_factory=list)  # why a run did not finish
    # Why each failed attempt of the run with failures failed (induced or not).
    attempt_failures: list[str] = field(default_factory=list)
    # In-flight bytes held by the checkpoints that the run's restarts restored from
    # (what inflight_replayed must be non-zero for).
    inflight_restored: int = 0
    # --kill-driver: each start of the driver and how it ended
    driver_starts: list[str] = field(default_factory=list)
    # A drained stop: how many records its sources emitted before the drain ended
    # them (their positions in the savepoint), all of which must be committed once.
    drain_emitted: int | None = None

    def shortfalls(self) -> list[str]:
        """Why the run proved less than its spec asked for, even when exact."""
        out = []
        if len(self.failures_fired) < self.spec.failures:
            out.append(
                f"only {len(self.failures_fired)} of {self.spec.failures} induced failures "
                "happened: give the job more records (or fewer failures)"
            )
        killed = sum(" killed " in d for d in self.driver_starts)
        if killed < self.spec.kill_driver:
            out.append(
                f"the driver was killed {killed} of {self.spec.kill_driver} times before the "
                "job ended: give it more records"
            )
        if self.spec.rescale_to and self.spec.policy != "aligned" and not self.restored_inflight:
            out.append(
                "the restored checkpoint held no in-flight data: slow the sink down "
                "(e.g. a ThrottledSink) so that records queue up under backpressure"
            )
        return out

    def vacuous(self) -> list[str]:
        """Why a run that committed nothing and did not fail proved nothing, said
        plainly (``spillover chaos`` counts it as not exact, kind ``Vacuous``): a
        drain that ended its sources before they emitted a record, or no output."""
        if self.records or self.errors:
            return []
        if self.drain_emitted == 0:
            return [
                "Vacuous: the drain ended the sources before they emitted a record (their "
                "positions in the savepoint are all 0), so nothing was lost and the drain's "
                "commits went untested"
            ]
        return ["Vacuous: nothing was committed, so the comparison proved nothing"]

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["spec"] = self.spec.__dict__
        return d

    def text(self) -> str:
        rescale = f" -> {self.spec.rescale_to}" if self.spec.rescale_to else ""
        lines = [
            f"{self.spec.describe()}, parallelism {self.spec.parallelism}{rescale}, "
            f"policy {self.spec.policy}: {self.records} records, {self.attempts} attempts, "
            f"{self.checkpoints_completed} checkpoints completed, {self.duration_s:.1f} s",
            f"failures induced ({len(self.failures_fired)}): "
            + (", ".join(self.failures_fired) or "none"),
            f"in-flight data: {self.inflight_persisted} bytes persisted by completed "
            f"checkpoints, {self.inflight_replayed} bytes replayed by restores",
        ]
        if self.spec.batch:  # no checkpoints, so no policy and no in-flight data
            lines[0] = (
                f"{self.spec.describe()}, parallelism {self.spec.parallelism}, runtime mode "
                f"{self.spec.runtime_mode}: {self.records} records, {self.attempts} "
                f"attempts, {self.duration_s:.1f} s"
            )
            del lines[2]
        if self.driver_starts:
            lines.append(f"driver started {len(self.driver_starts)} times:")
            lines += [f"  {d}" for d in self.driver_starts]
        if self.spec.stop:
            how = {
                "savepoint": "an aligned savepoint",
                "unaligned-savepoint": "an unaligned savepoint",
                "drain": "drain and a savepoint",
            }[self.spec.stop]
            lines.append(f"stopped part way with {how}, then restored from the savepoint")
            if self.drain_emitted is not None:
                lines.append(
                    f"the drain ended the sources once they had emitted {self.drain_emitted:,} "
                    "records (their positions in the savepoint)"
                )
        elif self.spec.rescale_to:
            lines.append(
                f"rescaled from the latest checkpoint, which held {self.restored_inflight} "
                "bytes of in-flight data"
            )
        lines += [f"WARNING: {s}" for s in self.shortfalls()]
        if self.exact:
            proved = "; ".join(self.checks) or "no record lost, duplicated or reordered"
            lines.append(f"EXACT: {proved}")
            return "\n".join(lines)
        lines.append(f"NOT EXACT (job {self.status})")
        lines += [f"  {e}" for e in self.errors]
        lines += [f"  failed {f}" for f in self.attempt_failures]
        for title, items in (
            ("lost (partition, seq)", self.lost),
            ("duplicated (partition, seq, times)", self.duplicated),
            ("not in the failure-free output (partition, seq)", self.unexpected),
            ("reordered (partition, seq)", self.reordered),
            ("wrong running total (partition, seq, total)", self.wrong_totals),
            (
                "outside the key groups of their subtask "
                "(partition, seq, key, key group, subtask, parallelism)",
                self.misplaced,
            ),
            ("final state differs (key, expected, found)", self.state_mismatch),
            ("keyed state differs (state, key, expected, found)", self.keyed_state_mismatch),
            (
                "broadcast records not seen once (subtask, partition, seq, times)",
                self.broadcast_wrong,
            ),
            (
                "event-time windows differ (key, window end, expected, found)",
                self.windows_wrong,
            ),
            (
                "finish() summaries miscount (partition, summarised, committed)",
                self.summaries_wrong,
            ),
        ):
            if items:
                shown = ", ".join(map(str, items[:20]))
                more = f" ... and {len(items) - 20} more" if len(items) > 20 else ""
                lines.append(f"  {len(items)} {title}: {shown}{more}")
        return "\n".join(lines)


def _unpack(i: Any) -> tuple[int, int]:
    return int(i >> 40), int(i & ((1 << 40) - 1))


def _ids(rows: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.int64]]:
    return np.asarray(rows["partition"].astype(np.int64) << 40 | rows["seq"].astype(np.int64))


def _count_diff(
    e_ids: np.ndarray[Any, Any], a_ids: np.ndarray[Any, Any]
) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]], list[tuple[int, int]]]:
    """Lost, duplicated (with the times seen) and unexpected records: the difference of
    the two multisets of ``(partition, seq)``."""
    ids = np.union1d(e_ids, a_ids)
    e_u, e_c = np.unique(e_ids, return_counts=True)
    a_u, a_c = np.unique(a_ids, return_counts=True)
    ce = np.zeros(len(ids), np.int64)
    ca = np.zeros(len(ids), np.int64)
    ce[np.searchsorted(ids, e_u)] = e_c
    ca[np.searchsorted(ids, a_u)] = a_c
    lost = [_unpack(i) for i in ids[ca < ce][:1000]]
    dup = (ca > ce) & (ce > 0)
    duplicated = [
        (*_unpack(i), int(c)) for i, c in zip(ids[dup][:1000], ca[dup][:1000], strict=True)
    ]
    unexpected = [_unpack(i) for i in ids[(ce == 0) & (ca > 0)][:1000]]
    return lost, duplicated, unexpected


def _pairs(ids: np.ndarray[Any, Any], values: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``(id, value)`` rows as opaque bytes, to test membership of whole pairs."""
    pairs = np.empty(len(ids), [("id", "<i8"), ("value", values.dtype)])
    pairs["id"], pairs["value"] = ids, values
    return pairs.view(f"V{pairs.dtype.itemsize}")


def _reordered(rows: np.ndarray[Any, Any], order_by: str | None) -> list[tuple[int, int]]:
    """Records committed after a later record of their ``(partition, key)`` (or partition),
    in ``order_by`` order, or in commit order."""
    if not len(rows):
        return []
    names = rows.dtype.names or ()
    ordinal = rows[order_by] if order_by else np.arange(len(rows))
    key = rows["key"] if "key" in names else np.zeros(len(rows), np.int64)
    order = np.lexsort((ordinal, key, rows["partition"]))
    p, k, s = rows["partition"][order], key[order], rows["seq"][order]
    same = (p[1:] == p[:-1]) & (k[1:] == k[:-1])
    back = np.flatnonzero(same & (s[1:] < s[:-1]))
    return [(int(p[i + 1]), int(s[i + 1])) for i in back[:1000]]


def _misplaced(
    rows: np.ndarray[Any, Any], max_parallelism: int
) -> list[tuple[int, int, int, int, int, int]]:
    """``(partition, seq, key, key group, subtask, parallelism)`` of every row whose key
    is not in the key groups of the subtask that emitted it."""
    names = rows.dtype.names or ()
    if not len(rows) or max_parallelism < 1 or "subtask" not in names or "key" not in names:
        return []
    kg = key_groups(np.ascontiguousarray(rows["key"], dtype=np.int64), max_parallelism)
    owner = kg.astype(np.int64) * rows["parallelism"] // max_parallelism
    bad = np.flatnonzero(owner != rows["subtask"])[:1000]
    cols = ("partition", "seq", "key", "subtask", "parallelism")
    found = [tuple(int(r[c]) for c in cols) for r in rows[bad]]
    return [(p, s, k, int(g), t, n) for (p, s, k, t, n), g in zip(found, kg[bad], strict=True)]


def compare(spec: VerifySpec, expected: RunOutput, actual: RunOutput) -> Report:
    """Every difference between a failure-free run and a run with failures."""
    e, a = expected.rows, actual.rows
    e_names, a_names = e.dtype.names or (), a.dtype.names or ()
    e_ids, a_ids = _ids(e), _ids(a)
    lost, duplicated, unexpected = _count_diff(e_ids, a_ids)
    checks = ["every record committed as often as without failures"]
    wrong: list[tuple[int, int, int]] = []
    if "total" in e_names and "total" in a_names:
        # Totals must equal the failure-free ones record by record.
        known = np.isin(a_ids, e_ids)
        totals = a["total"].astype(e["total"].dtype)
        ok = np.isin(_pairs(a_ids, totals), _pairs(e_ids, e["total"]))
        wrong = [
            (int(r["partition"]), int(r["seq"]), r["total"].item()) for r in a[known & ~ok][:1000]
        ]
        checks.append("per-record totals equal")
    order_by, state_uid, _ = spec.checks()
    reordered: list[tuple[int, int]] = []
    if spec.order == "per-key":
        reordered = _reordered(a, order_by)
        per = "(partition, key)" if "key" in a_names else "partition"
        checks.append(f"order per {per} kept" + (f" (by {order_by})" if order_by else ""))
    misplaced = _misplaced(a, actual.max_parallelism)
    if "subtask" in a_names and "key" in a_names:
        checks.append("every key in its subtask's key groups")
    keys = sorted(set(expected.state) | set(actual.state), key=repr)
    mismatch = [
        (k, expected.state.get(k), actual.state.get(k))
        for k in keys
        if expected.state.get(k) != actual.state.get(k)
    ]
    if expected.state:
        checks.append(f"final keyed state of {state_uid} equal")
    r = actual.result
    exact = (
        r.status == "finished"
        and expected.result.status == "finished"
        and not lost
        and not duplicated
        and not unexpected
        and not reordered
        and not wrong
        and not misplaced
        and not mismatch
        and len(a) == len(e)
    )
    report = Report(
        spec,
        exact,
        len(a),
        lost,
        duplicated,
        reordered,
        wrong,
        mismatch[:1000],
        actual.fired,
        r.persisted_inflight_bytes,
        r.replayed_bytes,
        actual.restored_inflight,
        r.attempts,
        len(r.completed_checkpoints()),
        r.duration_s,
        r.status,
        unexpected=unexpected,
        misplaced=misplaced,
        checks=checks,
        errors=[
            f"the run {label} {run.result.status}: {run.result.failures[-1]}"
            for label, run in (("without failures", expected), ("with failures", actual))
            if run.result.status != "finished" and run.result.failures
        ],
        attempt_failures=list(actual.result.failures),
        inflight_restored=_inflight_restored(r),
    )
    if actual.finished_from is not None:
        whole = not (lost or duplicated or unexpected)
        report.errors.append(
            f"it failed for good; restored from its latest checkpoint "
            f"({actual.finished_from}) with no faults, it ended {actual.finished_status}: "
            + (
                "every record committed once, nothing it had committed lost"
                if whole and actual.finished_status == "finished"
                else "its whole output differs as below"
            )
        )
    return check_promises(spec, expected, actual, report)


def _inflight_restored(r: JobResult) -> int:
    """In-flight bytes of the completed checkpoints the run restored from."""
    held = {int(c["checkpoint_id"]): int(c["inflight_bytes"]) for c in r.completed_checkpoints()}
    return sum(held.get(cid, 0) for cid in r.restored_from)


def broadcast_wrong(
    spec: VerifySpec, rows: np.ndarray[Any, Any]
) -> list[tuple[int, int, int, int]]:
    """``(subtask, partition, seq, times)`` for every broadcast record that a subtask of
    the last parallelism did not see exactly once.

    A subtask ``d`` restored at another parallelism inherits the view of old subtask
    ``broadcast_source(d, old)`` (its processed records were committed under the old
    tag, its in-flight ones are replayed to ``d``), so its view is the rows of both.
    """
    from spillover.rescale import broadcast_source

    old = spec.parallelism
    new = spec.rescale_to or old
    partitions, per = _broadcast_records(spec)
    ids = rows["partition"].astype(np.int64) * per + rows["seq"]
    valid = (rows["partition"] >= 0) & (rows["partition"] < partitions)
    valid &= (rows["seq"] >= 0) & (rows["seq"] < per)
    wrong: list[tuple[int, int, int, int]] = []
    for d in range(new):
        mine = (rows["parallelism"] == new) & (rows["subtask"] == d)
        mine |= (rows["parallelism"] == old) & (rows["subtask"] == broadcast_source(d, old))
        times = np.bincount(ids[mine & valid], minlength=partitions * per)
        bad = np.flatnonzero(times != 1)
        wrong += [(d, int(i // per), int(i % per), int(times[i])) for i in bad[:1000]]
        foreign = rows[mine & ~valid]  # records the broadcast source never made
        wrong += [(d, int(r["partition"]), int(r["seq"]), 1) for r in foreign[:1000]]
    return wrong[:1000]


def check_promises(
    spec: VerifySpec, expected: RunOutput, actual: RunOutput, report: Report
) -> Report:
    """Adds to ``report`` what a rescaling topology promises beyond ``compare``: its
    order-free keyed states equal the failure-free run's, and for ``broadcast`` every
    subtask of the last parallelism saw every broadcast record exactly once."""
    if spec.job is not None:
        return report
    if spec.topology in ORDER_FREE_TOPOLOGIES:
        vacuous = ("per-record totals", "order per")
        report.checks = [c for c in report.checks if not c.startswith(vacuous)]
    for uid, name in KEYED_CHECKS.get(spec.topology, ()):
        e = final_state(expected.result, expected.max_parallelism, uid, name)
        a = final_state(actual.result, actual.max_parallelism, uid, name, required=False)
        report.keyed_state_mismatch += [
            (name, k, e.get(k), a.get(k)) for k in sorted(set(e) | set(a)) if e.get(k) != a.get(k)
        ][:1000]
        report.checks.append(f"final {name} per key equal")
    if (spec.topology == "finishing" or spec.event_time) and spec.stop != "drain":
        e_w, a_w = (_windows(run) for run in (expected, actual))
        report.windows_wrong = [
            (k, end, e_w.get((k, end)), a_w.get((k, end)))
            for k, end in sorted(set(e_w) | set(a_w))
            if e_w.get((k, end)) != a_w.get((k, end))
        ][:1000]
        report.checks.append("event-time window counts equal")
    if spec.topology == "broadcast":
        if actual.out_dir is None:
            raise ValueError("the run's output directory is unknown (RunOutput.out_dir)")
        rows = _read_rows(os.path.join(actual.out_dir, BROADCAST_VIEW_DIR), BROADCAST_DTYPE)
        report.broadcast_wrong = broadcast_wrong(spec, rows)
        report.checks.append("every broadcast record seen once by every subtask")
    report.exact = (
        report.exact
        and not report.keyed_state_mismatch
        and not report.broadcast_wrong
        and not report.windows_wrong
    )
    return report


def _windows(run: RunOutput) -> dict[tuple[int, int], int]:
    """The committed window counts of a ``finishing`` run, per (key, window end); a
    window committed twice shows as its counts added up."""
    if run.out_dir is None:
        raise ValueError("the run's output directory is unknown (RunOutput.out_dir)")
    rows = _read_rows(os.path.join(run.out_dir, WINDOW_VIEW_DIR), WINDOW_DTYPE)
    out: dict[tuple[int, int], int] = {}
    for k, end, n in zip(
        rows["key"].tolist(), rows["window_end"].tolist(), rows["count"].tolist(), strict=True
    ):
        out[(k, end)] = out.get((k, end), 0) + n
    return out
