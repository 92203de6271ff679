# The README's commands. Each target installs what it needs first (scripts/setup.sh).
PY := .venv/bin/python

.PHONY: setup jar test run demo bench lint clean

setup:
	@bash scripts/setup.sh

## The JVM listener jar (spark_bridge/jars/), from spark_bridge/jvm with javac; part of setup.
jar: setup

## Run the test suite against real redis-server and Azurite (started by the tests).
test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

## Run the daemon with throw-away local redis-server and Azurite (Ctrl-C / SIGTERM stops all).
run: setup
	$(PY) scripts/run_local.py

## A real Spark streaming query → daemon → Redis → Azurite blob, read back at the end.
demo: setup
	$(PY) scripts/demo.py

## Benchmarks; results go to bench/results/.
bench: setup
	$(PY) bench/ingest.py
	$(PY) bench/flush.py
	$(PY) bench/listener.py

lint: setup
	.venv/bin/ruff check sidecar spark_bridge tests bench scripts
	.venv/bin/ruff format --check sidecar spark_bridge tests bench scripts
	.venv/bin/mypy

clean:
	rm -rf .venv .tools .pytest_cache .mypy_cache .ruff_cache
