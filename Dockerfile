# GPU tier image: CUDA + PyTorch + Transformer Engine (from NVIDIA's PyTorch container), with
# megatron-core, SGLang and its runtime requirements, and this package installed with its own.
# Build on a machine with Docker and network access to NGC:  docker build -t megatron-fp8rl:gpu .
# CI cannot build it (no Docker engine, no GPU); it lints it with hadolint and checks that every
# runtime dependency of setup.py and of SGLang is installed here (tests/test_dockerfile.py).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3
FROM ${BASE_IMAGE}

ARG MEGATRON_CORE_VERSION=0.16.1
ARG SGLANG_VERSION=0.5.23
# Set to 1 to build NVIDIA apex from source (optional: megatron-core runs without it).
ARG BUILD_APEX=0

# The base image's torch and Transformer Engine are not the versions the test suite ran on
# (megatron_fp8rl/compat/versions.py): the version gate allows exactly these versions, by version
# (those of NGC PyTorch 25.10, as its release notes give them; not confirmed by a build here: the RUN
# below fails the build if the base image holds other ones), and refuses any other.
ARG TORCH_VERSION=2.9.0a0
ARG TE_VERSION=2.8.0
ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    MEGATRON_FP8RL_ALLOW_UNTESTED=torch==${TORCH_VERSION},transformer-engine==${TE_VERSION}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

WORKDIR /opt/megatron_fp8rl

RUN (python -c "__import__('sys').exit(__import__('torch').__version__.split('+')[0] != '${TORCH_VERSION}')" \
      || (echo "base image torch is not ${TORCH_VERSION}: pass --build-arg TORCH_VERSION" >&2 && exit 1)) \
 && (python -c "__import__('sys').exit(__import__('importlib.metadata').metadata.version('transformer-engine').split('+')[0] != '${TE_VERSION}')" \
      || (echo "base image Transformer Engine is not ${TE_VERSION}: pass --build-arg TE_VERSION" >&2 && exit 1))

# Every install below runs under /opt/base-constraints.txt: the base image's torch, torchvision
# and Transformer Engine at their installed versions, so pip fails instead of replacing them.
RUN pip list --format=freeze \
      | grep -iE '^(torch|torchvision|transformer[-_]engine[-_a-z0-9]*)==' > /opt/base-constraints.txt \
 && grep -iq '^torch==' /opt/base-constraints.txt

# SGLang without its declared torch pin, then its runtime requirements (requirements/sglang-gpu.txt
# is its wheel's Requires-Dist less torch/torchvision/torchaudio).
COPY requirements/sglang-gpu.txt requirements/
RUN pip install --no-cache-dir -c /opt/base-constraints.txt "sglang==${SGLANG_VERSION}" --no-deps \
 && pip install --no-cache-dir -c /opt/base-constraints.txt -r requirements/sglang-gpu.txt

# apex has no releases on PyPI (the PyPI "apex" is unrelated); pin a commit with APEX_REF.
ARG APEX_REF=master
# hadolint ignore=DL3013
RUN if [ "${BUILD_APEX}" = "1" ]; then \
      pip install --no-cache-dir --no-build-isolation \
        --config-settings "--build-option=--cpp_ext" --config-settings "--build-option=--cuda_ext" \
        "git+https://github.com/NVIDIA/apex.git@${APEX_REF}"; \
    fi

# This package with its install_requires (setup.py COMMON) and the gpu extra's pins; Transformer
# Engine (the extra's transformer-engine[pytorch]) is the base image's.
COPY setup.py README.md ./
COPY megatron_fp8rl ./megatron_fp8rl
COPY tools ./tools
COPY examples ./examples
RUN pip install --no-cache-dir -c /opt/base-constraints.txt \
      "megatron-core==${MEGATRON_CORE_VERSION}" transformers==5.19.0 -e . \
 && python -c "import transformer_engine.pytorch, megatron.core, sglang, megatron_fp8rl.cli" \
 && megatron-fp8rl --help > /dev/null

ENTRYPOINT ["megatron-fp8rl"]
CMD ["--help"]
