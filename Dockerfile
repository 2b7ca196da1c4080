# GPU-capable image of the qarray Tesseract, serving on 0.0.0.0:8000.
#   docker build -t qarray .
#   docker run --gpus all -p 127.0.0.1:8000:8000 qarray
# jax's CUDA 13 wheels bundle the CUDA libraries; the NVIDIA driver comes from the
# host through `--gpus all`. Without a GPU the same image runs on the CPU.
#
# Build arguments:
#   BASE_IMAGE  any Debian-like image with Python >= 3.12, venv and `useradd`
#               (default: the slim Python 3.12 image from Docker Hub)
#   JAX         "cuda13" (default: jax's CUDA 13 wheels), "tpu" (jax[tpu]: the
#               pinned jax with the libtpu wheel its extra pins; run it on a
#               Cloud TPU VM with --privileged --net=host, docs/tpu-image.md)
#               or "cpu" (CPU-only jax: a smaller image, what `make test-image`
#               builds). Every variant serves on the CPU where its accelerator
#               is absent.
# The install runs scripts/install.sh, the script `make setup` runs, on the same
# pinned tesseract_requirements.txt, in a build stage that also compiles
# qarray's CPU kernels (g++ from the base image's apt); the image itself has no
# compiler.
ARG BASE_IMAGE=python:3.12.12-slim-bookworm

# --- build: the environment, with qarray's CPU kernels compiled (the compiler
# stays in this stage; the image below gets the finished venv)
FROM ${BASE_IMAGE} AS build
ARG JAX=cuda13
ENV PIP_NO_CACHE_DIR=1
# the base image's own Debian release decides g++'s version (any C++17 compiler
# builds the kernels), and it never reaches the image: not pinned
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/qarray
# the pinned requirements first, in a layer of their own: a change to qarray
# (its code, pyproject.toml, the README) rebuilds only the layer below
COPY tesseract_requirements.txt ./
COPY scripts/install.sh scripts/build_kernels.sh scripts/
# JAX=tpu swaps the pinned jax's extra for [tpu] in the build stage's copy of
# the requirements (the same version; its extra pins libtpu); the runtime
# install below reads the same copy
RUN case "$JAX" in \
        cuda13) jax_option= ;; \
        tpu) jax_option= \
            && sed -i 's/^jax\[[a-z0-9,_-]*\]==/jax[tpu]==/' tesseract_requirements.txt \
            && grep -q '^jax\[tpu\]==' tesseract_requirements.txt ;; \
        cpu) jax_option=--cpu ;; \
        *) echo "build argument JAX must be cuda13, tpu or cpu, got '$JAX'" >&2; exit 2 ;; \
    esac \
    && python -m venv /opt/venv \
    && scripts/install.sh /opt/venv/bin/python requirements $jax_option
COPY pyproject.toml README.md ./
COPY qarray/ qarray/
RUN if [ "$JAX" = cpu ]; then jax_option=--cpu; else jax_option=; fi \
    && scripts/install.sh /opt/venv/bin/python runtime $jax_option \
    && test -f /opt/venv/lib/python*/site-packages/qarray/_cpu/libqarray_cpu.so

# --- the image
FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH
COPY --from=build /opt/venv /opt/venv

COPY tesseract_api.py /tesseract/tesseract_api.py
# output_data is writable by any uid: `tesseract serve` runs containers as the
# calling user's uid, not as the image's USER
RUN useradd --create-home --uid 10001 tesseract \
    && mkdir -p /tesseract/input_data /tesseract/output_data \
    && chmod 755 /tesseract/input_data \
    && chmod 777 /tesseract/output_data

# The environment and label a `tesseract build` image carries (tesseract-core's
# tooling reads them: `tesseract ps` needs TESSERACT_VERSION);
# tests/image/test_image.py checks them against `tesseract build --generate-only`.
LABEL ai.pasteurlabs.tesseract.metadata="{}"
ENV TESSERACT_NAME=qarray \
    TESSERACT_VERSION=0.1.0 \
    TESSERACT_DESCRIPTION="int8-quantized network with differentiable endpoints (qarray, a JAX hijax type)" \
    TESSERACT_API_PATH=/tesseract/tesseract_api.py \
    TESSERACT_INPUT_PATH=/tesseract/input_data \
    TESSERACT_OUTPUT_PATH=/tesseract/output_data \
    TESSERACT_OUTPUT_FORMAT=json+base64 \
    XLA_PYTHON_CLIENT_PREALLOCATE=false \
    QARRAY_VJP_CACHE_SIZE=8 \
    QARRAY_MAX_REQUEST_BYTES=268435456

USER 10001
WORKDIR /tesseract
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

# `tesseract serve` runs images as `serve --port 8000 [--num-workers N] --host 0.0.0.0`;
# qarray-serve takes those arguments (tesseract-runtime's app behind qarray's
# request guard) and hands any other command to tesseract-runtime. The default
# command keeps that order: `tesseract ps` reads the port from the command's
# third word.
ENTRYPOINT ["qarray-serve"]
CMD ["serve", "--port", "8000", "--host", "0.0.0.0"]
