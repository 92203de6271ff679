#!/usr/bin/env bash
# Build the JVM listener jar (spark_bridge/jars/checkpoint-sidecar-listener.jar) with the JDK's
# javac against the Spark jars inside the installed pyspark wheel. No Maven, no downloads.
#   bash scripts/build_jar.sh            # uses .venv/bin/python's pyspark
#   PYTHON=/path/to/python bash scripts/build_jar.sh
#   SPARK_JARS=/path/to/jars bash scripts/build_jar.sh   # Spark's jars, no pyspark import
#                                        # (the Dockerfile's listener stage)
# Bytecode for Java 8 (--release 8): the jar loads on every JVM Spark 3.4-4.x runs on. Rebuilt
# only when a source file is newer than the jar.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-.venv/bin/python}"
SRC="spark_bridge/jvm/src"
OUT="spark_bridge/jars/checkpoint-sidecar-listener.jar"
log() { printf '[build-jar] %s\n' "$*"; }

if [ -f "$OUT" ] && [ -z "$(find "$SRC" -name '*.java' -newer "$OUT" | head -1)" ]; then
    log "up to date: $OUT"
    exit 0
fi
command -v javac >/dev/null || { echo "[build-jar] ERROR: javac not found; install a JDK (Debian: openjdk-17-jdk-headless)" >&2; exit 1; }
jars="${SPARK_JARS:-$("$PYTHON" -c 'import os, pyspark; print(os.path.join(os.path.dirname(pyspark.__file__), "jars"))')}"
[ -d "$jars" ] || { echo "[build-jar] ERROR: no Spark jars at $jars; install pyspark first" >&2; exit 1; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# -options: JDK 17+ warns that release 8 is old (that is the point); -path: jars in the wheel
# name Class-Path entries that the wheel does not ship.
javac --release 8 -Xlint:all,-options,-path -Werror -encoding UTF-8 \
    -cp "$jars/*" -d "$work/classes" $(find "$SRC" -name '*.java' | sort)
mkdir -p "$(dirname "$OUT")"
version="$("$PYTHON" -c 'import tomllib; print(tomllib.load(open("pyproject.toml","rb"))["project"]["version"])')"
printf 'Implementation-Title: checkpoint-sidecar listener\nImplementation-Version: %s\n' "$version" > "$work/manifest"
jar --create --file "$OUT.tmp" --manifest "$work/manifest" -C "$work/classes" .
mv "$OUT.tmp" "$OUT"
log "built $OUT ($(wc -c < "$OUT") bytes, Java 8 bytecode, against $(basename "$(ls "$jars"/spark-core_*.jar)")"
