"""Checkpoint policies by name, the one place that says which options each sets:
``verify``, ``bench`` and the pytest plugin all name policies this way.

- ``none``: no checkpoints (bench only);
- ``aligned``: aligned barriers;
- ``unaligned``: unaligned checkpoints (``execution.checkpointing.unaligned.enabled``);
- ``timeout``: aligned, switching to unaligned after the alignment timeout
  (``execution.checkpointing.aligned-checkpoint-timeout``);
- ``max-inflight``: unaligned with a bound on the in-flight bytes one subtask
  persists per checkpoint (``execution.checkpointing.unaligned.max-inflight-bytes``).
"""

from __future__ import annotations

from typing import Any, Final

from spillover.errors import ConfigError

__all__ = ["CHECKPOINT_POLICIES", "POLICIES", "policy_options"]

POLICIES: Final = ("none", "aligned", "unaligned", "timeout", "max-inflight")
CHECKPOINT_POLICIES: Final = POLICIES[1:]  # those that take checkpoints

_CP = "execution.checkpointing."


def policy_options(
    policy: str, *, aligned_timeout_ms: int = 100, max_inflight_bytes: int = 1 << 20
) -> dict[str, Any]:
    """The configuration keys of ``policy`` (none of them for ``none`` and ``aligned``;
    ``none`` leaves checkpointing off by not setting an interval, which is the
    caller's)."""
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}", hint=f"choose from {', '.join(POLICIES)}")
    options: dict[str, Any] = {}
    if policy in ("unaligned", "timeout", "max-inflight"):
        options[_CP + "unaligned.enabled"] = True
    if policy == "timeout":
        options[_CP + "aligned-checkpoint-timeout"] = f"{aligned_timeout_ms} ms"
    if policy == "max-inflight":
        options[_CP + "unaligned.max-inflight-bytes"] = max_inflight_bytes
    return options
