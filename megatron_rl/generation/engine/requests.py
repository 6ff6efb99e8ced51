"""A ``/generate`` body for the built-in engine, read and checked before anything is queued: the
prompts (one, or a batch), their ids (``rid``), ``stream``, the reply's log-prob form, and each
prompt's sampling parameters as SGLang 0.5.23 reads and verifies them. Every refusal is a
:class:`BadRequest` naming the field (``sampling_params[3].top_p: ...``); a batch is checked
whole, so one bad prompt queues nothing.

No field is ignored. Each top-level field of SGLang 0.5.23's ``GenerateReqInput``
(``sglang/srt/managers/io_struct.py``) is implemented here, or accepted because it changes nothing
that this engine does (:data:`_GENERATE_INERT`, each with why), or refused unless at the value
that switches it off (:data:`_GENERATE_OFF`: ``lora_path`` null, ``return_hidden_states``
false, ...); a key that is none of these is refused as unknown. Every integer that reaches torch
has a range: token ids within the model's vocabulary (``input_ids[i][j]``,
``stop_token_ids[j]``), ``sampling_seed`` a signed 64-bit integer, ``top_k`` an int32.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
#: The top-level fields parse_generate_body reads (implements); ``text`` and the media fields only
#: to refuse them with what to do instead.
_GENERATE_READ = frozenset(
    {
        "rid",
        "input_ids",
        "text",
        "sampling_params",
        "stream",
        "return_routed_experts",
        "routed_experts_start_len",
        FLAT_LOGPROBS,  # ours, advertised in /server_info
        *_MEDIA_FIELDS,
    }
)


def _bool(v: JsonValue) -> bool:
    return isinstance(v, bool)


def _bools(v: JsonValue) -> bool:  # SGLang's per-request form: one value, or one per prompt
    return isinstance(v, bool) or (isinstance(v, list) and all(isinstance(x, bool) for x in v))


def _text(v: JsonValue) -> bool:
    return isinstance(v, str)


def _int64(v: JsonValue) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63


def _labels(v: JsonValue) -> bool:
    return isinstance(v, dict) and all(isinstance(x, str) for x in v.values())


def _object(v: JsonValue) -> bool:
    return isinstance(v, dict)


# SGLang 0.5.23 /generate fields accepted at any value of their type (or null) because none
# changes what this engine computes or returns: (the value's check, what it must be). A wrong type
# is still refused, as SGLang's parser refuses it.
_GENERATE_INERT: dict[str, tuple[Callable[[JsonValue], bool], str]] = {
    # The output tokens' log-probs are always in the reply (the RL loop reads them), as SGLang's
    # reply has them with return_logprob true, which every caller of ours sends.
    "return_logprob": (_bools, "true or false (or one per prompt)"),
    # Whether SGLang counts the request in its metrics / may log it: this engine keeps no
    # per-request metrics and never logs a prompt or an output.
    "log_metrics": (_bool, "true or false"),
    "no_logs": (_bool, "true or false"),
    # Scheduling order only: SGLang ignores it without --enable-priority-scheduling (its default)
    # after this same range check; this engine admits first come, first served.
    "priority": (_int64, "a signed 64-bit integer"),
    # Identities for SGLang's session prefix cache, its routing-key queue order and its request
    # tracking: cache keys and labels, never the prompt (unlike session_params, refused below).
    "session_id": (_text, "a string"),
    "routing_key": (_text, "a string"),
    "conversation_id": (_text, "a string"),
    # Metric labels and a tracing context: this engine exports neither.
    "custom_labels": (_labels, "an object of strings"),
    "external_trace_header": (_object, "an object"),
    # Not SGLang's but sglang-router's (its GenerateRequest.model, forwarded as null when the
    # client names none): the model it routes by, which picked this server; SGLang ignores it.
    "model": (_text, "a string"),
}

# SGLang 0.5.23 /generate fields this engine does not implement, each at the value that switches
# it off: accepted at that value (or null, empty, or a per-prompt list of them), refused at any
# other, naming the field, rather than answered as if it were not there.
_GENERATE_OFF: dict[str, JsonValue] = {
    # Adapters: none is ever loaded here (a base-model answer to a LoRA request would be wrong
    # with no word; SGLang refuses an adapter it has not loaded). See _LORA_FIELDS.
    "lora_path": None,
    "lora_id": None,
    # Log-probs beyond the output tokens': prompt ones (a start >= 0), top-n, chosen ids, the
    # sampling support, detokenised text (no tokenizer here), flat raw arrays.
    "logprob_start_len": -1,
    "top_logprobs_num": 0,
    "token_ids_logprob": None,
    "return_sampling_mask": False,
    "sampling_logprobs_mode": None,
    "return_text_in_logprobs": False,
    "return_flat_raw_top_logprobs": False,
    "return_flat_raw_output_top_logprobs": False,
    "return_flat_raw_top_logprobs_b64": False,
    # Other outputs: hidden states, indexer top-k, entropy, the prompt's ids, image bytes.
    "return_hidden_states": False,
    "return_indexer_topk": False,
    "return_entropy": False,
    "return_prompt_token_ids": False,
    "return_bytes": False,
    # Inputs other than token ids, and what goes with media (image_data etc. are read above).
    "input_embeds": None,
    "positional_embed_overrides": None,
    "mm_hashes": None,
    "mm_content_hashes": None,
    "use_audio_in_video": False,
    "video_config": None,
    "modalities": None,
    "max_dynamic_patch": None,
    "min_dynamic_patch": None,
    "image_max_dynamic_patch": None,
    "video_max_dynamic_patch": None,
    "images_config": None,
    "mm_processor_kwargs": None,
    "multi_item_delimiter_indices": None,
    "token_indices_to_pool": None,
    # Generation we do not do: a custom logit processor, a watermark, a session's prompt
    # continuation, reasoning controls, background (responses API) requests.
    "custom_logit_processor": None,
    "watermark": None,
    "session_params": None,
    "require_reasoning": False,
    "max_thinking_tokens": None,
    "background": False,
    # Cache isolation: this engine shares the KV of identical running prompts, whatever the salt.
    "cache_salt": None,
    "extra_key": None,
    "kv_hints": None,
    # Disaggregated prefill/decode and data-parallel routing: one worker here (dp rank 0 only,
    # which SGLang also ignores on one rank).
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "bootstrap_pair_key": None,
    "decode_tp_size": None,
    "routed_dp_rank": 0,
    "data_parallel_rank": 0,
    "disagg_prefill_dp_rank": None,
    # SGLang's internal fields, set between its own processes, never by a client.
    "http_worker_ipc": None,
    "received_time": None,
    "need_wait_for_mm_inputs": None,
    "num_items_assigned": None,
    "encoder_urls": None,
}
_LORA_FIELDS = ("lora_path", "lora_id")
#: The keys of sglang-router's /generate body (0.3.2) that SGLang's GenerateReqInput lacks.
ROUTER_FIELDS = frozenset({"model"})
#: Every top-level /generate key this engine knows; any other is refused as unknown.
_GENERATE_KEYS = _GENERATE_READ | set(_GENERATE_INERT) | set(_GENERATE_OFF)
# The longest rid: ids are dict keys, logged and echoed in every reply; a larger one is a mistake.
_MAX_RID_CHARS = 4096
# Token ids when the vocabulary is unknown (the timing engine without one): what an int64 holds.
_MAX_TOKEN_ID = 2**63 - 1
# SGLang 0.5.23's range for sampling_seed (SamplingParams.verify). torch.Generator.manual_seed
# takes [-2**63, 2**64 - 1] (a negative seed is read as its two's complement), so this signed
# half maps each seed to its own generator state and is refused by neither.
_SEED_RANGE = (-(2**63), 2**63 - 1)
# The largest top_k: SGLang's sampler holds top_k in int32 (sampling_batch_info.py); any k at or
# past the vocabulary keeps all of it, as -1 does.
_MAX_TOP_K = 2**31 - 1


def _check_top_level(body: dict[str, JsonValue]) -> None:
    """Refuse an unknown top-level key, an inert field of the wrong type, or an unimplemented one
    at other than its off value (:class:`BadRequest` naming the first, in sorted order)."""
    unknown = sorted(set(body) - _GENERATE_KEYS)
    if unknown:
        raise BadRequest(f"{unknown[0]}: not a /generate field (SGLang 0.5.23's GenerateReqInput)")
    for key in sorted(set(body) & set(_GENERATE_INERT)):
        check, what = _GENERATE_INERT[key]
        if body[key] is not None and not check(body[key]):
            raise BadRequest(f"{key}: must be {what} or null, got {_show(body[key])}")
    for key in sorted(set(body) & set(_GENERATE_OFF)):
        v, off = body[key], _GENERATE_OFF[key]
        if all(_is_off(x, off) for x in (v if isinstance(v, list) else [v])):  # one per prompt
            continue
        if key in _LORA_FIELDS:
            asked = next((x for x in v if x), v) if isinstance(v, list) else v  # as SGLang names it
            raise BadRequest(
                f"{key}: no LoRA adapter is loaded on this server ({_show(asked)} was asked); the built-in "
                "engine serves the checkpoint's own weights only, so it refuses rather than answer "
                "from the base model"
            )
        allowed = "null" if off is None else f"{off!r} or null"
        raise BadRequest(f"{key}: not supported by the built-in engine (only {allowed}), got {_show(v)}")


def _show(v: JsonValue, most: int = 80) -> str:
    """``repr(v)`` cut to ``most`` characters: an error echoes what was sent, not megabytes of it."""
    text = repr(v)
    return text if len(text) <= most else f"{text[: most - 3]}..."


def parse_generate_body(body: dict[str, JsonValue], *, vocab_size: int | None = None) -> GenerateBody:
    """``body``'s requests, checked (:class:`BadRequest` naming the field). ``vocab_size``: the
    model's; a token id outside ``[0, vocab_size)`` is refused naming it (None: not known)."""
    _check_top_level(body)
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
    top_id = _MAX_TOKEN_ID if vocab_size is None else vocab_size - 1
    jobs: list[Job] = []
    for i, (rid, prompt, sp) in enumerate(zip(rid_list, prompts, params_list)):
        where = f"[{i}]" if batch else ""
        if not isinstance(prompt, list) or not all(_is_int(t) for t in prompt):
            raise BadRequest(f"input_ids{where}: must be a list of token ids (integers)")
        bad = next((j for j, t in enumerate(prompt) if not 0 <= t <= top_id), None)
        if bad is not None:  # "prompt[i]: " as the engine's own refusals of a batch's prompt
            raise BadRequest(
                f"{f'prompt{where}: ' if batch else ''}input_ids{where}[{bad}]: token id "
                f"{prompt[bad]} is outside the vocabulary [0, {top_id + 1})"
            )
        if rid is not None and (isinstance(rid, bool) or not isinstance(rid, (str, int))):
            raise BadRequest(f"rid{where}: must be a string, got {rid!r}")
        if rid is not None and len(str(rid)) > _MAX_RID_CHARS:
            raise BadRequest(f"rid{where}: at most {_MAX_RID_CHARS} characters, got {len(str(rid))}")
        if routed_start > len(prompt):  # SGLang: in [0, prompt tokens]
            raise BadRequest(
                f"routed_experts_start_len: {routed_start} is beyond the prompt{where} ({len(prompt)} tokens)"
            )
        jobs.append(
            Job(
                str(rid) if rid is not None else "",
                prompt,
                _sampling(sp, f"sampling_params{where}", top_id),
                where,
            )
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


def _sampling(sp: JsonValue, where: str, top_id: int = _MAX_TOKEN_ID) -> Sampling:
    """The checked sampling parameters of one request, as SGLang 0.5.23 reads and verifies them
    (null: the default); ``BadRequest`` naming the first bad field otherwise. ``top_id``: the
    largest token id of the vocabulary."""
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
    if not _is_int(top_k) or (top_k != TOP_K_OFF and not 1 <= top_k <= _MAX_TOP_K):
        raise BadRequest(f"{where}.top_k: must be -1 (no cut) or an integer in [1, 2**31 - 1], got {top_k!r}")
    seed = sp.get("sampling_seed")
    lo, hi = _SEED_RANGE
    if seed is not None and not (_is_int(seed) and lo <= seed <= hi):
        raise BadRequest(
            f"{where}.sampling_seed: must be an integer in [-2**63, 2**63 - 1] (SGLang's range, "
            f"which torch.Generator.manual_seed takes), got {seed!r}"
        )
    stops = sp.get("stop_token_ids") or []
    if not isinstance(stops, list) or not all(_is_int(t) and t >= 0 for t in stops):
        raise BadRequest(f"{where}.stop_token_ids: must be a list of token ids, got {_show(stops)}")
    bad = next((j for j, t in enumerate(stops) if t > top_id), None)
    if bad is not None:  # it could never be sampled, so the request would never stop on it
        raise BadRequest(
            f"{where}.stop_token_ids[{bad}]: token id {stops[bad]} is outside the vocabulary "
            f"[0, {top_id + 1})"
        )
    return Sampling(
        max_new_tokens=max_new,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop_token_ids=stops,
    )
