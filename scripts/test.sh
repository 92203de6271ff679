#!/usr/bin/env bash
# `make test` (and so .ci/run): the suite with PySpark 4 (.venv), then the Spark tests again
# with PySpark 3.5 (.venv-spark35). Beside them, at the lowest CPU priority (it takes the cores
# the suites leave idle), the flush simulation's deep pass (scripts/deep_simulation.sh):
# DEEP_EXAMPLES examples (default 1,500: what this round's defects needed) in runs of 150,
# stopped between runs once DEEP_GRACE_S (default 600) passed after the suites ended. Its
# failure fails the run.
# PYTEST_ARGS (a shell-quoted string) is passed to both suites; a subset has no deep pass and
# may hold no test for PySpark 3.5 (exit code 5 there is a failure only for the whole suite:
# the markers would be wrong).
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_TAG=test
# shellcheck source=scripts/lib.sh
source scripts/lib.sh

eval "set -- ${PYTEST_ARGS:-}"
DEEP_EXAMPLES=${DEEP_EXAMPLES:-1500}
DEEP_GRACE_S=${DEEP_GRACE_S:-600}
work=$(mktemp -d /tmp/cps-test.XXXXXX)
deep=""
finish() {
    if [ -n "$deep" ]; then kill -TERM -- "-$deep" 2>/dev/null; wait "$deep" 2>/dev/null; fi
    rm -rf "$work"
}
trap finish EXIT

if [ $# -eq 0 ] && [ "$DEEP_EXAMPLES" -gt 0 ]; then
    log "the flush simulation's deep pass ($DEEP_EXAMPLES examples) runs beside the suites:" \
        "$work/simulation.log"
    setsid nice -n 19 scripts/deep_simulation.sh "$DEEP_EXAMPLES" 150 "$work/stop_at" \
        >"$work/simulation.log" 2>&1 &
    deep=$!
fi

.venv/bin/python -m pytest "$@" || exit $?

.venv-spark35/bin/python -m pytest -m "spark and not spark4" "$@"
rc=$?
if [ $rc -eq 5 ] && [ $# -gt 0 ]; then
    log "PYTEST_ARGS selects no Spark test that runs on PySpark 3.5"
    rc=0
elif [ $rc -eq 5 ]; then
    log "no test ran on PySpark 3.5 (exit 5): check the spark/spark4 markers" >&2
fi
[ $rc -eq 0 ] || exit $rc

if [ -n "$deep" ]; then
    echo $(($(date +%s) + DEEP_GRACE_S)) >"$work/stop_at"
    log "waiting for the flush simulation's deep pass (at most ${DEEP_GRACE_S} s more)"
    wait "$deep"
    rc=$?
    deep=""
    tail -n 60 "$work/simulation.log"
    exit $rc
fi
