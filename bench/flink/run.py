#!/usr/bin/env python3
"""Run the reference job of `spillover bench` on Apache Flink 2.3 (local MiniCluster).

Fetches Flink's JARs from PyPI (the `apache-flink-libraries` wheel, a zip)
into a cache outside the repository, compiles FlinkCheckpointBench.java
against them, runs one JVM per checkpoint policy and writes the results
(one object per policy) to --out.

    python bench/flink/run.py --duration 30 --warmup 10 --out flink-results.json
    python bench/flink/run.py --stops 3 --warmup 5 --policies unaligned --out flink-stop.json

With --stops N, each policy's job is stopped with a savepoint after the warm-up
instead of measured, N times (a new job each time, in one JVM); --duration is
then unused.

    python bench/flink/run.py --recovery 5 --warmup 5 --policies unaligned --out flink-rec.json
    python bench/flink/run.py --rescale 5 --warmup 5 --policies unaligned --out flink-rsc.json

With --recovery N, the keyed count fails once after the warm-up and the job
restarts from its latest checkpoint (fixed-delay, --restart-delay-ms), N times:
time to the first restored sink record, to 90 % of the steady sink rate, and
the restored checkpoint's in-flight bytes. With --rescale N, the job is stopped
with a savepoint at parallelism 2 and submitted again from it at
--to-parallelism on the same MiniCluster, N times: time from the stop request
to the first sink record at the new parallelism.

Needs: java and javac 11+ (17 tested), pip, and network access to PyPI the
first time (about 330 MB). See docs/benchmarks.md, "Flink 2.3 on the same
machine".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

FLINK_VERSION = "2.3.0"
PACKAGE = "apache-flink-libraries"
WHEEL = f"apache_flink_libraries-{FLINK_VERSION}-py2.py3-none-any.whl"
HERE = Path(__file__).resolve().parent
SOURCE = HERE / "FlinkCheckpointBench.java"
MAIN_CLASS = "FlinkCheckpointBench"
RESULT_PREFIX = "FLINK_BENCH_RESULT "
POLICIES = ("none", "aligned", "unaligned", "aligned-timeout", "debloat")
DEFAULT_POLICIES = "aligned,unaligned,aligned-timeout,debloat"

# What Flink's own config.yaml passes to every JVM on Java 17 (env.java.opts.all).
JAVA_OPENS = [
    "--add-exports=java.base/sun.net.util=ALL-UNNAMED",
    "--add-exports=java.rmi/sun.rmi.registry=ALL-UNNAMED",
    "--add-exports=java.security.jgss/sun.security.krb5=ALL-UNNAMED",
    "--add-opens=java.base/java.lang=ALL-UNNAMED",
    "--add-opens=java.base/java.net=ALL-UNNAMED",
    "--add-opens=java.base/java.io=ALL-UNNAMED",
    "--add-opens=java.base/java.nio=ALL-UNNAMED",
    "--add-opens=java.base/sun.nio.ch=ALL-UNNAMED",
    "--add-opens=java.base/java.lang.reflect=ALL-UNNAMED",
    "--add-opens=java.base/java.text=ALL-UNNAMED",
    "--add-opens=java.base/java.time=ALL-UNNAMED",
    "--add-opens=java.base/java.util=ALL-UNNAMED",
    "--add-opens=java.base/java.util.concurrent=ALL-UNNAMED",
    "--add-opens=java.base/java.util.concurrent.atomic=ALL-UNNAMED",
    "--add-opens=java.base/java.util.concurrent.locks=ALL-UNNAMED",
]

LOG4J2 = """\
rootLogger.level = WARN
rootLogger.appenderRef.file.ref = BenchFile
appender.file.name = BenchFile
appender.file.type = File
appender.file.append = false
appender.file.fileName = ${sys:flink.bench.log}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = %d{HH:mm:ss,SSS} %-5p %c{1} [%t] - %m%n
"""


class BenchError(Exception):
    """A clear, user-facing reason why the benchmark cannot run."""


def say(msg: str) -> None:
    print(f"[flink-bench] {msg}", file=sys.stderr, flush=True)


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "spillover" / "flink"


def check_java() -> tuple[str, str]:
    java, javac = shutil.which("java"), shutil.which("javac")
    if not java or not javac:
        raise BenchError(
            "java and javac (JDK 11 or later; 17 tested) must be on PATH: "
            f"java={java or 'missing'}, javac={javac or 'missing'}"
        )
    out = subprocess.run([java, "-version"], capture_output=True, text=True).stderr
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    major = int(m.group(1)) if m else 0
    if major == 1 and m and m.group(2):
        major = int(m.group(2))
    if major < 11:
        raise BenchError(
            f"Flink {FLINK_VERSION} needs Java 11 or later; `java -version` says: "
            f"{out.strip().splitlines()[0] if out.strip() else '?'}"
        )
    return java, javac


def fetch_wheel(cache: Path) -> Path:
    wheel_dir = cache / "wheel"
    wheel = wheel_dir / WHEEL
    if wheel.is_file() and zipfile.is_zipfile(wheel):
        return wheel
    wheel_dir.mkdir(parents=True, exist_ok=True)
    say(f"downloading {PACKAGE}=={FLINK_VERSION} from PyPI into {wheel_dir} (about 330 MB)")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        f"{PACKAGE}=={FLINK_VERSION}",
        "-d",
        str(wheel_dir),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        raise BenchError(
            f"`{' '.join(cmd)}` failed (exit {proc.returncode}); "
            f"is PyPI reachable and pip installed for {sys.executable}?\n{tail}"
        )
    if not (wheel.is_file() and zipfile.is_zipfile(wheel)):
        raise BenchError(f"pip reported success but {wheel} is missing or not a zip")
    return wheel


def extract_jars(wheel: Path, cache: Path) -> list[Path]:
    jar_dir = cache / f"jars-{FLINK_VERSION}"
    marker = jar_dir / ".complete"
    if not marker.is_file():
        say(f"extracting Flink's JARs into {jar_dir}")
        if jar_dir.exists():
            shutil.rmtree(jar_dir)
        jar_dir.mkdir(parents=True)
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                # pyflink/lib holds flink-dist (runtime, DataStream API, datagen
                # source, REST handlers) and log4j; pyflink/opt is not needed.
                if name.startswith("pyflink/lib/") and name.endswith(".jar"):
                    target = jar_dir / Path(name).name
                    with z.open(name) as src, open(target, "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 20)
        marker.write_text(WHEEL + "\n")
    jars = sorted(jar_dir.glob("*.jar"))
    names = [j.name for j in jars]
    for needed in (f"flink-dist-{FLINK_VERSION}.jar", "log4j-core-"):
        if not any(n.startswith(needed) for n in names):
            raise BenchError(f"{needed}* not found in {wheel} (pyflink/lib); found: {names}")
    # The table planner and the Scala API are not used by a DataStream job.
    return [j for j in jars if not j.name.startswith(("flink-table-planner", "flink-scala"))]


def compile_job(javac: str, jars: list[Path], cache: Path) -> Path:
    if not SOURCE.is_file():
        raise BenchError(f"{SOURCE} is missing")
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    classes = cache / f"classes-{FLINK_VERSION}-{digest}"
    if (classes / f"{MAIN_CLASS}.class").is_file():
        return classes
    say(f"compiling {SOURCE.name}")
    tmp = classes.with_name(classes.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cmd = [
        javac,
        "-nowarn",
        "-encoding",
        "UTF-8",
        "-d",
        str(tmp),
        "-cp",
        os.pathsep.join(map(str, jars)),
        str(SOURCE),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BenchError(f"javac failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    shutil.rmtree(classes, ignore_errors=True)
    tmp.rename(classes)
    return classes


def run_policy(
    java: str, classpath: str, policy: str, args: argparse.Namespace, cache: Path
) -> dict:
    logs = cache / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log4j = cache / "log4j2-bench.properties"
    log4j.write_text(LOG4J2)
    log_file = logs / f"{policy}.log"
    cmd = [
        java,
        f"-Xmx{args.heap}",
        f"-Xms{args.heap}",
        *JAVA_OPENS,
        f"-Dlog4j.configurationFile={log4j}",
        f"-Dflink.bench.log={log_file}",
        "-cp",
        classpath,
        MAIN_CLASS,
        "--policy",
        policy,
        "--duration",
        str(args.duration),
        "--warmup",
        str(args.warmup),
        "--sink-rate",
        str(args.sink_rate),
        "--parallelism",
        "2",
        "--segment-size",
        args.segment_size,
        "--interval-ms",
        str(args.interval_ms),
    ]
    if args.raw_dir:
        Path(args.raw_dir).mkdir(parents=True, exist_ok=True)
        cmd += ["--raw-out", str(Path(args.raw_dir) / f"{policy}.json")]
    if args.recovery:
        cmd += ["--recovery", str(args.recovery), "--after", str(args.after)]
        cmd += ["--restart-delay-ms", str(args.restart_delay_ms)]
        timeout = args.recovery * (args.warmup + args.after + 240)
        what = f"{args.recovery} induced failures, each after {args.warmup:g} s"
    elif args.rescale:
        cmd += ["--rescale", str(args.rescale), "--to-parallelism", str(args.to_parallelism)]
        timeout = args.rescale * (args.warmup + 240)
        what = f"{args.rescale} stop-and-restores at {args.to_parallelism}"
    elif args.stops:
        cmd += ["--stops", str(args.stops)]
        timeout = args.stops * (args.warmup + 240)
        what = f"{args.stops} stops with a savepoint, each after {args.warmup:g} s"
    else:
        timeout = args.warmup + args.duration + 240
        what = f"{args.warmup:g} s warm-up + {args.duration:g} s measured"
    say(f"policy {policy}: running ({what}; Flink log: {log_file})")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise BenchError(
            f"policy {policy}: the JVM did not finish within {timeout:g} s; see {log_file}"
        ) from e
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    tail = "\n".join(proc.stderr.strip().splitlines()[-25:])
    raise BenchError(f"policy {policy}: no result (exit {proc.returncode}); see {log_file}\n{tail}")


def machine() -> dict:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "system": platform.platform(),
        "python": platform.python_version(),
    }


def fmt(x, unit="", digits=0) -> str:
    if x is None:
        return "-"
    return f"{x:,.{digits}f}{unit}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--duration", type=float, default=30.0, help="measured seconds per policy (default 30)"
    )
    p.add_argument(
        "--warmup", type=float, default=10.0, help="warm-up seconds per policy (default 10)"
    )
    p.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        help=f"comma-separated, from {', '.join(POLICIES)} (default: all)",
    )
    p.add_argument(
        "--out", default="flink-results.json", help="results file (default flink-results.json)"
    )
    p.add_argument(
        "--sink-rate", type=float, default=5000.0, help="sink records/s per subtask (default 5000)"
    )
    p.add_argument(
        "--segment-size",
        default="32kb",
        help="taskmanager.memory.segment-size, e.g. 128kb (default 32kb, Flink's)",
    )
    p.add_argument(
        "--interval-ms",
        type=int,
        default=1000,
        help="execution.checkpointing.interval in ms (default 1000, as spillover bench)",
    )
    p.add_argument("--heap", default="1g", help="JVM heap, -Xmx/-Xms (default 1g)")
    p.add_argument(
        "--cache-dir",
        default=str(default_cache()),
        help="wheel, JARs, classes and logs (default ~/.cache/spillover/flink)",
    )
    p.add_argument("--raw-dir", default=None, help="also save the raw REST answers per policy here")
    p.add_argument(
        "--stops",
        type=int,
        default=0,
        help="stop-with-savepoint mode: stop the job after the warm-up, this many times "
        "per policy, and time each stop (default 0: measure checkpoints)",
    )
    p.add_argument(
        "--recovery",
        type=int,
        default=0,
        help="recovery mode: fail the keyed count once after the warm-up, this many "
        "times per policy, and time the restart (default 0)",
    )
    p.add_argument(
        "--after",
        type=float,
        default=8.0,
        help="recovery mode: seconds sampled after each failure (default 8)",
    )
    p.add_argument(
        "--restart-delay-ms",
        type=int,
        default=0,
        help="recovery mode: restart-strategy.fixed-delay.delay (default 0)",
    )
    p.add_argument(
        "--rescale",
        type=int,
        default=0,
        help="rescale mode: stop with a savepoint and restore at --to-parallelism, "
        "this many times per policy (default 0)",
    )
    p.add_argument(
        "--to-parallelism", type=int, default=3, help="rescale mode: the new parallelism"
    )
    args = p.parse_args(argv)

    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    bad = [x for x in policies if x not in POLICIES]
    if bad or not policies:
        p.error(f"unknown policies {bad}; choose from {', '.join(POLICIES)}")
    if args.duration <= 0 or args.warmup < 0:
        p.error("--duration must be > 0 and --warmup >= 0")
    if args.stops < 0 or args.recovery < 0 or args.rescale < 0:
        p.error("--stops, --recovery and --rescale must be >= 0")
    if sum(1 for x in (args.stops, args.recovery, args.rescale) if x) > 1:
        p.error("--stops, --recovery and --rescale exclude each other")
    if args.to_parallelism < 1 or args.after <= 0:
        p.error("--to-parallelism must be >= 1 and --after > 0")
    if args.interval_ms < 10:
        p.error("--interval-ms must be at least 10 (Flink's minimum checkpoint interval)")
    if not re.fullmatch(r"[0-9]+(b|kb|mb)", args.segment_size.strip().lower()):
        p.error(f"--segment-size {args.segment_size!r} is not a size like 32kb or 1mb")

    cache = Path(args.cache_dir).expanduser()
    out = Path(args.out)
    results: list[dict] = []
    errors: list[str] = []
    try:
        java, javac = check_java()
        wheel = fetch_wheel(cache)
        jars = extract_jars(wheel, cache)
        classes = compile_job(javac, jars, cache)
        classpath = os.pathsep.join([str(classes), *map(str, jars)])
        for policy in policies:
            try:
                results.append(run_policy(java, classpath, policy, args, cache))
            except BenchError as e:
                errors.append(str(e))
                say(str(e))
    except BenchError as e:
        say(f"cannot run Flink: {e}")
        return 2

    benchmark = (
        "flink-recovery"
        if args.recovery
        else "flink-rescale"
        if args.rescale
        else "flink-stop-with-savepoint"
        if args.stops
        else "flink-reference-job"
    )
    doc = {
        "benchmark": benchmark,
        "flink_version": FLINK_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        "job": {
            "parallelism": 2,
            "keys": 10_000,
            "payload_bytes": 100,
            "sink_rate_per_subtask": args.sink_rate,
            "checkpoint_interval_ms": args.interval_ms,
            "segment_size": args.segment_size,
            "warmup_s": args.warmup,
            "duration_s": None if args.stops else args.duration,
            "stops": args.stops,
            "recovery": args.recovery,
            "restart_delay_ms": args.restart_delay_ms if args.recovery else None,
            "rescale": args.rescale,
            "to_parallelism": args.to_parallelism if args.rescale else None,
        },
        "runs": results,
        "errors": errors,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")

    if args.recovery:
        print(
            f"{'policy':<12} {'rounds':>6} {'running ms':>11} {'first ms':>9} {'90% ms':>9} "
            f"{'replayed B':>11}"
        )
        for r in results:
            print(
                f"{r['policy']:<12} {len(r['rounds']):>6} {fmt(r['running_again_ms_median']):>11} "
                f"{fmt(r['first_record_ms_median']):>9} {fmt(r['ninety_percent_ms_median']):>9} "
                f"{fmt(r['replayed_bytes_median']):>11}"
            )
        say(f"wrote {out}")
        return 1 if errors else 0
    if args.rescale:
        print(
            f"{'policy':<12} {'rounds':>6} {'savepoint ms':>13} {'running ms':>11} {'first ms':>9}"
        )
        for r in results:
            print(
                f"{r['policy']:<12} {len(r['rounds']):>6} {fmt(r['savepoint_ms_median']):>13} "
                f"{fmt(r['running_ms_median']):>11} {fmt(r['first_record_ms_median']):>9}"
            )
        say(f"wrote {out}")
        return 1 if errors else 0
    if args.stops:
        head = f"{'complete ms median (min-max)':>30} {'returned ms':>24}"
        print(f"{'policy':<16} {'stops':>5} {head}")
        for r in results:
            print(
                f"{r['policy']:<16} {len(r['stops']):>5} "
                f"{fmt(r['complete_ms_median'], digits=0):>10} "
                f"({fmt(r['complete_ms_min'])}-{fmt(r['complete_ms_max'])}) "
                f"{fmt(r['returned_ms_median'], digits=0):>10} "
                f"({fmt(r['returned_ms_min'])}-{fmt(r['returned_ms_max'])})"
            )
        say(f"wrote {out}")
        return 1 if errors else 0
    print(
        f"{'policy':<16} {'ckpts':>5} {'median ms':>10} {'p90 ms':>9} {'max ms':>9} "
        f"{'in-flight B':>12} {'sink rec/s':>11}"
    )
    for r in results:
        median = fmt(r["checkpoint_ms_median"], digits=0)
        p90 = fmt(r["checkpoint_ms_p90"], digits=0)
        peak = fmt(r["checkpoint_ms_max"], digits=0)
        print(
            f"{r['policy']:<16} {r['checkpoints_completed']:>5} {median:>10} {p90:>9} "
            f"{peak:>9} {fmt(r['persisted_bytes_median']):>12} "
            f"{fmt(r['sink_records_per_s']):>11}"
        )
    say(f"wrote {out}")
    if errors:
        say(f"{len(errors)} of {len(policies)} policies failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
