"""Held-out evaluation with the real reward, on a scripted generator (so the expected figures are
known), and the whole warm-up at toy sizes."""

from __future__ import annotations

import json

import pytest

from megatron_rl.generation.api import GenResult
from megatron_rl.quickstart.evaluate import EvalConfig, evaluate
from megatron_rl.quickstart.sft import format_trace
from megatron_rl.quickstart.tokenizer import text_ids


class ScriptedGenerator:
    """Answers request ``i/k`` with ``script(i, k)`` (a completion text) + EOS."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.requests = tokenizer, script, []

    def generate(self, requests):
        for r in reversed(list(requests)):  # out of order, as a real generator may finish
            self.requests.append(r)
            i, k = map(int, r.request_id.split("/"))
            ids = text_ids(self.tokenizer, self.script(i, k)) + [self.tokenizer.eos_token_id]
            yield GenResult(
                request_id=r.request_id,
                prompt_ids=r.input_ids,
                token_ids=ids,
                logprobs=[0.0] * len(ids),
                versions=[0] * len(ids),
                finish_reason="stop",
            )


def test_pass_at_1_format_and_length(tokenizer, problems):
    _, held_out = problems
    chosen = held_out[:4]

    def script(i, k):
        p = chosen[i]
        if i == 0:
            return format_trace(p)  # always right
        if i == 1:
            return format_trace(p) if k == 0 else format_trace(p, slip="-999")  # half right
        if i == 2:
            return "The answer is 3."  # no <think>: format failure
        return format_trace(p, slip="-999")  # always wrong

    gen = ScriptedGenerator(tokenizer, script)
    report = evaluate(gen, tokenizer, chosen, EvalConfig(samples=2, temperature=1.0, seed=5))
    assert report.completions == 8
    assert report.pass_at_1 == pytest.approx((1 + 0.5 + 0 + 0) / 4)
    assert report.format_ok == pytest.approx(6 / 8)
    lengths = [len(text_ids(tokenizer, script(i, k))) + 1 for i in range(4) for k in range(2)]
    assert report.mean_length == pytest.approx(sum(lengths) / 8)
    assert set(report.by_difficulty) == {p.difficulty for p in chosen}
    # requests: the chat-templated prompt, sampling settings and a distinct seed each
    assert len({r.seed for r in gen.requests}) == 8
    assert all(
        r.temperature == 1.0 and r.input_ids[-1] == gen.requests[0].input_ids[-1] for r in gen.requests
    )


def test_warmup_end_to_end_at_toy_size(tmp_path):
    from megatron_rl.quickstart.model import TinyModelConfig
    from megatron_rl.quickstart.problems import ProblemConfig
    from megatron_rl.quickstart.sft import SFTConfig
    from megatron_rl.quickstart.warmup import run_warmup

    result = run_warmup(
        tmp_path / "qs",
        problems=ProblemConfig(count=400),
        model=TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64, max_positions=128),
        sft=SFTConfig(steps=3, batch_size=8, warmup_steps=1, threads=1),
        eval_cfg=EvalConfig(max_new_tokens=16),
        eval_problems=6,
        progress=False,
    )
    for name in ("train", "held_out", "tokenizer", "init", "sft"):
        assert result.paths[name].exists(), name
    assert result.eval.completions == 6 and 0.0 <= result.eval.pass_at_1 <= 1.0
    summary = json.loads((tmp_path / "qs" / "warmup.json").read_text())
    assert summary["paths"]["sft"] == str(result.paths["sft"])
    assert summary["seconds"]["total"] > 0 and len(result.sft_losses) == 3
