"""Prometheus metrics under Flink's names, as Flink's ``PrometheusReporter`` exposes
them: ``flink_jobmanager_job_<metric>{job_id, job_name}`` for the job's checkpoints
and restarts, ``flink_taskmanager_job_task_<metric>{job_id, job_name, task_name,
subtask_index}`` per subtask (``task_name`` is the vertex's uid). Every value is read
at scrape time from the job's trackers and its subtasks' live metrics (on Spark, as
the workers report them to the driver over the control channel)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from spillover.rest.job import ServedJob
from spillover.rest.views import vertex_metrics

JOB = "flink_jobmanager_job_"
TASK = "flink_taskmanager_job_task_"


class FlinkMetricsCollector(Collector):
    """One job's metrics, collected on each scrape."""

    def __init__(self, job: ServedJob) -> None:
        self.job = job

    def collect(self) -> Iterator[Metric]:
        job = self.job
        ex = job.executor
        labels = ["job_id", "job_name"]
        ids = [job.job_id, job.name]
        s = ex.stats.snapshot()
        st = ex.status.snapshot()
        last = s.latest_completed
        restored = s.restored
        values: list[tuple[str, str, float]] = [
            ("numberOfCompletedCheckpoints", "completed checkpoints", s.completed_count),
            ("numberOfFailedCheckpoints", "failed checkpoints", s.failed_count),
            ("numberOfInProgressCheckpoints", "checkpoints in progress", len(s.in_progress)),
            ("totalNumberOfCheckpoints", "checkpoints triggered", s.total_count),
            (
                "lastCheckpointDuration",
                "the last completed checkpoint's duration to its last acknowledgement (ms)",
                last.end_to_end_ms if last else -1,
            ),
            (
                "lastCheckpointPersistedData",
                "in-flight bytes the last completed checkpoint persisted",
                last.total("inflight_bytes") if last else -1,
            ),
            (
                "lastCheckpointProcessedData",
                "bytes processed during the last completed checkpoint's alignment",
                last.total("bytes_during_alignment") if last else -1,
            ),
            (
                "lastCheckpointFullSize",
                "the last completed checkpoint's full size (bytes)",
                last.state_size if last else -1,
            ),
            (
                "lastCheckpointSize",
                "bytes the last completed checkpoint wrote",
                last.checkpointed_size if last else -1,
            ),
            (
                "lastCompletedCheckpointId",
                "the last completed checkpoint's id",
                last.checkpoint_id if last else -1,
            ),
            (
                "lastCheckpointRestoreTimestamp",
                "when the running attempt restored (ms since the epoch)",
                restored.restore_ms if restored else -1,
            ),
            ("numRestarts", "restarts since the job started", st.num_restarts),
        ]
        for name, doc, value in values:
            g = GaugeMetricFamily(JOB + name, doc, labels=labels)
            g.add_metric(ids, float(value))
            yield g

        task_labels = [*labels, "task_name", "subtask_index"]
        # The latest completed checkpoint's per-subtask start delay and alignment.
        acked = {(a.vertex, a.index): a for a in last.subtasks} if last else {}
        families = {
            name: GaugeMetricFamily(TASK + name, doc, labels=task_labels)
            for name, doc in (
                ("numRecordsIn", "records the subtask read"),
                ("numRecordsOut", "records the subtask emitted"),
                ("numRecordsInPerSecond", "records read per second"),
                ("numRecordsOutPerSecond", "records emitted per second"),
                ("backPressuredTimeMsPerSecond", "ms per second the subtask was backpressured"),
                ("busyTimeMsPerSecond", "ms per second the subtask was busy"),
                ("checkpointStartDelayNanos", "the last checkpoint's start delay (ns)"),
                ("checkpointAlignmentTime", "the last checkpoint's alignment time (ns)"),
            )
        }
        for uid, subtasks in sorted(vertex_metrics(job).items()):
            for index, m in sorted(subtasks.items(), key=lambda kv: int(kv[0])):
                at = [*ids, uid, index]
                a = acked.get((uid, int(index)))
                for name, value in (
                    ("numRecordsIn", m.get("records_in", 0.0)),
                    ("numRecordsOut", m.get("records_out", 0.0)),
                    ("numRecordsInPerSecond", m.get("records_in_per_s", 0.0)),
                    ("numRecordsOutPerSecond", m.get("records_out_per_s", 0.0)),
                    ("backPressuredTimeMsPerSecond", m.get("backpressured_ms_per_s", 0.0)),
                    ("busyTimeMsPerSecond", m.get("busy_ms_per_s", 0.0)),
                    ("checkpointStartDelayNanos", a.metric("start_delay_ms") * 1e6 if a else 0.0),
                    ("checkpointAlignmentTime", a.metric("alignment_ms") * 1e6 if a else 0.0),
                ):
                    families[name].add_metric(at, float(value))
        yield from families.values()


def registry_for(job: ServedJob) -> CollectorRegistry:
    """A registry of this job's metrics alone (no process or platform collectors)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FlinkMetricsCollector(job))
    return registry
