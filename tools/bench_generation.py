"""Generation throughput: the built-in engine server over HTTP against HF ``model.generate``.

    megatron-rl bench generation [--hidden 256] [--layers 4] [--vocab 1000] [--prompts 64]
                                 [--prompt-len 16] [--max-new-tokens 64] [--threads 1]
                                 [--repeats 3]

One random Llama-style model (fp32, saved with ``save_pretrained``, no EOS token, so every
sequence runs to ``--max-new-tokens``), ``--prompts`` random prompts of one length, sampling at
temperature 1.0 over the full vocabulary (no top-k, no top-p), timed in this one run:

- baseline: HF transformers ``model.generate`` in this process on the whole batch
  (``do_sample``, ``use_cache``, ``min_new_tokens = max_new_tokens`` so that nothing stops early);
- the built-in engine server (``EngineProcess``, as many slots as prompts) through
  ``FleetClient.generate``: one HTTP request per prompt, continuous batching in the server.

Both use ``--threads`` torch threads (the server via ``EngineProcess(threads=...)``, HF via
``torch.set_num_threads``); each runs once untimed on a few short requests, then ``--repeats``
times, alternating, median reported. The engine's row also shows how much of its wall time the
server spent in engine steps (the rest: HTTP, JSON, admission). Tokens/s counts generated tokens
only. The last line is one JSON object; ``engine_over_hf_generate`` = engine tokens/s / HF
tokens/s.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import tempfile
import time

import torch


def make_model(folder: str, args: argparse.Namespace) -> int:
    """Save a random fp32 Llama without EOS to ``folder``; returns its parameter count."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=11 * args.hidden // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=args.prompt_len + args.max_new_tokens,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def _busy_s(fleet, url: str) -> float:
    info = fleet.server_info(url)
    return float(info["internal_states"][0]["busy_s"])


def engine_run(fleet, url: str, prompts: list[list[int]], max_new: int, tag: str) -> tuple[float, int, float]:
    """(seconds, generated tokens, server busy seconds) for every prompt through the fleet."""
    from megatron_rl.generation.api import GenRequest

    reqs = [
        GenRequest(request_id=f"{tag}-{i}", input_ids=p, max_new_tokens=max_new, temperature=1.0, seed=i)
        for i, p in enumerate(prompts)
    ]
    busy = _busy_s(fleet, url)
    start = time.perf_counter()
    results = list(fleet.generate(reqs))
    seconds = time.perf_counter() - start
    busy = _busy_s(fleet, url) - busy
    if sorted(len(r.token_ids) for r in results) != [max_new] * len(reqs):
        raise SystemExit("bench generation: the engine stopped a sequence early")
    return seconds, sum(len(r.token_ids) for r in results), busy


def hf_run(model, prompts: list[list[int]], max_new: int) -> tuple[float, int]:
    """(seconds, generated tokens) for HF ``generate`` on the whole batch."""
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            use_cache=True,
            pad_token_id=0,
        )
    seconds = time.perf_counter() - start
    new = out.shape[1] - ids.shape[1]
    if new != max_new:
        raise SystemExit(f"bench generation: HF generated {new} tokens, not {max_new}")
    return seconds, new * ids.shape[0]


def run(args: argparse.Namespace, folder: str) -> dict:
    import transformers

    from megatron_rl.generation.client import FleetClient
    from megatron_rl.generation.engine.launch import EngineProcess

    params = make_model(folder, args)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, args.vocab, (args.prompts, args.prompt_len), generator=g).tolist()
    warm = [p[:4] for p in prompts[:4]]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()
    engine_rows, hf_rows = [], []
    max_len = args.prompt_len + args.max_new_tokens
    api_key = secrets.token_urlsafe(32)  # our server is never open, not even on loopback
    with EngineProcess(
        folder, max_slots=args.prompts, max_len=max_len, threads=args.threads, api_key=api_key
    ) as server:
        fleet = FleetClient([server.url], api_key=api_key)
        engine_run(fleet, server.url, warm, 4, "warm")  # untimed
        hf_run(model, warm, 4)  # untimed
        # Alternated, so that a busy spell of a shared machine hits both alike.
        for r in range(args.repeats):
            hf_rows.append(hf_run(model, prompts, args.max_new_tokens))
            engine_rows.append(engine_run(fleet, server.url, prompts, args.max_new_tokens, f"r{r}"))
        fleet.close()
    tokens = hf_rows[0][1]
    hf_s = statistics.median(s for s, _ in hf_rows)
    engine_s = statistics.median(s for s, _, _ in engine_rows)
    busy_s = statistics.median(b for _, _, b in engine_rows)
    hf_tps, engine_tps = tokens / hf_s, tokens / engine_s
    print(
        f"generation: random Llama hidden {args.hidden}, {args.layers} layers, vocab "
        f"{args.vocab} ({params / 1e6:.2f}M parameters, fp32); {args.prompts} prompts of "
        f"{args.prompt_len} tokens, {args.max_new_tokens} new tokens each (no EOS), sampled at "
        f"temperature 1.0; {args.threads} torch thread(s) each; median of {args.repeats}"
    )
    print(f"{'generator':52} {'seconds':>8} {'tokens/s':>9} {'÷ HF':>6}")
    print(f"{f'HF model.generate, batch {args.prompts} (baseline)':52} {hf_s:8.3f} {hf_tps:9.0f} {1.0:6.2f}")
    print(
        f"{f'built-in engine over HTTP (FleetClient), {args.prompts} slots':52} {engine_s:8.3f} "
        f"{engine_tps:9.0f} {engine_tps / hf_tps:6.2f}"
    )
    print(f"{'  of which in engine steps (server busy)':52} {busy_s:8.3f}")
    return {
        "engine_over_hf_generate": round(engine_tps / hf_tps, 4),
        "engine_tokens_per_s": round(engine_tps, 1),
        "hf_tokens_per_s": round(hf_tps, 1),
        "engine_s": round(engine_s, 4),
        "engine_busy_s": round(busy_s, 4),
        "hf_s": round(hf_s, 4),
        "generated_tokens": tokens,
        "threads": args.threads,
        "params": params,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--prompts", type=int, default=64, help="prompts (= engine slots, HF batch)")
    ap.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads, for each generator")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each (median)")
    args = ap.parse_args(argv)
    if min(args.prompts, args.prompt_len, args.max_new_tokens, args.threads, args.repeats) < 1:
        ap.error("--prompts, --prompt-len, --max-new-tokens, --threads, --repeats must be >= 1")
    with tempfile.TemporaryDirectory(prefix="bench-generation-") as folder:
        out = run(args, folder)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
