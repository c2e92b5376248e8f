"""What a chaos scenario is, and how one is drawn from a seed and rebuilt from its id.

A :class:`Scenario` is a whole job (a built-in topology, its settings) and a timed
script of faults and operator actions, each named from :data:`VOCABULARY`. Features
are composable pieces in :data:`FEATURES`: each says what it needs, what it cannot
go with, and which actions it adds to the script, so combinations are drawn, not
enumerated. Everything is drawn from ``random.Random`` seeded with the run's seed
and the scenario's index; the id (``<seed>-<index>``) rebuilds the same draws.

A shrunk scenario's id adds the edits that made it smaller after a ``~``:
``-name`` (a feature removed), ``xN`` (action N of the script removed), ``pN``
(parallelism N), ``rN`` (N records per source) and ``tNAME`` (topology NAME), so
``--replay`` rebuilds it too.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from spillover.errors import ConfigError
from spillover.runtime.network.tcp.faults import CONNECTIONS, FAULT_ACTIONS, NetworkFault
from spillover.verify.run import DRAIN_TOPOLOGIES
from spillover.verify.spec import EVENT_TIME_TOPOLOGIES
from spillover.verify.topologies import POLICIES, RESCALE_TOPOLOGIES

__all__ = [
    "EXECUTORS",
    "FEATURES",
    "STORAGE_ERRORS",
    "STORAGE_OPS",
    "VOCABULARY",
    "Action",
    "Feature",
    "Scenario",
    "Settings",
    "draw",
    "parse_id",
    "scenario_for",
    "shrink_steps",
]

EXECUTORS = ("local", "spark")

# Write-side and read-side operations of checkpoint storage a fault can hit
# (spillover.chaos.faults): ``rename`` only on a local disk, the others on the
# fault-injecting pyarrow filesystem.
STORAGE_OPS = ("open", "write", "close", "rename", "list", "read", "mkdir")
# What goes wrong: an I/O error, a full disk, or no error but slow storage.
STORAGE_ERRORS = ("EIO", "ENOSPC", "latency")

# Shrinking halves the records down to this many per source, no further: a shorter
# run ends before a stop or a rescale can come, which is not what failed.
MIN_SHRUNK_RECORDS = 4_000

# The plain topologies a scenario without a job feature draws from.
PLAIN_TOPOLOGIES = ("pipeline", "union", "multi-input", *RESCALE_TOPOLOGIES)
# Those a batch run draws from (bounded, no loop), and those a rescale may restore.
BATCH_TOPOLOGIES = ("pipeline", "union", "multi-input", "finishing")
RESCALABLE = (*PLAIN_TOPOLOGIES, "finishing")


@dataclass(frozen=True)
class Action:
    """One step of a scenario's script: ``name`` from the vocabulary, striking at
    ``at`` (a share of the run, 0 to 1), with what it does in ``detail``."""

    name: str
    at: float
    detail: str = ""

    def describe(self) -> str:
        return f"{self.name}@{self.at:.2f}" + (f"({self.detail})" if self.detail else "")


@dataclass(frozen=True)
class Settings:
    """The drawn settings of a scenario's job."""

    policy: str = "aligned"
    interval_ms: int = 50
    max_concurrent_checkpoints: int = 1
    parallelism: int = 2
    max_subtasks_per_channel_state_file: int = 1
    records: int = 12_000  # per source


@dataclass(frozen=True)
class Scenario:
    """A job, its settings, the features combined in it and their script of actions."""

    seed: int
    index: int
    topology: str
    settings: Settings
    features: tuple[str, ...]
    actions: tuple[Action, ...]
    executor: str = "local"
    edits: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        base = f"{self.seed}-{self.index}"
        return base + ("~" + ",".join(self.edits) if self.edits else "")

    def has(self, feature: str) -> bool:
        return feature in self.features

    def actions_of(self, name: str) -> tuple[Action, ...]:
        return tuple(a for a in self.actions if a.name == name)

    def describe(self) -> str:
        s = self.settings
        concurrent = (
            f" concurrent {s.max_concurrent_checkpoints}"
            if s.max_concurrent_checkpoints > 1
            else ""
        )
        return (
            f"{self.id}: {self.topology} p{s.parallelism} {s.records:,} records, "
            f"{s.policy} every {s.interval_ms} ms{concurrent}, "
            f"{s.max_subtasks_per_channel_state_file} subtasks per channel-state file; "
            f"features {', '.join(self.features) or '-'}; "
            f"script {' '.join(a.describe() for a in self.actions) or '-'}"
        )


@dataclass(frozen=True)
class Feature:
    """A composable piece: what it needs, what it excludes, on which executors it
    runs, and the actions it adds to a script (drawn with the scenario's random)."""

    name: str
    excludes: tuple[str, ...] = ()
    requires_one_of: tuple[str, ...] = ()
    executors: tuple[str, ...] = EXECUTORS
    actions: Callable[[random.Random, Settings], tuple[Action, ...]] = lambda rng, s: ()


def _failures(rng: random.Random, s: Settings) -> tuple[Action, ...]:
    n = rng.randint(1, 3)
    return tuple(Action("failure", round((i + 1) / (n + 1), 2)) for i in range(n))


def _rescale(rng: random.Random, s: Settings) -> tuple[Action, ...]:
    to = rng.choice([p for p in (1, 2, 3) if p != s.parallelism])
    return (Action("rescale", 0.5, f"{s.parallelism}->{to}"),)


def _stop(rng: random.Random, s: Settings) -> tuple[Action, ...]:
    return (Action("stop", 0.5, rng.choice(("aligned", "unaligned"))),)


def _storage_fault(rng: random.Random, s: Settings) -> tuple[Action, ...]:
    op = rng.choice(STORAGE_OPS)
    error = rng.choice(STORAGE_ERRORS)
    # Reads happen only in restores, and listings rarely: strike among the first.
    skip = rng.randint(0, 3) if op in ("read", "list") else rng.randint(0, 120)
    count = rng.randint(1, 4) if op in ("read", "list") else rng.randint(5, 60)
    at = round(rng.uniform(0.1, 0.9), 2)
    return (Action("storage-fault", at, f"{op} {error} after {skip} for {count}"),)


def _aborted(rng: random.Random, s: Settings) -> tuple[Action, ...]:
    return (Action("aborted-savepoint", 0.5, f"{rng.randint(1, 2)} attempts fail on storage"),)


def _worker_kill(rng: random.Random, s: Settings) -> tuple[Action, ...]:
    return (Action("worker-kill", 0.4, f"worker {rng.randrange(s.parallelism)}"),)


def _network_fault(rng: random.Random, s: Settings) -> tuple[Action, ...]:
    connection, action = rng.choice(CONNECTIONS), rng.choice(FAULT_ACTIONS)
    # Early enough to strike in any run: a worker sends its hello, its wired, then
    # metrics twice a second on its control connection; the smallest jobs' workers
    # send a dozen or two data frames (at 10 to 60 the fault missed 3 of 8 runs).
    after = rng.randint(3, 6) if connection == "control" else rng.randint(2, 12)
    fault = NetworkFault(connection, action, after, worker=rng.randrange(s.parallelism))
    return (Action("network-fault", 0.3, fault.describe()),)


def _driver_kill(rng: random.Random, s: Settings) -> tuple[Action, ...]:
    n = rng.randint(1, 2)
    return tuple(Action("driver-kill", round((i + 1) / (n + 1), 2)) for i in range(n))


_JOB_SHAPES = ("loop", "finishing", "batch")
_STOPS = ("stop", "stop-drain")
_KILLS = ("worker-kill", "driver-kill")

# The vocabulary's features, in the order a draw considers them.
FEATURES: dict[str, Feature] = {
    f.name: f
    for f in (
        Feature("batch", excludes=("loop", "concurrent-checkpoints", "storage-fault", *_STOPS)),
        Feature("loop", excludes=("finishing", "event-time", "batch", "rescale", *_STOPS)),
        Feature("finishing", excludes=("loop",)),
        Feature("event-time", excludes=("loop",)),
        Feature("concurrent-checkpoints", excludes=("batch",)),
        Feature("failure", excludes=_KILLS, actions=_failures),
        Feature("rescale", excludes=("batch", "loop", *_KILLS), actions=_rescale),
        Feature("stop", excludes=("batch", "loop", "stop-drain", *_KILLS), actions=_stop),
        Feature(
            "stop-drain",
            excludes=("batch", "loop", "stop", *_KILLS),
            actions=lambda rng, s: (Action("stop-drain", 0.5),),
        ),
        Feature(
            "aborted-savepoint",
            requires_one_of=_STOPS,
            executors=("local",),
            actions=_aborted,
        ),
        Feature(
            "storage-fault",
            excludes=("batch", *_KILLS),
            executors=("local",),
            actions=_storage_fault,
        ),
        Feature(
            "worker-kill",
            # A worker is killed once a checkpoint completed: a batch job takes none.
            excludes=("batch", "failure", "rescale", "driver-kill", *_STOPS),
            executors=("spark",),
            actions=_worker_kill,
        ),
        Feature(
            "driver-kill",
            excludes=("failure", "rescale", "worker-kill", "storage-fault", *_STOPS),
            actions=_driver_kill,
        ),
        Feature(
            "network-fault",
            # Like a killed worker: the attempt it breaks fails over once, alone.
            excludes=("batch", "failure", "rescale", *_KILLS, *_STOPS),
            executors=("spark",),
            actions=_network_fault,
        ),
    )
}
# Every name a scenario's features and actions take.
VOCABULARY = tuple(FEATURES)
# Features drawn after the others, from a random stream of their own, so that adding
# one left every scenario drawn before it as it was (ids found earlier still replay);
# taken wherever they fit, since they exclude so much that a smaller share left
# them under ten in half an hour on Spark. The stream's first number is still drawn
# (it once decided the share), so the faults of ids found earlier replay unchanged.
_DRAWN_LATE = ("network-fault",)


def _compatible(features: tuple[str, ...], name: str, executor: str) -> bool:
    f = FEATURES[name]
    if executor not in f.executors:
        return False
    return not any(name in FEATURES[g].excludes or g in f.excludes for g in features)


def _valid(features: tuple[str, ...], executor: str) -> bool:
    """Whether every feature can run on ``executor``, none excludes another, and
    every requirement is met."""
    for i, name in enumerate(features):
        if not _compatible(features[:i] + features[i + 1 :], name, executor):
            return False
        needs = FEATURES[name].requires_one_of
        if needs and not any(n in features for n in needs):
            return False
    return True


def _topology(rng: random.Random, features: tuple[str, ...]) -> str:
    if "loop" in features:
        return "iteration"
    if "finishing" in features:
        return "finishing"
    pool: tuple[str, ...] = PLAIN_TOPOLOGIES
    if "event-time" in features:
        pool = tuple(t for t in EVENT_TIME_TOPOLOGIES if t != "finishing")
    if "batch" in features:
        pool = tuple(t for t in pool if t in BATCH_TOPOLOGIES)
    if "stop-drain" in features:
        pool = tuple(t for t in pool if t in DRAIN_TOPOLOGIES)
    if "rescale" in features:
        pool = tuple(t for t in pool if t in RESCALABLE)
    return rng.choice(pool)


def _settings(rng: random.Random, features: tuple[str, ...]) -> Settings:
    if "batch" in features:  # a batch run takes no checkpoints: its settings stay default
        return Settings(
            policy="aligned",
            interval_ms=100,
            parallelism=rng.randint(1, 3),
            records=rng.choice((8_000, 12_000, 16_000)),
        )
    concurrent = "concurrent-checkpoints" in features
    # Several checkpoints at once only go with aligned barriers (config/sections.py).
    policy = "aligned" if concurrent else rng.choice(POLICIES)
    return Settings(
        policy=policy,
        interval_ms=rng.choice((20, 50, 100)),
        max_concurrent_checkpoints=rng.randint(2, 4) if concurrent else 1,
        parallelism=rng.randint(1, 3),
        max_subtasks_per_channel_state_file=rng.choice((1, 2, 4)),
        records=rng.choice((8_000, 12_000, 16_000)),
    )


def draw(seed: int, index: int, executor: str = "local") -> Scenario:
    """Scenario ``index`` of a run seeded ``seed``: each feature is drawn with a
    share of one in three, in a random order, and kept when it goes with those kept
    before it; a feature that needs another (an aborted savepoint needs a stop)
    brings one in."""
    if executor not in EXECUTORS:
        raise ConfigError(f"unknown executor {executor!r}", hint=f"choose from {EXECUTORS}")
    rng = random.Random(f"spillover-chaos:{seed}:{index}:{executor}")
    names = [n for n in FEATURES if n not in _DRAWN_LATE]
    rng.shuffle(names)
    features: tuple[str, ...] = ()
    for name in names:
        if rng.random() >= 1 / 3 or not _compatible(features, name, executor):
            continue
        needs = FEATURES[name].requires_one_of
        if needs and not any(n in features for n in needs):
            options = [n for n in needs if _compatible((*features, name), n, executor)]
            if not options:
                continue
            features += (rng.choice(options),)
        features += (name,)
    features = tuple(n for n in FEATURES if n in features)  # the registry's order
    topology = _topology(rng, features)
    settings = _settings(rng, features)
    actions: tuple[Action, ...] = ()
    for name in features:
        actions += FEATURES[name].actions(rng, settings)
    for name in _DRAWN_LATE:
        late = random.Random(f"spillover-chaos:{seed}:{index}:{executor}:{name}")
        late.random()
        if not _compatible(features, name, executor):
            continue
        features = tuple(n for n in FEATURES if n in features or n == name)
        if name == "network-fault":  # between workers: at least two of them
            settings = replace(settings, parallelism=max(2, settings.parallelism))
        actions += FEATURES[name].actions(late, settings)
    actions = tuple(sorted(actions, key=lambda a: a.at))
    return Scenario(seed, index, topology, settings, features, actions, executor)


_ID = re.compile(r"^(\d+)-(\d+)(?:~(.+))?$")
_EDIT = re.compile(
    r"^(?:-(?P<feature>[a-z-]+)|x(?P<action>\d+)|p(?P<p>\d+)|r(?P<r>\d+)|t(?P<t>.+))$"
)


def parse_id(scenario_id: str) -> tuple[int, int, tuple[str, ...]]:
    """``(seed, index, edits)`` of a scenario id; a :class:`ConfigError` naming it
    when it is not one."""
    m = _ID.match(scenario_id.strip())
    bad = ConfigError(
        f"not a chaos scenario id: {scenario_id!r}",
        hint="ids look like 7-3, or 7-3~-rescale,x1,p1 once shrunk (as chaos prints them)",
    )
    if m is None:
        raise bad
    edits = tuple(m.group(3).split(",")) if m.group(3) else ()
    if not all(_EDIT.match(e) for e in edits):
        raise bad
    return int(m.group(1)), int(m.group(2)), edits


def _edited(s: Scenario, edit: str) -> Scenario:
    m = _EDIT.match(edit)
    assert m is not None
    if m.group("feature"):
        name = m.group("feature")
        if name not in s.features:
            raise ConfigError(f"scenario {s.id} has no feature {name!r} to remove")
        features = tuple(f for f in s.features if f != name)
        topology = s.topology
        settings = s.settings
        if name in ("loop", "finishing"):
            topology = "pipeline"
        if name == "concurrent-checkpoints":
            settings = replace(settings, max_concurrent_checkpoints=1)
        if name == "batch":
            settings = replace(settings, interval_ms=50)
        if name in _STOPS:
            features = tuple(f for f in features if f != "aborted-savepoint")
        actions = tuple(
            a
            for a in s.actions
            if a.name != name and (a.name != "aborted-savepoint" or "aborted-savepoint" in features)
        )
        return replace(s, topology=topology, settings=settings, features=features, actions=actions)
    if m.group("action"):
        k = int(m.group("action"))
        if not 0 <= k < len(s.actions):
            raise ConfigError(f"scenario {s.id} has no action {k} to remove")
        gone = s.actions[k]
        actions = s.actions[:k] + s.actions[k + 1 :]
        features = s.features
        if not any(a.name == gone.name for a in actions):  # its feature's last action
            features = tuple(f for f in features if f != gone.name)
        return replace(s, actions=actions, features=features)
    if m.group("p"):
        p = int(m.group("p"))
        rescaled = [a for a in s.actions if a.name == "rescale"]
        if p < 1 or any(a.detail.endswith(f"->{p}") for a in rescaled):
            raise ConfigError(f"scenario {s.id} cannot run at parallelism {p}")
        actions = tuple(
            replace(a, detail=f"{p}->{a.detail.split('->')[1]}") if a.name == "rescale" else a
            for a in s.actions
        )
        return replace(s, settings=replace(s.settings, parallelism=p), actions=actions)
    if m.group("r"):
        r = int(m.group("r"))
        if r < 1000:
            raise ConfigError(f"scenario {s.id} needs at least 1000 records per source")
        return replace(s, settings=replace(s.settings, records=r))
    topology = m.group("t")
    if topology not in PLAIN_TOPOLOGIES or s.has("loop") or s.has("finishing"):
        raise ConfigError(f"scenario {s.id} cannot take topology {topology!r}")
    return replace(s, topology=topology)


def scenario_for(scenario_id: str, executor: str = "local") -> Scenario:
    """The scenario ``scenario_id`` names: drawn again from its seed and index, then
    edited as its id says."""
    seed, index, edits = parse_id(scenario_id)
    s = draw(seed, index, executor)
    for edit in edits:
        s = _edited(s, edit)
    if not _valid(s.features, executor):
        raise ConfigError(f"scenario {scenario_id} combines features that do not go together")
    return replace(s, edits=edits)


def shrink_steps(s: Scenario) -> list[Scenario]:
    """The scenarios one edit smaller than ``s``, simplest first: a feature fewer, an
    action fewer, a lower parallelism, half the records, a simpler topology. Each is
    rebuilt from its id, so what shrinking finds replays."""
    edits: list[str] = [f"-{f}" for f in s.features]
    edits += [f"x{k}" for k, a in enumerate(s.actions) if len(s.actions_of(a.name)) > 1]
    edits += [f"p{p}" for p in range(1, s.settings.parallelism)]
    if s.settings.records // 2 >= MIN_SHRUNK_RECORDS:
        edits.append(f"r{s.settings.records // 2}")
    if s.topology in PLAIN_TOPOLOGIES and s.topology != "pipeline":
        edits.append("tpipeline")
    out = []
    for e in edits:
        try:
            out.append(scenario_for(f"{s.id}{',' if s.edits else '~'}{e}", s.executor))
        except ConfigError:
            continue
    return out
