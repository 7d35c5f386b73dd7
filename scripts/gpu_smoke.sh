#!/usr/bin/env bash
# GPU smoke kit (bench/gpu_smoke.py): our FP8 linear vs bf16 at Qwen3-8B shapes, a Megatron bf16 +
# FP8 training step, the calibrated recipe's scales on CUDA, a _scaled_mm batch-invariance probe,
# a Qwen3-8B layer through the colocated weight sync's CUDA IPC transport into another process.
#   scripts/gpu_smoke.sh wheelhouse       here (network): py3.12 wheels of megatron-core and the
#                                         pure-Python deps into .cache/gpu_wheelhouse (~18 MiB)
#   scripts/gpu_smoke.sh run [OUT_DIR]    on the GPU machine (torch 2.11, Python 3.12, no network,
#                                         no TE, no SGLang): install from the wheelhouse into a venv
#                                         over the system torch, run, write OUT_DIR/gpu_smoke.json
# On the lent GPU:  run(command="scripts/gpu_smoke.sh run $OUT", carry=[".cache/gpu_wheelhouse"]).
# The machine's torch is not a tested version (megatron_fp8rl/compat/versions.py): `run` allows
# exactly that, by name. Takes a few minutes on an H200.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="$ROOT/.cache/gpu_wheelhouse"
# megatron-core and what it and our smoke path import beyond torch (its Requires-Dist: numpy, packaging)
PACKAGES=("megatron-core==0.16.1" "numpy" "packaging")

case "${1:-}" in
  wheelhouse)
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    python3 -m pip download --quiet --python-version 3.12 --only-binary=:all: --no-deps \
      --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$WHEELS" "${PACKAGES[@]}"
    du -sh "$WHEELS"
    ;;
  run)
    OUT="${2:-$ROOT/runs/gpu_smoke}"
    mkdir -p "$OUT"
    [ -d "$WHEELS" ] || { echo "no $WHEELS: run 'scripts/gpu_smoke.sh wheelhouse' first and carry it" >&2; exit 2; }
    VENV="$(mktemp -d)/venv"
    python3 -m venv --system-site-packages "$VENV"
    "$VENV/bin/python" -m pip install --quiet --no-index --no-deps --find-links "$WHEELS" "${PACKAGES[@]}"
    MEGATRON_FP8RL_ALLOW_UNTESTED=torch PYTHONPATH="$ROOT" PYTHONUNBUFFERED=1 \
      timeout 480 "$VENV/bin/python" "$ROOT/bench/gpu_smoke.py" --out "$OUT/gpu_smoke.json"
    ;;
  *)
    echo "usage: $0 wheelhouse | run [OUT_DIR]" >&2
    exit 2
    ;;
esac
