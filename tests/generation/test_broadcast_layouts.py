"""A weight update from a two-rank trainer at TP=2 and at PP=2 to a built-in engine server.

One spawn of two gloo ranks (``tests/spawn.py``) runs both layouts, one after the other, because
each process start costs seconds. At each layout the ranks build a ``PolicyTrainer``, connect a
``WeightBroadcaster`` to that layout's server (one per layout, started here, so that each can be
checked after the spawn) and ``sync(version=5)``: TP shards are all-gathered inside the stage,
the second pipeline stage sends its tensors to rank 0, and rank 0 alone broadcasts. Rank 0 then
writes the HF tensors the trainer holds (``PolicyTrainer.hf_tensors``) to a file, and every rank returns the
trainer's own log-probs of a few fixed sequences (Megatron's forward at that layout). This
process checks, per layout, that

- the server's ``/megatron_rl/weights_digest`` is the sha256 of those tensors, bit for bit;
- a ``/generate`` through the fleet client reports version 5 for every token;
- the tensors are the trainer's model, not merely what the converter made of it: a plain HF-named
  decoder loaded with them gives the trainer's log-probs (a shard gathered in the wrong order or
  a stage's layers misnumbered would not).
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.request

import pytest
import torch

from megatron_rl.generation.api import GenRequest
from megatron_rl.generation.client import FleetClient
from megatron_rl.generation.engine.launch import EngineProcess
from tests.generation.conftest import free_port, prompt
from tests.spawn import run_ranks

pytestmark = pytest.mark.distributed

VERSION = 5
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}  # name -> (tensor_parallel, pipeline_parallel)
SEQUENCES = [(prompt(4 + i, 300 + i), prompt(8, 400 + i)) for i in range(3)]  # (prompt, completion)
# The trainer (Megatron, fp32) and the HF-named decoder compute the same log-softmax with
# differently ordered fp32 sums: ~1e-6 apart. A wrong tensor moves log-probs by O(0.1).
LOGPROB_TOL = 1e-4


def _sync_one_layout(
    rank: int, name: str, folder: str, url: str, port: int, out_file: str
) -> list[list[float]]:
    """Build the trainer at layout ``name``, join the update group, sync, report."""
    from safetensors.torch import save_file

    from megatron_rl.algorithms.config import GRPOConfig
    from megatron_rl.batching.config import BatchingConfig
    from megatron_rl.training.config import TrainerConfig
    from megatron_rl.training.parallel import ParallelConfig
    from megatron_rl.training.trainer import PolicyTrainer
    from megatron_rl.types import TrainBatch, TrainSequence
    from megatron_rl.weight_sync.broadcast import WeightBroadcaster, WeightSyncConfig

    tp, pp = LAYOUTS[name]
    trainer = PolicyTrainer(
        folder,
        TrainerConfig(parallel=ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp)),
        GRPOConfig(),
        BatchingConfig(),
    )
    fleet = FleetClient([url])
    try:
        # Small buckets (50 KB): several broadcasts per sync.
        bc = WeightBroadcaster(
            trainer.hf_tensors,
            fleet,
            WeightSyncConfig(backend="gloo", master_port=port, bucket_mb=0.05, group_name=f"layouts_{name}"),
        )
        bc.connect()
        stats = bc.sync(version=VERSION)
        hf = {n: t.clone() for n, t in trainer.hf_tensors()}
        if rank == 0:
            assert stats["weight_sync/buckets"] > 1, stats
            save_file(hf, out_file)
        else:
            assert not hf  # everything went to rank 0
        bc.close()
        batch = TrainBatch(
            sequences=[
                TrainSequence(
                    tokens=torch.tensor(p + c),
                    prompt_length=len(p),
                    behaviour_logprobs=torch.zeros(len(c)),
                    versions=torch.zeros(len(c), dtype=torch.long),
                    advantage=0.0,
                    weight=1.0,
                    group_id=i,
                )
                for i, (p, c) in enumerate(SEQUENCES)
            ]
        )
        # Plain floats: tensors would cross the result queue as shared memory that dies with
        # this process.
        return [lp.tolist() for lp in trainer.compute_logprobs(batch, temperature=1.0)]
    finally:
        fleet.close()
        trainer.close()


def _sync_every_layout(rank: int, world: int, folder: str, jobs: dict) -> dict:
    """One trainer rank: every layout in turn; ``jobs``: name -> (url, port, out_file)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU test by design, also where a GPU is present
    return {name: _sync_one_layout(rank, name, folder, *job) for name, job in jobs.items()}


@pytest.fixture(scope="module")
def servers(tiny_llama):
    """One server per layout. Started from this thread: a server dies with the thread that
    started it (``PR_SET_PDEATHSIG``), so not from a short-lived worker thread."""
    procs = {name: EngineProcess(tiny_llama, max_slots=4, max_len=64) for name in LAYOUTS}
    try:
        for p in procs.values():
            p.start()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def _sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _digest(url: str) -> dict[str, str]:
    return json.load(urllib.request.urlopen(f"{url}/megatron_rl/weights_digest"))


def _decoder_logprobs(folder: str, hf: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    from megatron_rl.generation.engine.model import Decoder

    model = Decoder.from_pretrained(folder)
    model.load_state_dict(hf)
    out = []
    for p, c in SEQUENCES:
        logits = model.full_logits(torch.tensor([p + c]))[0, len(p) - 1 : -1]
        out.append(torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(c)[:, None])[:, 0])
    return out


def test_two_rank_trainers_at_tp2_and_pp2_update_their_servers(servers, tiny_llama, tmp_path):
    from safetensors.torch import load_file

    before = {name: _digest(s.url) for name, s in servers.items()}
    jobs = {name: (s.url, free_port(), str(tmp_path / f"{name}.safetensors")) for name, s in servers.items()}
    per_rank = run_ranks(_sync_every_layout, 2, args=(tiny_llama, jobs), timeout=120)

    for name, server in servers.items():
        hf = load_file(jobs[name][2])
        digest = _digest(server.url)
        assert digest == {n: _sha256(t) for n, t in hf.items()}, name
        assert digest != before[name], name

        fleet = FleetClient([server.url])
        reqs = [
            GenRequest(
                request_id=f"{name}-{i}",
                input_ids=prompt(5, 700 + i),
                max_new_tokens=6,
                temperature=1.0,
                seed=i,
            )
            for i in range(3)
        ]
        results = list(fleet.generate(reqs))
        fleet.close()
        assert sorted(r.request_id for r in results) == [r.request_id for r in reqs], name
        assert all(r.versions == [VERSION] * 6 for r in results), name

        # Both ranks got the same trainer log-probs (all-reduced); the tensors reproduce them.
        assert per_rank[0][name] == per_rank[1][name], name
        for trainer_lp, decoder_lp in zip(per_rank[0][name], _decoder_logprobs(tiny_llama, hf)):
            torch.testing.assert_close(
                decoder_lp, torch.tensor(trainer_lp), atol=LOGPROB_TOL, rtol=0, msg=lambda m: f"{name}: {m}"
            )
