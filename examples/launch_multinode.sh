#!/usr/bin/env bash
# Multi-node torchrun launch of `megatron-fp8rl train` with c10d rendezvous. Run the same command on
# every node (by hand, pdsh, or a scheduler), each with its own NODE_RANK:
#   HEAD_NODE=node0 NNODES=3 NODE_RANK=0 examples/launch_multinode.sh \
#     --config examples/qwen2_5_32b_grpo_fp8.yaml model.hf_path=/models/Qwen2.5-32B-Instruct \
#     rollout.server_url=http://node3:30000 run_dir=/shared/runs/qwen2_5_32b
# Variables:
#   HEAD_NODE      host of the rendezvous (required); the node with NODE_RANK=0 must be this host.
#   NNODES         number of nodes (default 1).
#   NODE_RANK      0 on HEAD_NODE, 1..NNODES-1 elsewhere (required when NNODES > 1). Node 0 hosts
#                  the rendezvous store; no other node tries to (two agents on one host would both
#                  take HEAD_NODE for their own address). The global ranks are assigned by the
#                  rendezvous, so global rank 0 (the rollout engine, checkpoint conversion, logs,
#                  the final export) may run on any node.
#   GPUS_PER_NODE  processes per node (default 8; on the CPU tier, processes per machine).
#   RDZV_PORT      rendezvous port on HEAD_NODE (default 29500).
#   RDZV_ID        rendezvous id, the same on every node of one job (default: megatron_fp8rl).
# run_dir must be on a file system every node sees: rank 0 writes the converted start checkpoint
# that every rank loads, and checkpoints are saved by all ranks together.
set -euo pipefail

: "${HEAD_NODE:?set HEAD_NODE to the host that runs the rendezvous}"
NNODES="${NNODES:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
RDZV_PORT="${RDZV_PORT:-29500}"
RDZV_ID="${RDZV_ID:-megatron_fp8rl}"
if [[ -z "${NODE_RANK:-}" ]]; then
  if (( NNODES > 1 )); then
    echo "set NODE_RANK: 0 on HEAD_NODE=${HEAD_NODE}, a distinct 1..$((NNODES - 1)) on each other node" >&2
    exit 2
  fi
  NODE_RANK=0
fi
if ! [[ "${NODE_RANK}" =~ ^[0-9]+$ ]] || (( NODE_RANK >= NNODES )); then
  echo "NODE_RANK=${NODE_RANK} must be an integer in [0, NNODES=${NNODES})" >&2
  exit 2
fi
IS_HOST=$(( NODE_RANK == 0 ))

exec torchrun \
  --nnodes "${NNODES}" \
  --nproc-per-node "${GPUS_PER_NODE}" \
  --rdzv-backend c10d \
  --rdzv-endpoint "${HEAD_NODE}:${RDZV_PORT}" \
  --rdzv-id "${RDZV_ID}" \
  --rdzv-conf "is_host=${IS_HOST}" \
  -m megatron_fp8rl.cli train "$@"
