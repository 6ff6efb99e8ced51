"""A ``/generate`` body for the built-in engine, read and checked before anything is queued: the
prompts (one, or a batch), their ids (``rid``), ``stream``, the reply's log-prob form, and each
prompt's sampling parameters as SGLang 0.5.23 reads and verifies them. Every refusal is a :class:`BadRequest` naming the field
(``sampling_params[3].top_p: ...``); a batch is checked whole, so one bad prompt queues nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_rl.generation.engine.engine import TOP_K_OFF
from megatron_rl.generation.engine.http import BadRequest
from megatron_rl.generation.protocol import FLAT_LOGPROBS

if TYPE_CHECKING:
    from megatron_rl.fileio import JsonValue

__all__ = ["GenerateBody", "Job", "Sampling", "parse_generate_body"]


@dataclass(kw_only=True)
class Sampling:
    """One request's sampling parameters, checked (see :func:`_sampling`)."""

    max_new_tokens: int | None  # None: up to the context length
    temperature: float
    top_p: float
    top_k: int  # TOP_K_OFF: no cut
    seed: int | None
    stop_token_ids: list[int]


@dataclass
class Job:
    """One prompt of a ``/generate`` body, checked; ``where`` is its ``[i]`` in a batch, ``rid``
    "" where the caller named none (the server gives it one)."""

    rid: str
    prompt: list[int]
    sampling: Sampling
    where: str


@dataclass
class GenerateBody:
    """A checked ``/generate`` body: ``batch`` (a list of prompts; the reply is a list, or in a
    stream each item carries its ``index``), ``stream`` (finished items as server-sent events
    instead of one reply), and its jobs in order."""

    batch: bool
    stream: bool
    jobs: list[Job]
    flat_logprobs: bool = False  # FLAT_LOGPROBS: log-probs as one list of floats per reply
    return_routed_experts: bool = False  # SGLang's: meta_info.routed_experts in each reply
    routed_experts_start_len: int = 0  # the first position whose experts are returned


#: SGLang 0.5.23's multimodal ``/generate`` fields (``GenerateReqInput``): refused, naming the field.
_MEDIA_FIELDS = ("image_data", "video_data", "audio_data")


def parse_generate_body(body: dict[str, JsonValue]) -> GenerateBody:
    """``body``'s requests, checked (:class:`BadRequest` naming the field)."""
    for media in _MEDIA_FIELDS:  # SGLang's multimodal inputs: this engine runs language models only
        if body.get(media) not in (None, [], ""):
            raise BadRequest(
                f"{media}: the built-in engine serves the language model of a checkpoint and takes "
                "text prompts only (token ids); images, video and audio need SGLang servers "
                "(fleet.urls), which serve a vision-language checkpoint whole"
            )
    if body.get("text") is not None or body.get("input_ids") is None:
        raise BadRequest(
            "input_ids: required (the built-in engine has no tokenizer; send token ids, not text)"
        )
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest(f"stream: must be true or false, got {stream!r}")
    flat = body.get(FLAT_LOGPROBS)
    if flat is not None and not isinstance(flat, bool):
        raise BadRequest(f"{FLAT_LOGPROBS}: must be true or false, got {flat!r}")
    routed = body.get("return_routed_experts", False)
    if not isinstance(routed, bool):
        raise BadRequest(f"return_routed_experts: must be true or false, got {routed!r}")
    routed_start = body.get("routed_experts_start_len", 0)
    if not _is_int(routed_start) or routed_start < 0:
        raise BadRequest(f"routed_experts_start_len: must be an integer >= 0, got {routed_start!r}")
    ids = body["input_ids"]
    if not isinstance(ids, list) or not ids:
        raise BadRequest("input_ids: must be a non-empty list of token ids, or a list of such lists")
    batch = isinstance(ids[0], list)
    prompts = ids if batch else [ids]
    rids = body.get("rid")
    if rids is not None and batch != isinstance(rids, list):
        raise BadRequest("rid: one string per prompt (a list for a batch, a string for one prompt)")
    rid_list = rids if isinstance(rids, list) else [rids] * len(prompts)
    params = body.get("sampling_params")
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    if len(rid_list) != len(prompts) or len(params_list) != len(prompts):
        raise BadRequest(f"rid / sampling_params: need one per prompt ({len(prompts)})")
    jobs: list[Job] = []
    for i, (rid, prompt, sp) in enumerate(zip(rid_list, prompts, params_list)):
        where = f"[{i}]" if batch else ""
        if not isinstance(prompt, list) or not all(_is_int(t) for t in prompt):
            raise BadRequest(f"input_ids{where}: must be a list of token ids (integers)")
        if rid is not None and (isinstance(rid, bool) or not isinstance(rid, (str, int))):
            raise BadRequest(f"rid{where}: must be a string, got {rid!r}")
        if routed_start > len(prompt):  # SGLang: in [0, prompt tokens]
            raise BadRequest(
                f"routed_experts_start_len: {routed_start} is beyond the prompt{where} ({len(prompt)} tokens)"
            )
        jobs.append(
            Job(str(rid) if rid is not None else "", prompt, _sampling(sp, f"sampling_params{where}"), where)
        )
    named = [j.rid for j in jobs if j.rid]
    if len(set(named)) != len(named):
        raise BadRequest("rid: the same id twice in one batch")
    return GenerateBody(
        batch=batch,
        stream=bool(stream),
        jobs=jobs,
        flat_logprobs=bool(flat),
        return_routed_experts=routed,
        routed_experts_start_len=int(routed_start),
    )


# SGLang 0.5.23's sampling parameters (``SamplingParams``, sglang/srt/sampling/sampling_params.py)
# that the built-in engine does not implement, each at the value that switches it off: accepted at
# that value (or null, SGLang's "default"), refused at any other. A key in neither this table nor
# _sampling's is not an SGLang parameter at all: refused as unknown, not silently ignored.
_SAMPLING_OFF: dict[str, JsonValue] = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "ignore_eos": False,
    "stop": None,  # stop strings need a tokenizer (SGLang refuses them without one too)
    "stop_regex": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "custom_params": None,
    "logit_bias": None,
    "stream_interval": None,
    "beam_width": None,
    "watermark": None,
}
# Token ids in and out: these change only how SGLang detokenises, which we never do.
_SAMPLING_TEXT_FLAGS = ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
_SAMPLING_KEYS = frozenset(
    {"max_new_tokens", "temperature", "top_p", "top_k", "n", "sampling_seed", "stop_token_ids"}
    | set(_SAMPLING_TEXT_FLAGS)
    | set(_SAMPLING_OFF)
)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is not the token id 1


def _is_off(v: JsonValue, off: JsonValue) -> bool:
    """Whether a parameter's value ``v`` is its switched-off ``off`` (null and empty count)."""
    if v is None or (isinstance(v, (str, list, dict)) and not v):
        return True
    if isinstance(off, bool):
        return v is off
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == off


def _number(sp: dict[str, JsonValue], key: str, default: float, where: str) -> float:
    v = sp.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise BadRequest(f"{where}.{key}: must be a finite number, got {v!r}")
    return float(v)


def _sampling(sp: JsonValue, where: str) -> Sampling:
    """The checked sampling parameters of one request, as SGLang 0.5.23 reads and verifies them
    (null: the default); ``BadRequest`` naming the first bad field otherwise."""
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise BadRequest(f"{where}: must be an object, got {type(sp).__name__}")
    unknown = sorted(set(sp) - _SAMPLING_KEYS)
    if unknown:
        raise BadRequest(f"{where}.{unknown[0]}: not a sampling parameter (SGLang 0.5.23)")
    for key, off in _SAMPLING_OFF.items():
        if not _is_off(sp.get(key), off):
            raise BadRequest(f"{where}.{key}: not supported by the built-in engine (only {off!r})")
    for key in _SAMPLING_TEXT_FLAGS:
        if sp.get(key) is not None and not isinstance(sp[key], bool):
            raise BadRequest(f"{where}.{key}: must be true or false, got {sp[key]!r}")
    n = sp.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise BadRequest(
            f"{where}.n: must be 1, got {n!r}: the built-in engine draws one sample per request; "
            "send one request per sample (as the fleet client does, each with its own rid and seed)"
        )
    max_new = sp.get("max_new_tokens", 128)  # absent: SGLang's default; null: no limit
    if max_new is not None and (not _is_int(max_new) or max_new < 1):
        raise BadRequest(
            f"{where}.max_new_tokens: must be an integer >= 1 (or null: up to the context length), "
            f"got {max_new!r}; the built-in engine returns no prompt log-probs, so 0 would answer nothing"
        )
    temperature = _number(sp, "temperature", 1.0, where)
    if temperature < 0:
        raise BadRequest(f"{where}.temperature: must be >= 0, got {temperature}")
    top_p = _number(sp, "top_p", 1.0, where)
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"{where}.top_p: must be in (0, 1], got {top_p}")
    top_k = sp.get("top_k")
    top_k = TOP_K_OFF if top_k is None else top_k
    if not _is_int(top_k) or (top_k != TOP_K_OFF and top_k < 1):
        raise BadRequest(f"{where}.top_k: must be -1 (no cut) or an integer >= 1, got {top_k!r}")
    seed = sp.get("sampling_seed")
    if seed is not None and not _is_int(seed):
        raise BadRequest(f"{where}.sampling_seed: must be an integer, got {seed!r}")
    stops = sp.get("stop_token_ids") or []
    if not isinstance(stops, list) or not all(_is_int(t) and t >= 0 for t in stops):
        raise BadRequest(f"{where}.stop_token_ids: must be a list of token ids, got {stops!r}")
    return Sampling(
        max_new_tokens=max_new,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop_token_ids=stops,
    )
