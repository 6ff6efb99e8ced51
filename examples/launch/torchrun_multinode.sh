#!/bin/bash
# The trainer side on N nodes without SLURM, against SGLang servers that are already up.
# Run on every trainer node with the same arguments, NODE_RANK=0..N-1:
#
#   MASTER=10.0.0.1 NNODES=2 NODE_RANK=0 SERVERS="http://10.0.1.1:30000 http://10.0.1.2:30000" \
#     examples/launch/torchrun_multinode.sh examples/magistral_small_rl.yaml
#
# Overrides follow the recipe, e.g. long traces split over 2 ranks of each replica:
#   ... torchrun_multinode.sh RECIPE.yaml trainer.parallel.context_parallel=2 batching.layout=packed
# (the world size must be a multiple of tensor_parallel x pipeline_parallel x context_parallel).
#
# Start each SGLang server (same SGLang as the client: 0.5.23) with the flags the recipe implies:
#   python -m sglang.launch_server --model-path MODEL --tp-size 8 --host 0.0.0.0 --port 30000 \
#     $(megatron-rl sglang-args server RECIPE.yaml) --api-key "$MEGATRON_RL_API_KEY"
set -euo pipefail
RECIPE=${1:?usage: torchrun_multinode.sh RECIPE.yaml [overrides...]}; shift
: "${MASTER:?address of trainer node 0}" "${NNODES:?number of trainer nodes}"
: "${NODE_RANK:?0..NNODES-1}" "${SERVERS:?space-separated SGLang server URLs}"
URLS=$(printf '"%s",' $SERVERS); URLS="[${URLS%,}]"
exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "${GPUS:-8}" \
  --master-addr "$MASTER" --master-port "${MASTER_PORT:-29500}" \
  -m megatron_rl train "$RECIPE" "fleet.urls=$URLS" "weight_sync.master_address=$MASTER" "$@"
