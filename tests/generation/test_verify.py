"""``weight_sync.verify`` against SGLang-style servers, and the prefix-cache option, over real HTTP.

SGLang's ``/weights_checker`` reports checksums of its own fused, TP-sharded tensors, so the
trainer cannot compare them with what it sent; what it can check is that every server of one
layout holds the same weights. The built-in engine answers the same route with SGLang's reply
shape, so two real engines stand in for two SGLang servers here.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from megatron_rl.config import ConfigError
from megatron_rl.generation.client import FleetClient
from megatron_rl.generation.engine.launch import EngineProcess
from megatron_rl.weight_sync.broadcast import checksums_agree
from tests.generation.conftest import TINY

pytestmark = pytest.mark.distributed  # real server processes

KEY = "verify-test-key"


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory) -> str:
    """The tiny Llama's shape with other weights (another seed)."""
    torch.manual_seed(8)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY))
    folder = tmp_path_factory.mktemp("other_llama")
    model.float().save_pretrained(folder)
    return str(folder)


def test_checksums_agree_across_servers_with_the_same_weights(tiny_llama, other_llama):
    with (
        EngineProcess(tiny_llama, api_key=KEY) as a,
        EngineProcess(tiny_llama, api_key=KEY) as b,
        EngineProcess(other_llama, api_key=KEY) as c,
    ):
        with FleetClient([a.url, b.url, c.url], api_key=KEY) as fleet:
            sums = {u: fleet.weights_checksums(u) for u in (a.url, b.url, c.url)}
            assert set(sums[a.url]) == {(0, 0)}  # one worker: pp_rank 0, tp_rank 0
            checksums_agree({a.url: sums[a.url], b.url: sums[b.url]})
            with pytest.raises(
                RuntimeError, match=rf"{c.url} \(pp_rank 0, tp_rank 0\) holds different weights from {a.url}"
            ):
                checksums_agree(sums)
            assert fleet.flush_cache() == []  # the built-in engine has no prefix cache: always done


def test_checksums_of_other_layouts_are_not_compared():
    """Servers with another TP layout shard differently: they are compared among themselves."""
    checksums_agree({"http://a": {(0, 0): "x"}, "http://b": {(0, 0): "y", (0, 1): "z"}})
    with pytest.raises(RuntimeError, match=r"http://c \(pp_rank 0, tp_rank 1\)"):
        checksums_agree({"http://b": {(0, 0): "y", (0, 1): "z"}, "http://c": {(0, 0): "y", (0, 1): "w"}})


def test_flush_is_refused_for_the_async_loop():
    from megatron_rl.orchestration.recipe import load_config

    with pytest.raises(ConfigError, match="weight_sync.prefix_cache.*loop.mode sync"):
        load_config(None, ["weight_sync.prefix_cache=flush", "loop.mode=async"])
    cfg = load_config(None, ["weight_sync.prefix_cache=flush", "loop.mode=sync"])
    assert cfg.weight_sync.prefix_cache == "flush"
    with pytest.raises(ConfigError, match="prefix_cache"):
        load_config(None, ["weight_sync.prefix_cache=sometimes"])
