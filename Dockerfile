# GPU tier image: CUDA + PyTorch + Transformer Engine (from NVIDIA's PyTorch container), with
# megatron-core and sglang pinned and this package installed. Build on a machine with Docker and
# network access to NGC:  docker build -t megatron-fp8rl:gpu .
# CI cannot build it (no Docker engine, no GPU); it lints it with hadolint (tests/test_dockerfile.py).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3
FROM ${BASE_IMAGE}

ARG MEGATRON_CORE_VERSION=0.16.1
ARG SGLANG_VERSION=0.5.23
# Set to 1 to build NVIDIA apex from source (optional: megatron-core runs without it).
ARG BUILD_APEX=0

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

WORKDIR /opt/megatron_fp8rl

# The base image's torch and Transformer Engine are kept: sglang is installed without letting it
# replace them.
RUN pip install --no-cache-dir "megatron-core==${MEGATRON_CORE_VERSION}" psutil==7.2.2 \
 && pip install --no-cache-dir "sglang==${SGLANG_VERSION}" --no-deps \
 && python -c "import transformer_engine.pytorch, megatron.core"

# apex has no releases on PyPI (the PyPI "apex" is unrelated); pin a commit with APEX_REF.
ARG APEX_REF=master
# hadolint ignore=DL3013
RUN if [ "${BUILD_APEX}" = "1" ]; then \
      pip install --no-cache-dir --no-build-isolation \
        --config-settings "--build-option=--cpp_ext" --config-settings "--build-option=--cuda_ext" \
        "git+https://github.com/NVIDIA/apex.git@${APEX_REF}"; \
    fi

COPY setup.py README.md ./
COPY megatron_fp8rl ./megatron_fp8rl
COPY tools ./tools
COPY examples ./examples
RUN pip install --no-cache-dir safetensors==0.8.0 tensorboard==2.21.0 tqdm==4.70.1 pyyaml==6.0.4 \
      ml_dtypes==0.6.0 transformers==5.19.0 \
 && pip install --no-cache-dir --no-deps -e .

ENTRYPOINT ["megatron-fp8rl"]
CMD ["--help"]
