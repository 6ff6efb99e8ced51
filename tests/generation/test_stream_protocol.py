"""The ``/generate`` reply readers on what a server may send: a streamed batch's events (finished
items, SGLang's partial ones, an error mid-stream, ``[DONE]``) and malformed per-token data, each
refused with a :class:`ProtocolError` that names the server, never a bare ``TypeError``."""

from __future__ import annotations

import json
import math

import pytest

from megatron_rl.generation.api import GenRequest
from megatron_rl.generation.protocol import (
    FLAT_LOGPROBS,
    ProtocolError,
    generate_batch_payload,
    loads_reply,
    parse_generate,
    parse_stream_events,
)

REQS = [GenRequest(request_id=f"r{i}", input_ids=[1, 2, 3], max_new_tokens=8, seed=i) for i in range(3)]


def _item(index: int | None, tokens: list[int], finished: bool = True) -> dict:
    item = {
        "output_ids": tokens,
        "meta_info": {
            "id": "x",
            "finish_reason": {"type": "length", "length": len(tokens)} if finished else None,
            "output_token_logprobs": [[-0.5 - t, t, None] for t in tokens],
            "weight_versions": [{"version": "4", "start": 0, "end": len(tokens)}],
        },
    }
    if index is not None:
        item["index"] = index
    return item


def _events(*items: object) -> bytes:
    return b"".join(
        b"data: " + (x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n\n" for x in items
    )


def test_a_batch_payload_asks_for_a_stream_only_when_told():
    assert generate_batch_payload(REQS)["stream"] is False
    assert generate_batch_payload(REQS, stream=True)["stream"] is True


def test_finished_items_are_read_with_their_index_and_partial_ones_skipped():
    events = _events(_item(2, [5, 6], finished=False), _item(2, [5, 6, 7]), _item(0, [9]), b"[DONE]")
    got, done = parse_stream_events(REQS, events, server="http://s")
    assert done
    assert [(i, r.request_id, r.token_ids, r.versions) for i, r in got] == [
        (2, "r2", [5, 6, 7], [4, 4, 4]),
        (0, "r0", [9], [4]),
    ]
    assert got[0][1].logprobs == [-5.5, -6.5, -7.5] and got[0][1].server == "http://s"
    assert parse_stream_events(REQS, b": a comment\n\n", server="s") == ([], False)


@pytest.mark.fault("input")
@pytest.mark.parametrize(
    "events, why",
    [
        (_events({"error": {"message": "out of memory"}}), "out of memory"),
        (_events(_item(3, [1])), "index 3"),
        (_events(_item(True, [1])), "index True"),
        (b"data: {not json\n\n", "not JSON"),
        (_events([1, 2]), "not an object"),
    ],
)
def test_a_bad_event_is_a_protocol_error_naming_the_server(events, why):
    with pytest.raises(ProtocolError, match=why) as e:
        parse_stream_events(REQS, events, server="http://bad:1")
    assert "http://bad:1" in str(e.value)


@pytest.mark.fault("input")
@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b["meta_info"]["output_token_logprobs"].pop(),  # one short
        lambda b: b["meta_info"]["output_token_logprobs"][0].__setitem__(1, 99),  # another token
        lambda b: b["meta_info"]["output_token_logprobs"].__setitem__(0, None),  # not a triple
        lambda b: b["meta_info"]["output_token_logprobs"][1].__setitem__(0, "high"),  # not a number
        lambda b: b["output_ids"].__setitem__(0, "five"),  # not a token id
        lambda b: b.pop("meta_info"),
    ],
    ids=["short", "other-token", "not-a-triple", "text-logprob", "text-token", "no-meta"],
)
def test_malformed_per_token_data_is_a_protocol_error(mutate):
    body = _item(None, [5, 6, 7])
    mutate(body)
    with pytest.raises(ProtocolError, match="http://bad:1"):
        parse_generate(REQS[0], body, server="http://bad:1")


def _flat(tokens: list[int]) -> dict:
    body = _item(None, tokens)
    triples = body["meta_info"].pop("output_token_logprobs")
    body["meta_info"]["output_logprobs"] = [lp for lp, _, _ in triples]
    return body


def test_flat_logprobs_read_as_the_triples_do():
    assert FLAT_LOGPROBS not in generate_batch_payload(REQS)
    assert generate_batch_payload(REQS, flat_logprobs=True)[FLAT_LOGPROBS] is True
    flat, triples = parse_generate(REQS[0], _flat([5, 6, 7])), parse_generate(REQS[0], _item(None, [5, 6, 7]))
    assert (flat.token_ids, flat.logprobs, flat.versions) == (
        triples.token_ids,
        triples.logprobs,
        triples.versions,
    )


@pytest.mark.fault("input")
@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b["meta_info"]["output_logprobs"].pop(),  # one short
        lambda b: b["meta_info"].__setitem__("output_logprobs", {"0": -1.0}),  # not a list
        lambda b: b["meta_info"]["output_logprobs"].__setitem__(1, "high"),  # not a number
        lambda b: b["meta_info"]["output_logprobs"].__setitem__(1, [-1.0, 6]),  # a triple in a flat list
        lambda b: b.__setitem__("meta_info", [1]),  # not an object
    ],
    ids=["short", "not-a-list", "text-logprob", "nested", "meta-not-object"],
)
def test_malformed_flat_logprobs_are_a_protocol_error(mutate):
    body = _flat([5, 6, 7])
    mutate(body)
    with pytest.raises(ProtocolError, match="http://bad:1"):
        parse_generate(REQS[0], body, server="http://bad:1")


def test_json_that_only_python_writes_still_reads():
    """orjson refuses NaN and Infinity; Python's json writes them (a logprob of -inf)."""
    assert loads_reply(b'{"a": [1.5, 2]}') == {"a": [1.5, 2]}
    assert loads_reply(b"[-Infinity]")[0] == -math.inf
    with pytest.raises(ValueError):
        loads_reply(b"{nope")
