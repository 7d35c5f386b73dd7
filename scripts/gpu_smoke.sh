#!/usr/bin/env bash
# GPU kit (bench/gpu_smoke.py): every figure of issue #43's targets in one command (FP8 linear per
# recipe x gemm vs bf16 at Qwen3-8B shapes, the batch-invariant Triton GEMM vs _scaled_mm and bf16,
# the Megatron bf16 + FP8 step, a training step under sync-debug mode, the colocated weight sync's
# CUDA IPC transport, the calibrated recipe's scales on CUDA, a _scaled_mm batch-invariance probe).
#   scripts/gpu_smoke.sh wheelhouse       here (network): py3.12 wheels of megatron-core and the
#                                         pure-Python deps into .cache/gpu_wheelhouse (~18 MiB)
#   scripts/gpu_smoke.sh run [OUT_DIR]    on the GPU machine (torch 2.11, triton 3.6, Python 3.12 in
#                                         a venv of its own, no network, no TE, no SGLang): install
#                                         the wheelhouse with `pip install --target` into a folder on
#                                         PYTHONPATH (a --system-site-packages venv made from that
#                                         python3 does not see its torch), run the kit, write
#                                         OUT_DIR/gpu_smoke.json after each item. At most 290 s.
# On the lent GPU:  run(command="scripts/gpu_smoke.sh run $OUT", carry=[".cache/gpu_wheelhouse"], timeout_s=330).
# The machine's torch is not a tested version (megatron_fp8rl/compat/versions.py): `run` detects
# it and allows that distribution by name, saying so. Extra arguments after OUT_DIR go to the kit
# (e.g. --only gemm,linears).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="$ROOT/.cache/gpu_wheelhouse"
# megatron-core and what it and our kit import beyond torch (its Requires-Dist: numpy, packaging)
PACKAGES=("megatron-core==0.16.1" "numpy" "packaging")
KIT_TIMEOUT_S=270  # + installation (~10 s) stays under 290 s
KIT_BUDGET_S=235   # no item starts after this; the one in flight has until KIT_TIMEOUT_S

case "${1:-}" in
  wheelhouse)
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    python3 -m pip download --quiet --python-version 3.12 --only-binary=:all: --no-deps \
      --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$WHEELS" "${PACKAGES[@]}"
    du -sh "$WHEELS"
    ;;
  run)
    OUT="${2:-$ROOT/runs/gpu_smoke}"
    shift $(( $# >= 2 ? 2 : 1 ))
    mkdir -p "$OUT"
    [ -d "$WHEELS" ] || { echo "no $WHEELS: run 'scripts/gpu_smoke.sh wheelhouse' first and carry it" >&2; exit 2; }
    SITE="$(mktemp -d)/site"
    timeout 60 python3 -m pip install --quiet --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl
    TORCH="$(python3 -c 'import torch; print(torch.__version__.split("+")[0])')"
    ALLOW=""
    if ! grep -q "\"torch\": (.*\"$TORCH\"" "$ROOT/megatron_fp8rl/compat/versions.py"; then
      ALLOW="torch"
      echo "torch $TORCH is not a tested version: allowed by name (MEGATRON_FP8RL_ALLOW_UNTESTED=torch)"
    fi
    MEGATRON_FP8RL_ALLOW_UNTESTED="$ALLOW" PYTHONPATH="$ROOT:$SITE" PYTHONUNBUFFERED=1 \
      timeout "$KIT_TIMEOUT_S" python3 "$ROOT/bench/gpu_smoke.py" --budget-s "$KIT_BUDGET_S" \
      --out "$OUT/gpu_smoke.json" "$@"
    ;;
  *)
    echo "usage: $0 wheelhouse | run [OUT_DIR [kit arguments]]" >&2
    exit 2
    ;;
esac
