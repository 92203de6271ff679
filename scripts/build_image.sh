#!/usr/bin/env bash
# Build the container image from the Dockerfile (`make image`; tests/integration/test_container.py too).
#   bash scripts/build_image.sh                       # checkpoint-sidecar:<version>
#   IMAGE=registry.example.com/checkpoint-sidecar:0.1.0 bash scripts/build_image.sh
#   ENGINE=podman bash scripts/build_image.sh         # docker | podman; default: docker when
#                                                     # its daemon answers, else podman
#   PYTHON_IMAGE=python:3.11-slim@sha256:<digest> bash scripts/build_image.sh
#   SBOM_FILE=out/sbom.json bash scripts/build_image.sh  # default dist/checkpoint-sidecar-<version>.cdx.json
#   CONTEXT=/tmp/checkout bash scripts/build_image.sh   # build another tree of this project
#       (e.g. a `git archive` of it: what a clean checkout builds) with this one's engine,
#       bases and layer cache; absolute, or relative to the repository root. Default: here.
# podman runs through scripts/podman.sh (scripts/containers.conf, storage in the user's cache);
# podman and what it runs with are installed from apt when missing (root only; podman_tools
# in scripts/lib.sh).
# When PYTHON_IMAGE can be neither found locally nor pulled (no registry reachable), the bases
# are local Debian bookworm ones made with mmdebstrap and imported once: $LOCAL_BASE for the
# builder stage, $LOCAL_RUNTIME_BASE (no apt, no pip: ~95 MB) for the final one; both are
# kept and reused. The labels org.opencontainers.image.version/revision/source come from
# pyproject.toml and git; the CycloneDX SBOM that the build writes from the image's venv is
# copied out to $SBOM_FILE. The host's CA bundle is handed to the build as a BuildKit secret
# (a read-only mount during the pip download only; nothing of it lands in a layer), for
# networks that re-sign TLS. Layers and pip's cache are kept, so a rebuild with nothing
# changed takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

version="$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -1)"
IMAGE="${IMAGE:-checkpoint-sidecar:$version}"
PYTHON_IMAGE="${PYTHON_IMAGE:-python:3.11-slim}"
# RUNTIME_IMAGE: the final stage's base; default PYTHON_IMAGE, or $LOCAL_RUNTIME_BASE.
LOCAL_BASE="${LOCAL_BASE:-localhost/checkpoint-sidecar-build:bookworm}"
LOCAL_RUNTIME_BASE="${LOCAL_RUNTIME_BASE:-localhost/checkpoint-sidecar-runtime:bookworm}"
SBOM_FILE="${SBOM_FILE:-dist/checkpoint-sidecar-$version.cdx.json}"
CONTEXT="${CONTEXT:-.}"
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
        podman_tools
        engine_cmd=(bash scripts/podman.sh)
        ;;
    *) die "ENGINE must be docker or podman, not '$ENGINE'" ;;
esac
engine() { "${engine_cmd[@]}" "$@"; }
log "engine: $ENGINE ($("$ENGINE" --version 2>/dev/null | head -1))"

# --- the base images ----------------------------------------------------------------------
# Debian bookworm root file systems made with mmdebstrap, imported once and kept (remove one
# to rebuild it). No documentation, manual pages or translations: nothing in an image reads
# them. The merged-/usr hook makes the /bin -> usr/bin links itself, as debootstrap does,
# instead of installing the usrmerge package, which would bring perl (~50 MB) in.
# make_local_base VARIANT IMAGE PACKAGES [mmdebstrap option...]
make_local_base() {
    local variant="$1" image="$2" packages="$3" work
    shift 3
    command -v mmdebstrap >/dev/null 2>&1 || apt_install --no-install-recommends mmdebstrap uidmap
    work="$(mktemp -d)"
    # shellcheck disable=SC2064  # expand $work now
    trap "rm -rf '$work'" RETURN
    log "building $image with mmdebstrap (Debian bookworm $variant + $packages; ~30 s)"
    mmdebstrap --quiet --variant="$variant" \
        --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
        --include="$packages" \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        "$@" \
        bookworm "$work/base.tar" \
        "deb $DEBIAN_MIRROR bookworm main" \
        "deb $DEBIAN_MIRROR bookworm-updates main" \
        "deb $DEBIAN_SECURITY_MIRROR bookworm-security main"
    engine import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["python3"]' \
        "$work/base.tar" "$image" >/dev/null
    log "built $image ($(du -h "$work/base.tar" | cut -f1) tar)"
}

local_base() {
    if engine image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
        log "build base: $LOCAL_BASE (present, made earlier)"
    else
        # The builder's: minbase (with apt) + Python with venv/ensurepip, and binutils (strip).
        make_local_base minbase "$LOCAL_BASE" python3,python3-venv,binutils,ca-certificates
    fi
}

local_runtime_base() {
    if engine image inspect "$LOCAL_RUNTIME_BASE" >/dev/null 2>&1; then
        log "runtime base: $LOCAL_RUNTIME_BASE (present, made earlier)"
    else
        # The final stage's: Debian's Essential packages (a shell and coreutils, which the pod
        # template's jar copier uses; dpkg) + Python, the CA certificates and libstdc++
        # (frozenlist's extension is C++; the Dockerfile loads every one). No apt, pip,
        # venv/ensurepip or binutils; no glibc iconv modules (gconv, 8 MB: Python has its own
        # codecs). The same bookworm python3 as the build base: the venv links to it.
        make_local_base essential "$LOCAL_RUNTIME_BASE" python3,ca-certificates,libstdc++6 \
            --dpkgopt='path-exclude=/usr/lib/*/gconv/*'
    fi
}

# podman resolves a short name only through registries.conf, which may name no registry.
qualify() {
    local name="$1"
    if [ "$ENGINE" = podman ] && [[ "${name%%/*}" != *[.:]* ]] && [ "${name%%/*}" != localhost ]; then
        case "$name" in */*) name="docker.io/$name" ;; *) name="docker.io/library/$name" ;; esac
    fi
    printf '%s\n' "$name"
}

base="$(qualify "$PYTHON_IMAGE")"
runtime="${RUNTIME_IMAGE:+$(qualify "$RUNTIME_IMAGE")}"
if engine image inspect "$base" >/dev/null 2>&1; then
    log "base: $base (present)"
elif timeout 120 "${engine_cmd[@]}" pull -q "$base" >/dev/null 2>&1; then
    log "base: $base (pulled)"
else
    log "cannot pull $base (no registry reachable?): using local Debian bases instead"
    local_base
    base="$LOCAL_BASE"
    if [ -z "$runtime" ]; then
        local_runtime_base
        runtime="$LOCAL_RUNTIME_BASE"
    fi
fi
runtime="${runtime:-$base}"

# --- the image ----------------------------------------------------------------------------
# Labels: the commit the image is built from (the work tree's uncommitted changes too, if
# any: said below) and the repository, when origin names a public URL (never a local path,
# never credentials).
revision="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
source_url() {
    local url
    url="$(git remote get-url origin 2>/dev/null)" || return 0
    case "$url" in
        http://* | https://*) url="$(printf '%s' "$url" | sed -E 's#^(https?://)[^/@]*@#\1#')" ;;
        [!/]*@*:*) url="https://$(printf '%s' "${url#*@}" | sed 's#:#/#')" ;;  # git@host:owner/repo
        *) return 0 ;;
    esac
    printf '%s\n' "${url%.git}"
}
SOURCE_URL="${SOURCE_URL-$(source_url)}"
[ -n "$SOURCE_URL" ] || log "no public URL for git remote 'origin': the source label is empty (set SOURCE_URL)"
if [ "$CONTEXT" = . ] && [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    log "the work tree has uncommitted changes: they are built in, the revision label says $revision"
fi

# The labels are also given as --label: podman's layer cache (buildah, podman 4.3) reuses the
# Dockerfile's LABEL step when only a build argument's value changed, so a commit that
# changes nothing in the context kept the previous commit's revision label.
build_args=(--tag "$IMAGE"
    --build-arg "PYTHON_IMAGE=$base" --build-arg "RUNTIME_IMAGE=$runtime"
    --build-arg "VERSION=$version" --build-arg "REVISION=$revision"
    --build-arg "SOURCE=$SOURCE_URL"
    --label "org.opencontainers.image.version=$version"
    --label "org.opencontainers.image.revision=$revision"
    --label "org.opencontainers.image.source=$SOURCE_URL")
if [ -s "$CA_BUNDLE" ]; then
    build_args+=(--secret "id=host-ca,src=$CA_BUNDLE")
fi
if [ "$ENGINE" = podman ]; then
    # The build's RUN steps use the host's network (pip reaches the package index); the
    # bases are local, never pulled again; --layers keeps every step for the next build.
    build_args+=(--network host --pull=never --layers)
fi
log "building $IMAGE from $base (final stage on $runtime)$([ "$CONTEXT" = . ] || echo ", context $CONTEXT")"
start=$SECONDS
[ -f "$CONTEXT/Dockerfile" ] || die "no Dockerfile in CONTEXT=$CONTEXT"
engine build "${build_args[@]}" --file "$CONTEXT/Dockerfile" "$CONTEXT" >&2
size="$(engine image inspect --format '{{.Size}}' "$IMAGE")"
log "built $IMAGE in $((SECONDS - start)) s: $((size / 1000000)) MB"

# --- the SBOM, beside the image ------------------------------------------------------------
# Written in the build from the image's own venv; copied out of a created (never started)
# container.
mkdir -p "$(dirname "$SBOM_FILE")"
cid="$(engine create "$IMAGE")"
if ! engine cp "$cid:/opt/venv/share/checkpoint-sidecar/sbom.cdx.json" "$SBOM_FILE.tmp"; then
    engine rm "$cid" >/dev/null
    die "cannot copy the SBOM out of $IMAGE"
fi
engine rm "$cid" >/dev/null
mv -f "$SBOM_FILE.tmp" "$SBOM_FILE"
log "SBOM: $SBOM_FILE (CycloneDX, $(grep -c '"bom-ref"' "$SBOM_FILE") entries)"
