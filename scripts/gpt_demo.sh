#!/usr/bin/env bash
# The tiny Megatron GPT demo (no RL, ~30 s): the real Megatron-Core GPT trained on a built-in
# sequence task, launched with torchrun on 2 processes (tensor parallel 2, gloo).
# Creates/reuses .venv (scripts/env.sh). Extra arguments go to `megatron-fp8rl demo`
# (e.g. --steps 400).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/env.sh
source "$ROOT/scripts/env.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port "${MASTER_PORT:-29500}" \
  -m megatron_fp8rl.cli demo --tensor-parallel 2 "$@"
