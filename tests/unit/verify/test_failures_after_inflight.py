"""``VerifySpec(failures_after_inflight=True)``: where it cannot hold its promise it is
refused before anything runs; its failure script waits for in-flight data."""

from __future__ import annotations

from typing import Any

import pytest

from spillover.errors import ConfigError
from spillover.runtime.failures import FailureSpec, InducedFailure
from spillover.verify import VerifySpec
from spillover.verify.inflight import AfterInflight, InflightWait


@pytest.mark.parametrize(
    "changes",
    [
        {"policy": "aligned"},
        {"executor": "processes"},
        {"rescale_to": 3},
        {"stop": "savepoint"},
        {"sink_share": 1.0},
    ],
)
def test_refused_where_no_sink_can_be_held_or_nothing_is_in_flight(changes: dict[str, Any]) -> None:
    spec = VerifySpec(**{"policy": "unaligned", "failures_after_inflight": True, **changes})
    with pytest.raises(ConfigError, match="failures_after_inflight"):
        spec.check()


def test_a_failure_waits_for_a_completed_checkpoint_with_inflight_data() -> None:
    wait = InflightWait()
    script = AfterInflight([FailureSpec("operator", None, None, after_records=1)], wait)
    assert wait.holding
    script.check("operator", 0, "map", 0, records=5)  # nothing in flight yet: no failure
    wait.latest_inflight = 100
    assert not wait.holding
    with pytest.raises(InducedFailure):
        script.check("operator", 0, "map", 0, records=6)
    assert wait.pending == 0 and not wait.holding
