# syntax=docker/dockerfile:1
#
# checkpoint-sidecar container image.
#
# Build (from the repository root): `make image` (scripts/build_image.sh: docker, or podman
# where no Docker daemon runs; local Debian bases when no registry is reachable; it also sets
# the version/revision/source labels and writes the SBOM beside the image). By hand, with
# BuildKit (the default builder since Docker 23) or podman/buildah, from a clean checkout
# (nothing to build first: the listener stage compiles the Spark listener jar):
#
#     docker build -t checkpoint-sidecar:0.1.0 .
#
# What is installed is pinned with hashes: requirements/image.txt (the daemon's dependencies),
# requirements/image-build.txt (pip, setuptools, cyclonedx-bom) and
# requirements/listener-build.txt (the PySpark whose Spark jars the listener is compiled
# against), all made by `make lock`; an unchanged tree rebuilds to the same versions. The
# final stage gets only the finished venv, and the driver side's wheel and listener jar in
# /opt/checkpoint-sidecar/bridge/ (for Spark images to install or copy): no pip, setuptools,
# wheel, JDK, compiler or binutils.
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
# The final stage's base: the same Python without the means to install anything. Official
# python images carry pip, which the final stage removes (its bytes stay in the base's layer);
# scripts/build_image.sh's local runtime base has none to remove. Must have the builder's
# Python at the same path (the venv links to it).
ARG RUNTIME_IMAGE=${PYTHON_IMAGE}

# ---- listener: the Spark listener jar, compiled with javac against Spark's jars --------
FROM ${PYTHON_IMAGE} AS listener

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /src

# A JDK for javac and jar (Debian's, from the base's apt; its own layer, kept). Slim bases
# leave out /usr/share/man, where the JDK's postinst links its manual pages: made first.
RUN mkdir -p /usr/share/man/man1 \
 && apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends openjdk-17-jdk-headless >/dev/null \
 && rm -rf /var/lib/apt/lists/* \
 && javac -version

# Spark's jars from PySpark's source distribution, pinned with its hash in the lock; nothing
# installed, only deps/jars/ unpacked. The pinned pip and setuptools (image-build.txt) fetch
# it, the download in pip's cache mount (kept between builds, never in a layer), the CA
# secret as in the builder below. This layer is rebuilt only when a lock changes.
COPY requirements/image-build.txt requirements/listener-build.txt requirements/
RUN --mount=type=cache,id=checkpoint-sidecar-pip,target=/root/.cache/pip \
    --mount=type=secret,id=host-ca \
    if [ -s /run/secrets/host-ca ]; then export PIP_CERT=/run/secrets/host-ca; fi \
 && python3 -m venv /opt/build \
 && /opt/build/bin/python -m pip install -q --require-hashes --only-binary :all: --no-deps \
        -r requirements/image-build.txt \
 && /opt/build/bin/python -m pip download -q --require-hashes --no-deps --no-binary :all: \
        --no-build-isolation --dest /tmp/sdist -r requirements/listener-build.txt \
 && mkdir -p /opt/spark-jars \
 && tar -xzf /tmp/sdist/pyspark-*.tar.gz -C /opt/spark-jars --strip-components=3 \
        --wildcards '*/deps/jars/*.jar' \
 && rm -rf /tmp/sdist /opt/build \
 && ls /opt/spark-jars/spark-sql_*.jar

# The jar, by the same script as `make jar` (Java 8 bytecode, -Werror).
COPY pyproject.toml ./
COPY scripts/build_jar.sh scripts/
COPY spark_bridge/jvm/ spark_bridge/jvm/
RUN SPARK_JARS=/opt/spark-jars PYTHON=python3 bash scripts/build_jar.sh

# ---- builder: /opt/venv, finished (stripped, compiled, its SBOM written) ---------------
FROM ${PYTHON_IMAGE} AS builder

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /src

# strip(1), for the extension modules below: in the local build base already; python:*-slim
# has no binutils.
RUN command -v strip >/dev/null || { apt-get update -qq \
    && apt-get install -y -qq --no-install-recommends binutils >/dev/null \
    && rm -rf /var/lib/apt/lists/*; }

# The build tools (/opt/build) and the daemon's dependencies (/opt/venv), from the hashed
# locks alone: this layer is rebuilt when a lock changes, not at every source change. Wheels
# only (nothing compiled here), --no-deps (the lock is complete; pip refuses any file whose
# hash it does not list). /opt/venv has no pip: /opt/build's pip installs into it (--python).
# The optional secret `host-ca` is a CA bundle to trust for the download (networks that
# re-sign TLS): `--secret id=host-ca,src=<bundle>`, mounted read-only for this step only;
# scripts/build_image.sh passes the host's. pip's cache is a build cache mount: kept between
# builds, never in a layer.
COPY requirements/image.txt requirements/image-build.txt requirements/
RUN --mount=type=cache,id=checkpoint-sidecar-pip,target=/root/.cache/pip \
    --mount=type=secret,id=host-ca \
    if [ -s /run/secrets/host-ca ]; then export PIP_CERT=/run/secrets/host-ca; fi \
 && python3 -m venv /opt/build \
 && /opt/build/bin/python -m pip install -q --require-hashes --only-binary :all: --no-deps \
        -r requirements/image-build.txt \
 && python3 -m venv --without-pip /opt/venv \
 && /opt/build/bin/python -m pip --python /opt/venv/bin/python install -q --no-compile \
        --require-hashes --only-binary :all: --no-deps -r requirements/image.txt

# Then the project's wheel, offline, with the pinned setuptools (the build hook, setup.py,
# refuses to build without the listener jar: the listener stage's), and installed with its
# extras' dependencies resolved against what is already there: one missing from the lock
# fails the build here instead of the daemon at start.
COPY pyproject.toml setup.py README.md LICENSE ./
COPY sidecar/ sidecar/
COPY spark_bridge/ spark_bridge/
COPY --from=listener /src/spark_bridge/jars/ spark_bridge/jars/
RUN /opt/build/bin/python -m pip wheel -q --no-deps --no-build-isolation \
        --check-build-dependencies --wheel-dir /tmp/wheels . \
 && { /opt/build/bin/python -m pip --python /opt/venv/bin/python install -q --no-compile \
        --no-index --find-links /tmp/wheels "checkpoint-sidecar[daemon,uvloop]" \
      || { echo "requirements/image.txt does not satisfy pyproject.toml: run 'make lock'" >&2; \
           exit 1; }; } \
 && rm -rf /tmp/wheels

# The driver side, for Spark images that install it rather than copy the jar out: the
# checkpoint-sidecar-bridge wheel (Python 3.8+, no dependencies), built from spark_bridge/ as
# `make dist` builds it, with the listener stage's jar inside, and that jar beside it. The
# final stage keeps both in /opt/checkpoint-sidecar/bridge/ (docs/spark-bridge.md, "Installing
# the Spark side").
RUN /opt/build/bin/python -m pip wheel -q --no-deps --no-build-isolation \
        --check-build-dependencies --wheel-dir /opt/checkpoint-sidecar/bridge ./spark_bridge \
 && cp spark_bridge/jars/checkpoint-sidecar-listener.jar /opt/checkpoint-sidecar/bridge/

# Finish the venv: wheels' extension modules carry their debug information (uvloop's alone is
# 13 MB of it), which nothing here reads; files with an RPATH (auditwheel-patched, whose
# vendored .libs strip may break) are left alone. Bytecode compiled once, checked by hash of
# the source rather than its mtime (unchecked: the image is immutable, and its root file
# system read-only in the pod). The SBOM (CycloneDX JSON) is read from the finished venv
# itself (every distribution in it, with its version and licence); `make image` copies it
# out beside the image.
RUN find /opt/venv -type f -name '*.so*' ! -path '*.libs/*' -exec sh -c 'for f; do \
        readelf -d "$f" | grep -qE "\((RPATH|RUNPATH)\)" || strip --strip-unneeded "$f"; \
    done' sh {} + \
 && /opt/venv/bin/python -m compileall -q -j 0 --invalidation-mode unchecked-hash /opt/venv/lib \
 && mkdir -p /opt/venv/share/checkpoint-sidecar \
 && /opt/build/bin/cyclonedx-py environment --pyproject pyproject.toml --output-reproducible \
        --output-format JSON --output-file /opt/venv/share/checkpoint-sidecar/sbom.cdx.json \
        /opt/venv/bin/python

# ---- final: the venv on a Python without pip, run as a non-root user -------------------
FROM ${RUNTIME_IMAGE}

# Fixed numeric ids, so Kubernetes `runAsNonRoot` can verify them and pod specs can name them
# (written directly: the local runtime base has no useradd). pip, setuptools and wheel go
# where the base has them (official python images).
# Any other uid works as well when its primary group is 0 (OpenShift's restricted SCCs run an
# arbitrary uid, with no /etc/passwd entry, in group 0): the one directory the daemon writes,
# the socket's, belongs to group 0 with the owner's rights (OpenShift's image guidelines), and
# nothing else is written at run time -- no HOME, no /tmp, no bytecode -- so the root file
# system stays read-only. In a pod the socket directory is an emptyDir anyway; this one serves
# a plain `docker run` and a new named volume, which takes the directory's owner and mode.
RUN if python3 -m pip --version >/dev/null 2>&1; then \
        python3 -m pip uninstall -q -y --root-user-action=ignore pip setuptools wheel; \
    fi \
 && echo 'sidecar:x:10001:' >> /etc/group \
 && echo 'sidecar:x:10001:10001::/nonexistent:/usr/sbin/nologin' >> /etc/passwd \
 && mkdir -p /var/run/checkpoint-sidecar \
 && chown 10001:0 /var/run/checkpoint-sidecar \
 && chmod 0770 /var/run/checkpoint-sidecar

COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /opt/checkpoint-sidecar/bridge/ /opt/checkpoint-sidecar/bridge/

# Only SIDECAR_* names that sidecar/config/settings.py knows may be set: the daemon refuses unknown
# SIDECAR_* variables at start (exit code 2).
ENV PATH="/opt/venv/bin:${PATH}" \
    LANG=C.UTF-8 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SIDECAR_SOCKET_PATH=/var/run/checkpoint-sidecar/sidecar.sock

# It runs here: every extension module loads (stripped, against this base's libraries),
# nothing can install packages, and the driver side is where the docs say.
RUN checkpoint-sidecar --version \
 && test -s /opt/checkpoint-sidecar/bridge/checkpoint-sidecar-listener.jar \
 && ls /opt/checkpoint-sidecar/bridge/checkpoint_sidecar_bridge-*-py3-none-any.whl >/dev/null \
 && python -c 'import importlib, pathlib, sysconfig; \
site = pathlib.Path(sysconfig.get_path("purelib")); \
[importlib.import_module(".".join(p.relative_to(site).parent.parts + (p.name.split(".")[0],))) \
 for p in site.rglob("*.so")]' \
 && ! python -m pip --version 2>/dev/null

USER 10001:10001

# /metrics, /healthz, /readyz (SIDECAR_METRICS_PORT). No HEALTHCHECK: Kubernetes probes
# /healthz (liveness) and /readyz (readiness) directly.
EXPOSE 9400

# The daemon handles SIGTERM/SIGINT itself (a second signal forces exit) and starts no child
# processes, so it runs as PID 1 without an init shim.
STOPSIGNAL SIGTERM
ENTRYPOINT ["checkpoint-sidecar"]
CMD ["run"]

# Last, so that a new commit changes only the image's configuration, no layer. Set by
# scripts/build_image.sh: the version from pyproject.toml, the git commit, the repository.
ARG VERSION=""
ARG REVISION=""
ARG SOURCE=""
LABEL org.opencontainers.image.title="checkpoint-sidecar" \
      org.opencontainers.image.description="Sidecar beside a Spark driver: buffers Structured Streaming offsets in Redis and checkpoints them to Azure Blob Storage" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}"
