"""SGLang's HTTP API, the subset we use: every payload the client sends and how replies are read.

Pinned to **SGLang 0.5.23** (``SGLANG_VERSION``). The field names and routes below are checked
against that release's own request dataclasses (``sglang/srt/managers/io_struct.py``,
``sglang/srt/sampling/sampling_params.py``) and routes (``sglang/srt/entrypoints/http_server.py``)
by ``tests/generation/test_sglang_contract.py``, which parses the pinned wheel's source. The
built-in engine server (``megatron_rl/generation/engine/server.py``) answers the same payloads.

Routes and payloads (all JSON):

========================================  ==================================================
``POST /generate``                        :func:`generate_payload` -> :func:`parse_generate`;
                                          a group in one: :func:`generate_batch_payload` ->
                                          :func:`parse_generate_batch`
``POST /pause_generation``                ``{"mode": "in_place"}`` (keep running requests and
                                          their KV cache; ``"abort"`` ends them)
``POST /continue_generation``             ``{}``
``POST /init_weights_update_group``       :func:`init_group_payload`
``POST /begin_weight_update``             ``{}`` (0.5.23: updates must sit in a session)
``POST /update_weights_from_distributed`` :func:`update_weights_payload`
``POST /end_weight_update``               ``{}``
``POST /destroy_weights_update_group``    ``{"group_name": ...}``
``POST /abort_request``                   ``{"rid": ...}`` or ``{"abort_all": true}``
``POST /flush_cache``                     empties the radix (prefix) cache; SGLang does it
                                          only when no request runs or waits
``POST /weights_checker``                 :func:`weights_checker_payload` ->
                                          :func:`parse_weights_checker`
``GET  /server_info``                     ``max_total_num_tokens`` (KV capacity), the layout
                                          (``tp_size``, ``pp_size``, ``dp_size``:
                                          :func:`update_group_ranks`), ...
``POST /release_memory_occupation``       :func:`memory_payload` (colocated mode: free the KV
                                          cache / weights while the trainer runs; idle only)
``POST /resume_memory_occupation``        :func:`memory_payload` (take the memory back)
``POST /update_weights_from_tensor``      :func:`update_weights_from_tensor_payload` (named
                                          tensors by reference: CUDA IPC, or CPU shared memory)
``GET  /health``                          200 when the server is up
========================================  ==================================================

**sglang-router** (``ROUTER_VERSION``) forwards ``/generate`` to its workers and answers
``/health``; it has no ``/abort_request``, ``/pause_generation`` or ``/server_info`` (404). So
behind a router, aborts, pauses and weight updates go to the workers themselves (the fleet's
``update_urls``), and the router's own request timeout (``--request-timeout-secs``, 1800 s by
default) is set from the recipe (``fleet.request_timeout_s``) so that it never cuts a
generation the client still waits for.

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

import base64
import binascii
import hashlib
import io
import json
import math
import operator
import os
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import orjson
import torch
from torch.multiprocessing.reductions import rebuild_storage_filename

from megatron_rl.generation.api import GenRequest, GenResult

if TYPE_CHECKING:
    from megatron_rl.fileio import JsonValue
    from megatron_rl.generation.api import FinishReason

__all__ = [
    "API_KEY_ENV",
    "FLAT_LOGPROBS",
    "FLAT_LOGPROBS_FIELD",
    "FUSED_IN_ONE_LOAD",
    "MEMORY_TAGS",
    "ROUTER_VERSION",
    "ROUTES",
    "SGLANG_VERSION",
    "STREAMED_BATCH",
    "ProtocolError",
    "abort_payload",
    "api_key_from_env",
    "auth_headers",
    "bucket_layout",
    "check_api_key",
    "check_server_url",
    "dtype_name",
    "fused_partner",
    "generate_batch_payload",
    "generate_payload",
    "init_group_payload",
    "loads_reply",
    "memory_payload",
    "pack_bucket",
    "parse_generate",
    "parse_generate_batch",
    "parse_stream_events",
    "parse_weights_checker",
    "pause_payload",
    "router_launch_args",
    "serialize_named_tensors",
    "server_launch_args",
    "tensor_digest",
    "unpack_bucket",
    "update_group_ranks",
    "update_weights_from_tensor_payload",
    "update_weights_payload",
    "versions_per_token",
    "weights_checker_payload",
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
    "/flush_cache": "POST",
    "/weights_checker": "POST",
    "/release_memory_occupation": "POST",
    "/resume_memory_occupation": "POST",
    "/update_weights_from_tensor": "POST",
    "/server_info": "GET",
    "/health": "GET",
}

#: The sglang-router release our launch scripts start and ``tests/generation/test_router.py`` runs
#: in front of built-in engines (the ``router`` extra pins ``sglang-router`` to this minor).
ROUTER_VERSION = "0.3.2"


#: The environment variable holding the API key ("" or unset: no key) for ``serve-engine``, the
#: engine processes we start and :class:`~megatron_rl.generation.client.FleetClient`.
API_KEY_ENV = "MEGATRON_RL_API_KEY"

# A key of the built-in engine's /server_info (not SGLang's): the server streams a batch
# /generate's items as each finishes and sends nothing else, so the client streams group requests
# there; SGLang would also send partial outputs every --stream-interval tokens.
STREAMED_BATCH = "megatron_rl_streamed_batch"

# A key of the built-in engine's /server_info and a /generate field (not SGLang's): asked for with
# true, the reply's ``meta_info`` carries ``output_logprobs``, one float per output token, instead
# of SGLang's ``output_token_logprobs`` triples ``[logprob, token_id, null]`` that repeat the
# ``output_ids``. It reads in about half the time (one list of floats, no list per token): the
# client's CPU per completion is what one orchestrator's fleet size is bounded by.
FLAT_LOGPROBS = "megatron_rl_flat_logprobs"
FLAT_LOGPROBS_FIELD = "output_logprobs"  # the meta_info key that carries them


class ProtocolError(ValueError):
    """A reply that does not have the shape SGLang's API promises."""


def api_key_from_env() -> str:
    """The key in ``$MEGATRON_RL_API_KEY``; "" when it is unset (no key)."""
    return check_api_key(os.environ.get(API_KEY_ENV, ""))


def check_server_url(url: object) -> str:
    """``url`` if it can name a generation server (``http://HOST[:PORT][/PATH]``, or https), else
    ``ValueError`` saying what is wrong: checked where a recipe is read, before anything starts."""
    if not isinstance(url, str):
        raise ValueError(f"must be a string http://HOST[:PORT], got {url!r}")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as e:  # a port that is not a number or out of range
        raise ValueError(f"{url!r}: not a server URL ({e}); expected http://HOST[:PORT]") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r}: not a server URL (expected http://HOST[:PORT])")
    if port == 0 or parts.query or parts.fragment or parts.username is not None:
        raise ValueError(
            f"{url!r}: a server URL holds no port 0, user, query or fragment (expected http://HOST[:PORT])"
        )
    return url


def check_api_key(key: str) -> str:
    """``key`` if it can travel whole in an ``Authorization`` header (printable ASCII, no
    spaces), else ``ValueError`` (which does not repeat the key)."""
    if not all("!" <= c <= "~" for c in key):
        raise ValueError("api_key: must be printable ASCII without spaces")
    return key


def auth_headers(api_key: str) -> dict[str, str]:
    """The header SGLang's ``--api-key`` asks for (none when ``api_key`` is "")."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _sampling_params(req: GenRequest) -> dict[str, object]:
    """A request's ``sampling_params``: its own sampling seed, token ids in and out."""
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
    return sampling


def generate_payload(req: GenRequest) -> dict[str, object]:
    """``/generate`` body for one request: token ids in, token ids + log-probs + versions out."""
    body: dict[str, object] = {
        "rid": req.request_id,
        "input_ids": list(req.input_ids),
        "sampling_params": _sampling_params(req),
        "return_logprob": True,
        # -1: log-probs of the output tokens only.
        "logprob_start_len": -1,
        "stream": False,
    }
    if req.return_routed_experts:  # every position from 0: the trainer replays them all
        body["return_routed_experts"] = True
    return body


def generate_batch_payload(
    reqs: Sequence[GenRequest], *, stream: bool = False, flat_logprobs: bool = False
) -> dict[str, object]:
    """``/generate`` body for several requests at once (a group's G samples of one prompt):
    SGLang's batch form, a ``rid``, a prompt and a ``sampling_params`` (its own sampling seed)
    per request. The reply is a list, one object per request in this order
    (:func:`parse_generate_batch`). A group then costs one HTTP request, and the server sees its
    samples together, so their shared prompt is prefilled once (SGLang's prefix cache; the
    built-in engine's prompt sharing).

    ``stream``: the reply is server-sent events instead, each item as it finishes with its
    ``index`` (:func:`parse_stream_events`). The built-in engine sends only finished items
    (:data:`STREAMED_BATCH`); SGLang also sends every item's partial output every
    ``--stream-interval`` tokens, which the parser skips.

    ``flat_logprobs``: ask for the log-probs as one list of floats (:data:`FLAT_LOGPROBS`; only
    for a server whose ``/server_info`` says it takes it)."""
    if not reqs:
        raise ValueError("generate_batch_payload: need at least one request")
    body: dict[str, object] = {
        "rid": [r.request_id for r in reqs],
        "input_ids": [list(r.input_ids) for r in reqs],
        "sampling_params": [_sampling_params(r) for r in reqs],
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": stream,
    }
    if flat_logprobs:
        body[FLAT_LOGPROBS] = True
    if any(r.return_routed_experts for r in reqs):  # one field for the batch, as SGLang has it
        body["return_routed_experts"] = True
    return body


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


_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


def parse_generate(
    req: GenRequest, body: dict[str, JsonValue], *, server: str = "", initial_version: int = 0
) -> GenResult:
    """Read a ``/generate`` reply (one request) into a :class:`GenResult`."""
    try:
        meta = body["meta_info"]
        token_ids = list(map(int, body["output_ids"]))
        flat = meta.get(FLAT_LOGPROBS_FIELD)  # FLAT_LOGPROBS, asked of a built-in engine
        lp = meta["output_token_logprobs"] if flat is None else flat
        finish = meta.get("finish_reason") or {}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ProtocolError(f"/generate reply from {server or 'server'} lacks {e}") from None
    # SGLang: [[logprob, token_id, text_or_None], ...] for the output tokens. Read with map and
    # itemgetter (C loops): this runs for every token of every completion of a run. float() and
    # int() of a float or an int that JSON gave return it as it is.
    try:
        if flat is None:
            matches = len(lp) == len(token_ids) and list(map(int, map(_SECOND, lp))) == token_ids
            logprobs = list(map(float, map(_FIRST, lp)))
        else:
            matches = isinstance(lp, list) and len(lp) == len(token_ids)
            logprobs = list(map(float, lp))
    except (TypeError, ValueError, IndexError, KeyError):
        matches = False
    if not matches:
        raise ProtocolError(
            f"/generate reply from {server or 'server'}: output_token_logprobs do not match output_ids"
        )
    reason = _finish_reason(finish.get("type", "stop") if isinstance(finish, dict) else str(finish))
    routed = _routed_experts(meta.get("routed_experts"), len(req.input_ids) + len(token_ids) - 1, server)
    return GenResult(
        request_id=req.request_id,
        prompt_ids=req.input_ids,  # shared with the request (a group's samples: one list), never changed
        token_ids=token_ids,
        logprobs=logprobs,
        versions=versions_per_token(
            meta.get("weight_versions"), len(token_ids), initial_version=initial_version
        ),
        finish_reason=reason,
        server=server,
        meta={
            "finish_reason": finish,
            "weight_version": meta.get("weight_version"),
            # Prompt tokens served from SGLang's prefix cache (KV possibly of older weights).
            "cached_tokens": int(meta.get("cached_tokens") or 0),
        },
        routed_experts=routed,
    )


def _routed_experts(value: JsonValue, positions: int, server: str) -> torch.Tensor | None:
    """SGLang's ``meta_info.routed_experts`` (base64 of int32 experts, position by position, for
    the ``positions`` fed tokens) as a flat int32 tensor; None when the reply has none."""
    if value is None:
        return None
    try:
        raw = base64.b64decode(str(value), validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError(
            f"/generate reply from {server or 'server'}: routed_experts is not base64"
        ) from None
    if len(raw) % 4 or positions < 1 or (len(raw) // 4) % positions:
        raise ProtocolError(
            f"/generate reply from {server or 'server'}: routed_experts holds {len(raw)} bytes, not "
            f"int32 experts for each of the {positions} positions fed"
        )
    return torch.frombuffer(bytearray(raw), dtype=torch.int32)


def parse_generate_batch(
    reqs: Sequence[GenRequest], body: JsonValue, *, server: str = "", initial_version: int = 0
) -> list[GenResult]:
    """Read a batch ``/generate`` reply (:func:`generate_batch_payload`): one result per
    request, in the order sent."""
    if not isinstance(body, list) or len(body) != len(reqs):
        got = f"a list of {len(body)}" if isinstance(body, list) else type(body).__name__
        raise ProtocolError(
            f"/generate batch reply from {server or 'server'}: expected a list of {len(reqs)} "
            f"results, got {got}"
        )
    out = []
    for req, item in zip(reqs, body):
        if not isinstance(item, dict):
            raise ProtocolError(f"/generate batch reply from {server or 'server'}: an item is not an object")
        out.append(parse_generate(req, item, server=server, initial_version=initial_version))
    return out


def loads_reply(data: bytes) -> JsonValue:
    """JSON from bytes: orjson (a reply of per-token log-probs parses 2-3x faster), or the
    standard parser for what orjson refuses and Python writes (``NaN``, ``-Infinity``);
    ``ValueError`` if neither reads it."""
    try:
        return orjson.loads(data)
    except ValueError:
        return json.loads(data)


def parse_stream_events(
    reqs: Sequence[GenRequest], events: bytes, *, server: str = "", initial_version: int = 0
) -> tuple[list[tuple[int, GenResult]], bool]:
    """Read whole server-sent events of a streamed batch ``/generate`` (``data: {...}``, each
    ending in a blank line): the finished items among them as ``(index, result)`` (partial
    outputs skipped), and whether ``data: [DONE]`` was among them. An error event (SGLang
    sends ``{"error": {"message": ...}}`` when a request fails mid-stream) raises."""
    out: list[tuple[int, GenResult]] = []
    done = False
    for event in events.split(b"\n\n"):
        for line in event.splitlines():
            if not line.startswith(b"data:"):
                continue  # comments and other SSE fields
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                continue
            try:
                item = loads_reply(data)
            except ValueError:
                raise ProtocolError(
                    f"/generate stream from {server or 'server'}: an event is not JSON"
                ) from None
            if not isinstance(item, dict):
                raise ProtocolError(f"/generate stream from {server or 'server'}: an event is not an object")
            if "error" in item:
                error = item["error"]
                message = error.get("message") if isinstance(error, dict) else error
                raise ProtocolError(f"/generate stream from {server or 'server'}: {message}")
            meta = item.get("meta_info")
            if not isinstance(meta, dict) or not meta.get("finish_reason"):
                continue  # a partial output (SGLang, every --stream-interval tokens)
            index = item.get("index", 0)
            if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(reqs):
                raise ProtocolError(
                    f"/generate stream from {server or 'server'}: index {index!r} is not one of the "
                    f"{len(reqs)} requests sent"
                )
            out.append(
                (index, parse_generate(reqs[index], item, server=server, initial_version=initial_version))
            )
    return out, done


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


def update_group_ranks(info: dict[str, JsonValue], url: str = "server") -> int:
    """How many ranks of the weight-update group a server takes, from its ``/server_info``.

    SGLang 0.5.23 joins each worker process at ``rank_offset + tp_rank`` (its
    ``ModelRunner`` weight updater) and refuses the distributed update with data-parallel
    replicas (the tokenizer manager asserts ``dp_size == 1``). So a server takes ``tp_size``
    ranks; ``pp_size > 1`` would make the stages' workers claim the same ranks, and ``dp_size
    > 1`` is refused by SGLang itself: both raise :class:`ProtocolError` naming the server and
    the field, before any group is made (run one server per replica, behind the router).
    Fields a server does not report (a router, an old build) count as 1."""
    sizes = {}
    for field in ("tp_size", "pp_size", "dp_size"):
        raw = info.get(field, 1)
        try:
            value = int(raw) if raw is not None else 1
        except (TypeError, ValueError):
            raise ProtocolError(f"{url}: /server_info {field} is not an integer: {raw!r}") from None
        if value < 1:
            raise ProtocolError(f"{url}: /server_info {field} must be >= 1, got {value}")
        sizes[field] = value
    if sizes["dp_size"] > 1:
        raise ProtocolError(
            f"{url}: dp_size={sizes['dp_size']}: SGLang {SGLANG_VERSION} refuses weight updates "
            "from distributed with data-parallel replicas; start one server per replica "
            "(behind sglang-router) instead of --dp-size"
        )
    if sizes["pp_size"] > 1:
        raise ProtocolError(
            f"{url}: pp_size={sizes['pp_size']}: SGLang {SGLANG_VERSION} joins each worker to "
            "the update group at rank_offset + tp_rank, so the pipeline stages' workers would "
            "claim the same ranks; serve with --pp-size 1"
        )
    return sizes["tp_size"]


def weights_checker_payload() -> dict[str, object]:
    """``/weights_checker``: a checksum of every weight of the server (per worker rank)."""
    return {"action": "checksum"}


def parse_weights_checker(body: JsonValue, url: str = "server") -> dict[tuple[int, int], str]:
    """The ``per_gpu_checksum`` of each worker of a ``/weights_checker`` checksum reply, keyed
    by ``(pp_rank, tp_rank)`` (two servers with the same layout and weights agree key by key)."""
    if not isinstance(body, dict) or not body.get("success"):
        message = body.get("message") if isinstance(body, dict) else body
        raise ProtocolError(f"{url}: /weights_checker failed: {message!r}")
    out: dict[tuple[int, int], str] = {}
    try:
        for rank in body["ranks"]:
            placement = rank["parallelism_info"]
            if isinstance(placement, list):  # one entry per role; the target model's first
                placement = next(p for p in placement if p.get("role", "target") == "target")
            out[int(placement["pp_rank"]), int(placement["tp_rank"])] = str(rank["per_gpu_checksum"])
    except (KeyError, TypeError, ValueError, StopIteration) as e:
        raise ProtocolError(f"{url}: /weights_checker reply lacks {e}") from None
    if not out:
        raise ProtocolError(f"{url}: /weights_checker reply has no ranks")
    return out


def server_launch_args(
    *, deterministic: bool, weight_version: int = 0, routed_experts: bool = False
) -> list[str]:
    """The flags of ``python -m sglang.launch_server`` that follow from a recipe (the launch
    scripts add the model, the layout, host and port; ``megatron-rl sglang-args`` prints these).

    ``deterministic``: ``--enable-deterministic-inference``. Without it SGLang ignores the
    per-request ``sampling_seed`` our requests carry (its sampler reads the seed only in that
    mode), so the same prompt and seed give different completions; with it SGLang switches to
    batch-invariant kernels, which cost throughput (SGLang's own figures: about 35% slower
    decode with FlashInfer/FA3 attention; measure on your model). ``--weight-version`` makes the
    server's initial weights read as the trainer's version, not ``"default"``.
    ``routed_experts`` (``algorithm.routing_replay: rollout``): ``--enable-return-routed-experts``,
    without which SGLang refuses a request's ``return_routed_experts``."""
    args = ["--weight-version", str(int(weight_version))]
    if deterministic:
        args.append("--enable-deterministic-inference")
    if routed_experts:
        args.append("--enable-return-routed-experts")
    return args


#: HF tensors SGLang's loaders fuse into one parameter, and only when both come in one
#: ``load_weights`` call -- one weight-update request: (first, partner), as name suffixes of one
#: layer. DeepSeek's loader (``deepseek_weight_loader.py``) caches ``q_a_proj`` and
#: ``kv_a_proj_with_mqa`` in a dict local to the call and loads ``fused_qkv_a_proj_with_mqa`` once
#: both are in; split over two requests, neither is ever loaded (silently).
FUSED_IN_ONE_LOAD = (("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),)


def fused_partner(name: str) -> str | None:
    """The tensor ``name`` must share an update request with (see :data:`FUSED_IN_ONE_LOAD`),
    or None."""
    for first, partner in FUSED_IN_ONE_LOAD:
        if name.endswith("." + first):
            return name[: -len(first)] + partner
    return None


#: How much longer than the client's own ``request_timeout_s`` the router waits on a worker: the
#: client's timeout fires first and aborts the request at its worker (the router cannot).
ROUTER_TIMEOUT_MARGIN_S = 60


def router_launch_args(*, request_timeout_s: float) -> list[str]:
    """The flags of ``python -m sglang_router.launch_router`` that follow from a recipe: its
    request timeout (``--request-timeout-secs``, 1800 s by default in sglang-router 0.3.2, less
    than a long reasoning trace may take) set above the client's ``fleet.request_timeout_s``."""
    if not 0 < request_timeout_s < float("inf"):
        raise ValueError(
            f"request_timeout_s: must be a finite number of seconds > 0, got {request_timeout_s!r}"
        )
    return ["--request-timeout-secs", str(math.ceil(request_timeout_s) + ROUTER_TIMEOUT_MARGIN_S)]


# ---------------------------------------------------------------------------- colocated mode

#: SGLang 0.5.23's memory regions (``GPU_MEMORY_ALL_TYPES``, ``srt/constants.py``) that
#: ``/release_memory_occupation`` and ``/resume_memory_occupation`` take as ``tags``; none or an
#: empty list means all of them.
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")


def memory_payload(tags: Sequence[str] | None = None) -> dict[str, object]:
    """``/release_memory_occupation`` or ``/resume_memory_occupation``: the regions ``tags``
    (``MEMORY_TAGS``), or every region when ``tags`` is None."""
    if tags is None:
        return {}
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad or not tags:
        raise ValueError(f"tags: each one of {', '.join(MEMORY_TAGS)}, got {list(tags)!r}")
    return {"tags": list(tags)}


def _reduce_cpu_storage(storage: torch.UntypedStorage) -> tuple[Callable[..., object], tuple[object, ...]]:
    """A CPU storage pickled by the name of a shared-memory segment (torch's ``file_system``
    sharing), whatever the process's sharing strategy: the default ``file_descriptor`` passes
    the descriptor through a socket authenticated with the *sender's* multiprocessing key, which
    a server we did not fork cannot present. Moves ``storage`` into shared memory in place."""
    manager, handle, size = storage._share_filename_cpu_()
    storage._shared_incref()  # the receiver's rebuild takes this reference back
    return rebuild_storage_filename, (type(storage), manager, handle, size)


def serialize_named_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(list of (name, tensor), output_str=True)``:
    a ``ForkingPickler`` pickle, base64. Only handles travel, never the bytes: a CUDA tensor as a
    CUDA IPC handle (what SGLang on the same GPU opens), a CPU tensor as a shared-memory segment
    (what the built-in engine on the same host maps, ``engine/colocate.py``). CPU tensors are
    copied into shared memory first (the caller's own tensors stay where they are); the caller
    keeps the returned payload's tensors alive by keeping ``named``'s tensors until the server
    has answered."""
    from multiprocessing.reduction import ForkingPickler  # lazy: only the colocated push needs it

    class _Pickler(ForkingPickler):
        def __init__(self, file: io.BytesIO) -> None:
            super().__init__(file)
            self.dispatch_table[torch.UntypedStorage] = _reduce_cpu_storage

    items: list[tuple[str, torch.Tensor]] = []
    for name, t in named:
        t = t.detach()
        items.append((str(name), t.contiguous() if t.is_cuda else t.contiguous().clone()))
    buf = io.BytesIO()
    _Pickler(buf).dump(items)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def update_weights_from_tensor_payload(
    serialized: Sequence[str], *, weight_version: int, load_format: str | None = None
) -> dict[str, object]:
    """``/update_weights_from_tensor``: ``serialized`` holds one :func:`serialize_named_tensors`
    string per tensor-parallel rank of the server (SGLang's rank ``i`` opens entry ``i``).
    Flushes the prefix cache (SGLang's default: its entries hold keys and values of the old
    weights, and in colocated mode nothing runs that would keep them) and aborts nothing."""
    if not serialized:
        raise ValueError("serialized: one entry per tensor-parallel rank, got none")
    payload: dict[str, object] = {
        "serialized_named_tensors": list(serialized),
        "flush_cache": True,
        "abort_all_requests": False,
        "weight_version": str(int(weight_version)),
    }
    if load_format is not None:
        payload["load_format"] = load_format
    return payload
