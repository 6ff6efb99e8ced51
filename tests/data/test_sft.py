"""SFT traces from a run directory: correct only, early steps skipped, capped per problem, hard
problems upsampled, general data mixed in -- and the result feeds build_sft_batch."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_rl.batching.sft import build_sft_batch
from megatron_rl.data.benchmarks import sample_file
from megatron_rl.data.problems import DataError
from megatron_rl.data.rundir import Sample, SampleWriter, read_samples
from megatron_rl.data.sft import (
    SFTTraceConfig,
    collect_traces,
    load_general,
    mix_general,
    read_sft_pairs,
    render_general,
)
from tests.data.tinylm import make_tokenizer


def s(step, pid, correct, completion_ids) -> Sample:
    return Sample(
        step=step,
        prompt_id=pid,
        problem=pid,
        task="math",
        prompt_ids=[1, 2, 3],
        completion_ids=completion_ids,
        completion="...",
        reward=float(bool(correct)),
        reason="ok" if correct else ("wrong_answer" if correct is False else "worker_timeout"),
        correct=correct,
        versions=[step] * len(completion_ids),
    )


def run_samples() -> list[Sample]:
    out = []
    for step in range(10):
        out.append(s(step, "easy", True, [10, step]))  # solved every step: 10 distinct traces
        out.append(s(step, "easy", True, [10, step]))  # ... each twice (duplicates)
        out.append(s(step, "hard", step == 7, [20, step]))  # solved once in 10
        out.append(s(step, "never", False, [30]))
        out.append(s(step, "mid", step % 2 == 0, [40, step]))
    out.append(s(1, "early", True, [50]))  # only solved before min_step
    out.append(s(9, "unchecked", None, [60]))
    return out


def test_collect_traces_rules():
    cfg = SFTTraceConfig(min_step=2, max_per_problem=3, upsample_below=0.5, max_upsample=4)
    traces, report = collect_traces(run_samples(), cfg, progress=False)
    by = {}
    for t in traces:
        by.setdefault(t["prompt_id"], []).append(t)
    assert set(by) == {"easy", "hard", "mid"}
    # easy: the three latest distinct traces, once each (pass rate 1).
    assert [t["answer_ids"] for t in by["easy"]] == [[10, 9], [10, 8], [10, 7]]
    # hard: 1 of 8 checked samples from step 2 on -> rate 0.125 -> ceil(0.5 / 0.125) = 4 copies.
    assert [t["answer_ids"] for t in by["hard"]] == [[20, 7]] * 4 and by["hard"][0]["pass_rate"] == 0.125
    # mid: steps 2, 4, 6, 8 correct out of 8 -> rate 0.5, not upsampled, capped at 3.
    assert [t["step"] for t in by["mid"]] == [8, 6, 4]
    assert report.total == 52 and report.kept == 7
    assert report.dropped["before min_step 2"] == 11
    assert report.dropped["duplicate completion"] == 8 and report.dropped["over max_per_problem 3"] == 6
    assert report.dropped["not checked (correct is null)"] == 1
    assert report.total == report.kept + sum(report.dropped.values())


def test_general_data_share_and_sft_batch(tmp_path):
    tok = make_tokenizer()
    traces, report = collect_traces(run_samples(), SFTTraceConfig(min_step=2), progress=False)
    general = load_general(str(sample_file("general_chat.jsonl")), tok)
    cfg = SFTTraceConfig(min_step=2, general_share=0.2)
    mixed = mix_general(traces, general, cfg, report)
    n_general = sum(r["source"] == "general" for r in mixed)
    assert n_general == round(0.25 * len(traces)) and len(mixed) == len(traces) + n_general
    short = mix_general(traces, general[:1], SFTTraceConfig(general_share=0.5), report)
    assert sum(r["source"] == "general" for r in short) == 1
    assert any(k.startswith("general data short") for k in report.notes)
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in mixed))
    pairs = read_sft_pairs(str(path))
    batch = build_sft_batch(pairs)
    assert len(batch) == len(mixed)
    weights = sum(seq.weight * seq.completion_length for seq in batch.sequences)
    assert weights == pytest.approx(1.0)


def test_render_general_splits_prompt_and_answer():
    tok = make_tokenizer()
    prompt, answer = render_general(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}], tok
    )
    assert tok.decode(prompt) == "<|user|>Hi<|assistant|>"
    assert tok.decode(answer) == "Hello</s>" and answer[-1] == tok.eos_token_id
    with pytest.raises(ValueError, match="last message must be the assistant"):
        render_general([{"role": "user", "content": "Hi"}], tok)


def test_bad_general_and_sft_lines_are_named(tmp_path):
    tok = make_tokenizer()
    bad = tmp_path / "chat.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{"messages": [{"role": "user", "content": "x"}]}\n')
    with pytest.raises(DataError, match=r"chat.jsonl:2: messages: the last message must be"):
        load_general(str(bad), tok)
    sft = tmp_path / "sft.jsonl"
    sft.write_text('{"prompt_ids": [1], "answer_ids": []}\n')
    with pytest.raises(DataError, match=r"sft.jsonl:1: answer_ids: expected a non-empty list"):
        read_sft_pairs(str(sft))


def test_traces_from_a_written_run_directory(tmp_path):
    with SampleWriter(tmp_path / "run") as w:
        w.write_many(run_samples())
    traces, _ = collect_traces(read_samples(tmp_path / "run"), SFTTraceConfig(min_step=2), progress=False)
    assert torch.tensor(traces[0]["answer_ids"]).dtype == torch.long
    assert {t["prompt_id"] for t in traces} == {"easy", "hard", "mid"}
