"""SFT warm-up: the traces earn the full reward, a short run lowers the loss, and the exported HF
folder is the trainer's model exactly (the engine's logits equal the trainer's, fp32).

One process, one rank: the trainer sets up (and tears down) a one-rank gloo group itself.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_rl.batching.sft import build_sft_batch
from megatron_rl.generation.engine.model import Decoder
from megatron_rl.quickstart.model import TinyModelConfig, build_model_folder, export_hf_folder
from megatron_rl.quickstart.sft import (SFTConfig, _batches, format_trace, make_trainer, run_sft,
                                        sft_pairs)
from megatron_rl.rewards.compose import RewardConfig, RewardInput, score
from megatron_rl.rewards.format import check_format

TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       intermediate_size=64, max_positions=128, seed=1)


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
    for p in levels.values():
        for trace in (format_trace(p), format_trace(p, direct=True)):
            parsed, why = check_format(trace, "math")
            assert parsed is not None, why
            r = score(RewardInput(problem=p.problem, completion=trace, task="math",
                                  answer=p.answer, num_tokens=40), cfg)
            assert r.format_ok and r.correct, (trace, r)
            # format 0.1 + correct 0.9 + language 0.1 (English words in both sections)
            assert r.reward == pytest.approx(1.1), (trace, r)


def test_pairs_end_with_eos_and_prompt_ends_with_assistant(tokenizer, problems):
    train, _ = problems
    for (prompt, answer), p in zip(sft_pairs(tokenizer, train[:5]), train[:5]):
        assert answer[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(answer, skip_special_tokens=True) == format_trace(p)
        assert prompt[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")


def test_direct_traces_are_mixed_in_at_the_configured_rate():
    worked, direct = [("w", i) for i in range(10)], [("d", i) for i in range(10)]
    draws = [pair for _, batch in zip(range(200), _batches(worked, direct, 10, 0.3, seed=0))
             for pair in batch]
    assert 0.25 < sum(kind == "d" for kind, _ in draws) / len(draws) < 0.35
    # every problem keeps coming back, in either form
    assert {i for _, i in draws} == set(range(10))
    plain = [p for _, batch in zip(range(20), _batches(worked, direct, 10, 0.0, seed=0))
             for p in batch]
    assert all(kind == "w" for kind, _ in plain)


def test_init_folder_is_an_hf_model(init_dir, tokenizer):
    config = json.loads((init_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == len(tokenizer)
    assert config["eos_token_id"] == tokenizer.eos_token_id
    assert (init_dir / "model.safetensors").is_file() and (init_dir / "tokenizer.json").is_file()
    Decoder.from_pretrained(init_dir)  # the engine's loader accepts it


def test_short_sft_lowers_the_loss_and_exports_the_trainer_model(init_dir, tokenizer, problems,
                                                                 tmp_path):
    train, _ = problems
    batch = build_sft_batch(sft_pairs(tokenizer, train[:16]))
    trainer = make_trainer(init_dir, lr=1e-2)
    try:
        losses = [trainer.sft_step(batch)["loss"] for _ in range(12)]
        # Near ln(V) ~ 5.5 at random init; one batch repeated is quickly fitted in part.
        assert losses[0] > 4.5 and losses[-1] < 0.7 * losses[0], losses
        out = export_hf_folder(trainer, tmp_path / "sft", like=init_dir)
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
    result = run_sft(init_dir, train, tmp_path / "sft",
                     SFTConfig(steps=8, batch_size=16, lr=1e-2, min_lr=1e-3, warmup_steps=1),
                     progress=False)
    assert len(result.losses) == 8 and result.losses[-1] < result.losses[0]
    assert (result.folder / "model.safetensors").is_file()
    assert (result.folder / "tokenizer_config.json").is_file()
    Decoder.from_pretrained(result.folder)
