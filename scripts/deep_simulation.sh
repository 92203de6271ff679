#!/usr/bin/env bash
# The flush simulation's deep pass, as `make test` runs it beside the suites (scripts/test.sh):
# runs of CHUNK examples with seeds 1, 2, ... (each a different draw) until EXAMPLES examples
# ran, or until the time in the file STOP_AT (seconds since the epoch, written when the suites
# end) has passed: a time limit, checked between runs. Exit code: the first failing run's.
#   scripts/deep_simulation.sh EXAMPLES CHUNK STOP_AT
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_TAG=simulation
# shellcheck source=scripts/lib.sh
source scripts/lib.sh

examples=$1 chunk=$2 stop_at=$3
ran=0 seed=0 started=$SECONDS
while [ "$ran" -lt "$examples" ]; do
    if [ -s "$stop_at" ] && [ "$(date +%s)" -ge "$(cat "$stop_at")" ]; then
        log "time limit reached: $ran of $examples examples ran"
        exit 0
    fi
    seed=$((seed + 1))
    SIMULATION_EXAMPLES=$chunk .venv/bin/python -m pytest -q -p no:cacheprovider --timeout 0 \
        --hypothesis-seed="$seed" "tests/unit/test_flush_simulation.py::TestFlushSimulation" \
        || { rc=$?; log "FAILED with --hypothesis-seed=$seed (SIMULATION_EXAMPLES=$chunk)"; exit $rc; }
    ran=$((ran + chunk))
done
log "$ran examples passed (seeds 1-$seed, $((SECONDS - started)) s)"
