#!/usr/bin/env bash
# The GPU figures the CPU machines cannot give, in one run of at most ~10 minutes on one NVIDIA
# GPU (H100/H200 class; run from the repository root after `pip install -e '.[gpu,test]'`):
#
#   1. trainer MFU: `megatron-rl bench train-step` on a ~1.1B-parameter Llama (hidden 2048,
#      16 layers, GQA 16/8, MLP 5632, vocab 32k), bf16, Transformer Engine when installed,
#      8 sequences of 512 prompt + up to 4,096 completion tokens per step;
#   2. NCCL broadcast GB/s of that model's bytes (2 ranks; needs 2 GPUs, skipped on one);
#   3. SGLang generation tokens/s on the same model shape (random weights), when sglang is
#      installed: SGLang's own server driven by our FleetClient (tools/gpu_check_sglang.py).
#
# Each step prints its own last-line JSON; this script collects them into gpu_check.json (or
# $OUT/gpu_check.json when $OUT is set) and prints that last. README says which of these are
# measured; until a run of this script is recorded there, they are not.
set -u
OUT_DIR="${OUT:-.}"
PY="${PYTHON:-python}"
RESULTS="$OUT_DIR/gpu_check.json"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device here" >&2
    exit 2
fi
NGPU="$("$PY" -c "import torch; print(torch.cuda.device_count())")"
"$PY" -c "import torch; print('device:', torch.cuda.get_device_name(0), 'x', torch.cuda.device_count())"
"$PY" -c "import transformer_engine" 2>/dev/null && echo "Transformer Engine: installed" \
    || echo "Transformer Engine: NOT installed (the trainer falls back to the local spec)"

MODEL=(--hidden 2048 --layers 16 --heads 16 --kv-heads 8 --ffn 5632 --vocab 32000)

echo "== 1/3 trainer MFU (timeout 300 s)"
timeout 300 "$PY" -m megatron_rl bench train-step "${MODEL[@]}" --sequences 8 --group-size 8 \
    --prompt 512 --completion 4096 --budget 8192 --warmup 1 --steps 3 | tee "$TMP/train.log"

echo "== 2/3 NCCL broadcast (timeout 120 s)"
if [ "$NGPU" -ge 2 ]; then
    cat > "$TMP/bcast.py" <<'EOF'
import json, os, time, torch, torch.distributed as dist
dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(rank)
n = 2 * 1_100_000_000  # the ~1.1B model in bf16, bytes
buf = torch.empty(n, dtype=torch.uint8, device="cuda")
for _ in range(2):
    dist.broadcast(buf, src=0)
torch.cuda.synchronize()
t0 = time.perf_counter()
reps = 5
for _ in range(reps):
    dist.broadcast(buf, src=0)
torch.cuda.synchronize()
dt = (time.perf_counter() - t0) / reps
if rank == 0:
    print(json.dumps({"nccl_broadcast_gbps": round(n / dt / 1e9, 2), "bytes": n, "seconds": round(dt, 4)}))
dist.destroy_process_group()
EOF
    timeout 120 torchrun --standalone --nproc-per-node 2 "$TMP/bcast.py" | tee "$TMP/bcast.log"
else
    echo '{"nccl_broadcast_gbps": null, "skipped": "needs 2 GPUs (one rank each)"}' | tee "$TMP/bcast.log"
fi

echo "== 3/3 SGLang generation (timeout 300 s)"
if "$PY" -c "import sglang" 2>/dev/null; then
    timeout 300 "$PY" tools/gpu_check_sglang.py "$TMP/model" | tee "$TMP/gen.log"
else
    echo '{"sglang_tokens_per_s": null, "skipped": "sglang is not installed"}' | tee "$TMP/gen.log"
fi

"$PY" - "$TMP" "$RESULTS" <<'EOF'
import json, sys
from pathlib import Path
tmp, out = Path(sys.argv[1]), Path(sys.argv[2])
def last_json(name):
    lines = [l for l in (tmp / name).read_text().splitlines() if l.startswith("{")] if (tmp / name).exists() else []
    return json.loads(lines[-1]) if lines else {"failed": True}
res = {"train_step": last_json("train.log"), "broadcast": last_json("bcast.log"), "generation": last_json("gen.log")}
out.write_text(json.dumps(res, indent=2) + "\n")
print(json.dumps(res))
EOF
