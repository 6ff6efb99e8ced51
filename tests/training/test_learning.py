"""The trainer learns: SFT on a generated task lowers the loss on fresh problems, and GRPO on the
policy's own samples raises a toy reward. Single process (TP = PP = DP = 1), fixed seeds.

The GRPO test samples with a tiny sampler written here (full forward over the prefix, softmax over
the real vocabulary, multinomial; no KV cache: completions are 8 tokens) and records behaviour
log-probs, as the generator would; before the first update those must equal the trainer's own.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algorithms.config import GRPOConfig
from megatron_rl.batching.builder import build_train_batch
from megatron_rl.batching.config import BatchingConfig
from megatron_rl.batching.sft import build_sft_batch
from megatron_rl.training.config import OptimConfig, TrainerConfig
from megatron_rl.training.trainer import PolicyTrainer
from megatron_rl.types import Completion, Group, Prompt, ScoredCompletion
from tests.training.conftest import tiny_llama_config

VOCAB = 32  # real vocabulary (padded to 1024 by the model; the padded ids are never sampled)


@pytest.fixture(autouse=True)
def _one_thread():
    # Hundreds of tiny steps: per-op overhead dominates, and two intra-op threads on a two-core
    # machine stall on OpenMP barriers whenever another process holds a core (measured: 0.03 s
    # steps becoming 0.2-1 s). One thread keeps these tests at a steady few seconds.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _trainer(lr: float, seed: int) -> PolicyTrainer:
    hf = tiny_llama_config(VOCAB, 64)
    torch.manual_seed(seed)  # CPU initialisation draws from the default generator
    return PolicyTrainer(
        hf,
        TrainerConfig(optim=OptimConfig(lr=lr, clip_grad=1.0)),
        GRPOConfig(),
        BatchingConfig(token_budget=256),
    )


# -- SFT: reverse a string of digits ----------------------------------------------------------------

BOS, SEP, EOS, DIGIT0 = 1, 2, 3, 4  # digits are ids 4..13


def _reverse_pairs(n: int, generator: torch.Generator) -> list[tuple[list[int], list[int]]]:
    pairs = []
    for _ in range(n):
        digits = (DIGIT0 + torch.randint(0, 10, (5,), generator=generator)).tolist()
        pairs.append(([BOS, *digits, SEP], [*reversed(digits), EOS]))
    return pairs


def test_sft_learns_to_reverse_digits(single_rank):
    trainer = _trainer(lr=3e-3, seed=0)
    gen = torch.Generator().manual_seed(0)
    held_out = build_sft_batch(_reverse_pairs(64, torch.Generator().manual_seed(99)))
    before = trainer.forward_backward(held_out, "sft")["loss"]
    losses = [trainer.sft_step(build_sft_batch(_reverse_pairs(32, gen)))["loss"] for _ in range(150)]
    after = trainer.forward_backward(held_out, "sft")["loss"]
    assert all(torch.isfinite(torch.tensor(losses)))
    # Uniform over the 32 ids is ln 32 = 3.47; guessing "some digit" gives ln 10 = 2.30 (66%). A
    # quarter of the start on problems never trained on needs the order (measured: ~10-12%).
    assert after < 0.25 * before, (before, after, losses[::10])


# -- GRPO: a toy reward on the policy's own samples --------------------------------------------------

TARGET = (20, 21, 22, 23)  # reward: the fraction of completion tokens in this set (4/32 at random)
GROUPS, GROUP_SIZE, COMPLETION = 4, 8, 8


@torch.no_grad()
def _sample(
    model, prompt: list[int], n: int, length: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` completions of ``length`` tokens and their behaviour log-probs, both ``[n, length]``."""
    seqs = torch.tensor(prompt).repeat(n, 1)
    logps = []
    for _ in range(length):
        s = seqs.shape[1]
        logits = model(seqs, torch.arange(s).expand(n, s), None)[:, -1, :VOCAB].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        token = torch.multinomial(logprobs.exp(), 1, generator=gen)
        logps.append(logprobs.gather(1, token))
        seqs = torch.cat([seqs, token], dim=1)
    return seqs[:, len(prompt) :], torch.cat(logps, dim=1)


def _groups(model, prompts: list[list[int]], gen: torch.Generator, version: int) -> list[Group]:
    groups = []
    for i, prompt in enumerate(prompts):
        tokens, logps = _sample(model, prompt, GROUP_SIZE, COMPLETION, gen)
        scored = []
        for k in range(GROUP_SIZE):
            ids = tokens[k].tolist()
            reward = sum(t in TARGET for t in ids) / len(ids)
            comp = Completion(
                prompt_id=str(i),
                sample_index=k,
                token_ids=ids,
                logprobs=logps[k].tolist(),
                versions=[version] * len(ids),
            )
            scored.append(ScoredCompletion(completion=comp, reward=reward))
        groups.append(Group(prompt=Prompt(prompt_id=str(i), token_ids=prompt), completions=scored))
    return groups


def _mean_reward(groups: list[Group]) -> float:
    rewards = [sc.reward for g in groups for sc in g.completions]
    return sum(rewards) / len(rewards)


def test_grpo_raises_the_reward_of_its_own_samples(single_rank):
    trainer = _trainer(lr=2e-3, seed=1)
    policy = trainer.chunks[0]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, VOCAB, (4,), generator=gen).tolist() for _ in range(GROUPS)]
    rewards, first = [], None
    for step in range(20):
        groups = _groups(policy, prompts, gen, version=step)
        rewards.append(_mean_reward(groups))
        metrics = trainer.rl_step(build_train_batch(groups, GRPOConfig()))
        first = first or metrics
    # On-policy before the first update: the trainer's log-probs are the sampler's.
    assert first["ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert first["approx_kl_mean"] == pytest.approx(0.0, abs=1e-6)
    start, end = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert end > start + 0.3, [round(r, 3) for r in rewards]


def test_trainer_checkpoint_resumes_the_next_step_exactly(single_rank, tmp_path):
    """Train 3 SFT steps, checkpoint after the 2nd; a fresh trainer loading it takes a 3rd step
    with the uninterrupted run's loss, grad norm and learning rate, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    batches = [build_sft_batch(_reverse_pairs(8, gen)) for _ in range(3)]
    trainer = _trainer(lr=3e-3, seed=0)
    for b in batches[:2]:
        trainer.sft_step(b)
    trainer.save_checkpoint(tmp_path, extra={"cursor": 2})
    expected = trainer.sft_step(batches[2])
    trainer.close()

    resumed = _trainer(lr=3e-3, seed=123)  # different init: everything must come from the file
    assert resumed.load_checkpoint(tmp_path) == {"cursor": 2} and resumed.step == 2
    got = resumed.sft_step(batches[2])
    resumed.close()
    for key in ("loss", "grad_norm", "lr"):
        assert got[key] == expected[key], key
