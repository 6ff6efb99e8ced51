"""SFT cold-start data from an RL run's correct completions (Magistral Small's recipe).

From ``RUN/samples.jsonl`` (:mod:`megatron_rl.data.rundir`):

1. keep samples from step ``min_step`` on (early traces are short and unsophisticated);
2. a problem's pass rate is its share of correct samples among those checked (``correct`` not
   null) from ``min_step`` on;
3. keep the correct completions only; per problem at most ``max_per_problem`` distinct ones, the
   latest first (a later policy reasons better) -- so easy problems, solved over and over, do not
   swamp the set;
4. upsample problems with low pass rates: a problem below ``upsample_below`` has its traces
   repeated ``min(max_upsample, ceil(upsample_below / pass_rate))`` times;
5. mix in general instruction data (chat messages, rendered with the tokenizer's chat template)
   so that it makes up ``general_share`` of the output (the paper: 10%); with too little general
   data, all of it is used and the report says so;
6. shuffle (``seed``) and write one JSON line per example, ready for
   :func:`megatron_rl.batching.sft.build_sft_batch`::

       {"prompt_ids": [...], "answer_ids": [...], "source": "trace", "prompt_id": "p7", ...}

   (:func:`read_sft_pairs` reads it back as ``(prompt_ids, answer_ids)`` pairs.)

General instruction data: JSONL with ``{"messages": [{"role": ..., "content": ...}, ...]}`` whose
last message is the assistant's (the answer; everything before it is the prompt), or
``{"prompt": str, "response": str}``.
"""

from __future__ import annotations

import math
import random
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, NotRequired, TypedDict

from tqdm import tqdm

from megatron_rl.config import check_range
from megatron_rl.data.problems import DataError, read_records
from megatron_rl.data.report import CurationReport
from megatron_rl.data.rundir import Sample

__all__ = [
    "SFTRecord",
    "SFTTraceConfig",
    "collect_traces",
    "load_general",
    "mix_general",
    "read_sft_pairs",
    "render_general",
]


class SFTRecord(TypedDict):
    """One line of an SFT file (see the module docstring)."""

    prompt_ids: list[int]
    answer_ids: list[int]
    source: Literal["trace", "general"]
    prompt_id: NotRequired[str]  # traces only: the problem, the step that sampled it, ...
    step: NotRequired[int]
    pass_rate: NotRequired[float]  # ... the problem's pass rate, and which repeat this is
    copy: NotRequired[int]


@dataclass(kw_only=True)
class SFTTraceConfig:
    """What goes into the SFT set."""

    min_step: int = 0  # samples from earlier steps are skipped
    max_per_problem: int = 4  # distinct correct traces kept per problem (the latest)
    upsample_below: float = 0.5  # problems with a lower pass rate are repeated ...
    max_upsample: int = 4  # ... at most this many times in all
    general_share: float = 0.1  # share of general instruction examples in the output
    seed: int = 0  # shuffling and the choice of general examples

    def __post_init__(self) -> None:
        check_range("min_step", self.min_step, low=0)
        check_range("max_per_problem", self.max_per_problem, low=1)
        check_range("upsample_below", self.upsample_below, low=0.0, high=1.0)
        check_range("max_upsample", self.max_upsample, low=1)
        check_range("general_share", self.general_share, low=0.0, high=1.0, high_open=True)


def collect_traces(
    samples: Iterable[Sample], cfg: SFTTraceConfig, progress: bool = True
) -> tuple[list[SFTRecord], CurationReport]:
    """Steps 1-4 of the module docstring: trace records (repeats included), and the report."""

    report = CurationReport("curate sft-traces")
    checked: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # prompt_id -> [correct, checked]
    correct: dict[str, list[Sample]] = defaultdict(list)
    for s in tqdm(samples, desc="reading samples", unit="sample", file=sys.stderr, disable=not progress):
        report.total += 1
        if s.step < cfg.min_step:
            report.drop(f"before min_step {cfg.min_step}")
            continue
        if s.correct is not None:
            checked[s.prompt_id][1] += 1
            checked[s.prompt_id][0] += int(s.correct)
        if not s.correct:
            report.drop("not correct" if s.correct is False else "not checked (correct is null)")
            continue
        correct[s.prompt_id].append(s)
    traces: list[SFTRecord] = []
    for pid, found in correct.items():
        rate = checked[pid][0] / checked[pid][1]
        found.sort(key=lambda s: -s.step)  # latest first (stable: file order within a step)
        distinct: list[Sample] = []
        seen: set[tuple[int, ...]] = set()
        for s in found:
            key = tuple(s.completion_ids)
            if key in seen:
                report.drop("duplicate completion")
                continue
            seen.add(key)
            distinct.append(s)
        chosen = distinct[: cfg.max_per_problem]
        if len(distinct) > len(chosen):
            report.drop(f"over max_per_problem {cfg.max_per_problem}", len(distinct) - len(chosen))
        copies = 1
        if rate < cfg.upsample_below:
            copies = min(cfg.max_upsample, math.ceil(cfg.upsample_below / rate))
            report.note(f"problems upsampled x{copies}")
        report.keep(len(chosen))
        if copies > 1:
            report.note("repeated traces added", (copies - 1) * len(chosen))
        for s in chosen:
            for c in range(copies):
                traces.append(
                    {
                        "prompt_ids": s.prompt_ids,
                        "answer_ids": s.completion_ids,
                        "source": "trace",
                        "prompt_id": pid,
                        "step": s.step,
                        "pass_rate": rate,
                        "copy": c,
                    }
                )
    return traces, report


def render_general(messages: Sequence[dict], tokenizer) -> tuple[list[int], list[int]]:
    """``(prompt_ids, answer_ids)`` of a chat whose last message is the assistant's: the prompt is
    the template of the earlier messages with the generation prompt, the answer what the full
    template adds after it (the reply and its end-of-turn tokens)."""
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("the last message must be the assistant's")
    prompt = tokenizer.apply_chat_template(list(messages[:-1]), tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(list(messages), tokenize=False)
    if not full.startswith(prompt):
        raise ValueError(
            "the chat template renders the conversation differently from its prefix; "
            "cannot split prompt and answer"
        )
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer = tokenizer(full[len(prompt) :], add_special_tokens=False)["input_ids"]
    return list(ids), list(answer)


def load_general(path: str, tokenizer) -> list[SFTRecord]:
    """General instruction examples of ``path`` (see the module docstring), tokenized."""
    out: list[SFTRecord] = []
    for where, obj in read_records(path):
        if not isinstance(obj, dict):
            raise DataError(f"{where}: expected a JSON object")
        if "messages" in obj:
            messages = obj["messages"]
            if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages
            ):
                raise DataError(f"{where}: messages: expected a list of {{role, content}} objects")
        elif isinstance(obj.get("prompt"), str) and isinstance(obj.get("response"), str):
            messages = [
                {"role": "user", "content": obj["prompt"]},
                {"role": "assistant", "content": obj["response"]},
            ]
        else:
            raise DataError(f"{where}: messages: missing (or give 'prompt' and 'response' strings)")
        try:
            prompt, answer = render_general(messages, tokenizer)
        except ValueError as e:
            raise DataError(f"{where}: messages: {e}") from None
        if not prompt or not answer:
            raise DataError(f"{where}: messages: renders to an empty prompt or answer")
        out.append({"prompt_ids": prompt, "answer_ids": answer, "source": "general"})
    return out


def mix_general(
    traces: list[SFTRecord], general: list[SFTRecord], cfg: SFTTraceConfig, report: CurationReport
) -> list[SFTRecord]:
    """Traces plus enough general examples to make ``general_share`` of the result, shuffled."""
    rng = random.Random(cfg.seed)
    want = round(cfg.general_share / (1 - cfg.general_share) * len(traces))
    if want > len(general):
        report.note(f"general data short: wanted {want}, have {len(general)}")
    chosen = rng.sample(general, min(want, len(general)))
    report.note("general examples mixed in", len(chosen))
    out = traces + chosen
    rng.shuffle(out)
    return out


def read_sft_pairs(path: str) -> list[tuple[list[int], list[int]]]:
    """``(prompt_ids, answer_ids)`` of every line of an SFT file (for ``build_sft_batch``)."""
    pairs = []
    for where, obj in read_records(path):
        for key in ("prompt_ids", "answer_ids"):
            v = obj.get(key) if isinstance(obj, dict) else None
            if (
                not isinstance(v, list)
                or not v
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in v)
            ):
                raise DataError(f"{where}: {key}: expected a non-empty list of token ids")
        pairs.append((obj["prompt_ids"], obj["answer_ids"]))
    return pairs
