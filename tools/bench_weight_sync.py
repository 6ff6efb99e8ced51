"""Weight-update time: ``WeightBroadcaster.sync()``, streamed and per bucket, against one raw
broadcast of the same bytes over the same group.

    megatron-rl bench weight-sync [--hidden 1024] [--layers 4] [--vocab 16384] [--bucket-mb 16]
                                  [--servers 1] [--repeats 5]

Builds a random Llama-style model (fp32, saved with ``save_pretrained``; the defaults make 80.7M
parameters, 323 MB, so that the figure is about bandwidth and overlap, not fixed costs), a
``PolicyTrainer`` on one gloo rank in this process, and ``--servers`` built-in engine servers
(``EngineProcess``) from the same folder. Two ``WeightBroadcaster`` s join them, each on an update
group of its own (gloo over loopback):

- streamed (``stream: on``): pause and the whole update's manifest in one round trip, then the
  ``--bucket-mb`` buckets as bare broadcasts, bucket k+1 packed while bucket k is on the wire,
  the servers' checks overlapping the next bucket, the update swapped in whole at the end;
- per bucket (``stream: off``, SGLang's protocol): one ``/update_weights_from_distributed`` per
  bucket to every server with its broadcast, the servers' check and copy per bucket;
- baseline: one broadcast of a single flat ``uint8`` tensor of the same number of bytes over the
  streamed sync's group, which the servers receive through ``POST /megatron_rl/receive_raw`` and
  discard: the transport alone.

Each is run once untimed (first use of the group's connections), then in ``--repeats``
interleaved rounds (raw, streamed, raw, per bucket); medians are reported, with the breakdown of
each sync (pack, waiting for the packer, broadcast, server apply, control). After the timed syncs,
every server's ``/megatron_rl/weights_digest`` is checked against the trainer's HF tensors. The
last line is one JSON object; ``broadcast_over_raw`` = streamed sync seconds / raw broadcast
seconds (1.0 would be a free update), ``per_bucket_over_raw`` the same for the per-bucket path.
"""

from __future__ import annotations

import argparse
import json
import secrets
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch

from megatron_rl.errors import ArgumentParser, float_arg, int_arg, run_cli


def make_model(folder: str, args: argparse.Namespace) -> int:
    """Save a random fp32 Llama (no EOS) to ``folder``; returns its parameter count."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.ffn or 11 * args.hidden // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, route: str, body: dict, api_key: str) -> dict:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"}
    req = urllib.request.Request(f"{url}{route}", data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def raw_broadcast(
    urls: list[str], group, group_name: str, flat: torch.Tensor, pool: ThreadPoolExecutor, api_key: str
) -> float:
    """Seconds for one broadcast of ``flat`` that every server receives and discards."""
    from megatron_rl.generation.update_group import broadcast

    start = time.perf_counter()
    futs = [
        pool.submit(
            _post, u, "/megatron_rl/receive_raw", {"group_name": group_name, "numel": flat.numel()}, api_key
        )
        for u in urls
    ]
    broadcast(flat, group, src=0)
    for f in futs:
        f.result()
    return time.perf_counter() - start


def _servers_hold(fleet, urls: list[str], trainer) -> bool:
    """Whether every server's weights are the trainer's HF tensors, bit for bit."""
    from megatron_rl.generation.protocol import tensor_digest

    want = {n: tensor_digest(t) for n, t in trainer.hf_tensors()}
    return all(fleet.weights_digest(u) == want for u in urls)


def _sync_pair(trainer, fleet, args: argparse.Namespace):
    """Two broadcasters of the trainer's weights to the same servers, each on a group of its own:
    streamed (one manifest per update, packing overlapped) and per bucket (SGLang's protocol)."""
    from megatron_rl.weight_sync.broadcast import WeightBroadcaster, WeightSyncConfig

    out = []
    for stream in ("on", "off"):
        cfg = WeightSyncConfig(
            backend="gloo",
            master_port=_free_port(),
            bucket_mb=args.bucket_mb,
            group_name=f"bench_weight_sync_{stream}",
            stream=stream,
        )
        bc = WeightBroadcaster(trainer.hf_tensors, fleet, cfg)
        bc.connect()
        out.append(bc)
    return out


def run(args: argparse.Namespace, folder: str) -> dict:
    from megatron_rl.algorithms.config import GRPOConfig
    from megatron_rl.batching.config import BatchingConfig
    from megatron_rl.generation.client import FleetClient
    from megatron_rl.generation.engine.launch import EngineProcess
    from megatron_rl.training.config import TrainerConfig
    from megatron_rl.training.trainer import PolicyTrainer

    params = make_model(folder, args)
    trainer = PolicyTrainer(folder, TrainerConfig(), GRPOConfig(), BatchingConfig())
    api_key = secrets.token_urlsafe(32)  # our servers are never open, not even on loopback
    servers = [EngineProcess(folder, max_slots=1, max_len=64, api_key=api_key) for _ in range(args.servers)]
    try:
        for s in servers:
            s.start()
        urls = [s.url for s in servers]
        fleet = FleetClient(urls, api_key=api_key)
        streamed, per_bucket = _sync_pair(trainer, fleet, args)
        first = streamed.sync(version=1)  # untimed: first use of the group's connections
        per_bucket.sync(version=1)
        nbytes = int(first["weight_sync/bytes"])
        flat = torch.zeros(nbytes, dtype=torch.uint8)
        syncs, buckets, raws = [], [], []
        with ThreadPoolExecutor(len(urls)) as pool:
            raw_broadcast(urls, streamed.group, streamed.cfg.group_name, flat, pool, api_key)  # untimed
            # Interleaved rounds, so that a busy spell of a shared machine hits each alike.
            for i in range(args.repeats):
                raws.append(raw_broadcast(urls, streamed.group, streamed.cfg.group_name, flat, pool, api_key))
                syncs.append(streamed.sync(version=2 + 2 * i))
                raws.append(raw_broadcast(urls, streamed.group, streamed.cfg.group_name, flat, pool, api_key))
                buckets.append(per_bucket.sync(version=3 + 2 * i))
        streamed.sync(version=2 + 2 * args.repeats)  # the servers end on the streamed update
        same = _servers_hold(fleet, urls, trainer)
        streamed.close()
        per_bucket.close()
        fleet.close()
    finally:
        for s in servers:
            s.stop()
        trainer.close()

    def med(runs: list[dict], key: str) -> float:
        return statistics.median(r[f"weight_sync/{key}"] for r in runs)

    raw_s, sync_s, bucket_s = statistics.median(raws), med(syncs, "seconds"), med(buckets, "seconds")
    gb = nbytes / 1e9
    print(
        f"model: Llama-style hidden {args.hidden}, {args.layers} layers, ffn {args.ffn or 11 * args.hidden // 4}, "
        f"vocab {args.vocab}: {params / 1e6:.1f}M parameters, {nbytes / 1e6:.1f} MB fp32 (HF tensors); "
        f"{args.servers} built-in server(s), gloo over loopback; buckets of {args.bucket_mb:g} MB "
        f"({int(first['weight_sync/buckets'])} per sync); median of {args.repeats} interleaved rounds "
        f"(raw, streamed, raw, per bucket); servers hold the trainer's weights after the syncs: "
        f"{'yes' if same else 'NO'}"
    )
    print(f"{'step':52} {'seconds':>8} {'GB/s':>7} {'÷ raw':>7}")
    for label, seconds in [
        ("raw broadcast, one uint8 tensor (baseline)", raw_s),
        ("sync(), streamed (stream: on, built-in engine)", sync_s),
        ("sync(), one HTTP call per bucket (stream: off)", bucket_s),
    ]:
        print(f"{label:52} {seconds:8.3f} {gb / seconds:7.3f} {seconds / raw_s:7.2f}")
    parts = ("pack_s", "pack_wait_s", "broadcast_s", "apply_s", "control_s")
    labels = {
        "pack_s": "pack (on the packer thread, overlapped)",
        "pack_wait_s": "waiting for the packer (not overlapped)",
        "broadcast_s": "broadcast (the buckets on the wire)",
        "apply_s": "server apply (swap in / check + copy)",
        "control_s": "control (HTTP round trips, refresh)",
    }
    breakdown = {
        "streamed": {p: med(syncs, p) for p in parts},
        "per_bucket": {p: med(buckets, p) for p in parts},
    }
    print(f"{'breakdown, median seconds':52} {'stream':>8} {'bucket':>8}")
    for p in parts:
        print(f"  {labels[p]:50} {breakdown['streamed'][p]:8.3f} {breakdown['per_bucket'][p]:8.3f}")
    if not same:
        raise SystemExit("bench weight-sync: a server's weights differ from the trainer's")
    return {
        "broadcast_over_raw": round(sync_s / raw_s, 4),
        "per_bucket_over_raw": round(bucket_s / raw_s, 4),
        "sync_s": round(sync_s, 5),
        "sync_gbps": round(gb / sync_s, 4),
        "per_bucket_s": round(bucket_s, 5),
        "raw_s": round(raw_s, 5),
        "raw_gbps": round(gb / raw_s, 4),
        "bytes": nbytes,
        "buckets": int(first["weight_sync/buckets"]),
        "bucket_mb": args.bucket_mb,
        **{f"stream_{p}": round(v, 5) for p, v in breakdown["streamed"].items()},
        **{f"per_bucket_{p}": round(v, 5) for p, v in breakdown["per_bucket"].items()},
        "servers": args.servers,
        "params": params,
        "repeats": args.repeats,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int_arg(1), default=1024)
    ap.add_argument("--layers", type=int_arg(1), default=4)
    ap.add_argument("--heads", type=int_arg(1), default=8)
    ap.add_argument("--kv-heads", type=int_arg(1), default=4)
    ap.add_argument(
        "--ffn",
        type=int_arg(0, note=" (0: the default width)"),
        default=0,
        help="MLP width (0: 11/4 x hidden)",
    )
    ap.add_argument("--vocab", type=int_arg(1), default=16384)
    ap.add_argument(
        "--bucket-mb", type=float_arg(0.0, low_open=True), default=16.0, help="bytes per sync broadcast"
    )
    ap.add_argument("--servers", type=int_arg(1), default=1, help="built-in engine servers to update")
    ap.add_argument("--repeats", type=int_arg(1), default=5, help="timed runs of each (median)")
    args = ap.parse_args(argv)
    if args.servers < 1 or args.repeats < 1:
        ap.error("--servers and --repeats must be >= 1")
    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-") as folder:
        out = run(args, folder)
    print(json.dumps(out))
    return out


if __name__ == "__main__":  # an argument mistake: one line, exit 2 (errors.run_cli)
    sys.exit(run_cli("megatron-rl bench weight-sync", main))
