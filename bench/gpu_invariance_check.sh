#!/usr/bin/env bash
# GPU check of the batch-invariant kernels (issue 21), for a lent CUDA GPU with torch + triton;
# a few minutes. Not run on the CPU tier (there: pytest -m triton, and -m "slow and triton").
# 1. bench/triton_gemm.py: the Triton FP8 GEMM vs torch._scaled_mm at Qwen3-8B shapes (ratio;
#    target >= 0.8), its exactness bound against the fp64 'exact' GEMM (<= 1) and rows computed
#    alone vs in the batch (True) on the GPU's FP8 MMA.
# 2. SGLang's Triton attention (deterministic unified extend + decode) on CUDA: error against a
#    float64 reference, bits alone vs in a batch, split-count sensitivity. Needs sglang importable
#    (the lent machine has none by default: carry a wheelhouse); says so and stops when absent.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD"
python - <<'PY'
import torch, triton
print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
PY
python bench/triton_gemm.py --tokens "${TOKENS:-16,256,4096}"
if python -c "import sglang" 2>/dev/null; then
    python -m tests.rollout.sglang_triton_attention --device cuda
else
    echo "attention step not run: sglang is not importable on this machine"
    exit 3
fi
