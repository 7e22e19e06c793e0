# syntax=docker/dockerfile:1
# kvsidecar container image, in two variants told apart by the tag's suffix:
#
#   docker build -t kvsidecar:0.1.0-cpu .                                    # CPU torch (default)
#   docker build -t kvsidecar:0.1.0-cu128 --build-arg TORCH_VARIANT=cu128 .  # CUDA 12.8 torch
#
# TORCH_VARIANT is the name of torch's wheel index (cpu, cu126, cu128, ...) and the tag's suffix.
# GPU nodes need a -cu12x image: the CPU build cannot open CUDA IPC handles or pin the host pool,
# and a daemon with require_cuda = true refuses to start on it. The build fails if the installed
# torch does not match the variant asked for.
#
# CUDA: the CUDA wheels of torch bundle the CUDA runtime libraries, and the NVIDIA container
# runtime mounts the driver, so the slim Python base serves GPU nodes too. To build on a CUDA base
# image instead, pass PYTHON_IMAGE: both stages use it, because the virtual environment copied
# between them points at the base image's interpreter (it must be Python 3.11 at the same path).

ARG PYTHON_IMAGE=python:3.11-slim

# --- build: a virtual environment with torch and kvsidecar ---------------------------------------
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/kvsidecar
ENV PATH=/opt/kvsidecar/bin:$PATH
# Torch first and from its own index, in a layer of its own: it is most of the image and changes
# least often. A plain `pip install .` would pull the multi-GB CUDA build from PyPI.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
 && python -c 'import sys, torch; v, c = sys.argv[1], torch.version.cuda; \
sys.exit(None if (c is None) == (v == "cpu") else f"TORCH_VARIANT={v}, but torch has CUDA {c}")' \
    "${TORCH_VARIANT}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvsidecar ./kvsidecar
RUN pip install --no-cache-dir . && kvsidecar --help >/dev/null

# --- runtime --------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
ARG TORCH_VARIANT=cpu
LABEL org.opencontainers.image.title="kvsidecar" \
      io.kvsidecar.torch-variant="${TORCH_VARIANT}" \
      org.opencontainers.image.description="Per-node daemon that moves KV-cache blocks for LLM inference engines" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/kvsidecar/kvsidecar"

# A fixed uid: engines that talk to this daemon over ipc:// must run as the same uid (the daemon
# checks peer credentials), so deployments set both to 10001.
ARG KVSIDECAR_UID=10001
RUN groupadd --system --gid "${KVSIDECAR_UID}" kvsidecar \
 && useradd --system --uid "${KVSIDECAR_UID}" --gid kvsidecar --no-create-home \
      --home-dir /nonexistent --shell /usr/sbin/nologin kvsidecar \
 && install -d -o kvsidecar -g kvsidecar -m 0700 /run/kvsidecar

COPY --from=build /opt/kvsidecar /opt/kvsidecar

ENV PATH=/opt/kvsidecar/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    KVSIDECAR_RUNTIME_DIR=/run/kvsidecar \
    KVSIDECAR_METRICS_HOST=0.0.0.0 \
    KVSIDECAR_METRICS_PORT=9464 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# Numeric, so that Kubernetes' runAsNonRoot can verify it without looking up /etc/passwd.
USER ${KVSIDECAR_UID}:${KVSIDECAR_UID}
EXPOSE 9464

# /healthz answers 200 while the event loop is responsive; no curl in the image, Python will do.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('KVSIDECAR_METRICS_PORT', '9464'), timeout=4)"]

# SIGTERM starts a graceful drain; give `docker stop` a --time longer than drain_timeout_s.
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvsidecar", "serve"]
