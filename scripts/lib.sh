# Shared by the set-up scripts (sourced, not run): log lines tagged with $LOG_TAG, a fatal
# error, and Debian package installs that say what to do where they cannot run.

# Each line says the seconds since its script began: where a fresh machine's set-up goes.
log() { printf '[%s +%ds] %s\n' "$LOG_TAG" "$SECONDS" "$*"; }
die() { printf '[%s] ERROR: %s\n' "$LOG_TAG" "$*" >&2; exit 1; }

APT_UPDATED=""
# apt_install [apt-get install options] PACKAGE...
apt_install() {
    # Install Debian packages when we can; otherwise say exactly what to do.
    if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
        die "missing: $*. Install it (Debian/Ubuntu: 'sudo apt-get install -y $*') and re-run."
    fi
    # Another apt (a parallel `make setup` or `make image`) is waited for, not failed on.
    if [ -z "$APT_UPDATED" ]; then
        log "apt-get update"
        apt-get update -qq -o DPkg::Lock::Timeout=300 >/dev/null
        APT_UPDATED=1
    fi
    log "apt-get install $*"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=300 "$@" >/dev/null
}

# podman_tools [podman-compose]: everything this project runs podman with, installed from
# apt when missing (without recommendations, so each one that is needed is named here):
# podman, buildah and runc; mmdebstrap (and uidmap) for the local Debian bases; netavark and
# aardvark-dns, scripts/containers.conf's network backend; iptables, which netavark calls to
# set up every network (Debian's netavark only recommends it: without it a container on a
# network is created but never starts, "netavark: No such file or directory"); catatonit, the
# infra container of `podman kube play`'s pods; and podman-compose when asked for.
podman_tools() {
    local missing=() tool
    for tool in podman buildah runc mmdebstrap iptables "$@"; do
        command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
    done
    for tool in netavark aardvark-dns catatonit; do
        [ -x "/usr/lib/podman/$tool" ] || [ -x "/usr/libexec/podman/$tool" ] \
            || command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
    done
    [ ${#missing[@]} -eq 0 ] || apt_install --no-install-recommends "${missing[@]}" uidmap
}

# podman_network_check PODMAN_COMMAND...: create a network and start a container on it with
# an image already present, and fail now, saying why, when that cannot be done (a missing
# firewall tool, a kernel without netfilter): otherwise compose creates its containers and
# they never start, and a test waits minutes for a checkpoint that cannot come.
podman_network_check() {
    local net="cps-netcheck-$$" image out
    image="$("$@" images --format '{{.Repository}}:{{.Tag}}' | grep -v '<none>' | head -1)"
    [ -n "$image" ] || return 0  # nothing to start yet: the first build comes first
    "$@" network rm -f "$net" >/dev/null 2>&1 || true
    if ! out="$("$@" network create "$net" 2>&1)" \
            || ! out="$("$@" run --rm --network "$net" --entrypoint true "$image" 2>&1)"; then
        "$@" network rm -f "$net" >/dev/null 2>&1 || true
        die "podman cannot start a container on a network (netavark): ${out##*$'\n'}. Check that iptables is installed ('apt-get install iptables') and that the kernel has netfilter."
    fi
    "$@" network rm -f "$net" >/dev/null 2>&1 || true
}
