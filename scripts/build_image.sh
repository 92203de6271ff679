#!/usr/bin/env bash
# Build the container image from the Dockerfile (`make image`; tests/integration/test_container.py too).
#   bash scripts/build_image.sh                       # checkpoint-sidecar:<version>
#   IMAGE=registry.example.com/checkpoint-sidecar:0.1.0 bash scripts/build_image.sh
#   ENGINE=podman bash scripts/build_image.sh         # docker | podman; default: docker when
#                                                     # its daemon answers, else podman
#   PYTHON_IMAGE=python:3.11-slim@sha256:<digest> bash scripts/build_image.sh
# podman runs through scripts/podman.sh (scripts/containers.conf, storage in .tools/containers);
# podman, buildah, runc and mmdebstrap are installed from apt when missing (root only).
# When PYTHON_IMAGE can be neither found locally nor pulled (no registry reachable), the base
# is a local Debian bookworm made with mmdebstrap and imported once as $LOCAL_BASE; it is
# kept and reused. The host's CA bundle is handed to the build as a BuildKit secret (a
# read-only mount during the pip download only; nothing of it lands in a layer), for
# networks that re-sign TLS. Layers and pip's cache are kept, so a rebuild with nothing
# changed takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

version="$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -1)"
IMAGE="${IMAGE:-checkpoint-sidecar:$version}"
PYTHON_IMAGE="${PYTHON_IMAGE:-python:3.11-slim}"
LOCAL_BASE="${LOCAL_BASE:-localhost/checkpoint-sidecar-base:bookworm}"
CA_BUNDLE="${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
DEBIAN_SECURITY_MIRROR="${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"

LOG_TAG=image
# shellcheck source=scripts/lib.sh
source scripts/lib.sh

# --- the engine -------------------------------------------------------------------------
if [ -z "${ENGINE:-}" ]; then
    if command -v docker >/dev/null 2>&1 && timeout 10 docker info >/dev/null 2>&1; then
        ENGINE=docker
    else
        ENGINE=podman
    fi
fi
case "$ENGINE" in
    docker)
        engine_cmd=(docker)
        export DOCKER_BUILDKIT=1  # RUN --mount needs BuildKit
        ;;
    podman)
        missing=()
        for tool in podman buildah runc mmdebstrap; do
            command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
        done
        # conmon and the containers-common files come with podman; uidmap is for mmdebstrap.
        [ ${#missing[@]} -eq 0 ] || apt_install --no-install-recommends "${missing[@]}" uidmap
        engine_cmd=(bash scripts/podman.sh)
        ;;
    *) die "ENGINE must be docker or podman, not '$ENGINE'" ;;
esac
engine() { "${engine_cmd[@]}" "$@"; }
log "engine: $ENGINE ($("$ENGINE" --version 2>/dev/null | head -1))"

# --- the base image -----------------------------------------------------------------------
# podman resolves a short name only through registries.conf, which may name no registry.
base="$PYTHON_IMAGE"
if [ "$ENGINE" = podman ] && [[ "${base%%/*}" != *[.:]* ]] && [ "${base%%/*}" != localhost ]; then
    case "$base" in */*) base="docker.io/$base" ;; *) base="docker.io/library/$base" ;; esac
fi

build_local_base() {
    command -v mmdebstrap >/dev/null 2>&1 || apt_install --no-install-recommends mmdebstrap uidmap
    local work
    work="$(mktemp -d)"
    # shellcheck disable=SC2064  # expand $work now
    trap "rm -rf '$work'" RETURN
    log "building $LOCAL_BASE with mmdebstrap (Debian bookworm minbase + python3; ~30 s)"
    # No documentation, manual pages or translations: nothing in the image reads them. The
    # merged-/usr hook makes the /bin -> usr/bin links itself, as debootstrap does, instead
    # of installing the usrmerge package, which would bring perl (~50 MB) into the image.
    mmdebstrap --quiet --variant=minbase \
        --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
        --include=python3,python3-venv,python3-pip,python-is-python3,ca-certificates \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        bookworm "$work/base.tar" \
        "deb $DEBIAN_MIRROR bookworm main" \
        "deb $DEBIAN_MIRROR bookworm-updates main" \
        "deb $DEBIAN_SECURITY_MIRROR bookworm-security main"
    engine import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["python3"]' \
        "$work/base.tar" "$LOCAL_BASE" >/dev/null
    log "built $LOCAL_BASE ($(du -h "$work/base.tar" | cut -f1) tar)"
}

if engine image inspect "$base" >/dev/null 2>&1; then
    log "base: $base (present)"
elif timeout 120 "${engine_cmd[@]}" pull -q "$base" >/dev/null 2>&1; then
    log "base: $base (pulled)"
else
    log "cannot pull $base (no registry reachable?): using the local Debian base $LOCAL_BASE instead"
    if engine image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
        log "base: $LOCAL_BASE (present, made earlier; remove it to rebuild)"
    else
        build_local_base
    fi
    base="$LOCAL_BASE"
fi

# --- the image ----------------------------------------------------------------------------
build_args=(--build-arg "PYTHON_IMAGE=$base" --tag "$IMAGE")
if [ -s "$CA_BUNDLE" ]; then
    build_args+=(--secret "id=host-ca,src=$CA_BUNDLE")
fi
if [ "$ENGINE" = podman ]; then
    # The build's RUN steps use the host's network (pip reaches the package index); the
    # base is local, never pulled again; --layers keeps every step for the next build.
    build_args+=(--network host --pull=never --layers)
fi
log "building $IMAGE from $base"
start=$SECONDS
engine build "${build_args[@]}" . >&2
size="$(engine image inspect --format '{{.Size}}' "$IMAGE")"
log "built $IMAGE in $((SECONDS - start)) s: $((size / 1000000)) MB"
