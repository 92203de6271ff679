# Shared by the set-up scripts (sourced, not run): log lines tagged with $LOG_TAG, a fatal
# error, and Debian package installs that say what to do where they cannot run.

log() { printf '[%s] %s\n' "$LOG_TAG" "$*"; }
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
