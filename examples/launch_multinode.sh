#!/usr/bin/env bash
# Multi-node torchrun launch of `megatron-fp8rl train` with c10d rendezvous. Run the same command on
# every node (by hand, pdsh, or a scheduler); torchrun assigns node ranks at the rendezvous.
#   HEAD_NODE=node0 NNODES=3 examples/launch_multinode.sh --config examples/qwen2_5_32b_grpo_fp8.yaml \
#     model.hf_path=/models/Qwen2.5-32B-Instruct rollout.server_url=http://node3:30000
# Variables: HEAD_NODE (host of the rendezvous; required), NNODES (default 1), GPUS_PER_NODE
# (default 8), RDZV_PORT (default 29500), RDZV_ID (default: megatron_fp8rl).
set -euo pipefail

: "${HEAD_NODE:?set HEAD_NODE to the host that runs the rendezvous}"
NNODES="${NNODES:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
RDZV_PORT="${RDZV_PORT:-29500}"
RDZV_ID="${RDZV_ID:-megatron_fp8rl}"

exec torchrun \
  --nnodes "${NNODES}" \
  --nproc-per-node "${GPUS_PER_NODE}" \
  --rdzv-backend c10d \
  --rdzv-endpoint "${HEAD_NODE}:${RDZV_PORT}" \
  --rdzv-id "${RDZV_ID}" \
  -m megatron_fp8rl.cli train "$@"
