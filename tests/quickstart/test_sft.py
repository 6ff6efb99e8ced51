"""SFT warm-up: the traces earn the full reward, a short run lowers the loss, and the exported HF
folder is the trainer's model exactly (the engine's logits equal the trainer's, fp32).

One process, one rank: the trainer sets up (and tears down) a one-rank gloo group itself.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from megatron_rl.batching.sft import build_sft_batch
from megatron_rl.generation.engine.model import Decoder
from megatron_rl.quickstart.model import TinyModelConfig, build_model_folder
from megatron_rl.quickstart.sft import (
    SFTConfig,
    ThreadGovernor,
    _batches,
    format_trace,
    make_trainer,
    run_sft,
    sft_pairs,
    slipped_answer,
)
from megatron_rl.rewards.compose import RewardConfig, RewardInput, score
from megatron_rl.rewards.format import check_format

TINY = TinyModelConfig(
    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, max_positions=128, seed=1
)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny steps: per-op overhead dominates (tests/training does so too)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def init_dir(tokenizer_dir, tmp_path_factory):
    return build_model_folder(TINY, tokenizer_dir, tmp_path_factory.mktemp("m") / "init")


def test_trace_gets_the_full_reward(problems):
    train, _ = problems
    cfg = RewardConfig()
    levels = {}
    for p in train:
        levels.setdefault((p.kind, p.difficulty), p)
    rng = random.Random(0)
    for p in levels.values():
        trace = format_trace(p)
        parsed, why = check_format(trace, "math")
        assert parsed is not None, why
        r = score(
            RewardInput(problem=p.problem, completion=trace, task="math", answer=p.answer, num_tokens=40), cfg
        )
        assert r.format_ok and r.correct, (trace, r)
        # format 0.1 + correct 0.9 + language 0.1 (English words in both sections)
        assert r.reward == pytest.approx(1.1), (trace, r)
        # a slipped trace keeps the format and loses exactly the correctness part
        slipped = format_trace(p, slip=slipped_answer(p.answer, rng))
        r = score(
            RewardInput(problem=p.problem, completion=slipped, task="math", answer=p.answer, num_tokens=40),
            cfg,
        )
        assert r.format_ok and not r.correct and r.reward == pytest.approx(0.2), (slipped, r)


def test_slip_changes_one_digit_of_the_last_result_and_the_box(problems):
    train, _ = problems
    rng = random.Random(1)
    for p in train[:200]:
        wrong = slipped_answer(p.answer, rng)
        assert wrong != p.answer and len(wrong) == len(p.answer)
        assert sum(a != b for a, b in zip(wrong, p.answer)) == 1
        assert (wrong != "-0" and not wrong.lstrip("-").startswith("0")) or wrong == "0"
        plain, slipped = format_trace(p), format_trace(p, slip=wrong)
        # everything before the last result is the same; the box holds the slipped value
        last = plain.rindex(f" {p.answer}.</think>")
        assert slipped[:last] == plain[:last]
        assert slipped.endswith(f"\\boxed{{{wrong}}}.") and f" {wrong}.</think>" in slipped


def test_pairs_end_with_eos_and_prompt_ends_with_assistant(tokenizer, problems):
    train, _ = problems
    for (prompt, answer), p in zip(sft_pairs(tokenizer, train[:5]), train[:5]):
        assert answer[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(answer, skip_special_tokens=True) == format_trace(p)
        assert prompt[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")


def test_pairs_slip_at_the_configured_rate_and_batches_cover_every_problem(tokenizer, problems):
    train, _ = problems
    plain = sft_pairs(tokenizer, train[:100])
    slipped = sft_pairs(tokenizer, train[:100] * 4, slip_rate=0.3, rng=random.Random(0))
    rate = sum(a != plain[i % 100][1] for i, (_, a) in enumerate(slipped)) / len(slipped)
    assert 0.22 < rate < 0.38
    epoch = [p for _, batch in zip(range(10), _batches(train[:50], 5, seed=0)) for p in batch]
    assert sorted(p.id for p in epoch) == sorted(p.id for p in train[:50])


def test_init_folder_is_an_hf_model(init_dir, tokenizer):
    config = json.loads((init_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == len(tokenizer)
    assert config["eos_token_id"] == tokenizer.eos_token_id
    assert (init_dir / "model.safetensors").is_file() and (init_dir / "tokenizer.json").is_file()
    Decoder.from_pretrained(init_dir)  # the engine's loader accepts it


def test_short_sft_lowers_the_loss_and_exports_the_trainer_model(init_dir, tokenizer, problems, tmp_path):
    train, _ = problems
    batch = build_sft_batch(sft_pairs(tokenizer, train[:16]))
    trainer = make_trainer(init_dir, lr=1e-2)
    try:
        losses = [trainer.sft_step(batch)["loss"] for _ in range(12)]
        # Near ln(V) ~ 5.5 at random init; one batch repeated is quickly fitted in part.
        assert losses[0] > 4.5 and losses[-1] < 0.7 * losses[0], losses
        out = trainer.export_hf(tmp_path / "sft", like=init_dir)
        seq = batch.sequences[0].tokens[None]
        with torch.no_grad():
            theirs = trainer.chunks[0](seq, torch.arange(seq.shape[1])[None], None)
    finally:
        trainer.close()
    engine_model = Decoder.from_pretrained(out)
    ours = engine_model.full_logits(seq)
    vocab = len(tokenizer)
    assert ours.shape[-1] == vocab
    torch.testing.assert_close(ours, theirs[..., :vocab].float(), rtol=0, atol=1e-5)


def test_run_sft_end_to_end(init_dir, problems, tmp_path):
    train, _ = problems
    result = run_sft(
        init_dir,
        train,
        tmp_path / "sft",
        SFTConfig(steps=8, batch_size=16, lr=1e-2, min_lr=1e-3, warmup_steps=1, slip_rate=0.0),
        progress=False,
    )
    assert len(result.losses) == 8 and result.losses[-1] < result.losses[0]
    assert (result.folder / "model.safetensors").is_file()
    assert (result.folder / "tokenizer_config.json").is_file()
    Decoder.from_pretrained(result.folder)


def test_thread_governor_follows_the_faster_setting():
    """Two settings whose speed flips when 'load' arrives: the governor checks both, uses the
    faster, and re-checks at once when a step of the one in use turns slow."""
    threads = torch.get_num_threads()
    try:
        governor = ThreadGovernor((1, 2), every=10, trials=2)
        cost, used = {1: 0.5, 2: 0.25}, []
        for step in range(40):
            governor.before_step()
            used.append(torch.get_num_threads())
            if step == 20:
                cost[2] = 2.0  # another process takes a core: two threads stall
            governor.after_step(cost[used[-1]])
        assert used[:4] == [1, 1, 2, 2] and set(used[4:14]) == {2}  # checked, then the faster
        assert used[20] == 2 and used[21:25] == [1, 1, 2, 2]  # slow step: checked again at once
        assert set(used[25:35]) == {1} and governor.best == 1
    finally:
        torch.set_num_threads(threads)
