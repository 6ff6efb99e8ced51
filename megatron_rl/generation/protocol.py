"""SGLang's HTTP API, the subset we use: every payload the client sends and how replies are read.

Pinned to **SGLang 0.5.23** (``SGLANG_VERSION``). The field names and routes below are checked
against that release's own request dataclasses (``sglang/srt/managers/io_struct.py``,
``sglang/srt/sampling/sampling_params.py``) and routes (``sglang/srt/entrypoints/http_server.py``)
by ``tests/generation/test_sglang_contract.py``, which parses the pinned wheel's source. The
built-in engine server (``megatron_rl/generation/engine/server.py``) answers the same payloads.

Routes and payloads (all JSON):

========================================  ==================================================
``POST /generate``                        :func:`generate_payload` -> :func:`parse_generate`
``POST /pause_generation``                ``{"mode": "in_place"}`` (keep running requests and
                                          their KV cache; ``"abort"`` ends them)
``POST /continue_generation``             ``{}``
``POST /init_weights_update_group``       :func:`init_group_payload`
``POST /begin_weight_update``             ``{}`` (0.5.23: updates must sit in a session)
``POST /update_weights_from_distributed`` :func:`update_weights_payload`
``POST /end_weight_update``               ``{}``
``POST /destroy_weights_update_group``    ``{"group_name": ...}``
``POST /abort_request``                   ``{"rid": ...}`` or ``{"abort_all": true}``
``GET  /server_info``                     ``max_total_num_tokens`` (KV capacity), ...
``GET  /health``                          200 when the server is up
========================================  ==================================================

**API key.** A server started with ``--api-key KEY`` (SGLang's flag; the built-in engine also
reads ``$MEGATRON_RL_API_KEY``) answers every route but its health checks with 401
``{"error": "Unauthorized"}`` unless the request carries ``Authorization: Bearer KEY``
(:func:`auth_headers`). SGLang 0.5.23 has no environment variable for the key; ours keeps it out
of ``ps``.

**Weight versions.** SGLang versions are strings (initially ``"default"``); each output reports
``meta_info["weight_versions"]``, spans ``{"version", "start", "end"}`` over output token
positions. We always set integer versions (``str(policy_version)``); :func:`versions_per_token`
expands the spans into one int per token (a non-integer version, i.e. the server's initial
weights before any update, reads as ``initial_version``).

**Buckets.** ``load_format="flattened_bucket"``: each bucket is one ``uint8`` tensor holding its
tensors' bytes back to back in ``names`` order, each starting at a multiple of its dtype's size
(SGLang's ``FlattenedTensorBucket.empty`` layout; it rejects unaligned offsets, so
:func:`pack_bucket` orders tensors by decreasing element size).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from megatron_rl.generation.api import GenRequest, GenResult

if TYPE_CHECKING:
    from megatron_rl.fileio import JsonValue
    from megatron_rl.generation.api import FinishReason

__all__ = [
    "API_KEY_ENV",
    "ROUTES",
    "SGLANG_VERSION",
    "ProtocolError",
    "abort_payload",
    "api_key_from_env",
    "auth_headers",
    "bucket_layout",
    "check_api_key",
    "dtype_name",
    "generate_payload",
    "init_group_payload",
    "pack_bucket",
    "parse_generate",
    "pause_payload",
    "tensor_digest",
    "unpack_bucket",
    "update_weights_payload",
    "versions_per_token",
]

SGLANG_VERSION = "0.5.23"

# route -> HTTP method, for every route the client calls on an SGLang server: the client refuses
# any other, and tests/generation/test_sglang_contract.py checks each against SGLang's own routes.
ROUTES = {
    "/generate": "POST",
    "/pause_generation": "POST",
    "/continue_generation": "POST",
    "/init_weights_update_group": "POST",
    "/begin_weight_update": "POST",
    "/update_weights_from_distributed": "POST",
    "/end_weight_update": "POST",
    "/destroy_weights_update_group": "POST",
    "/abort_request": "POST",
    "/server_info": "GET",
    "/health": "GET",
}


#: The environment variable holding the API key ("" or unset: no key) for ``serve-engine``, the
#: engine processes we start and :class:`~megatron_rl.generation.client.FleetClient`.
API_KEY_ENV = "MEGATRON_RL_API_KEY"


class ProtocolError(ValueError):
    """A reply that does not have the shape SGLang's API promises."""


def api_key_from_env() -> str:
    """The key in ``$MEGATRON_RL_API_KEY``; "" when it is unset (no key)."""
    return check_api_key(os.environ.get(API_KEY_ENV, ""))


def check_api_key(key: str) -> str:
    """``key`` if it can travel whole in an ``Authorization`` header (printable ASCII, no
    spaces), else ``ValueError`` (which does not repeat the key)."""
    if not all("!" <= c <= "~" for c in key):
        raise ValueError("api_key: must be printable ASCII without spaces")
    return key


def auth_headers(api_key: str) -> dict[str, str]:
    """The header SGLang's ``--api-key`` asks for (none when ``api_key`` is "")."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def generate_payload(req: GenRequest) -> dict[str, object]:
    """``/generate`` body for one request: token ids in, token ids + log-probs + versions out."""
    sampling: dict[str, object] = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "max_new_tokens": req.max_new_tokens,
        # Token ids in and out; keep the stop token in the output (the trainer trains on it).
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if req.stop_token_ids:
        sampling["stop_token_ids"] = list(req.stop_token_ids)
    if req.seed is not None:
        sampling["sampling_seed"] = int(req.seed)
    return {
        "rid": req.request_id,
        "input_ids": list(req.input_ids),
        "sampling_params": sampling,
        "return_logprob": True,
        # -1: log-probs of the output tokens only.
        "logprob_start_len": -1,
        "stream": False,
    }


def versions_per_token(
    spans: Sequence[dict[str, JsonValue]] | None, n_tokens: int, *, initial_version: int = 0
) -> list[int]:
    """Expand SGLang's ``weight_versions`` spans into one policy version per output token."""
    if not spans:
        return [initial_version] * n_tokens
    out = [initial_version] * n_tokens
    covered = 0
    for span in spans:
        try:
            v = int(span["version"])
        except (TypeError, ValueError):
            v = initial_version
        start, end = int(span["start"]), min(int(span["end"]), n_tokens)
        if start != covered:
            raise ProtocolError(f"weight_versions: spans must tile the output, got {list(spans)}")
        out[start:end] = [v] * (end - start)
        covered = end
    if covered != n_tokens:
        raise ProtocolError(f"weight_versions: spans cover {covered} of {n_tokens} tokens")
    return out


def _finish_reason(value: object) -> FinishReason:
    """SGLang's finish type as ours; any other value counts as ``stop``."""
    if value == "length":
        return "length"
    if value == "abort":
        return "abort"
    return "stop"


def parse_generate(
    req: GenRequest, body: dict[str, JsonValue], *, server: str = "", initial_version: int = 0
) -> GenResult:
    """Read a ``/generate`` reply (one request) into a :class:`GenResult`."""
    try:
        meta = body["meta_info"]
        token_ids = [int(t) for t in body["output_ids"]]
        lp = meta["output_token_logprobs"]
        finish = meta.get("finish_reason") or {}
    except (KeyError, TypeError) as e:
        raise ProtocolError(f"/generate reply from {server or 'server'} lacks {e}") from None
    # SGLang: [[logprob, token_id, text_or_None], ...] for the output tokens.
    if len(lp) != len(token_ids) or any(int(e[1]) != t for e, t in zip(lp, token_ids)):
        raise ProtocolError(
            f"/generate reply from {server or 'server'}: output_token_logprobs do not match output_ids"
        )
    reason = _finish_reason(finish.get("type", "stop") if isinstance(finish, dict) else str(finish))
    return GenResult(
        request_id=req.request_id,
        prompt_ids=list(req.input_ids),
        token_ids=token_ids,
        logprobs=[float(e[0]) for e in lp],
        versions=versions_per_token(
            meta.get("weight_versions"), len(token_ids), initial_version=initial_version
        ),
        finish_reason=reason,
        server=server,
        meta={"finish_reason": finish, "weight_version": meta.get("weight_version")},
    )


def pause_payload(mode: str = "in_place") -> dict[str, object]:
    """``/pause_generation``: ``in_place`` keeps requests and their KV cache."""
    if mode not in ("in_place", "abort", "retract"):
        raise ValueError(f"mode: must be in_place, abort or retract, got {mode!r}")
    return {"mode": mode}


def abort_payload(rid: str | None = None) -> dict[str, object]:
    """``/abort_request`` for one request, or every request when ``rid`` is None."""
    return {"abort_all": True} if rid is None else {"rid": rid}


def init_group_payload(
    *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
) -> dict[str, object]:
    """``/init_weights_update_group``: the server's workers take ranks ``rank_offset + tp_rank``."""
    return {
        "master_address": master_address,
        "master_port": int(master_port),
        "rank_offset": int(rank_offset),
        "world_size": int(world_size),
        "group_name": group_name,
        "backend": backend,
    }


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (what SGLang's ``getattr(torch, name)`` reads)."""
    return str(dtype).removeprefix("torch.")


def update_weights_payload(
    *,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    group_name: str,
    weight_version: int,
    flattened_bucket: bool = True,
) -> dict[str, object]:
    """``/update_weights_from_distributed`` for one bucket; never flushes the cache."""
    payload: dict[str, object] = {
        "names": list(names),
        "dtypes": list(dtypes),
        "shapes": [list(map(int, s)) for s in shapes],
        "group_name": group_name,
        "flush_cache": False,
        "abort_all_requests": False,
        "weight_version": str(int(weight_version)),
    }
    if flattened_bucket:
        payload["load_format"] = "flattened_bucket"
    return payload


def bucket_layout(
    dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
) -> tuple[list[tuple[int, int]], int]:
    """Byte ``(start, end)`` of each tensor in a flattened bucket, and its total size."""
    spans: list[tuple[int, int]] = []
    offset = 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        dt = getattr(torch, dtype, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"dtypes: unknown dtype {dtype!r}")
        if offset % dt.itemsize:
            raise ValueError(f"bucket: {dtype} tensor at byte {offset} is not aligned")
        size = dt.itemsize * int(torch.Size(shape).numel())
        spans.append((offset, offset + size))
        offset += size
    return spans, offset


def pack_bucket(
    named: Iterable[tuple[str, torch.Tensor]],
) -> tuple[list[str], list[str], list[list[int]], torch.Tensor]:
    """``(names, dtypes, shapes, flat uint8 tensor)`` for the tensors, larger dtypes first."""
    items = sorted(named, key=lambda nt: -nt[1].element_size())  # stable: model order per dtype
    if not items:
        raise ValueError("bucket: no tensors")
    flat = torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for _, t in items])
    return (
        [n for n, _ in items],
        [dtype_name(t.dtype) for _, t in items],
        [list(t.shape) for _, t in items],
        flat,
    )


def unpack_bucket(
    names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], flat: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    """Views of each tensor inside a received flat ``uint8`` bucket."""
    spans, total = bucket_layout(dtypes, shapes)
    if flat.numel() != total:
        raise ValueError(f"bucket: {flat.numel()} bytes received, the metadata says {total}")
    return [
        (n, flat[a:b].view(getattr(torch, d)).view(list(s)))
        for n, d, s, (a, b) in zip(names, dtypes, shapes, spans)
    ]


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (what ``/megatron_rl/weights_digest`` reports per parameter)."""
    return hashlib.sha256(
        t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    ).hexdigest()
