# `make serve` and `make test` each build .venv from nothing when it is missing
# or out of date; everything they need is installed here.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
COMPAT_VENV ?= .venv-compat
PORT ?= 8000
HOST ?= 127.0.0.1
SCRATCH ?= $(or $(TMPDIR),/tmp)/qarray-serve

.PHONY: test-kernels test-kernels-arm test-kernels-avx512-emulated test-kernels-amx-emulated
.PHONY: setup test test-fast test-accelerator image test-image image-tpu test-image-tpu lint serve bench bench-peers soak test-compat clean docs browser gpu-check

setup: $(STAMP)

$(STAMP): pyproject.toml tesseract_requirements.txt scripts/install.sh \
		scripts/build_kernels.sh $(wildcard qarray/_cpu/*.cc qarray/_cpu/*.h)
	@test -x $(PY) || { python=$$(scripts/find_python.sh) && "$$python" -m venv $(VENV); }
	scripts/install.sh $(PY) dev --cpu
	@touch $@

# every test (with qarray's CPU kernels where they run), the tests marked
# `formulations` (those that reach a product formulation) again on XLA's
# formulations alone where the kernels ran (elsewhere the first run was XLA's
# already), and the documentation site built with --strict (a broken link, a
# missing page or a docstring mkdocstrings cannot render fails)
# (pytest on TEST_WORKERS processes, a test file each at a time: XLA compiles
# on one core, so two files at once use both; TEST_WORKERS=0 runs in-process)
TEST_WORKERS ?= 2
test: setup browser test-kernels
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -q --site-dir $(SCRATCH)-site
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile
	@if $(PY) -c "import sys, qarray._ffi as f; sys.exit(not f.available())"; then \
		echo "QARRAY_KERNELS=xla $(PY) -m pytest -m formulations ..."; \
		QARRAY_KERNELS=xla $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile \
			-m formulations tests/qarray tests/test_recipes.py; \
	else \
		echo "no XLA rerun: qarray's CPU kernels do not run here, the run above was XLA's"; \
		$(PY) -c "import qarray._ffi as f; print('  qarray._ffi.status():', f.status())"; \
	fi

# qarray's C++ kernels against a plain C++ reference (qarray/_cpu/tests/),
# without XLA: once for each instruction set this CPU has, then the aarch64
# tiles under qemu where the cross tools are (or install: root on Debian)
test-kernels:
	scripts/test_kernels.sh all
test-kernels-arm:
	scripts/test_kernels.sh arm
# the AVX-512 tiles through SIMDe over AVX2 (native runs it on CPUs without AVX-512)
test-kernels-avx512-emulated:
	scripts/test_kernels.sh avx512-emulated
# the AMX tiles over a scalar emulation of AMX (native runs it on CPUs without AMX)
test-kernels-amx-emulated:
	scripts/test_kernels.sh amx-emulated

# the inner loop (about a minute on 2 cores): the numerics, the batcher and
# the resident Tesseract in-process, settings, the upstream workarounds and
# the package boundaries;
# `make test` before a commit
FAST_TESTS := tests/qarray/test_numerics.py tests/tesseract/test_settings.py \
	tests/tesseract/test_workarounds.py tests/tesseract/test_inprocess.py \
	tests/tesseract/test_batching.py tests/test_boundaries.py
test-fast: setup
	$(PY) -m pytest -q -x $(FAST_TESTS)

# the accelerator suite (tests/qarray, the JAX recipes, the in-process
# Tesseract tests) on this machine's TPU (ACCELERATOR=gpu: its GPU), one
# process; needs a jax that sees the device in $(PY) (docs/accelerators.md)
ACCELERATOR ?= tpu
test-accelerator:
	scripts/test_accelerator.sh $(PY) $(ACCELERATOR)

# headless Chromium for the /docs page test (installed when root on Debian)
browser:
	@scripts/need_chromium.sh

# the documentation site (mkdocs, material theme, API reference from the
# docstrings) on $(HOST):$(DOCS_PORT)
DOCS_PORT ?= 8001
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve -a $(HOST):$(DOCS_PORT)

# the image, built and served for real: needs a Docker engine
# (../shared/tools/local-docker.sh start makes one on a machine without).
# BASE_IMAGE: any Debian-like image with Python >= 3.12 (default: the Dockerfile's);
# the image gets CPU-only jax. Containers are removed by id; the image stays.
IMAGE ?= qarray:test
# the CNN surrogate and neural operator examples' images, built on top of IMAGE
CNN_IMAGE ?= qarray-cnn-surrogate:test
OPERATOR_IMAGE ?= qarray-neural-operator:test
BASE_IMAGE ?=
# `make image` builds the three; `make test-image` builds them (layers cached)
# and tests them, a test file per process
image:
	docker build --network host --build-arg JAX=cpu \
		$(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) -t $(IMAGE) .
	docker build --build-arg QARRAY_IMAGE=$(IMAGE) -t $(CNN_IMAGE) examples/cnn_surrogate
	docker build --build-arg QARRAY_IMAGE=$(IMAGE) -t $(OPERATOR_IMAGE) examples/neural_operator
test-image: setup image
	QARRAY_TEST_IMAGE=$(IMAGE) QARRAY_TEST_CNN_IMAGE=$(CNN_IMAGE) \
		QARRAY_TEST_OPERATOR_IMAGE=$(OPERATOR_IMAGE) \
		$(if $(BASE_IMAGE),BASE_IMAGE=$(BASE_IMAGE)) \
		$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile tests/image

# the image's TPU variant (JAX=tpu: jax[tpu] with the libtpu its extra pins),
# built and served here on the CPU (JAX falls back to it without a chip):
# health, apply against NumPy, a bad request, the installed runtime. Not part
# of test-image (the libtpu wheel is large). Running it on a Cloud TPU VM:
# docs/tpu-image.md
IMAGE_TPU ?= qarray:tpu-test
image-tpu:
	docker build --network host --build-arg JAX=tpu \
		$(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) -t $(IMAGE_TPU) .
test-image-tpu: setup image-tpu
	QARRAY_TEST_TPU_IMAGE=$(IMAGE_TPU) $(PY) -m pytest tests/image/test_tpu_image.py

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# the qarray tests on jax 0.11.2 (what the lent GPU machines carry); not in CI
test-compat:
	@test -x $(COMPAT_VENV)/bin/python || { python=$$(scripts/find_python.sh) && "$$python" -m venv $(COMPAT_VENV); }
	$(COMPAT_VENV)/bin/python -m pip install -q --disable-pip-version-check "jax==0.11.2" "equinox==0.13.8" "numpy==2.5.4" "pytest==9.2.0" "optax==0.2.8" "safetensors==0.8.0"
	$(COMPAT_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
	$(COMPAT_VENV)/bin/python -m pytest tests/qarray

# on a machine with an NVIDIA GPU and jax's CUDA plugin in GPU_PYTHON (the lent
# machines carry one; nothing is installed): the library tests on the GPU and
# the product rows on the device, a few minutes, report in gpu_check.json
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py --out gpu_check.json

# serves on $(HOST):$(PORT) with base64 array responses; run folders go to $(SCRATCH);
# qarray-serve is tesseract-runtime serve behind the request guard (qarray/tesseract/)
serve: setup
	@mkdir -p "$(SCRATCH)"
	TESSERACT_API_PATH="$(CURDIR)/tesseract_api.py" \
	TESSERACT_NAME=qarray \
	TESSERACT_OUTPUT_FORMAT=json+base64 \
	TESSERACT_OUTPUT_PATH="$(SCRATCH)" \
	$(VENV)/bin/qarray-serve serve --host $(HOST) --port $(PORT)

# side-by-side benchmarks (never part of `make test`): table, results.json, results.png
bench: setup
	$(PY) -m benchmarks.run

# what a user would pick instead, side by side with ours: torchao's int8
# nn.Linear, eager and under torch.compile, at the same shapes with the same
# data and threads (its own venv: torch's PyPI wheel brings ~4 GB of CUDA
# libraries even for CPU use). Writes benchmarks/peers_results.json.
PEERS_VENV ?= .venv-peers
bench-peers: setup
	@test -x $(PEERS_VENV)/bin/python || { python=$$(scripts/find_python.sh) && "$$python" -m venv $(PEERS_VENV); }
	$(PEERS_VENV)/bin/python -m pip install -q --disable-pip-version-check "torch==2.14.0" "torchao==0.18.0" "numpy==2.5.4"
	$(PEERS_VENV)/bin/python benchmarks/bench_peers.py --out benchmarks/peers.json
	$(PY) -m benchmarks.compare_peers benchmarks/peers.json

# a real qarray-serve under mixed apply / vjp / jvp traffic from several client
# processes, bad requests interleaved, every answer checked against NumPy; fails
# on a wrong answer, a 5xx other than load shedding, or growing memory. Writes
# docs/soak.json and docs/soak.png. Never part of `make test`.
# SOAK_SECONDS: the timed phase; SOAK_ARGS: more (e.g. --workers 2 --clients 8)
SOAK_SECONDS ?= 180
SOAK_ARGS ?=
soak: setup
	$(PY) -m benchmarks.soak --seconds $(SOAK_SECONDS) $(SOAK_ARGS)

clean:
	rm -rf $(VENV) $(COMPAT_VENV) $(PEERS_VENV) site
