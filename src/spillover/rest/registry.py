"""The job registry: one JSON entry per job under ``SPILLOVER_HOME`` (default
``~/.spillover``), so that the CLI finds a running job by its id from any shell.

``$SPILLOVER_HOME/jobs/<id>.json`` holds a :class:`JobEntry`, replaced atomically
on every change; ``<id>.token`` (mode 0600) holds the token its mutating REST calls
need; ``<id>.log`` is a detached job's output.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from spillover.errors import ConfigError, JobNotFoundError
from spillover.storage.location import Location

HOME_ENV = "SPILLOVER_HOME"


def home() -> Path:
    """The registry's folder: ``$SPILLOVER_HOME``, else ``~/.spillover``."""
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".spillover")


def jobs_dir() -> Path:
    return home() / "jobs"


@dataclass(frozen=True)
class Command:
    """An operator's command that reached the job through its REST API."""

    at: float  # seconds since the epoch
    command: str  # savepoint | stop | cancel
    detail: str = ""


@dataclass(frozen=True)
class JobEntry:
    """What the registry says of one job."""

    id: str
    name: str
    state: str  # Flink's job state: RUNNING, FINISHED, CANCELED, FAILED, ...
    rest_url: str
    token_file: str
    pid: int
    started: float  # seconds since the epoch
    last_checkpoint: int | None = None
    ended: float | None = None
    savepoint: str | None = None  # where the job's stop left its savepoint
    commands: tuple[Command, ...] = ()  # the latest ones, oldest first

    def with_changes(self, **changes: Any) -> JobEntry:
        return replace(self, **changes)

    @property
    def alive(self) -> bool:
        """Whether its master's process still runs (a crashed one leaves RUNNING)."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    @property
    def effective_state(self) -> str:
        """Its state, or LOST when it says it runs but its process is gone."""
        terminal = self.state in ("FINISHED", "CANCELED", "FAILED")
        return self.state if terminal or self.alive else "LOST"

    def token(self) -> str:
        return Path(self.token_file).read_text().strip()


def new_token(job_id: str) -> Path:
    """A fresh random token for ``job_id``, written readable by its owner only."""
    d = jobs_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{job_id}.token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32))
    os.chmod(path, 0o600)
    return path


def write(entry: JobEntry) -> None:
    """Replaces the entry of ``entry.id`` atomically (a reader sees old or new)."""
    text = json.dumps(asdict(entry), indent=1) + "\n"
    path = jobs_dir() / f"{entry.id}.json"
    Location.parse(str(path)).publish(text.encode(), fsync=False, what="job registry entry")


def read(job_id: str) -> JobEntry:
    """The entry of ``job_id`` (a unique prefix of it will do), or a ConfigError."""
    d = jobs_dir()
    exact = d / f"{job_id}.json"
    if exact.exists():
        return _load(exact)
    matches = sorted(d.glob(f"{job_id}*.json")) if job_id and d.is_dir() else []
    if len(matches) == 1:
        return _load(matches[0])
    raise JobNotFoundError(
        f"no job {job_id!r}" if not matches else f"job id {job_id!r} is ambiguous",
        detail=f"registry {d}",
        hint="`spillover list` shows the jobs and their ids",
    )


def entries() -> list[JobEntry]:
    """Every registered job, newest first; unreadable entries are skipped."""
    d = jobs_dir()
    out = []
    for p in d.glob("*.json") if d.is_dir() else []:
        try:
            out.append(_load(p))
        except ConfigError:
            continue
    return sorted(out, key=lambda e: e.started, reverse=True)


def _load(path: Path) -> JobEntry:
    try:
        data = json.loads(path.read_text())
        commands = tuple(Command(**c) for c in data.pop("commands", ()))
        return JobEntry(**data, commands=commands)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError("cannot read the job's registry entry", detail=f"{path}: {e}") from None


def now() -> float:
    return time.time()
