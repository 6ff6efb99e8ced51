"""A run directory's ``samples.jsonl``: every scored completion the RL loop produced.

One JSON object per line, appended by the loop as groups are scored::

    {"step": 12, "prompt_id": "p7", "problem": "...", "task": "math",
     "prompt_ids": [...], "completion_ids": [...], "completion": "<think>...",
     "reward": 0.9, "parts": {"format": 0.1, ...}, "reason": "ok", "correct": true,
     "versions": [11, 11, 12, ...]}

``versions`` holds the policy version of every completion token (same length as
``completion_ids``); a multi-turn trajectory's line adds ``loss_mask`` (true on the tokens the
model sampled, false on the environment's rendered turns, whose version is -1), its own
``prompt_ids`` and, as ``completion``, its last model turn; ``correct`` is null when the answer was never checked (e.g. a verifier that
timed out); ``reason`` is one of :data:`megatron_rl.rewards.result.REASONS`.

The loop writes with :class:`SampleWriter` (line-buffered appends, so a crash loses at most the
line being written), making each line with :meth:`Sample.from_scored` from its typed records; :func:`read_samples` checks every line and names ``file:line: field`` on the
first bad one, but tolerates a cut-off last line (the mark of such a crash) with a warning.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from megatron_rl.data.problems import DataError
from megatron_rl.fileio import JsonlError, iter_jsonl
from megatron_rl.rewards.result import REASON_LABEL, REASONS

if TYPE_CHECKING:
    from megatron_rl.fileio import JsonValue
    from megatron_rl.types import Prompt, ScoredCompletion

__all__ = ["SAMPLES_FILE", "Sample", "SampleWriter", "read_samples", "samples_path"]

SAMPLES_FILE = "samples.jsonl"


@dataclass(kw_only=True)
class Sample:
    """One scored completion of an RL run."""

    step: int  # trainer step whose batch took it (or the step at which it was scored)
    prompt_id: str
    problem: str  # the problem statement
    task: Literal["math", "code"]
    prompt_ids: list[int]  # chat-templated prompt tokens
    completion_ids: list[int]
    completion: str  # decoded completion
    reward: float
    parts: dict[str, float] = field(default_factory=dict)  # format / correct / length / language
    reason: str = "ok"  # one of REASONS
    correct: bool | None = None  # None: the answer was not checked
    versions: list[int] = field(default_factory=list)  # policy version per completion token
    loss_mask: list[bool] | None = None  # a multi-turn trajectory: true where the model sampled

    def to_json(self) -> dict[str, JsonValue]:
        out = asdict(self)
        if self.loss_mask is None:
            del out["loss_mask"]  # single-turn lines stay as they were
        return out

    @classmethod
    def from_scored(cls, step: int, prompt: Prompt, scored: ScoredCompletion) -> Sample:
        """The line for one scored completion of the loop's typed records."""
        c = scored.completion
        return cls(
            step=step,
            prompt_id=prompt.prompt_id,
            problem=prompt.text,
            task=prompt.task,
            prompt_ids=list(prompt.token_ids if c.prompt_ids is None else c.prompt_ids),
            completion_ids=list(c.token_ids),
            completion=c.text,
            reward=float(scored.reward),
            parts=dict(scored.parts),
            reason=scored.reason,
            correct=scored.correct,
            versions=list(c.versions),
            loss_mask=None if c.loss_mask is None else list(c.loss_mask),
        )

    @classmethod
    def from_json(cls, obj: JsonValue, where: str) -> Sample:
        """Validate one decoded line; errors start with ``where`` (``file:line``) and the field."""
        if not isinstance(obj, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")

        def need(name: str, ok: Callable[[JsonValue], object], what: str) -> JsonValue:
            if name not in obj:
                raise DataError(f"{where}: {name}: missing")
            if not ok(obj[name]):
                raise DataError(f"{where}: {name}: expected {what}, got {obj[name]!r:.80}")
            return obj[name]

        def is_int(v: JsonValue) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def int_list(v: JsonValue) -> bool:
            return isinstance(v, list) and all(is_int(t) for t in v)

        s = cls(
            step=need("step", lambda v: is_int(v) and v >= 0, "a non-negative integer"),
            prompt_id=str(need("prompt_id", lambda v: isinstance(v, (str, int)), "a string")),
            problem=need("problem", lambda v: isinstance(v, str), "a string"),
            task=need("task", lambda v: v in ("math", "code"), "'math' or 'code'"),
            prompt_ids=need("prompt_ids", lambda v: int_list(v) and v, "a non-empty list of token ids"),
            completion_ids=need("completion_ids", int_list, "a list of token ids"),
            completion=need("completion", lambda v: isinstance(v, str), "a string"),
            reward=float(
                need("reward", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number")
            ),
            parts=need("parts", lambda v: isinstance(v, dict), "an object"),
            # One of REASONS, or a custom reward's own label (rewards/custom.py: a short label).
            reason=need(
                "reason",
                lambda v: v in REASONS or (isinstance(v, str) and REASON_LABEL.fullmatch(v) is not None),
                f"one of {', '.join(REASONS)}, or a custom reward's label",
            ),
            correct=need("correct", lambda v: v is None or isinstance(v, bool), "true, false or null"),
            versions=need("versions", int_list, "a list of integers"),
        )
        if obj.get("loss_mask") is not None:
            mask = obj["loss_mask"]
            if not isinstance(mask, list) or not all(isinstance(m, bool) for m in mask):
                raise DataError(f"{where}: loss_mask: expected a list of true/false, got {mask!r:.80}")
            if len(mask) != len(s.completion_ids):
                raise DataError(
                    f"{where}: loss_mask: {len(mask)} entries for {len(s.completion_ids)} completion tokens"
                )
            s.loss_mask = mask
        if len(s.versions) != len(s.completion_ids):
            raise DataError(
                f"{where}: versions: {len(s.versions)} entries for "
                f"{len(s.completion_ids)} completion tokens (one per token)"
            )
        return s


def samples_path(path: str | os.PathLike) -> Path:
    """``RUN/samples.jsonl`` for a run directory, or ``path`` itself when it is a file."""
    p = Path(path)
    return p / SAMPLES_FILE if p.is_dir() else p


def read_samples(path: str | os.PathLike) -> Iterator[Sample]:
    """Yield the samples of a run directory (or of a samples file), checking every line."""
    file = samples_path(path)
    if not file.is_file():
        raise DataError(f"{file}: no such file (a run directory holds {SAMPLES_FILE})")
    try:
        for lineno, obj in iter_jsonl(file, objects=False, cut_tail="warn"):
            yield Sample.from_json(obj, f"{file}:{lineno}")
    except JsonlError as e:
        raise DataError(str(e)) from None


class SampleWriter:
    """Appends samples to ``RUN/samples.jsonl`` (created with its folder), one flushed line each.

    with SampleWriter(run_dir) as w:
        w.write(sample)           # or w.write_many(samples)
    """

    def __init__(self, run_dir: str | os.PathLike):
        path = Path(run_dir)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / SAMPLES_FILE
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, sample: Sample) -> None:
        self._file.write(json.dumps(sample.to_json(), ensure_ascii=False) + "\n")
        self._file.flush()

    def write_many(self, samples: Iterable[Sample]) -> None:
        for s in samples:
            self._file.write(json.dumps(s.to_json(), ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SampleWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
