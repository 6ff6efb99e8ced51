"""The SGLang steps of ``tools/gpu_check.py`` (one GPU, or two for ``nccl``; sglang installed).

    python tools/gpu_check_sglang.py {generation,colocated,nccl} --work DIR --logs DIR

Each step saves (or reuses) a random ~1.1B-parameter Llama in bf16 under ``DIR/model`` (the shape
``gpu_check.py`` trains, ``gpu_check.MODEL``; no EOS token, so every request runs to its length),
starts SGLang's own server on it (``python -m sglang.launch_server``, loopback, an API key, its
PID tracked and its process group stopped at the end) and drives it with our code:

- ``generation``: tokens/s on the RL workload through ``FleetClient.submit``: 64 prompts of
  128-512 tokens, each sampled 8 times (a group shares its prompt, so SGLang's prefix cache serves
  it once), completion lengths lognormal (median 512, sigma 1, cut at 4,096) as
  ``megatron-rl bench generation`` draws them, 32 groups outstanding and a new group sent as soon
  as one completes; after 16 warm-up requests.
- ``colocated``: SGLang (``--enable-memory-saver``) and a ``PolicyTrainer`` on the same GPU, as
  ``loop.mode: colocated`` runs them (``weight_sync/colocated.py``): generate a batch of groups,
  ``TensorPusher.release``, one ``rl_step`` on that batch, ``TensorPusher.sync`` (weights memory
  back, the bf16 HF tensors by CUDA IPC handle through ``/update_weights_from_tensor``, KV cache
  back); 3 rounds, the first untimed. Checked: after the update SGLang's ``lm_head.weight`` (read
  back through ``/get_weights_by_name``) equals the trainer's, and differs from what it held before.
- ``nccl``: the trainer on GPU 0 and SGLang on GPU 1 (``--base-gpu-id 1``), our
  ``WeightBroadcaster`` over an NCCL update group (SGLang's per-bucket
  ``/update_weights_from_distributed``): one untimed sync, then 3 timed (median), the same check.

The last line is one JSON object of the figures (or ``failed`` and why).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import Future
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generation import drive_groups  # tools/ is on sys.path (above)
from gpu_check import MODEL

SERVER_START_S = 240.0  # the step's own budget (gpu_check.STEPS) cuts this shorter
CHECK_ROWS = 4  # rows of lm_head.weight read back from SGLang and compared with the trainer's
_RUNNING: list[subprocess.Popen[bytes]] = []  # servers started here, for the SIGTERM handler


def _on_sigterm(signum: int, frame: object) -> None:
    """The driver's budget ran out: kill our servers' process groups at once (SGLang's scheduler
    processes are children of its launcher, in the same group), then exit."""
    for proc in _RUNNING:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os._exit(128 + signum)


def make_model(work: Path) -> Path:
    """The random bf16 Llama of ``MODEL`` under ``work/model`` (built on the GPU, saved once)."""
    import torch
    import transformers

    folder = work / "model"
    if (folder / "config.json").is_file():
        return folder
    cfg = transformers.LlamaConfig(
        **MODEL,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        eos_token_id=None,  # random weights: no EOS, every request runs to its max_new_tokens
        bos_token_id=None,
        pad_token_id=None,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    model.save_pretrained(str(folder) + ".tmp")
    os.replace(str(folder) + ".tmp", folder)  # a step killed mid-save leaves no half folder
    del model
    torch.cuda.empty_cache()
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SGLangServer:
    """``python -m sglang.launch_server`` on loopback with an API key; stopped by its PID's
    process group (never by name)."""

    def __init__(self, model: Path, log: Path, extra: list[str]) -> None:
        self.key = secrets.token_urlsafe(24)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = server_command(model, self.port, extra)
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> SGLangServer:
        t0 = time.monotonic()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.cmd, f"--api-key={self.key}"],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its group is ours to stop, scheduler processes included
            )
        _RUNNING.append(self.proc)
        while time.monotonic() - t0 < SERVER_START_S:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"SGLang exited with {self.proc.returncode} while starting; see {self.log}"
                )
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).read()
                self.start_s = time.monotonic() - t0
                print(f"SGLang up in {self.start_s:.0f} s at {self.url}", flush=True)
                return self
            except OSError:
                time.sleep(1)
        self.__exit__()
        raise TimeoutError(f"SGLang did not answer /health in {SERVER_START_S:.0f} s; see {self.log}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=wait_s)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue

    def post(self, route: str, body: dict) -> object:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.key}"}
        req = urllib.request.Request(self.url + route, data=json.dumps(body).encode(), headers=headers)
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.load(r)

    def lm_head_rows(self) -> list[float]:
        """The first ``CHECK_ROWS`` rows of SGLang's ``lm_head.weight``, flattened (fp32 values)."""
        rows = self.post("/get_weights_by_name", {"name": "lm_head.weight", "truncate_size": CHECK_ROWS})
        return [float(x) for row in rows for x in row]  # type: ignore[union-attr]


def server_command(model: Path, port: int, extra: list[str]) -> list[str]:
    """The server's command line, without the key (every flag is pinned by
    ``tests/test_gpu_check.py`` against SGLang 0.5.23's own flags)."""
    return [
        sys.executable,
        "-m",
        "sglang.launch_server",
        *("--model-path", str(model), "--host", "127.0.0.1", "--port", str(port)),
        *("--skip-tokenizer-init", "--random-seed", "0", "--log-level", "warning"),
        *extra,
    ]


# Per step: what SGLang is started with on top of server_command's flags.
SERVER_EXTRA = {
    "generation": ["--mem-fraction-static", "0.85"],
    # Colocated: SGLang's share of the GPU while it holds its memory; the trainer's weights,
    # gradients and Adam state (~20 GB at 1.1B) stay resident beside it. CUDA graphs are kept (they
    # are released and resumed too) but captured only up to the batch sizes this step uses.
    "colocated": [
        *("--enable-memory-saver", "--mem-fraction-static", "0.35"),
        *("--cuda-graph-max-bs-decode", "32"),
    ],
    # NCCL: SGLang alone on GPU 1; the update needs no CUDA graphs, and skipping them saves start-up.
    "nccl": ["--base-gpu-id", "1", "--mem-fraction-static", "0.5", "--disable-cuda-graph"],
}


def rl_workload(seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, completion lengths per group): see the module docstring."""
    rng = random.Random(seed)
    vocab = MODEL["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(128, 512))] for _ in range(64)]
    lengths = [
        [min(4096, max(1, round(512 * math.exp(rng.gauss(0.0, 1.0))))) for _ in range(8)] for _ in range(64)
    ]
    return prompts, lengths


def generation(work: Path, logs: Path) -> dict[str, object]:
    from megatron_rl.generation.api import GenRequest
    from megatron_rl.generation.client import FleetClient

    model = make_model(work)
    prompts, lengths = rl_workload()
    with SGLangServer(model, logs / "sglang-generation.log", SERVER_EXTRA["generation"]) as server:
        with FleetClient([server.url], api_key=server.key) as fleet:
            warm = [
                GenRequest(request_id=f"w{i}", input_ids=prompts[i][:64], max_new_tokens=64)
                for i in range(16)
            ]
            list(fleet.generate(warm))

            def send(g: int) -> list[Future]:
                return [
                    fleet.submit(
                        GenRequest(
                            request_id=f"g{g}-{k}",
                            input_ids=prompts[g],
                            max_new_tokens=n,
                            temperature=1.0,
                            seed=1000 * g + k,
                        )
                    )
                    for k, n in enumerate(lengths[g])
                ]

            tokens, short = 0, 0

            def count(res) -> None:
                nonlocal tokens, short
                tokens += len(res.token_ids)
                short += res.finish_reason != "length"

            t0 = time.perf_counter()
            drive_groups(send, len(prompts), 32, count)  # 32 groups in flight, refilled as each ends
            dt = time.perf_counter() - t0
    wanted = sum(map(sum, lengths))
    print(f"SGLang, RL workload: {tokens} tokens ({wanted} asked) in {dt:.1f} s: {tokens / dt:.0f} tokens/s")
    return {
        "sglang_tokens_per_s": round(tokens / dt, 1),
        "tokens": tokens,
        "tokens_asked": wanted,
        "ended_early": short,
        "seconds": round(dt, 2),
        "requests": sum(map(len, lengths)),
        "server_start_s": round(server.start_s, 1),
    }


def _trainer(model: Path, lr: float):
    """A one-GPU ``PolicyTrainer`` on the saved model (bf16; TE's spec when installed). A large
    ``lr`` so that one Adam step moves every ``lm_head`` value by more than bf16's resolution."""
    from megatron_rl.algorithms.config import GRPOConfig
    from megatron_rl.batching.config import BatchingConfig
    from megatron_rl.training.config import OptimConfig, TrainerConfig
    from megatron_rl.training.trainer import PolicyTrainer

    cfg = TrainerConfig(optim=OptimConfig(lr=lr), precision="bf16")
    return PolicyTrainer(str(model), cfg, GRPOConfig(), BatchingConfig(token_budget=8192))


def _rollout_batch(fleet, version: int, groups: int = 4, group_size: int = 8, n: int = 256):
    """A GRPO minibatch from SGLang's own completions (prompts of 128 random tokens), rewards
    alternating so that no group is dropped: the loop's data flow, on a small scale."""
    from megatron_rl.algorithms.config import GRPOConfig
    from megatron_rl.batching.builder import build_train_batch
    from megatron_rl.generation.api import GenRequest
    from megatron_rl.types import Completion, Group, Prompt, ScoredCompletion

    rng = random.Random(version)
    prompts = [[rng.randrange(MODEL["vocab_size"]) for _ in range(128)] for _ in range(groups)]
    reqs = [
        GenRequest(request_id=f"v{version}-{g}-{k}", input_ids=p, max_new_tokens=n, seed=100 * g + k)
        for g, p in enumerate(prompts)
        for k in range(group_size)
    ]
    results = {r.request_id: r for r in fleet.generate(reqs)}
    batch_groups = []
    for g, p in enumerate(prompts):
        scored = []
        for k in range(group_size):
            r = results[f"v{version}-{g}-{k}"]
            comp = Completion(
                prompt_id=str(g),
                sample_index=k,
                token_ids=r.token_ids,
                logprobs=r.logprobs,
                versions=r.versions,
            )
            scored.append(ScoredCompletion(completion=comp, reward=float(k % 2)))
        batch_groups.append(Group(prompt=Prompt(prompt_id=str(g), token_ids=p), completions=scored))
    return build_train_batch(batch_groups, GRPOConfig()), results


def _lm_head_rows(trainer) -> list[float]:
    for name, t in trainer.hf_tensors():
        if name == "lm_head.weight":
            return t[:CHECK_ROWS].float().flatten().tolist()
    raise RuntimeError("the trainer's hf_tensors have no lm_head.weight")


def _check(server: SGLangServer, trainer, before: list[float]) -> dict[str, object]:
    """Whether SGLang holds the trainer's ``lm_head`` rows now, and whether they moved."""
    ours, theirs = _lm_head_rows(trainer), server.lm_head_rows()
    return {
        "weights_match": ours == theirs,
        "weights_max_abs_diff": max(abs(a - b) for a, b in zip(ours, theirs)),
        "weights_changed_by_training": ours != before,
    }


def colocated(work: Path, logs: Path) -> dict[str, object]:
    from megatron_rl.generation.client import FleetClient
    from megatron_rl.weight_sync.broadcast import WeightSyncConfig
    from megatron_rl.weight_sync.colocated import TensorPusher

    model = make_model(work)
    with SGLangServer(model, logs / "sglang-colocated.log", SERVER_EXTRA["colocated"]) as server:
        before = server.lm_head_rows()
        trainer = _trainer(model, lr=1e-3)
        with FleetClient([server.url], api_key=server.key) as fleet:
            push = TensorPusher(trainer.hf_tensors, fleet, WeightSyncConfig(cast_dtype="bfloat16"))
            push.connect()
            rounds = []
            for version in range(1, 4):
                batch, _ = _rollout_batch(fleet, version)
                release = push.release()
                t0 = time.perf_counter()
                train = trainer.rl_step(batch)
                train_s = time.perf_counter() - t0
                stats = push.sync(version=version)
                rounds.append({**release, **stats, "train_s": train_s, "loss": train["loss"]})
                print(
                    f"round {version}: release {release['colocate/release_s']:.3f} s, train {train_s:.2f} s, "
                    f"update {stats['weight_sync/seconds']:.3f} s ({stats['weight_sync/gb_per_s']:.2f} GB/s)",
                    flush=True,
                )
            _, after = _rollout_batch(fleet, 99, groups=1, n=16)  # it generates after the resume
            check = _check(server, trainer, before)
        trainer.close()
    timed = rounds[1:]  # the first round opens the CUDA IPC handles and warms the allocator

    def med(key: str) -> float:
        return round(statistics.median(r[key] for r in timed), 4)

    out = {
        "update_s": med("weight_sync/seconds"),
        "update_gbps": med("weight_sync/gb_per_s"),
        "release_s": med("colocate/release_s"),
        "resume_weights_s": med("weight_sync/pause_s"),
        "train_step_s": med("train_s"),
        "bytes": int(rounds[-1]["weight_sync/bytes"]),
        "buckets": int(rounds[-1]["weight_sync/buckets"]),
        "generates_after_update": all(len(r.token_ids) == 16 for r in after.values()),
        "versions_after_update": sorted({v for r in after.values() for v in r.versions}),
        **check,
        "server_start_s": round(server.start_s, 1),
    }
    if not (
        check["weights_match"] and check["weights_changed_by_training"] and out["generates_after_update"]
    ):
        out["failed"] = "SGLang does not hold the trainer's weights after the colocated update"
    return out


def nccl(work: Path, logs: Path) -> dict[str, object]:
    import torch

    from megatron_rl.generation.client import FleetClient
    from megatron_rl.weight_sync.broadcast import WeightBroadcaster, WeightSyncConfig

    if torch.cuda.device_count() < 2:
        return {"skipped": "needs 2 GPUs (trainer on GPU 0, SGLang on GPU 1)"}
    model = make_model(work)
    with SGLangServer(model, logs / "sglang-nccl.log", SERVER_EXTRA["nccl"]) as server:
        before = server.lm_head_rows()
        trainer = _trainer(model, lr=1e-3)
        with FleetClient([server.url], api_key=server.key) as fleet:
            cfg = WeightSyncConfig(backend="nccl", cast_dtype="bfloat16", master_port=_free_port())
            sync = WeightBroadcaster(trainer.hf_tensors, fleet, cfg)
            sync.connect()
            sync.sync(version=1)  # untimed: the group's first use
            batch, _ = _rollout_batch(fleet, 1)
            trainer.rl_step(batch)
            runs = [sync.sync(version=v) for v in range(2, 5)]
            check = _check(server, trainer, before)
            sync.close()
        trainer.close()

    def med(key: str) -> float:
        return round(statistics.median(r[f"weight_sync/{key}"] for r in runs), 4)

    out = {
        "sync_s": med("seconds"),
        "sync_gbps": med("gb_per_s"),
        "broadcast_s": med("broadcast_s") if "weight_sync/broadcast_s" in runs[0] else None,
        "control_s": med("control_s") if "weight_sync/control_s" in runs[0] else None,
        "bytes": int(runs[-1]["weight_sync/bytes"]),
        "streamed": sync.streaming,
        **check,
        "server_start_s": round(server.start_s, 1),
    }
    if not check["weights_match"]:
        out["failed"] = "SGLang does not hold the trainer's weights after the NCCL sync"
    return out


STEP_FUNCTIONS = {"generation": generation, "colocated": colocated, "nccl": nccl}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("step", choices=sorted(STEP_FUNCTIONS))
    ap.add_argument("--work", type=Path, required=True, help="folder for the model (made once, reused)")
    ap.add_argument("--logs", type=Path, required=True, help="folder for SGLang's server logs")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    args.logs.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        out = STEP_FUNCTIONS[args.step](args.work, args.logs)
    except Exception as e:  # re-raised: the driver wants one JSON line whatever went wrong
        print(json.dumps({"failed": f"{type(e).__name__}: {e}"}))
        raise
    print(json.dumps(out))
    return 1 if "failed" in out else 0


if __name__ == "__main__":
    sys.exit(main())
