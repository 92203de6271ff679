#!/usr/bin/env bash
# podman with this project's settings: scripts/containers.conf (runc, cgroupfs, ulimits the
# sandbox accepts) and image storage of its own (overlay driver), so nothing here touches, or
# depends on, the machine's default podman storage. The storage is a cache of the machine's
# user, shared by every clone (a fresh clone, CI's, reuses the layers built before: the base
# images, the JDK, PySpark's jars and wheels): $CHECKPOINT_SIDECAR_CACHE/containers, by default
# ~/.cache/checkpoint-sidecar/containers. Podman locks its storage: clones may use it at once.
#   bash scripts/podman.sh images
#   bash scripts/podman.sh run --rm checkpoint-sidecar:0.1.0 run --help
# scripts/build_image.sh (make image) and tests/integration/test_container.py go through this file.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd -P)"
cache="${CHECKPOINT_SIDECAR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/checkpoint-sidecar}"
state="$cache/containers"
mkdir -p "$state"
export CONTAINERS_CONF="$repo/scripts/containers.conf"
exec podman --root "$state/storage" --runroot "$state/run" --tmpdir "$state/tmp" \
    --storage-driver overlay "$@"
