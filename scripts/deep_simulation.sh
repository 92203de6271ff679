#!/usr/bin/env bash
# The flush simulation's deep pass, as `make test` runs it after the suites (scripts/test.sh):
# runs of CHUNK examples with seeds 1, 2, ... (each a different draw) until EXAMPLES examples
# ran, or until BUDGET_S seconds have passed: a time limit, checked between runs. Exit code:
# the first failing run's.
#   scripts/deep_simulation.sh EXAMPLES CHUNK BUDGET_S
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_TAG=simulation
# shellcheck source=scripts/lib.sh
source scripts/lib.sh

examples=$1 chunk=$2 budget_s=$3
ran=0 seed=0
while [ "$ran" -lt "$examples" ]; do
    if [ "$SECONDS" -ge "$budget_s" ]; then
        log "time limit (${budget_s} s) reached: $ran of $examples examples ran, all passed"
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
