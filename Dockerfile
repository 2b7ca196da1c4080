# GPU-capable image of the qarray Tesseract, serving on 0.0.0.0:8000.
#   docker build -t qarray .
#   docker run --gpus all -p 8000:8000 qarray
# jax's CUDA 13 wheels bundle the CUDA libraries; the NVIDIA driver comes from the
# host through `--gpus all`. Without a GPU the same image runs on the CPU.
# The install runs scripts/install.sh, the script `make setup` runs, on the same
# pinned tesseract_requirements.txt.
FROM python:3.12.12-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/venv/bin:$PATH

WORKDIR /opt/qarray
COPY pyproject.toml README.md tesseract_requirements.txt ./
COPY scripts/install.sh scripts/
COPY qarray/ qarray/
RUN python -m venv /opt/venv \
    && scripts/install.sh /opt/venv/bin/python runtime

COPY tesseract_api.py /tesseract/tesseract_api.py
RUN useradd --create-home --uid 10001 tesseract \
    && mkdir -p /tesseract/input_data /tesseract/output_data \
    && chown tesseract /tesseract/output_data

ENV TESSERACT_NAME=qarray \
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

# `tesseract serve` runs images as `serve --host 0.0.0.0 --port 8000 [--num-workers N]`;
# qarray-serve takes those arguments (tesseract-runtime's app behind qarray's
# request guard) and hands any other command to tesseract-runtime
ENTRYPOINT ["qarray-serve"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
