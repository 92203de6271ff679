#!/usr/bin/env bash
# The flush simulation's deep pass, as `make test` runs it after the suites (scripts/test.sh):
# runs of CHUNK examples with seeds 1, 2, ... (each a different draw) until EXAMPLES examples
# ran, or until BUDGET_S seconds have passed: a time limit, checked between runs; or, once
# MIN_EXAMPLES ran, as soon as the file STOP_FILE exists (make test creates it when the tests
# beside this pass end: the deep pass adds at most one run to the suite's time). Exit code:
# the first failing run's.
#   scripts/deep_simulation.sh EXAMPLES CHUNK BUDGET_S [MIN_EXAMPLES STOP_FILE]
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_TAG=simulation
# shellcheck source=scripts/lib.sh
source scripts/lib.sh

examples=$1 chunk=$2 budget_s=$3 min_examples=${4:-$1} stop_file=${5:-}
ran=0 seed=0
while [ "$ran" -lt "$examples" ]; do
    if [ "$SECONDS" -ge "$budget_s" ]; then
        log "time limit (${budget_s} s) reached: $ran of $examples examples ran, all passed"
        exit 0
    fi
    if [ -n "$stop_file" ] && [ -e "$stop_file" ] && [ "$ran" -ge "$min_examples" ]; then
        log "the tests beside it ended: $ran of $examples examples ran (seeds 1-$seed, at" \
            "least $min_examples), all passed ($SECONDS s)"
        exit 0
    fi
    seed=$((seed + 1))
    SIMULATION_EXAMPLES=$chunk .venv/bin/python -m pytest -q -p no:cacheprovider --timeout 0 \
        --hypothesis-seed="$seed" "tests/unit/test_flush_simulation.py::TestFlushSimulation" \
        || { rc=$?; log "FAILED with --hypothesis-seed=$seed (SIMULATION_EXAMPLES=$chunk)"; exit $rc; }
    ran=$((ran + chunk))
    log "$ran of $examples examples passed (${SECONDS} s)"
done
log "$ran examples passed (seeds 1-$seed, $SECONDS s)"
