# syntax=docker/dockerfile:1
# The measurement sidecar: `sidecar proxy` by default (traffic :8080, admin/metrics :9464);
# the same image runs `sidecar sim`, `sidecar replay` and `sidecar demo`.
#   docker build -t vllm-sidecar:0.1.0 .
#   docker run --rm -p 8080:8080 -p 9464:9464 vllm-sidecar:0.1.0 \
#       proxy --listen 0.0.0.0:8080 --metrics-listen 0.0.0.0:9464 --upstream http://vllm:8000
# Installed from pyproject.toml with the versions pinned in deploy/docker/constraints.txt.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY deploy/docker/constraints.txt /src/constraints.txt
COPY pyproject.toml README.md /src/
COPY sidecar /src/sidecar
# Wheels of the package and of every dependency (uvloop included), at the pinned versions.
RUN pip wheel --no-cache-dir --wheel-dir /wheels --constraint /src/constraints.txt /src

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --system --gid 10001 sidecar \
    && useradd --system --uid 10001 --gid sidecar --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin sidecar \
    && install -d -o 10001 -g 10001 -m 0750 /var/lib/sidecar/captures
COPY --from=build /wheels /wheels
# Offline from the wheels just built; fail the build if uvloop (the event loop the proxy
# runs on) or the CLI does not import.
RUN pip install --no-cache-dir --no-index --find-links /wheels /wheels/vllm_sidecar-*.whl \
    && rm -rf /wheels \
    && python -c "import uvloop, sidecar.cli"
# /var/lib/sidecar/captures belongs to this user: a named volume mounted there (compose)
# starts as a copy of it, writable for the sidecar.
USER 10001:10001
# 8080: traffic (the OpenAI-compatible API, relayed and measured).
# 9464: admin: /metrics (Prometheus), /stats, /replicas, /healthz. Never the traffic port.
EXPOSE 8080 9464
# The admin listener's /healthz. Set HEALTHCHECK_URL when the admin port is not 9464; for
# `sim` or `replay` containers, turn the check off (compose: healthcheck: disable: true).
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ.get('HEALTHCHECK_URL', 'http://127.0.0.1:9464/healthz'), timeout=2)"]
ENTRYPOINT ["sidecar"]
# --allow-open-admin: the admin port must be reachable from outside the container to be
# scraped; set SIDECAR_ADMIN_TOKEN instead where the network does not restrict who reaches it.
CMD ["proxy", "--listen", "0.0.0.0:8080", "--metrics-listen", "0.0.0.0:9464", \
     "--allow-open-admin", "--upstream", "http://127.0.0.1:8000"]
