# syntax=docker/dockerfile:1
# The measurement sidecar: `sidecar proxy` by default (traffic :8080, admin/metrics :9464);
# the same image runs `sidecar sim`, `sidecar replay` and `sidecar demo`.
#   docker build -t vllm-sidecar:0.1.0 \
#       --build-arg REVISION="$(git rev-parse HEAD)" \
#       --build-arg CREATED="$(date -u +%Y-%m-%dT%H:%M:%SZ)" .
#   export SIDECAR_ADMIN_TOKEN="$(head -c 32 /dev/urandom | base64)"   # Prometheus sends it
#   docker run --rm -p 8080:8080 -p 9464:9464 -e SIDECAR_ADMIN_TOKEN \
#       -e SIDECAR_METRICS_LISTEN=0.0.0.0:9464 vllm-sidecar:0.1.0 \
#       proxy --listen 0.0.0.0:8080 --upstream http://vllm:8000
# Installed from pyproject.toml with the versions pinned in deploy/docker/constraints.txt.
#
# The base image by digest: a rebuild starts from the same bytes, whatever the tag points at
# since. The digest is of the tag's multi-platform index (amd64 and arm64 alike). To move to
# a newer base: docker buildx imagetools inspect python:3.11-slim-bookworm, then
#   --build-arg PYTHON_DIGEST=sha256:<the index digest it prints>
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG PYTHON_DIGEST=sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91

FROM ${PYTHON_IMAGE}@${PYTHON_DIGEST} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# A C compiler for the package's five small extensions (sidecar/protocol/_tokenscan.c, vLLM's
# common chunks recognised in C; sidecar/proxy/_recvstamp.c, an upstream read with its kernel
# stamp; sidecar/proxy/_recordwire.c, a record's wire form; sidecar/proxy/_headerblock.c, the
# header lines a request and a response keep; sidecar/_recordtypes.c, a timeline's packed
# column); the final stage gets the built
# wheel, never the compiler. Unpinned:
# Debian's archive keeps only the current build of a package, so a pin would break the build
# at the next point release; the base image's digest fixes the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY deploy/docker/constraints.txt /src/constraints.txt
COPY pyproject.toml setup.py README.md /src/
COPY sidecar /src/sidecar
# Wheels of the package and of every dependency (uvloop included), at the pinned versions.
RUN pip wheel --no-cache-dir --wheel-dir /wheels --constraint /src/constraints.txt /src

FROM ${PYTHON_IMAGE}@${PYTHON_DIGEST}
ARG PYTHON_IMAGE
ARG PYTHON_DIGEST
# Build metadata, for the OCI labels: the version of the package (pyproject.toml), the
# commit and the build time (set them on the command line, see the top).
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
LABEL org.opencontainers.image.title="vllm-sidecar" \
      org.opencontainers.image.description="A measurement sidecar for vLLM: client- and server-side TTFT, ITL, TPOT and E2E, goodput under SLOs, Prometheus and OpenTelemetry export, capture and replay." \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="docker.io/library/${PYTHON_IMAGE}" \
      org.opencontainers.image.base.digest="${PYTHON_DIGEST}"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --system --gid 10001 sidecar \
    && useradd --system --uid 10001 --gid sidecar --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin sidecar \
    && install -d -o 10001 -g 10001 -m 0750 /var/lib/sidecar/captures
# Offline from the wheels just built, mounted from the build stage for this one step: no
# layer of the image holds them (a COPY would keep them in its layer even after an rm).
# Fail the build if uvloop (the event loop the proxy runs on), the C extensions or the CLI do
# not import, or the request path is not compiled (both are optional for `pip install` on a
# host without a compiler, not for the image).
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels /wheels/vllm_sidecar-*.whl \
    && python -c "import uvloop, sidecar.cli, sidecar.protocol._tokenscan, sidecar.proxy._recvstamp, sidecar.proxy._recordwire, sidecar.proxy._headerblock, sidecar._recordtypes" \
    && python -c "from sidecar import _compiled; assert _compiled.request_path_text() == 'compiled (mypyc)', _compiled.request_path_text()"
# /var/lib/sidecar/captures belongs to this user: a named volume mounted there (compose)
# starts as a copy of it, writable for the sidecar.
USER 10001:10001
# 8080: traffic (the OpenAI-compatible API, relayed and measured).
# 9464: admin: /metrics (Prometheus), /stats, /replicas, /healthz, /readyz. Never the traffic
# port. By default it listens on the container's loopback only (see CMD).
EXPOSE 8080 9464
# The admin listener's /healthz. Set HEALTHCHECK_URL when the admin port is not 9464; for
# `sim` or `replay` containers, turn the check off (compose: healthcheck: disable: true).
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ.get('HEALTHCHECK_URL', 'http://127.0.0.1:9464/healthz'), timeout=2)"]
ENTRYPOINT ["sidecar"]
# The default command is safe wherever it runs, `--network host` included: traffic on
# 0.0.0.0:8080, the admin listener on the CLI's default 127.0.0.1:9464 (the HEALTHCHECK and
# `docker exec` reach it; a published -p 9464 does not), vLLM expected at 127.0.0.1:8000 (a
# shared network namespace: `--network container:<vllm>`, a pod). No --metrics-listen and no
# --allow-open-admin here, so the environment decides (flags would win over it):
#   scraped, with a token:  -e SIDECAR_METRICS_LISTEN=0.0.0.0:9464 -e SIDECAR_ADMIN_TOKEN
#     (the value from your shell, off the command line; Prometheus sends it as a bearer token)
#   open, on a network that restricts who reaches it:  ... -e SIDECAR_ALLOW_OPEN_ADMIN=1
# A non-loopback admin address without either makes the sidecar refuse to start (exit 2).
CMD ["proxy", "--listen", "0.0.0.0:8080", "--upstream", "http://127.0.0.1:8000"]
