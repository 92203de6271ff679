#!/usr/bin/env bash
# podman with this project's settings: scripts/containers.conf (runc, cgroupfs, ulimits the
# sandbox accepts) and image storage of its own under .tools/containers (overlay driver), so
# nothing here touches, or depends on, the machine's default podman storage.
#   bash scripts/podman.sh images
#   bash scripts/podman.sh run --rm checkpoint-sidecar:0.1.0 run --help
# scripts/build_image.sh (make image) and tests/integration/test_container.py go through this file.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd -P)"
state="$(readlink -f "$repo/.tools")/containers"
mkdir -p "$state"
export CONTAINERS_CONF="$repo/scripts/containers.conf"
exec podman --root "$state/storage" --runroot "$state/run" --tmpdir "$state/tmp" \
    --storage-driver overlay "$@"
