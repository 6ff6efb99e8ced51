"""SGLang generation throughput for ``tools/gpu_check.sh`` (needs a GPU and sglang installed).

    python tools/gpu_check_sglang.py MODEL_FOLDER_TO_CREATE

A random ~1.1B-parameter Llama (the shape gpu_check.sh trains) is saved in bf16 and served by
SGLang's own server (``python -m sglang.launch_server``, with an API key), driven by our
``FleetClient``: 512 requests of 64 prompt tokens and 256 sampled tokens each (random weights: no
EOS is meant, so requests run to their length), after 32 warm-up requests. The last line is JSON.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import transformers

from megatron_rl.generation.api import GenRequest
from megatron_rl.generation.client import FleetClient

PORT = 30011


def main(folder: str) -> int:
    cfg = transformers.LlamaConfig(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        intermediate_size=5632,
        vocab_size=32000,
        max_position_embeddings=4096,
    )
    transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(folder)
    key = secrets.token_urlsafe(16)
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", folder, "--port", str(PORT)]
    server = subprocess.Popen([*cmd, "--api-key", key, "--skip-tokenizer-init"], stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{PORT}"
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        else:
            print(json.dumps({"sglang_tokens_per_s": None, "failed": "the server did not come up in 240 s"}))
            return 1

        def reqs(tag: str, n: int) -> list[GenRequest]:
            return [
                GenRequest(
                    request_id=f"{tag}{i}",
                    input_ids=[(7 * i + j) % cfg.vocab_size for j in range(64)],
                    max_new_tokens=256,
                    temperature=1.0,
                    seed=i,
                )
                for i in range(n)
            ]

        with FleetClient([url], api_key=key) as fleet:
            list(fleet.generate(reqs("warm", 32)))
            t0 = time.perf_counter()
            n = sum(len(r.token_ids) for r in fleet.generate(reqs("r", 512)))
            dt = time.perf_counter() - t0
        print(json.dumps({"sglang_tokens_per_s": round(n / dt, 1), "tokens": n, "seconds": round(dt, 2)}))
        return 0
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
