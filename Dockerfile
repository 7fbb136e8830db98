# syntax=docker/dockerfile:1.7
# The dart-batch image: Ray + CUDA PyTorch + this project (the C++ extension built), for the
# KubeRay manifests in k8s/ (head, GPU workers, job submitter, nightly CronJob).
#
#   docker build -t ghcr.io/your-org/dart-batch:0.1.0 .
#   docker push ghcr.io/your-org/dart-batch:0.1.0
#
# The base is Ray's own GPU image, so the layout is what KubeRay expects (bash, the `ray` CLI,
# user ray = uid 1000 / gid 100, Python 3.11 in /home/ray/anaconda3). RAY_VERSION must equal
# rayVersion in k8s/*.yaml (tests/test_k8s.py checks it). Tags can move: for reproducible
# builds pin the base by digest as well, e.g.
#   docker buildx imagetools inspect rayproject/ray:2.60.0-py311-gpu     # prints the digest
#   docker build --build-arg BASE_IMAGE=rayproject/ray:2.60.0-py311-gpu@sha256:<digest> ...
# and deploy your own image by digest too (ghcr.io/your-org/dart-batch@sha256:...).
ARG RAY_VERSION=2.60.0
ARG BASE_IMAGE=rayproject/ray:${RAY_VERSION}-py311-gpu

# ---- build: compile the native extension into a wheel (the compiler stays in this stage) ----
FROM ${BASE_IMAGE} AS build
USER root
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /tmp/src
COPY pyproject.toml setup.py README.md ./
COPY ngram_native/ ngram_native/
COPY dart_worker/ dart_worker/
COPY dart_train/ dart_train/
COPY pipeline/ pipeline/
COPY dart_bench/ dart_bench/
COPY jobs/ jobs/
# Portable flags only (setup.py: -O3, no -march=native); warnings are errors, as in CI.
RUN NGRAM_NATIVE_WERROR=1 python -m pip wheel --no-cache-dir --no-deps --wheel-dir /tmp/wheels .

# ---- runtime ---------------------------------------------------------------------------------
FROM ${BASE_IMAGE}
ARG RAY_VERSION
# The PyPI build of torch for linux/amd64 is the CUDA one (its CUDA libraries come as pip
# packages): the nodes' NVIDIA driver must support that CUDA version.
ARG TORCH_VERSION=2.13.0
# 1: convert the embedded default target (model.target=default) at build time, so that pods
# do not each spend a minute on it at start-up. 0 for images that only serve your own models.
ARG WARM_DEFAULT_MODEL=1
LABEL org.opencontainers.image.title="dart-batch" \
      org.opencontainers.image.description="Distributed batch generation with DART speculative decoding on Ray" \
      org.opencontainers.image.licenses="Apache-2.0"

USER 1000:100
# OMP_WAIT_POLICY: idle OpenMP threads sleep instead of spinning. On CPU workers that share cores
# with Ray's own processes and the read/write tasks, spinning made decoding steps >10x slower
# (docs/benchmarks.md); GPU runs do not care.
ENV DART_CACHE_DIR=/home/ray/.cache/dart-batch \
    OMP_WAIT_POLICY=PASSIVE \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first and pinned, so that installing the project never resolves another build.
RUN python -m pip install "torch==${TORCH_VERSION}"
# The project with its default extra: `pip install .[default]`, from the wheel built above.
# Ray is pinned in the same command so that no dependency moves it off RAY_VERSION.
COPY --from=build --chown=1000:100 /tmp/wheels/ /tmp/wheels/
RUN python -m pip install "$(ls /tmp/wheels/dart_batch-*.whl)[default]" \
        "ray[default,data,train]==${RAY_VERSION}" "torch==${TORCH_VERSION}" \
    && rm -rf /tmp/wheels \
    && test "$(python -c 'import ray; print(ray.__version__)')" = "${RAY_VERSION}" \
    && python -c "import torch, ngram_native._core, dart_worker.engine, dart_train.ngram_build, pipeline.settings.config, jobs.nightly_submit"

RUN if [ "${WARM_DEFAULT_MODEL}" = "1" ]; then \
        python -c "from dart_worker.artifacts.default_target import default_target_dir; print(default_target_dir())"; \
    fi

# Only the configs live in the working directory (the code is installed in site-packages):
# a source tree here would shadow the installed packages, which hold the compiled extension.
WORKDIR /home/ray/dart-batch
COPY --chown=1000:100 configs/ configs/
