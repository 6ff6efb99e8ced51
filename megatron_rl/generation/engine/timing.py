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
decodes one token for every running request, and takes

    decode_s + decode_s_per_seq * running + prefill_s_per_token * distinct prompt tokens admitted

seconds (while the server holds its engine lock, as a real step computes under it). As in the
real engine, the samples of one prompt (a group's G) are prefilled once: a prompt's tokens are
charged once per step however many of its samples enter, and not at all while a sample of it
already runs (its prompt's KV is shared, as a prefix cache serves it).
``tools/bench_async.py`` measures the three costs on the real engine and writes them here.

**Time.** A step's seconds are counted from the moment it starts (its own bookkeeping is part of
them) and the sleep's overshoot -- the OS wakes a sleeper late, by far more on busy cores -- is
taken off the next step's sleep (:attr:`TimingEngine.late_s` holds what is still owed). So over
any run of steps the engine is busy for the modeled time, to within one overshoot, rather than
drifting later by one overshoot per step; :attr:`TimingEngine.modeled_s` sums the modeled time.

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
import math
import os
import time
from collections import Counter
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


_COSTS = ("decode_s", "decode_s_per_seq", "prefill_s_per_token")
_KEYS = (*_COSTS, "logprob", "script")


@dataclass(kw_only=True)
class TimingConfig:
    """The cost model and the token script of a :class:`TimingEngine`."""

    decode_s: float = 0.01  # fixed cost of one step (seconds)
    decode_s_per_seq: float = 0.0  # plus this per running sequence
    prefill_s_per_token: float = 0.0  # plus this per distinct prompt token admitted in the step
    logprob: float = -1.0  # log-prob reported for every token
    script: list[list[int]] = field(default_factory=list)  # completions, picked by seed

    def __post_init__(self) -> None:
        for name in (*_COSTS, "logprob"):
            value = getattr(self, name)
            # bool is an int to Python; a calibration file's true/false is a mistake, not 1/0.
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name}: must be a finite number, got {value!r}")
            setattr(self, name, float(value))
        for name in _COSTS:
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.logprob > 0:
            raise ValueError(f"logprob: a log-probability is <= 0, got {self.logprob}")
        if not isinstance(self.script, list) or not self.script:
            raise ValueError("script: need a non-empty list of non-empty token-id lists")
        for i, entry in enumerate(self.script):
            if not isinstance(entry, list) or not entry:
                raise ValueError(f"script[{i}]: need a non-empty list of token ids, got {entry!r:.60}")
            for j, t in enumerate(entry):
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise ValueError(f"script[{i}][{j}]: a token id is an int >= 0, got {t!r}")
        self.script = [list(s) for s in self.script]

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> TimingConfig:
        """The config in the JSON file ``path``; ``ValueError`` naming the file and the field for
        a file that is not JSON, an unknown key or a bad value."""
        try:
            with open(path) as f:
                obj = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}: a JSON object is expected, got {type(obj).__name__}")
        unknown = set(obj) - set(_KEYS)
        if unknown:
            raise ValueError(f"{path}: unknown keys {sorted(unknown)} (known: {', '.join(_KEYS)})")
        try:
            return cls(**obj)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def step_seconds(self, running: int, prefill_tokens: int) -> float:
        """Modeled seconds of a step decoding ``running`` sequences and prefilling
        ``prefill_tokens`` (distinct) prompt tokens."""
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
    held: tuple[int, ...] = ()  # its prompt, while it holds a slot
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
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``sleep`` and ``clock`` (seconds) are what a step waits with and times itself by."""
        super().__init__(config)
        self.timing = timing
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.vocab_size = vocab_size
        self.model, self.cache = _NoModel(), _NoCache()
        self.modeled_s = 0.0  # modeled seconds of the steps so far
        self.late_s = 0.0  # past steps' overshoot not yet taken off a sleep (see "Time")
        self._sleep, self._clock = sleep, clock
        self._arrivals = 0
        self._held: Counter[tuple[int, ...]] = Counter()  # prompt -> running requests of it

    @classmethod
    def from_json(
        cls,
        path: str | os.PathLike[str],
        config: EngineConfig | None = None,
        *,
        eos_token_ids: Iterable[int] = (),
        vocab_size: int | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.perf_counter,
    ) -> TimingEngine:
        """An engine with the cost model and script of the JSON file ``path``."""
        return cls(
            TimingConfig.from_json(path),
            config,
            eos_token_ids=eos_token_ids,
            vocab_size=vocab_size,
            sleep=sleep,
            clock=clock,
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
        """Admit, then write one token for every running request; take the modeled time."""
        if self.paused:
            return []
        t0 = self._clock()
        finished: list[Finished] = []
        prompts: set[tuple[int, ...]] = set()  # prefilled once each, as the real engine does
        for req in self._admit():
            key = tuple(req.prompt_ids)
            if not self._held[key]:  # no running sibling holds its prompt's KV
                prompts.add(key)
            self._held[key] += 1
            req.held = key
            self._write(req, finished)  # the prefill's token
        running = len(self._running)
        for req in list(self._running.values()):
            self._write(req, finished)
        prefill = sum(len(p) for p in prompts)
        self.prefill_tokens += prefill
        seconds = self.timing.step_seconds(running, prefill)
        self.modeled_s += seconds
        self._wait(t0, seconds)
        return finished

    def _wait(self, t0: float, seconds: float) -> None:
        """Sleep until ``seconds`` after ``t0`` less what earlier steps overshot; keep this
        sleep's overshoot (or the debt left when the step is shorter than it) for the next."""
        want = seconds - self.late_s - (self._clock() - t0)
        if want > 0:
            self._sleep(want)
        self.late_s = max(0.0, self._clock() - t0 - (seconds - self.late_s))

    def _release(self, req: _Scripted) -> None:
        super()._release(req)
        self._held[req.held] -= 1
        if not self._held[req.held]:
            del self._held[req.held]

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
