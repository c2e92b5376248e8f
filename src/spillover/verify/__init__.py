"""Exactly-once verification of whole jobs: built-in topologies, induced failures,
and an exact comparison with a failure-free run.

Every topology ends in a keyed running total whose output is the same whatever
the batching and timing: keys are made per source partition, so each key's
records arrive in sequence order on one channel, and every record comes out
with its key's total after it. The committed Parquet output and the final keyed
state of a run with failures must equal those of a run without.

The rescaling topologies (``RESCALE_TOPOLOGIES``) add edges that do not keep that
order (rebalance, broadcast); each is checked on what it promises
(``check_promises``): the exact multiset of records always, running totals only
where order is kept, else the final keyed count and sum per key, and for a
broadcast input one copy of every broadcast record per subtask.
"""

from __future__ import annotations

from spillover.verify.compare import (
    Report,
    broadcast_wrong,
    check_promises,
    compare,
)
from spillover.verify.output import (
    ID_COLUMNS,
    OPTIONAL_COLUMNS,
    RunOutput,
    final_state,
    output_of,
    read_output,
)
from spillover.verify.run import (
    run_once,
    run_rescaled,
    verify,
    write_json,
)
from spillover.verify.spec import (
    VerifySpec,
    config_for,
)
from spillover.verify.topologies import (
    BROADCAST_DTYPE,
    BROADCAST_VIEW_DIR,
    KEYED_CHECKS,
    KEYS_PER_PARTITION,
    ORDER_FREE_TOPOLOGIES,
    OUT_DTYPE,
    POLICIES,
    RESCALE_TOPOLOGIES,
    STAMP_FIELDS,
    TOPOLOGIES,
    BroadcastView,
    CheckRouting,
    CountSum,
    JobFactory,
    MainRunningTotal,
    RunningTotal,
    RunningTotalOfTotals,
    SubtaskStamp,
    build,
    build_rescale_topology,
    key_modulo,
    load_job,
    per_partition_keys,
    stamp_subtask,
)

__all__ = [
    "BROADCAST_DTYPE",
    "BROADCAST_VIEW_DIR",
    "ID_COLUMNS",
    "KEYED_CHECKS",
    "KEYS_PER_PARTITION",
    "OPTIONAL_COLUMNS",
    "ORDER_FREE_TOPOLOGIES",
    "OUT_DTYPE",
    "POLICIES",
    "RESCALE_TOPOLOGIES",
    "STAMP_FIELDS",
    "TOPOLOGIES",
    "BroadcastView",
    "CheckRouting",
    "CountSum",
    "JobFactory",
    "MainRunningTotal",
    "Report",
    "RunOutput",
    "RunningTotal",
    "RunningTotalOfTotals",
    "SubtaskStamp",
    "VerifySpec",
    "broadcast_wrong",
    "build",
    "build_rescale_topology",
    "check_promises",
    "compare",
    "config_for",
    "final_state",
    "key_modulo",
    "load_job",
    "output_of",
    "per_partition_keys",
    "read_output",
    "run_once",
    "run_rescaled",
    "stamp_subtask",
    "verify",
    "write_json",
]
