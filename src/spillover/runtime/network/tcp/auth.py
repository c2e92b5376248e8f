"""Peer authentication for every connection of a job, data and control alike.

A connecting peer proves that it holds the job's secret without sending it: the
accepting side sends a fresh random nonce, the peer answers with
``HMAC-SHA256(secret, nonce + body)``, and the accepting side compares in constant
time. One rule for what a secret must be, one MAC, one comparison.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from spillover.errors import ConfigError

__all__ = ["MAC_BYTES", "MIN_SECRET_BYTES", "NONCE_BYTES", "job_key", "new_nonce", "sign", "verify"]

NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size
MIN_SECRET_BYTES = 16


def job_key(secret: bytes | str) -> bytes:
    """The secret as HMAC key bytes; refuses a secret too short to be one."""
    key = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(key) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"the job secret must be at least {MIN_SECRET_BYTES} bytes", detail=f"{len(key)} given"
        )
    return key


def new_nonce() -> bytes:
    """A fresh challenge."""
    return os.urandom(NONCE_BYTES)


def sign(key: bytes, nonce: bytes, body: bytes) -> bytes:
    """The answer to ``nonce`` for a peer that sends ``body``."""
    return hmac.new(key, nonce + body, hashlib.sha256).digest()


def verify(key: bytes, nonce: bytes, body: bytes, mac: bytes) -> bool:
    """Whether ``mac`` answers ``nonce`` for ``body`` under ``key`` (constant time)."""
    return hmac.compare_digest(mac, sign(key, nonce, body))
