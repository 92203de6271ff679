# The README's commands. Each target installs what it needs first (scripts/setup.sh).
PY := .venv/bin/python

.PHONY: setup jar test simulate soak snapshot-soak snapshot-v2-figure restore-kill run demo bench lint image quickstart-test dist lock docs clean

setup:
	@bash scripts/setup.sh

## The JVM listener jar (spark_bridge/jars/), from spark_bridge/jvm with javac; part of setup.
jar: setup

## Run the test suite against real redis-server and Azurite (started by the tests), with
## PySpark 4, on two pytest-xdist workers (TEST_WORKERS); then the Spark tests that are not
## PySpark-4-only again with PySpark 3.5, and beside them the flush simulation's deep pass
## (1,500 examples, at most 10 minutes): scripts/test.sh. Long runs: simulate, soak,
## snapshot-soak, restore-kill.
test: setup
	@bash scripts/test.sh

## The flush simulations far deeper than `make test` runs them: SIMULATION_EXAMPLES examples
## (default 5000; `make test` runs 150 of the daemon's, tests/unit/test_flush_simulation.py,
## and 300 of the core's, tests/unit/test_flush_core_simulation.py, which here also shows its
## search finding the defects put back that it can).
SIMULATION_EXAMPLES ?= 5000
simulate: setup
	SIMULATION_EXAMPLES=$(SIMULATION_EXAMPLES) $(PY) -m pytest -p no:cacheprovider --timeout 0 \
	    tests/unit/test_flush_simulation.py tests/unit/test_flush_core_simulation.py $(PYTEST_ARGS)

## The snapshot nemesis (tests/faults/snapshot_nemesis.py) longer than `make test` runs it (6
## rounds): rounds of seed SNAPSHOT_SOAK_SEED for SNAPSHOT_SOAK_S seconds (default 600, ~11 min
## in all), its report printed at the end (docs/snapshots.md#the-snapshot-nemesis).
SNAPSHOT_SOAK_S ?= 600
SNAPSHOT_SOAK_SEED ?= 20261164
snapshot-soak: setup
	SNAPSHOT_SOAK_S=$(SNAPSHOT_SOAK_S) SNAPSHOT_SOAK_SEED=$(SNAPSHOT_SOAK_SEED) $(PY) -m pytest \
	    -p no:cacheprovider -s tests/faults/test_snapshot_soak.py $(PYTEST_ARGS)

## A figure for format v2 with changelog checkpointing as users run it (minBatchesToRetain 10,
## a 400 ms trigger, 40 s): how soon the last batch's snapshot is listed
## (tests/integration/test_snapshot_v2_figure.py, ~1 min; docs/snapshots.md).
snapshot-v2-figure: setup
	SNAPSHOT_V2_FIGURE=1 $(PY) -m pytest -p no:cacheprovider -s \
	    tests/integration/test_snapshot_v2_figure.py $(PYTEST_ARGS)

## The flush nemesis soak (tests/faults/nemesis.py) longer than `make test` runs it (40 s):
## 30 minutes of seed 20261125 (SOAK_ARGS: --seconds S --seed N); bench/results/soak.json.
soak: setup
	$(PY) bench/soak.py $(SOAK_ARGS)

## restore --all killed -9 at 10 points of a 1 GiB restore, each followed by a run that must
## end with exactly the snapshot's files and the checkpoint at its batch, or a clear refusal
## (bench/restore_kill.py, ~10 min; docs/snapshots.md#a-restore-killed-at-any-point); results in
## bench/results/restore_kill.json. RESTORE_KILL_ARGS: e.g. --mib 256 --points 5.
restore-kill: setup
	$(PY) bench/restore_kill.py $(RESTORE_KILL_ARGS)

## Run the daemon with throw-away local redis-server and Azurite; it says when GET /readyz
## answers 200 (the launcher of tests/services.py). Ctrl-C / SIGTERM stops all.
run: setup
	$(PY) scripts/run_local.py

## A real Spark streaming query → daemon → Redis → Azurite blob, read back at the end.
demo: setup
	$(PY) scripts/demo.py

## Benchmarks; results go to bench/results/. bench/compare.py: the daemon against a direct
## leased-blob writer and Event Hubs' BlobCheckpointStore (BENCH_ARGS=--quick: ~3 min).
bench: setup
	$(PY) -m bench.compare $(BENCH_ARGS)
	$(PY) bench/ingest.py
	$(PY) bench/flush.py
	$(PY) bench/retire.py
	$(PY) bench/listener.py
	$(PY) bench/redis_topologies.py
	$(PY) bench/hotpath.py
	$(PY) bench/blob_acks.py --rounds 3 --out bench/results/blob_acks.json
	$(PY) bench/scale.py
	$(PY) bench/restart.py
	$(PY) bench/fleet.py
	$(PY) bench/footprint.py
	$(PY) bench/snapshots.py
	$(PY) bench/cut_listing.py
	$(PY) bench/cpu_placement.py

## The container image checkpoint-sidecar:<version>: docker when its daemon answers, else
## podman (installed from apt when missing); local Debian bases when no registry answers.
## It ships the JVM listener jar, compiled in the build itself (the Dockerfile's listener
## stage: no `make jar` needed), which pod templates copy to the driver; its dependencies
## come from requirements/image.txt (hashes checked). Beside it: its CycloneDX SBOM,
## dist/checkpoint-sidecar-<version>.cdx.json.
image:
	@bash scripts/build_image.sh

## The laptop quickstart (deploy/compose/compose.yaml: Redis, Azurite, the sidecar, a PySpark
## driver) end to end with podman-compose, local images standing in for the public ones: waits
## for the driver's query's checkpoint in the blob, shows it, removes the project
## (scripts/quickstart.sh; KEEP=1 leaves it running). tests/e2e/test_quickstart.py runs it.
quickstart-test: setup
	@bash scripts/quickstart.sh

## dist/: the sdist and the wheel, both with the listener jar, checked by `twine check`.
dist: jar
	@bash scripts/build_dist.sh

## requirements/image*.txt: the image's dependencies and build tools, pinned with hashes (uv
## pip compile, for CPython 3.11 on Linux); requirements/listener-build.txt: the PySpark whose
## jars the image's listener stage compiles against; requirements/release.txt: what the release
## workflow (.github/workflows/release.yml) builds the sdists and wheels with. Run it after
## changing pyproject.toml's `daemon` or `uvloop` dependencies, or the .in files; pins that
## still fit are kept.
## UPGRADE=1 moves all to the newest.
LOCK := .venv/bin/uv pip compile --quiet --generate-hashes --python-version 3.11 \
	--python-platform linux --custom-compile-command "make lock" $(if $(UPGRADE),--upgrade)
lock: setup
	$(LOCK) pyproject.toml --extra daemon --extra uvloop -o requirements/image.txt
	$(LOCK) requirements/image-build.in -o requirements/image-build.txt
	$(LOCK) --no-deps requirements/listener-build.in -o requirements/listener-build.txt
	$(LOCK) requirements/release.in -o requirements/release.txt

## The documentation site (MkDocs, mkdocs.yml) from docs/ and the two READMEs, into site/.
## Strict: a broken link or anchor fails it. `make test` builds it the same way
## (tests/unit/test_docs.py); `.venv/bin/mkdocs serve` serves it while you edit.
docs: setup
	$(PY) -m mkdocs build --strict

lint: setup
	.venv/bin/ruff check sidecar spark_bridge tests bench scripts deploy
	.venv/bin/ruff format --check sidecar spark_bridge tests bench scripts deploy
	.venv/bin/mypy
	.venv/bin/mypy deploy/grafana/dashboard.py
	.venv/bin/mypy deploy/kubernetes/monitoring/generate.py

clean:
	rm -rf .venv .venv-spark35 .tools .pytest_cache .mypy_cache .ruff_cache site
