#!/usr/bin/env bash
# Build the sdists and the wheels into dist/ (`make dist`), all carrying the Spark listener jar:
# the daemon's distribution (checkpoint-sidecar, ./pyproject.toml) and the Spark side's alone
# (checkpoint-sidecar-bridge, spark_bridge/pyproject.toml: Python 3.8+, no dependencies).
#   bash scripts/build_dist.sh                 # .venv/bin/python (build, twine: the test extra)
#   PYTHON=/path/to/python DIST_DIR=out bash scripts/build_dist.sh
# The jar is built first (scripts/build_jar.sh: javac against the installed pyspark's jars).
# Then `python -m build` makes the sdist from a clean copy of the tree -- the files git would
# commit (tracked and new, nothing ignored) plus the jar, so no stale egg-info, cache or venv
# leaks in -- and the wheel from that sdist, which proves the sdist alone is enough. The
# archives are checked (`twine check --strict`, the jar inside both) before they replace
# this version's previous ones in dist/. Other files in dist/ (the image's SBOM) are kept.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-.venv/bin/python}"
DIST_DIR="${DIST_DIR:-dist}"
JAR="spark_bridge/jars/checkpoint-sidecar-listener.jar"

LOG_TAG=dist
# shellcheck source=scripts/lib.sh
source scripts/lib.sh

"$PYTHON" -c 'import build, twine' 2>/dev/null \
    || die "$PYTHON has no 'build' or 'twine': run 'make setup' (they are in the test extra)"
PYTHON="$PYTHON" bash scripts/build_jar.sh

start=$SECONDS
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src" "$work/dist"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    # Files deleted in the work tree but still tracked are skipped (they are not there).
    git ls-files -z --cached --others --exclude-standard \
        | "$PYTHON" -c '
import os, shutil, sys
dest = sys.argv[1]
for path in sys.stdin.buffer.read().decode().split("\0"):
    if path and os.path.isfile(path):
        os.makedirs(os.path.join(dest, os.path.dirname(path)), exist_ok=True)
        shutil.copy2(path, os.path.join(dest, path))
' "$work/src"
    # The commit's time stamps the wheel's files (reproducible archives).
    SOURCE_DATE_EPOCH="$(git log -1 --format=%ct)"
    export SOURCE_DATE_EPOCH
else
    log "not a git checkout: building from a copy of the whole tree"
    tar --exclude='./.venv*' --exclude=./.tools --exclude=./dist --exclude=./build \
        --exclude='*.egg-info' --exclude=__pycache__ -cf - . | tar -xf - -C "$work/src"
fi
mkdir -p "$work/src/$(dirname "$JAR")"
cp -p "$JAR" "$work/src/$JAR"

# uv installs each isolated build's setuptools in a second where pip takes ten.
installer=pip
if "$PYTHON" -c 'import uv' 2>/dev/null; then installer=uv; fi
log "building the sdist, then the wheel from it (build isolation by $installer)"
"$PYTHON" -m build --installer "$installer" --outdir "$work/dist" "$work/src" > "$work/build.log" 2>&1 \
    || { tail -40 "$work/build.log" >&2; die "python -m build failed (its log ends above)"; }
"$PYTHON" -m twine check --strict "$work"/dist/*

# The Spark side's distribution, from its own directory (its sources are that directory).
log "building checkpoint-sidecar-bridge's sdist, then its wheel from it"
mkdir -p "$work/bridge"
"$PYTHON" -m build --installer "$installer" --outdir "$work/bridge" "$work/src/spark_bridge" \
    > "$work/build-bridge.log" 2>&1 \
    || { tail -40 "$work/build-bridge.log" >&2; die "python -m build failed for spark_bridge/ (its log ends above)"; }
"$PYTHON" -m twine check --strict "$work"/bridge/*

# Every archive carries the jar (the daemon's: its build hook, setup.py, refuses to make them
# without it; the bridge's: built after the jar, checked here).
"$PYTHON" - "$work/dist" "$work/bridge" "$JAR" <<'PY'
import pathlib, sys, tarfile, zipfile
jar = sys.argv[3]
for dist, in_sdist in ((sys.argv[1], jar), (sys.argv[2], jar.removeprefix("spark_bridge/"))):
    (wheel,), (sdist,) = pathlib.Path(dist).glob("*.whl"), pathlib.Path(dist).glob("*.tar.gz")
    assert jar in zipfile.ZipFile(wheel).namelist(), f"{wheel.name} lacks {jar}"
    with tarfile.open(sdist) as tar:
        assert any(n.endswith("/" + in_sdist) for n in tar.getnames()), f"{sdist.name} lacks {jar}"
PY
mv "$work"/bridge/* "$work/dist/"

mkdir -p "$DIST_DIR"
for built in "$work"/dist/*; do
    mv -f "$built" "$DIST_DIR/"
    log "$DIST_DIR/$(basename "$built") ($(du -k "$DIST_DIR/$(basename "$built")" | cut -f1) KiB)"
done
log "done in $((SECONDS - start)) s"
