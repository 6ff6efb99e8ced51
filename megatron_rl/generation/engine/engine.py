"""Continuous-batching generation over a :class:`~.model.Decoder` and its per-slot KV cache.

One :meth:`Engine.step`:

1. admits waiting requests (first come, first served) into free slots: each distinct prompt is
   prefilled once (a group's G samples share its forward; its keys and values are then copied
   into the siblings' slots), distinct prompts of equal length together (``[n, P]``), the output
   head on the last position only, and each request samples its first token from there with its
   own generator. A prompt that a running request already holds (a group's samples admitted in
   a later step than their siblings, as slots free one by one) is not prefilled again: its keys
   and values are copied from that request's slot and its last position's logits kept from its
   prefill (a prefix cache that lives as long as one sample of the prompt runs);
2. runs one decode step for every running request (``[B, 1]``, each slot at its own length), and
   samples its next token. Running requests always hold the leading slots ``0 .. B-1`` (a freed
   slot takes the last one's sequence), so attention reads the cache in place;
3. finishes requests that sampled a stop token (EOS from the config or the request's
   ``stop_token_ids``; the stop token is part of the output) or reached ``max_new_tokens``, frees
   their slots, and returns them as :class:`Finished`.

A request admitted in a step thus gains two tokens in that step, every other running request one.

**Log-probs.** Each token's ``logprob`` is ``log_softmax(logits / temperature)`` over the *full*
vocabulary at the sampled token: exactly what the trainer recomputes
(:func:`megatron_rl.algorithms.logprobs.token_logprobs` with the same temperature). It is *not* the
log-prob under the top-k / top-p-truncated, renormalised distribution the token was drawn from;
with ``top_k`` or ``top_p < 1`` the two differ by ``log(kept mass)``, and a token outside the kept
set is never drawn. Greedy requests (``temperature`` below SGLang's floor ``SAMPLING_EPS``, 0
included) report ``log_softmax(logits)`` (temperature 1), as SGLang, which samples them as
``temperature=1, top_k=1``.

**Versions.** :meth:`Engine.set_version` sets the weight version; every token records the
version in force when it was sampled.

**Routed experts.** A request with ``return_routed_experts`` (an MoE model) gets, in
``Finished.routed_experts``, the experts each position was sent to in each layer
(``[P + n - 1, layers, top_k]``, int32: every prompt token and every generated token but the last,
which is never fed; a dense layer's entries are zeros): SGLang's ``return_routed_experts``. They are the experts actually used: a
group's shared prompt is routed once (under the weights of its prefill), and the tokens decoded
after a weight update were routed by the new weights -- what routing replay trains on.

**Pause.** :meth:`Engine.pause` makes :meth:`step` a no-op until :meth:`Engine.resume`; the KV cache,
running and waiting requests are kept, so a weight update between the two continues every
sequence in place (its later tokens then carry the new version).
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import torch

from megatron_rl.generation.engine.model import Decoder, KVCache
from megatron_rl.types import FinishReason

__all__ = [
    "SAMPLING_EPS",
    "TOP_K_OFF",
    "Engine",
    "EngineConfig",
    "Finished",
    "SlotEngine",
    "sample_token",
    "sample_tokens",
]

# SGLang's temperature floor (``_SAMPLING_EPS``, sglang/srt/sampling/sampling_params.py, 0.5.23):
# a temperature in [0, 1e-6) decodes greedily. Below it logits / T overflows float32 for ordinary
# logits (|l| ~ 10 -> 1e7 and beyond), and the soft-max turns into NaN or one-hot noise.
SAMPLING_EPS = 1e-6
# ``top_k`` -1: no cut, the whole vocabulary (SGLang maps -1 and null to its ``TOP_K_ALL``, 2^30,
# and refuses 0 and other values below 1; so does check_request).
TOP_K_OFF = -1


@dataclass(kw_only=True)
class EngineConfig:
    """Sizes of the engine's KV cache."""

    max_slots: int = 8  # sequences decoded together (cache slots)
    max_len: int = 2048  # tokens per slot: prompt + completion must fit

    def __post_init__(self) -> None:
        if self.max_slots < 1:
            raise ValueError(f"max_slots: must be >= 1, got {self.max_slots}")
        if self.max_len < 2:
            raise ValueError(f"max_len: must be >= 2, got {self.max_len}")


@dataclass(kw_only=True)
class Finished:
    """A request's output: generated tokens with their log-probs and weight versions."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # log_softmax(logits / temperature)[token], full vocabulary
    versions: list[int]  # weight version that sampled each token
    finish_reason: FinishReason
    #: [P + n - 1, layers, top_k] int32 experts of every fed position (return_routed_experts only)
    routed_experts: torch.Tensor | None = None


@dataclass(kw_only=True)
class _Request:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int  # TOP_K_OFF: no cut
    stop: frozenset[int]
    generator: torch.Generator
    slot: int = -1
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    return_routed: bool = False
    routed: list[torch.Tensor] = field(default_factory=list)  # [n_i, layers, top_k] per forward

    def finished(self, reason: FinishReason) -> Finished:
        return Finished(
            request_id=self.request_id,
            prompt_ids=self.prompt_ids,
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            versions=self.versions,
            finish_reason=reason,
            routed_experts=torch.cat(self.routed) if self.return_routed and self.routed else None,
        )


def check_request(
    input_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    vocab_size: int | None,
    max_len: int,
    top_k: int = TOP_K_OFF,
) -> list[int]:
    """The prompt as ints; ``ValueError`` naming the field for a request no engine can run."""
    ids = [int(t) for t in input_ids]
    if not ids or min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size):
        raise ValueError(f"input_ids: need 1 or more ids in [0, {vocab_size}), got {len(ids)} ids")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    if len(ids) + max_new_tokens > max_len:
        raise ValueError(f"max_new_tokens: prompt ({len(ids)}) + {max_new_tokens} exceeds max_len {max_len}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature: must be a finite number >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p: must be in (0, 1], got {top_p}")
    if top_k != TOP_K_OFF and top_k < 1:
        raise ValueError(f"top_k: must be -1 (the whole vocabulary) or >= 1, got {top_k}")
    return ids


def sample_token(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    generator: torch.Generator,
    top_k: int = TOP_K_OFF,
) -> tuple[int, float]:
    """Draw one token from ``logits [V]``; return ``(token, log_softmax(logits / T)[token])``.

    One row of :func:`sample_tokens` (see there).
    """
    (tok,), (lp,) = sample_tokens(
        logits[None], temperatures=[temperature], top_ps=[top_p], generators=[generator], top_ks=[top_k]
    )
    return tok, lp


def sample_tokens(
    logits: torch.Tensor,
    *,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    generators: Sequence[torch.Generator],
    top_ks: Sequence[int] | None = None,
) -> tuple[list[int], list[float]]:
    """Draw one token per row of ``logits [B, V]``; return tokens and their
    ``log_softmax(logits / T)`` (full vocabulary).

    ``T < SAMPLING_EPS`` (0 included): argmax, log-prob at temperature 1. Otherwise the token is
    drawn from the most likely tokens that pass both cuts, renormalised: the ``top_k`` most likely
    (``top_ks``, default every row ``TOP_K_OFF``: no cut) and the smallest set whose mass reaches
    ``top_p``, the mass counted over the whole distribution (SGLang's order: both cuts on one
    sort, neither renormalised before the other). The draw inverts the CDF at one uniform number
    from the row's own generator, so a seeded request draws the same tokens whatever else shares
    its batch. The soft-max, cuts and CDF work is batched; only the uniform draws are per row.
    """
    logits = logits.float()
    ks = [TOP_K_OFF] * len(temperatures) if top_ks is None else list(top_ks)
    greedy = [t < SAMPLING_EPS for t in temperatures]
    temp = torch.tensor(
        [1.0 if g else t for t, g in zip(temperatures, greedy)], dtype=torch.float32, device=logits.device
    )
    logp = torch.log_softmax(logits / temp[:, None], -1)
    tokens = torch.argmax(logits, -1)
    sampled = [i for i, g in enumerate(greedy) if not g]
    if sampled:
        vocab = logits.shape[-1]
        rows = torch.tensor(sampled, device=logits.device)
        probs = logp[rows].exp()
        cut = [i for i, r in enumerate(sampled) if top_ps[r] < 1.0 or 0 < ks[r] < vocab]
        if cut:
            sub = torch.tensor(cut, device=logits.device)
            sorted_p, order = torch.sort(probs[sub], dim=-1, descending=True)
            tp = torch.tensor([top_ps[sampled[i]] for i in cut], dtype=probs.dtype, device=probs.device)
            k = torch.tensor(
                [ks[sampled[i]] if ks[sampled[i]] > 0 else vocab for i in cut], device=probs.device
            )
            # Keep a token if the mass strictly before it is below top_p (the first is always
            # kept) and fewer than k tokens rank above it.
            keep = (torch.cumsum(sorted_p, -1) - sorted_p) < tp[:, None]
            keep &= torch.arange(vocab, device=probs.device)[None, :] < k[:, None]
            probs[sub] = torch.zeros_like(sorted_p).scatter_(-1, order, sorted_p * keep)
        cdf = torch.cumsum(probs, -1)
        u = (
            torch.cat([torch.rand(1, generator=generators[r], device=logits.device) for r in sampled])
            * cdf[:, -1]
        )
        picks = torch.searchsorted(cdf, u[:, None], right=True)[:, 0]
        # Never a zero-probability token (u at the very top, or rounding in the cumsum).
        picks = torch.minimum(picks, (probs > 0).long().cumsum(-1).argmax(-1))
        tokens[rows] = picks
    lps = logp.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), lps.tolist()


class SlotRequest(Protocol):
    """What :class:`SlotEngine` needs of an engine's request record."""

    request_id: str
    slot: int  # -1 while waiting

    def finished(self, reason: FinishReason) -> Finished: ...


R = TypeVar("R", bound=SlotRequest)  # an engine's own request record


class SlotEngine(ABC, Generic[R]):
    """What every engine behind the server shares: requests wait in a queue for one of
    ``config.max_slots`` slots, run until they end, and free their slot; a weight version is
    stamped on every token; :meth:`pause` stops :meth:`step` in place. Subclasses hold the model
    (:class:`Engine`) or a cost model (:class:`~megatron_rl.generation.engine.timing.TimingEngine`)
    and implement :meth:`add_request` and :meth:`step`; their request records carry ``slot`` and
    ``request_id`` and have a ``finished(reason)`` method."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.version = 0
        self.paused = False
        self.prefill_tokens = 0  # prompt tokens run through the model (a recompute would add here)
        self._waiting: deque[R] = deque()
        self._running: dict[int, R] = {}  # slot -> request
        self._free: list[int] = list(range(self.config.max_slots - 1, -1, -1))  # pop() -> 0 first

    # ------------------------------------------------------------------ state

    @property
    def capacity_tokens(self) -> int:
        """Tokens the KV cache holds: ``max_slots * max_len``."""
        return self.config.max_slots * self.config.max_len

    @property
    def running(self) -> int:
        """Requests holding a slot."""
        return len(self._running)

    @property
    def waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self._waiting)

    def has_work(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._waiting or self._running)

    def set_version(self, version: int) -> None:
        """Weight version recorded for every token sampled from now on."""
        self.version = int(version)

    def weights_changed(self, version: int | None = None) -> None:
        """New weights are in place (and ``version``, when given, is theirs): what was computed
        from the old ones and kept for later requests (shared prompts) is dropped. Requests
        already running keep their KV cache, as with SGLang's in-place pause."""
        if version is not None:
            self.set_version(version)
        self._forget_prompts()

    def _forget_prompts(self) -> None:  # a hook; engines that keep no prompt state keep it
        """Drop what is kept of prompts for later requests."""

    def pause(self) -> None:
        """Stop :meth:`step` from advancing; cache and requests are kept."""
        self.paused = True

    def resume(self) -> None:
        """Let :meth:`step` advance again."""
        self.paused = False

    # ------------------------------------------------------------------ requests

    def _check_new(self, request_id: str) -> None:
        if self._find(request_id) is not None:
            raise ValueError(f"request_id: {request_id!r} is already queued or running")

    def abort(self, request_id: str) -> Finished | None:
        """Drop a waiting or running request, freeing its slot; return what it generated so far
        (``finish_reason="abort"``), or None if no such request is queued or running."""
        req = self._find(request_id)
        if req is None:
            return None
        if req.slot >= 0:
            self._release(req)
        else:
            self._waiting.remove(req)
        return req.finished("abort")

    def _find(self, request_id: str) -> R | None:
        for req in (*self._waiting, *self._running.values()):
            if req.request_id == request_id:
                return req
        return None

    def _admit(self) -> list[R]:
        """Give free slots to waiting requests, in arrival order; return the admitted ones."""
        admitted: list[R] = []
        while self._waiting and self._free:
            req = self._waiting.popleft()
            req.slot = self._free.pop()
            self._running[req.slot] = req
            admitted.append(req)
        return admitted

    def _release(self, req: R) -> None:
        del self._running[req.slot]
        self._clear_slot(req.slot)
        self._free.append(req.slot)
        req.slot = -1

    def _clear_slot(self, slot: int) -> None:  # a hook; engines without a KV cache keep it
        """Forget what the slot holds (the KV cache); nothing to do without one."""

    # ------------------------------------------------------------------ stepping

    @abstractmethod
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
        """Queue a request (``ValueError`` for one that cannot run)."""

    @abstractmethod
    def step(self) -> list[Finished]:
        """Admit waiting requests, advance every running one by a token; return those that
        ended. A no-op (``[]``) while paused."""

    def generate_all(self) -> list[Finished]:
        """Step until no request waits or runs; return the finished requests in finishing order.

        Raises ``RuntimeError`` if called while paused (it would never end).
        """
        if self.paused:
            raise RuntimeError("generate_all: the engine is paused")
        out: list[Finished] = []
        while self.has_work():
            out.extend(self.step())
        return out


class Engine(SlotEngine[_Request]):
    """Continuous batching over a fixed number of KV-cache slots; see the module docstring."""

    def __init__(
        self,
        model: Decoder,
        config: EngineConfig | None = None,
        *,
        eos_token_ids: Iterable[int] | None = None,
    ) -> None:
        super().__init__(config)
        self.model = model.eval()
        self.cache = KVCache(
            model.cfg,
            slots=self.config.max_slots,
            max_len=self.config.max_len,
            dtype=model.model.norm.weight.dtype,
            device=model.model.norm.weight.device,
        )
        self.eos_token_ids = frozenset(model.cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
        # prompt -> (its last position's logits, the running requests holding its KV, its routed
        # experts [P, layers, top_k] or None for a dense model)
        self._prompts: dict[tuple[int, ...], tuple[torch.Tensor, list[_Request], torch.Tensor | None]] = {}

    @classmethod
    def from_pretrained(
        cls,
        folder: str | os.PathLike[str],
        config: EngineConfig | None = None,
        *,
        eos_token_ids: Iterable[int] | None = None,
    ) -> Engine:
        """An engine over the HF model folder ``folder`` (config.json + safetensors)."""
        return cls(Decoder.from_pretrained(folder), config, eos_token_ids=eos_token_ids)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the KV cache holds: ``max_slots * max_len``."""
        return self.cache.capacity_tokens

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
        top_k: int = TOP_K_OFF,
        return_routed_experts: bool = False,
    ) -> None:
        """Queue a prompt ``input_ids`` (token ids). ``temperature=0`` (or below
        ``SAMPLING_EPS``) decodes greedily; ``top_k`` -1 keeps the whole vocabulary;
        ``return_routed_experts`` records every position's experts (an MoE model).

        Raises ``ValueError`` for a request that cannot run: duplicate id, empty prompt, prompt
        plus ``max_new_tokens`` beyond ``max_len``, ids outside the vocabulary, bad sampling values,
        routed experts of a model without experts.
        """
        self._check_new(request_id)
        if return_routed_experts and not self.model.cfg.num_experts:
            raise ValueError(
                f"return_routed_experts: the model ({self.model.cfg.model_type}) has no experts to report"
            )
        ids = check_request(
            input_ids,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            vocab_size=self.model.cfg.vocab_size,
            max_len=self.config.max_len,
            top_k=top_k,
        )
        gen = torch.Generator(device=self.cache.k.device)
        if seed is None:
            gen.seed()  # fresh non-deterministic seed, independent of the global RNG
        else:
            gen.manual_seed(int(seed))
        self._waiting.append(
            _Request(
                request_id=request_id,
                prompt_ids=ids,
                max_new_tokens=max_new_tokens,
                temperature=float(temperature),
                top_p=float(top_p),
                top_k=int(top_k),
                stop=frozenset(int(t) for t in stop_token_ids) | self.eos_token_ids,
                generator=gen,
                return_routed=bool(return_routed_experts),
            )
        )

    def _clear_slot(self, slot: int) -> None:
        self.cache.reset(slot)

    def _forget_prompts(self) -> None:
        self._prompts.clear()

    def _release(self, req: _Request) -> None:
        """Free ``req``'s slot and keep the running requests in the leading slots: the request in
        the last occupied slot moves into the freed one (its KV copied), so a decode step reads
        slots ``0 .. running-1`` of the cache in place."""
        key = tuple(req.prompt_ids)
        held = self._prompts.get(key)
        if held is not None:
            held[1][:] = [r for r in held[1] if r is not req]
            if not held[1]:
                del self._prompts[key]
        slot, last = req.slot, len(self._running) - 1
        super()._release(req)
        if slot != last:
            mover = self._running.pop(last)
            self.cache.move(last, slot)
            mover.slot = slot
            self._running[slot] = mover
            # The free stack pops the lowest slot first. super()._release pushed ``slot``, now
            # taken again; ``last``, now free, is below every other free slot: it goes on top.
            self._free[-1] = last

    # ------------------------------------------------------------------ stepping

    @torch.no_grad()
    def step(self) -> list[Finished]:
        """Admit, prefill, decode one token for every running request; return those that ended.

        A no-op (returns ``[]``) while paused.
        """
        if self.paused:
            return []
        finished: list[Finished] = []
        device = self.cache.k.device
        admitted: list[_Request] = self._admit()
        # Prefill each distinct prompt once (a group's G samples share it: its KV is forked into
        # the siblings' slots), prompts of equal length in one forward.
        groups: dict[tuple[int, ...], list[_Request]] = {}
        for req in admitted:
            groups.setdefault(tuple(req.prompt_ids), []).append(req)
        for key in [k for k in groups if k in self._prompts]:  # a running request holds its KV
            members, (row, holders, routed) = groups.pop(key), self._prompts[key]
            self.cache.fork(holders[0].slot, [r.slot for r in members], length=len(key))
            holders.extend(members)
            self._record(members, routed)
            self._accept(members, row.expand(len(members), -1), finished)
        by_len: dict[int, list[list[_Request]]] = {}
        for members in groups.values():
            by_len.setdefault(len(members[0].prompt_ids), []).append(members)
        for batch in by_len.values():
            ids = torch.tensor([m[0].prompt_ids for m in batch], dtype=torch.long, device=device)
            self.prefill_tokens += ids.numel()
            slots = torch.tensor([m[0].slot for m in batch], dtype=torch.long)
            last = self.model(ids, slots, self.cache, last_only=True)[:, -1]
            batch_routed = self.model.last_routed
            for j, members in enumerate(batch):
                self.cache.fork(members[0].slot, [r.slot for r in members[1:]])
                routed = None if batch_routed is None else batch_routed[j].clone()
                self._prompts[tuple(members[0].prompt_ids)] = (last[j].clone(), list(members), routed)
                self._record(members, routed)
            rows = torch.tensor([i for i, m in enumerate(batch) for _ in m], device=last.device)
            self._accept([r for m in batch for r in m], last[rows], finished)
        if self._running:
            # The running requests hold slots 0 .. n-1 (see _release); the last sampled token of
            # each is not yet in the cache: feed it now.
            decoding = [self._running[s] for s in range(len(self._running))]
            ids = torch.tensor([[r.token_ids[-1]] for r in decoding], dtype=torch.long, device=device)
            logits = self.model(ids, len(decoding), self.cache)[:, -1]
            step_routed = self.model.last_routed  # [B, 1, layers, top_k]
            if step_routed is not None:
                for i, req in enumerate(decoding):
                    if req.return_routed:
                        req.routed.append(step_routed[i])
            self._accept(decoding, logits, finished)
        return finished

    @staticmethod
    def _record(reqs: list[_Request], routed: torch.Tensor | None) -> None:
        """The prompt's routed experts ``[P, layers, top_k]`` for the requests that asked."""
        if routed is not None:
            for req in reqs:
                if req.return_routed:
                    req.routed.append(routed)

    def _accept(self, reqs: list[_Request], logits: torch.Tensor, finished: list[Finished]) -> None:
        """Sample each request's next token from its row of ``logits [B, V]``; finish the
        requests that are done."""
        tokens, logprobs = sample_tokens(
            logits,
            temperatures=[r.temperature for r in reqs],
            top_ps=[r.top_p for r in reqs],
            generators=[r.generator for r in reqs],
            top_ks=[r.top_k for r in reqs],
        )
        for req, token, logprob in zip(reqs, tokens, logprobs):
            req.token_ids.append(token)
            req.logprobs.append(logprob)
            req.versions.append(self.version)
            if token in req.stop:
                reason: FinishReason = "stop"
            elif len(req.token_ids) >= req.max_new_tokens:
                reason = "length"
            else:
                continue
            self._release(req)
            finished.append(req.finished(reason))
