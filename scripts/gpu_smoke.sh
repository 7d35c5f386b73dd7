#!/usr/bin/env bash
# GPU kit (bench/gpu_smoke.py): every GPU target of issue 64 in two calls of at most 5 minutes.
#   part 1: our FP8 linear, all seven recipes x gemm auto / batch_invariant, cold and warm weight
#           cache, fwd and fwd+bwd vs bf16 at Qwen3-8B's four linears (8192 tokens); the
#           batch-invariant Triton GEMM vs cuBLAS FP8 per tensor (TFLOP/s) and its row invariance.
#   part 2: the decoder-layer step (4 Qwen3-8B layers, bf16 vs FP8, LM head timed apart, peak
#           memory); the colocated weight sync's parts on a Qwen3-8B-shaped stack vs 0.25 s.
#   scripts/gpu_smoke.sh wheelhouse             here (network): py3.12 wheels of megatron-core and
#                                               the pure-Python deps into .cache/gpu_wheelhouse
#   scripts/gpu_smoke.sh run OUT --part 1|2     on the GPU machine (torch 2.11, triton 3.6, Python
#                                               3.12 in a venv of its own, no network, no TE, no
#                                               SGLang): install the wheelhouse with `pip install
#                                               --target` into a folder on PYTHONPATH (a
#                                               --system-site-packages venv made from that python3
#                                               does not see its torch), run the part, write
#                                               OUT/gpu_smoke_partN.json (after each item) and .md.
# On the lent GPU, one call per part:
#   run(command="scripts/gpu_smoke.sh run $OUT --part 1", carry=[".cache/gpu_wheelhouse"], timeout_s=300)
#   run(command="scripts/gpu_smoke.sh run $OUT --part 2", carry=[".cache/gpu_wheelhouse"], timeout_s=300)
# The machine's torch is not a tested version (megatron_fp8rl/compat/versions.py): `run` detects
# it and allows that distribution by name, saying so. Arguments after OUT go to the kit.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="$ROOT/.cache/gpu_wheelhouse"
# megatron-core and what it and our kit import beyond torch (its Requires-Dist: numpy, packaging;
# safetensors, tqdm: trainer/rollout_fp8.py and convert/fp8_export.py, the sync item's FP8 quantization)
PACKAGES=("megatron-core==0.16.1" "numpy" "packaging" "safetensors" "tqdm")
KIT_TIMEOUT_S=270  # + installation (~10 s) stays under a 300 s call
KIT_BUDGET_S=230   # the part's time guard: no measurement starts after this; the one in flight has until KIT_TIMEOUT_S

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
    case " $* " in
      *" --part 1 "* | *" --part 2 "*) ;;
      *) echo "run: name --part 1 or --part 2 (one lent-GPU call of at most 5 minutes each)" >&2; exit 2 ;;
    esac
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
      --out-dir "$OUT" "$@"
    ;;
  *)
    echo "usage: $0 wheelhouse | run [OUT_DIR [--part 1|2] [kit arguments]]" >&2
    exit 2
    ;;
esac
