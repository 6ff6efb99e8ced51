#!/bin/bash
# Colocated mode on one GPU node (docs/colocated.md): SGLang and the Megatron trainer share
# the node's GPUs and take turns. Each step SGLang generates a batch, frees its KV cache, weights
# and CUDA graphs (/release_memory_occupation), the trainer trains, then SGLang takes its memory
# back and the new weights by CUDA IPC handle (/update_weights_from_tensor; no NCCL group).
#
#   MODEL=/models/my-policy GPUS=8 examples/launch/colocated_node.sh examples/magistral_small_rl.yaml
#
# SGLang needs --enable-memory-saver for the release (torch_memory_saver; without it the routes
# free nothing); --mem-fraction-static is its share of each GPU while it holds its memory (the
# trainer's weights, gradients and optimizer state stay resident, so leave them room). The
# server listens on loopback only and wants the API key; this script tracks the PID it starts
# and stops it on exit (never by name).
set -euo pipefail
RECIPE=${1:?usage: colocated_node.sh RECIPE.yaml [overrides...]}; shift
MODEL=${MODEL:?export MODEL=/path/to/hf/model, the model.hf of the recipe}
GPUS=${GPUS:-8}                          # SGLang tp-size = trainer ranks = GPUs of the node
PORT=${SGLANG_PORT:-30000}
MEM_FRACTION=${MEM_FRACTION:-0.45}       # SGLang's static share of each GPU (weights + KV cache)
LOG=${LOG:-sglang-colocated.log}
# The key: the trainer reads $MEGATRON_RL_API_KEY; SGLang 0.5.23 takes it only as --api-key.
MEGATRON_RL_API_KEY=${MEGATRON_RL_API_KEY:-$(python -c 'import secrets; print(secrets.token_urlsafe(32))')}
export MEGATRON_RL_API_KEY

# The flags the recipe implies (--weight-version, --enable-deterministic-inference when
# fleet.deterministic is true), from `megatron-rl sglang-args`.
SERVER_ARGS=$(megatron-rl sglang-args server "$RECIPE" "$@")
# shellcheck disable=SC2086  # SERVER_ARGS is a list of words
python -m sglang.launch_server --model-path "$MODEL" --tp-size "$GPUS" \
  --host 127.0.0.1 --port "$PORT" \
  --enable-memory-saver --mem-fraction-static "$MEM_FRACTION" \
  $SERVER_ARGS --api-key "$MEGATRON_RL_API_KEY" >"$LOG" 2>&1 &
SGLANG_PID=$!
trap 'kill "$SGLANG_PID" 2>/dev/null || true; wait "$SGLANG_PID" 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
  kill -0 "$SGLANG_PID" 2>/dev/null || { echo "SGLang exited; see $LOG" >&2; exit 1; }
  sleep 5
done

torchrun --standalone --nproc-per-node "$GPUS" -m megatron_rl train "$RECIPE" \
  loop.mode=colocated "model.hf=$MODEL" "fleet.urls=[\"http://127.0.0.1:$PORT\"]" "$@"
