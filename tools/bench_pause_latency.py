"""How long a control request (``/pause_generation``) waits for the built-in engine's lock.

    megatron-rl bench pause-latency [--trials 7] [--max-new-tokens 480] [--after-steps 30]

The engine loop of ``megatron-rl serve-engine`` takes its lock for each step and takes it again
as soon as the step ends; Python's locks are not fair, so a request handler waiting for the lock
can lose the race step after step. The server makes a waiting handler go before the next step
(``EngineServer._between_steps``). This program measures, in one process, how many engine steps
pass between sending ``/pause_generation`` and its taking effect:

- baseline: the plain lock (the handler takes ``EngineServer.cond`` directly, as before);
- ours: the server as shipped.

Each trial: one in-process server over a random Llama without EOS (so the request runs to
``--max-new-tokens``), one request, ``/pause_generation`` sent once the engine has run
``--after-steps`` steps, then ``/continue_generation``. Trials alternate between the two. The
last line is one JSON object; ``plain_over_fair`` = median steps (baseline) / median steps
(ours), with a floor of one step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request

import torch

from megatron_rl.errors import ArgumentParser, int_arg, run_cli


def make_model(folder: str, max_len: int) -> None:
    """A random fp32 Llama without EOS in ``folder``."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=max_len,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(folder)


def _post(url: str, route: str, body: dict) -> dict:
    req = urllib.request.Request(
        url + route, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def trial(folder: str, args: argparse.Namespace, *, plain: bool, seed: int) -> tuple[int, float]:
    """(engine steps between sending the pause and its reply, milliseconds of that wait)."""
    from megatron_rl.generation.engine.engine import Engine, EngineConfig
    from megatron_rl.generation.engine.server import EngineServer

    engine = Engine.from_pretrained(folder, EngineConfig(max_slots=2, max_len=args.max_len), eos_token_ids=())
    server = EngineServer(engine)
    if plain:
        server._between_steps = lambda: server.cond  # the plain lock: the baseline
    server.start()
    try:
        body = {
            "input_ids": [3, 1, 4, 1, 5],
            "sampling_params": {
                "max_new_tokens": args.max_new_tokens,
                "temperature": 1.0,
                "sampling_seed": seed,
            },
        }
        gen = threading.Thread(target=_post, args=(server.url, "/generate", body))
        gen.start()
        while server.stats["steps"] < args.after_steps:
            time.sleep(0.0005)
        before, t0 = server.stats["steps"], time.perf_counter()
        _post(server.url, "/pause_generation", {"mode": "in_place"})
        steps, ms = server.stats["steps"] - before, 1e3 * (time.perf_counter() - t0)
        _post(server.url, "/continue_generation", {})
        gen.join()
        return steps, ms
    finally:
        server.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="megatron-rl bench pause-latency", description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int_arg(1), default=7)
    p.add_argument("--max-new-tokens", type=int_arg(1), default=480)
    p.add_argument("--after-steps", type=int_arg(0), default=30)
    p.add_argument("--threads", type=int_arg(1), default=1)
    args = p.parse_args(argv)
    args.max_len = args.max_new_tokens + 8
    if args.after_steps >= args.max_new_tokens:
        p.error("--after-steps must be below --max-new-tokens")
    torch.set_num_threads(args.threads)
    rows: dict[str, list[tuple[int, float]]] = {"plain lock (baseline)": [], "ours": []}
    with tempfile.TemporaryDirectory() as folder:
        make_model(folder, args.max_len)
        for i in range(args.trials):
            for name in rows:
                rows[name].append(trial(folder, args, plain=name != "ours", seed=i))
    print(f"{'':24} {'steps (median)':>15} {'steps (max)':>12} {'wait ms (median)':>17}")
    med = {}
    for name, res in rows.items():
        steps = [s for s, _ in res]
        med[name] = statistics.median(steps)
        print(
            f"{name:24} {med[name]:>15.0f} {max(steps):>12d} {statistics.median(ms for _, ms in res):>17.1f}"
        )
    base, ours = med["plain lock (baseline)"], med["ours"]
    print(
        json.dumps(
            {
                "pause_steps_plain_median": base,
                "pause_steps_fair_median": ours,
                "plain_over_fair": base / max(1.0, ours),
                "trials": args.trials,
            }
        )
    )
    return 0


if __name__ == "__main__":  # an argument mistake: one line, exit 2 (errors.run_cli)
    sys.exit(run_cli("megatron-rl bench pause-latency", main))
