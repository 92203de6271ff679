# syntax=docker/dockerfile:1
#
# checkpoint-sidecar container image.
#
# Build (from the repository root): `make image` (scripts/build_image.sh: docker, or podman
# where no Docker daemon runs; a local Debian base when no registry is reachable). By hand,
# with BuildKit (the default builder since Docker 23) or podman/buildah:
#
#     docker build -t checkpoint-sidecar:0.1.0 .
#
# Try it locally (the daemon waits for Redis before it binds the socket):
#
#     docker run --rm -p 9400:9400 -e SIDECAR_REDIS_URL=redis://host.docker.internal:6379/0 \
#         -e SIDECAR_NAMESPACE=local-test checkpoint-sidecar:0.1.0
#     docker run --rm checkpoint-sidecar:0.1.0 run --help      # every SIDECAR_* setting
#
# Stopping: SIGTERM starts a graceful stop (stop accepting, answer the requests already read,
# close Redis) that takes up to SIDECAR_SHUTDOWN_GRACE_S (default 20 s) plus a few seconds to
# close Redis and the admin endpoint. The container runtime's stop timeout -- in Kubernetes the
# pod's terminationGracePeriodSeconds, shared with the Spark driver, which stops first when
# the sidecar is a native sidecar -- must therefore EXCEED SIDECAR_SHUTDOWN_GRACE_S, or the
# daemon is SIGKILLed mid-drain. (`docker stop` waits only 10 s by default: use `-t 30`.)
#
# Exit codes: 0 clean stop, 1 runtime failure, 2 bad configuration, 130 forced stop.
# See deploy/README.md and deploy/kubernetes/ for running it beside a Spark driver.

ARG PYTHON_IMAGE=python:3.11-slim

# ---- builder: the project's wheel, plus wheels of all its dependencies ------------------
FROM ${PYTHON_IMAGE} AS builder

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /src

# /wheels ends up with a wheel for every dependency (the daemon's, and uvloop: the image runs
# the daemon on it, SIDECAR_EVENT_LOOP=auto) and checkpoint_sidecar-<version>-py3-none-
# any.whl, so the final stage installs offline (--no-index) exactly what was resolved here.
# First the dependencies (and the build backend), read from pyproject.toml alone: this layer
# is rebuilt when they change, not at every source change. The optional secret `host-ca` is a
# CA bundle to trust for the download (networks that re-sign TLS): `--secret
# id=host-ca,src=<bundle>`, mounted read-only for this step only; scripts/build_image.sh
# passes the host's. pip's cache is a build cache mount: kept between builds, never in a layer.
COPY pyproject.toml ./
RUN --mount=type=cache,id=checkpoint-sidecar-pip,target=/root/.cache/pip \
    --mount=type=secret,id=host-ca \
    if [ -s /run/secrets/host-ca ]; then export PIP_CERT=/run/secrets/host-ca; fi \
 && python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb")); \
print(*p["build-system"]["requires"], *p["project"]["dependencies"], \
      *p["project"]["optional-dependencies"]["daemon"], \
      *p["project"]["optional-dependencies"]["uvloop"], sep="\n")' > /tmp/requirements.txt \
 && python -m pip wheel --wheel-dir /wheels --requirement /tmp/requirements.txt

# Then the project's own wheel, offline, from what it is built from (the readme is README.md).
COPY README.md ./
COPY sidecar/ sidecar/
COPY spark_bridge/ spark_bridge/
RUN python -m pip wheel --no-deps --no-index --find-links /wheels --wheel-dir /wheels .

# ---- final: a venv with the wheel installed, run as a non-root user ---------------------
FROM ${PYTHON_IMAGE}

LABEL org.opencontainers.image.title="checkpoint-sidecar" \
      org.opencontainers.image.description="Sidecar beside a Spark driver: buffers Structured Streaming offsets in Redis" \
      org.opencontainers.image.licenses="Apache-2.0"

# Fixed numeric ids, so Kubernetes `runAsNonRoot` can verify them and pod specs can name them.
RUN groupadd --system --gid 10001 sidecar \
 && useradd --system --no-log-init --uid 10001 --gid 10001 --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin sidecar \
 && mkdir -p /var/run/checkpoint-sidecar \
 && chown 10001:10001 /var/run/checkpoint-sidecar \
 && chmod 0750 /var/run/checkpoint-sidecar

# The venv has no pip of its own: the base image's pip installs into it (--python), and the
# wheels are bind-mounted from the builder, so neither they nor a pip cache land in a layer.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    python -m venv --without-pip /opt/venv \
 && python -m pip --python /opt/venv/bin/python install \
        --no-cache-dir --disable-pip-version-check --root-user-action=ignore \
        --no-index --find-links=/wheels \
        "checkpoint-sidecar[daemon,uvloop]" \
 && /opt/venv/bin/checkpoint-sidecar --version

# Only SIDECAR_* names that sidecar/config/settings.py knows may be set: the daemon refuses unknown
# SIDECAR_* variables at start (exit code 2).
ENV PATH="/opt/venv/bin:${PATH}" \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SIDECAR_SOCKET_PATH=/var/run/checkpoint-sidecar/sidecar.sock

USER 10001:10001

# /metrics, /healthz, /readyz (SIDECAR_METRICS_PORT). No HEALTHCHECK: Kubernetes probes
# /healthz (liveness) and /readyz (readiness) directly.
EXPOSE 9400

# The daemon handles SIGTERM/SIGINT itself (a second signal forces exit) and starts no child
# processes, so it runs as PID 1 without an init shim.
STOPSIGNAL SIGTERM
ENTRYPOINT ["checkpoint-sidecar"]
CMD ["run"]
