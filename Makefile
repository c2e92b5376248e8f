# Set-up and the everyday commands. Everything installs into .venv (Python 3.11+).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NATIVE := $(wildcard csrc/*.c csrc/*.h src/spillover/_native/*.pyx src/spillover/_native/*.pxi src/spillover/_native/*.pxd src/spillover/_native/includes/*.pxd)

.PHONY: install bench demo test lint typecheck unit debug-test benchmarks side-by-side soak chaos clean profile browser

install: $(STAMP)

$(STAMP): pyproject.toml setup.py $(NATIVE)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

# Headless chromium and its driver for the dashboard's browser test, and strace for the
# test that traces a durable publish's system calls (Debian's packages; needs root, as
# CI has). A no-op where they are installed.
browser:
	(command -v chromium && command -v chromedriver && command -v strace) >/dev/null || \
		(apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium chromium-driver strace)

# The main job: checkpoints under backpressure, one run per policy (a few minutes);
# tables, CSV and plots go to results/. Flags and their SPILLOVER_BENCH_CLI_* twins:
# docs/benchmarks.md, e.g. `make bench BENCH_ARGS="--executor spark"`.
bench: $(STAMP)
	$(BIN)/spillover bench --out results $(BENCH_ARGS)

# Where the bench job's time goes, per stage (docs/benchmarks.md, "Where the time goes"):
# py-spy samples of the local executor, classified by bench/profile_stages.py. py-spy is
# installed into .venv on first use; it is not a dependency of the project.
PROFILE_OUT ?= results/profile
profile: $(STAMP)
	test -x $(BIN)/py-spy || $(BIN)/python -m pip install -q py-spy
	mkdir -p $(PROFILE_OUT)
	$(BIN)/py-spy record --native --idle -r 200 --format raw -o $(PROFILE_OUT)/profile.txt -- \
		$(BIN)/spillover bench --executor local --policies none --sink-rate 100000000 \
		--duration 10 --warmup 3 --repeat 1 --out $(PROFILE_OUT)
	$(BIN)/python bench/profile_stages.py $(PROFILE_OUT)/profile.txt $(PROFILE_OUT)/bench.json

# The engine alone: spill and restore a few hundred MB against the raw disk.
demo: $(STAMP)
	$(BIN)/spillover demo

# The whole test suite: lint, types, tests.
test: lint typecheck unit

# ruff, and the layers of docs/architecture.md as import-linter contracts (pyproject.toml).
lint: $(STAMP)
	$(BIN)/ruff check src tests bench tools fuzz
	$(BIN)/ruff format --check src tests bench tools fuzz
	$(BIN)/lint-imports --no-cache

typecheck: $(STAMP)
	$(BIN)/mypy

# The slowest cases (wide rescales) run last, as their own group.
unit: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow"
	$(BIN)/python -m pytest -q -p no:cacheprovider -m slow

# The unit and contract tests on a debug build (C asserts, bounds checks and Cython
# line tracing on, native handles counted): the run fails unless every handle was
# freed. The optimised build is put back afterwards.
debug-test: $(STAMP)
	SPILLOVER_DEBUG=1 $(BIN)/python setup.py -q build_ext --inplace --force --build-temp build/debug
	SPILLOVER_CHECK_LEAKS=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/contract tests/unit -m "not s3 and not slow"; \
	status=$$?; \
	$(BIN)/python setup.py -q build_ext --inplace --force --build-temp build/release; \
	exit $$status

# Performance figures for docs/benchmarks.md (minutes; not part of `make test`).
benchmarks: $(STAMP)
	$(BIN)/python -m pytest bench --benchmark-only -q

# Issue 34's figures beside Flink 2.3 (docs/benchmarks.md, "Issue 34, side by side"):
# alternating rounds of Flink, spillover on Spark and local, the bare network loop and the
# work floor, one table with the targets; raw results in results/side-by-side/ (tens of
# minutes at 5 rounds). SIDE_BY_SIDE_ARGS="--smoke" checks the harness in seconds.
SIDE_BY_SIDE_ARGS ?= --rounds 5
side-by-side: $(STAMP)
	$(BIN)/python bench/side_by_side.py --out results/side-by-side $(SIDE_BY_SIDE_ARGS)

# The soak (docs/runtime.md): SOAK_MINUTES per policy and executor of whole jobs with
# checkpoints every 20 ms and induced failures, every run checked exactly; not part
# of `make test` (CI's slow group runs a 60-second version).
SOAK_MINUTES ?= 10
soak: $(STAMP)
	$(BIN)/python -m spillover.verify.soak --minutes $(SOAK_MINUTES) --executor local --executor spark

# Chaos (docs/chaos.md): CHAOS_MINUTES per executor of whole-job scenarios drawn from
# CHAOS_SEED, every feature against every fault, each checked exactly; a failing one
# is shrunk and printed with its replay command. Reports: chaos-<executor>-<seed>.json.
CHAOS_MINUTES ?= 30
CHAOS_SEED ?= 1
chaos: $(STAMP)
	$(BIN)/spillover chaos --minutes $(CHAOS_MINUTES) --seed $(CHAOS_SEED) --executor local --json chaos-local-$(CHAOS_SEED).json; \
	local=$$?; \
	$(BIN)/spillover chaos --minutes $(CHAOS_MINUTES) --seed $(CHAOS_SEED) --executor spark --json chaos-spark-$(CHAOS_SEED).json \
	&& exit $$local

# Coverage-guided fuzzing (atheris) of the state-file readers, state handles, checkpoint
# metadata, the job event log and its lease: a million inputs over the six targets,
# two at a time, printing each one's count (tens of minutes; not part of `make test`).
# FUZZ_ARGS="--runs N" gives every target N; docs/fuzzing.md.
fuzz: $(STAMP)
	$(BIN)/python fuzz/run_all.py $(FUZZ_ARGS)

clean:
	rm -rf build $(VENV) src/spillover/_native/*.so src/spillover/_native/*.c
