"""A stand-in for :class:`~megatron_rl.generation.engine.Engine` whose steps *sleep* for a cost
model's time and whose tokens come from a script: the real server, routes and scheduling, with no
model compute.

    megatron-rl serve-engine --model HF_FOLDER --timing-model timing.json

``timing.json``::

    {"decode_s": 0.01, "decode_s_per_seq": 0.0001, "prefill_s_per_token": 1e-5,
     "script": [[12, 7, 7, 7, 30, 2], [12, 7, 30, 2], ...]}

Why: on a 2-core machine a real engine and a real trainer fight for the same cores, so a loop
benchmark would measure that contention rather than the scheduling it is after (how long the
generators wait in the synchronous loop, how the asynchronous loop keeps them busy).
``tools/bench_async.py`` runs the real orchestrator against servers in this mode.

**Cost.** One :meth:`TimingEngine.step` admits waiting requests into free slots (first come, first
served; each admitted request samples its first token, as the real engine's prefill does), then
decodes one token for every running request, and sleeps

    decode_s + decode_s_per_seq * running + prefill_s_per_token * admitted prompt tokens

seconds (while the server holds its engine lock, as a real step computes under it).

**Tokens.** A request with sampling seed ``s`` writes ``script[s % len(script)]`` token by token
(no seed: the requests' arrival order picks the entry), so the rewards a verifier gives are real
and as varied as the script. As in the real engine it stops after a stop token (the request's
``stop_token_ids`` or the model's EOS; the stop token is part of the output, ``finish_reason``
"stop") or at ``max_new_tokens`` ("length"); an entry that ends earlier without a stop token ends
the request there ("stop"). Every token's log-prob is ``logprob`` (a constant) and its version the
engine's version when it was written. Pause, resume, abort and versions behave as the real
engine's; there are no weights (:meth:`_NoModel.named_weights` is empty).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from megatron_rl.generation.engine.engine import (
    EngineConfig,
    Finished,
    FinishReason,
    SlotEngine,
    check_request,
)

__all__ = ["TimingConfig", "TimingEngine"]


@dataclass(kw_only=True)
class TimingConfig:
    """The cost model and the token script of a :class:`TimingEngine`."""

    decode_s: float = 0.01  # fixed cost of one step (seconds)
    decode_s_per_seq: float = 0.0  # plus this per running sequence
    prefill_s_per_token: float = 0.0  # plus this per prompt token admitted in the step
    logprob: float = -1.0  # log-prob reported for every token
    script: list[list[int]] = field(default_factory=list)  # completions, picked by seed

    def __post_init__(self) -> None:
        for name in ("decode_s", "decode_s_per_seq", "prefill_s_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if not self.script or any(not isinstance(s, list) or not s for s in self.script):
            raise ValueError("script: need a non-empty list of non-empty token-id lists")
        self.script = [[int(t) for t in s] for s in self.script]

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> TimingConfig:
        with open(path) as f:
            obj = json.load(f)
        if not isinstance(obj, dict):
            raise ValueError(f"{path}: a JSON object is expected")
        unknown = set(obj) - {"decode_s", "decode_s_per_seq", "prefill_s_per_token", "logprob", "script"}
        if unknown:
            raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
        return cls(**obj)

    def step_seconds(self, running: int, prefill_tokens: int) -> float:
        return self.decode_s + self.decode_s_per_seq * running + self.prefill_s_per_token * prefill_tokens


class _NoCache:
    """What the server reads of the KV cache: the device its receive buffers go to."""

    k = torch.empty(0)


class _NoModel:
    """No weights: a weight update names none of this model's (empty) parameters."""

    def named_weights(self) -> dict[str, torch.Tensor]:
        return {}


@dataclass(kw_only=True)
class _Scripted:
    request_id: str
    prompt_ids: list[int]
    script: list[int]
    max_new_tokens: int
    stop: frozenset[int]
    logprob: float  # reported for every token
    slot: int = -1
    token_ids: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def finished(self, reason: FinishReason) -> Finished:
        return Finished(
            request_id=self.request_id,
            prompt_ids=self.prompt_ids,
            token_ids=self.token_ids,
            logprobs=[self.logprob] * len(self.token_ids),
            versions=self.versions,
            finish_reason=reason,
        )


class TimingEngine(SlotEngine[_Scripted]):
    """The :class:`~megatron_rl.generation.engine.Engine` interface the server uses, timed by a
    cost model and written from a script; see the module docstring."""

    def __init__(
        self,
        timing: TimingConfig,
        config: EngineConfig | None = None,
        *,
        eos_token_ids: Iterable[int] = (),
        vocab_size: int | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(config)
        self.timing = timing
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.vocab_size = vocab_size
        self.model, self.cache = _NoModel(), _NoCache()
        self.modeled_s = 0.0  # seconds slept so far
        self._sleep = sleep
        self._arrivals = 0

    @classmethod
    def from_json(
        cls,
        path: str | os.PathLike[str],
        config: EngineConfig | None = None,
        *,
        eos_token_ids: Iterable[int] = (),
        vocab_size: int | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> TimingEngine:
        return cls(
            TimingConfig.from_json(path),
            config,
            eos_token_ids=eos_token_ids,
            vocab_size=vocab_size,
            sleep=sleep,
        )

    def add_request(
        self,
        request_id: str,
        input_ids: Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_token_ids: Iterable[int] = (),
    ) -> None:
        """Queue a request; refused (``ValueError``) where the real engine refuses it."""
        self._check_new(request_id)
        ids = check_request(
            input_ids,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            vocab_size=self.vocab_size,
            max_len=self.config.max_len,
        )
        pick = int(seed) if seed is not None else self._arrivals
        self._arrivals += 1
        script = self.timing.script
        self._waiting.append(
            _Scripted(
                request_id=request_id,
                prompt_ids=ids,
                script=script[pick % len(script)],
                max_new_tokens=int(max_new_tokens),
                logprob=self.timing.logprob,
                stop=frozenset(int(t) for t in stop_token_ids) | self.eos_token_ids,
            )
        )

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[Finished]:
        """Admit, then write one token for every running request; sleep the modeled time."""
        if self.paused:
            return []
        finished: list[Finished] = []
        admitted_tokens = 0
        for req in self._admit():
            admitted_tokens += len(req.prompt_ids)
            self._write(req, finished)  # the prefill's token
        running = len(self._running)
        for req in list(self._running.values()):
            self._write(req, finished)
        self.prefill_tokens += admitted_tokens
        seconds = self.timing.step_seconds(running, admitted_tokens)
        self.modeled_s += seconds
        self._sleep(seconds)
        return finished

    def _write(self, req: _Scripted, finished: list[Finished]) -> None:
        token = req.script[len(req.token_ids)]
        req.token_ids.append(token)
        req.versions.append(self.version)
        if token in req.stop:
            reason: FinishReason = "stop"
        elif len(req.token_ids) >= req.max_new_tokens:
            reason = "length"
        elif len(req.token_ids) == len(req.script):
            reason = "stop"  # the entry ends without a stop token: it ends the request
        else:
            return
        self._release(req)
        finished.append(req.finished(reason))
