"""Every SGLang route, server flag and router flag we rely on, pinned to SGLang's own definitions.

The definitions are read from the pinned releases' source by ``tools/sglang_fixture.py`` and
kept in ``fixtures/sglang-<version>.json``, so these checks run on any machine; where the sources
are present (``make install`` puts SGLang's in ``.cache``, the test extra installs sglang-router)
the last test regenerates the fixture and requires it to equal the committed file.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.generation.engine.server import GET_ROUTES, POST_ROUTES
from megatron_rl.generation.protocol import (
    ROUTER_VERSION,
    ROUTES,
    SGLANG_VERSION,
    ProtocolError,
    router_launch_args,
    server_launch_args,
    update_group_ranks,
)

REPO = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).parent / "fixtures" / f"sglang-{SGLANG_VERSION}.json"
LAUNCH = REPO / "examples" / "launch"
sys.path.insert(0, str(REPO / "tools"))
import sglang_fixture  # noqa: E402


@pytest.fixture(scope="module")
def pins() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def _flags(words: list[str]) -> list[str]:
    return [w for w in words if w.startswith("--")]


def _commands(script: Path, program: str) -> list[str]:
    """Each command line of ``script`` that runs ``python -m program`` (continuations joined)."""
    text = script.read_text(encoding="utf-8").replace("\\\n", " ")
    return [
        line for line in text.splitlines() if f"-m {program}" in line and not line.lstrip().startswith("#")
    ]


def test_fixture_is_of_the_pinned_releases(pins):
    assert pins["sglang_version"] == SGLANG_VERSION
    assert pins["router_version"] == ROUTER_VERSION
    setup = (REPO / "setup.py").read_text(encoding="utf-8")
    assert f'"sglang=={SGLANG_VERSION}"' in setup
    assert f'"sglang-router>={ROUTER_VERSION},<0.4"' in setup


def test_every_route_the_client_calls_is_sglangs(pins):
    for route, method in ROUTES.items():
        assert route in pins["routes"], f"{route}: not a route of SGLang {SGLANG_VERSION}"
        assert method in pins["routes"][route], (
            f"{route}: SGLang answers {pins['routes'][route]}, not {method}"
        )


def test_built_in_engine_answers_sglang_routes_with_sglangs_methods(pins):
    """The built-in engine's SGLang routes take the methods SGLang's do (ours under
    /megatron_rl/ are extensions)."""
    for table, method in ((POST_ROUTES, "POST"), (GET_ROUTES, "GET")):
        for route in table:
            if route.startswith("/megatron_rl/"):
                continue
            assert route in pins["routes"], f"built-in engine route {route} is not SGLang's"
            assert method in pins["routes"][route], f"{route}: SGLang answers {pins['routes'][route]}"


@pytest.mark.parametrize("deterministic, routed", [(False, False), (True, False), (False, True)])
def test_server_flags_we_print_are_sglangs(pins, deterministic, routed):
    words = server_launch_args(deterministic=deterministic, routed_experts=routed)
    for flag in _flags(words):
        assert flag in pins["server_flags"], f"{flag}: not a flag of sglang.launch_server {SGLANG_VERSION}"
    assert ("--enable-deterministic-inference" in words) == deterministic
    assert ("--enable-return-routed-experts" in words) == routed  # routing replay needs it


def test_router_timeout_outlasts_the_clients(pins):
    """The router's own default (1800 s) would cut a long trace the client still waits on: the
    flag we print is the router's, and its value outlasts ``fleet.request_timeout_s``."""
    assert pins["router_defaults"]["request_timeout_secs"] == 1800
    words = router_launch_args(request_timeout_s=3600.0)
    assert _flags(words) == ["--request-timeout-secs"]
    assert words[0] in pins["router_flags"]
    assert int(words[1]) > 3600
    with pytest.raises(ValueError, match="request_timeout_s"):
        router_launch_args(request_timeout_s=float("inf"))


@pytest.mark.parametrize("script", sorted(LAUNCH.glob("*")), ids=lambda p: p.name)
def test_launch_scripts_parse_and_use_only_pinned_flags(pins, script):
    """Each launch script is valid bash, and every flag it gives SGLang's server or router is one
    of theirs (argparse takes a prefix such as ``--tp`` only while it is unambiguous, and a later
    release adding ``--tp-...`` flags breaks it: we use full names)."""
    subprocess.run(["bash", "-n", str(script)], check=True)
    for program, known in (
        ("sglang.launch_server", "server_flags"),
        ("sglang_router.launch_router", "router_flags"),
    ):
        for line in _commands(script, program):
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line.split(f"-m {program}", 1)[1]):
                assert flag in pins[known], f"{script.name}: {flag} is not a flag of {program}"


def test_sglang_args_verb_prints_the_recipes_flags(tmp_path):
    """What the launch scripts splice in: ``megatron-rl sglang-args server|router RECIPE``."""
    recipe = REPO / "examples" / "magistral_medium.yaml"
    run = [sys.executable, "-m", "megatron_rl", "sglang-args"]
    out = subprocess.run(
        [*run, "server", str(recipe), "fleet.deterministic=true"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert shlex.split(out.stdout) == server_launch_args(deterministic=True)
    out = subprocess.run(
        [*run, "router", str(recipe), "fleet.request_timeout_s=7200"], capture_output=True, text=True
    )
    assert shlex.split(out.stdout) == router_launch_args(request_timeout_s=7200)
    bad = subprocess.run(
        [*run, "server", str(recipe), "fleet.deterministic=maybe"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "fleet.deterministic" in bad.stderr and "Traceback" not in bad.stderr


def test_update_group_layout_follows_sglangs_rank_rule(pins):
    """A server takes ``tp_size`` ranks (its workers join at ``rank_offset + tp_rank``);
    pipeline stages would collide and data-parallel replicas are refused by SGLang itself."""
    assert pins["facts"]["update_group_rank_is_rank_offset_plus_tp_rank"]
    assert pins["facts"]["distributed_update_refuses_dp_replicas"]
    assert update_group_ranks({"tp_size": 8, "pp_size": 1, "dp_size": 1}) == 8
    assert update_group_ranks({}) == 1  # a router or an old build: one rank
    with pytest.raises(ProtocolError, match=r"http://a:1: pp_size=2"):
        update_group_ranks({"tp_size": 4, "pp_size": 2}, "http://a:1")
    with pytest.raises(ProtocolError, match=r"dp_size=2.*one server per replica"):
        update_group_ranks({"tp_size": 4, "dp_size": 2}, "http://a:1")
    with pytest.raises(ProtocolError, match="tp_size is not an integer"):
        update_group_ranks({"tp_size": "eight"})


def test_fixture_matches_the_sources():
    """Regenerated from the sources on this machine, the fixture is the committed one (run
    ``python tools/sglang_fixture.py`` after moving the pins)."""
    router = sglang_fixture.default_router_source()
    if router is None or not sglang_fixture.DEFAULT_SGLANG.is_dir():
        pytest.skip("SGLang's source (make install) or sglang-router (test extra) is not here")
    assert sglang_fixture.build(sglang_fixture.DEFAULT_SGLANG, router) == json.loads(FIXTURE.read_text())


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_synced_expert_names_are_those_sglangs_loader_reads(pins, family):
    """A weight update names each expert's tensors as the family's SGLang loader maps them onto
    its fused experts: the sparse block's attribute, then ``experts.<e>.<ckpt name>.weight``."""
    from megatron_rl.hf.layout import HFConverter
    from tests.hf.test_layout import hf_model

    loader = pins["moe_loaders"][family]
    conv = HFConverter.for_config(hf_model(family).config)
    prefix = f"model.layers.1.{loader['block']}"
    assert conv.hf_sources("decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight") == (
        f"{prefix}.experts.2.{loader['gate']}.weight",
        f"{prefix}.experts.2.{loader['up']}.weight",
    )
    assert conv.hf_sources("decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight") == (
        f"{prefix}.experts.2.{loader['down']}.weight",
    )
    assert conv.hf_sources("decoder.layers.1.mlp.router.weight") == (f"{prefix}.gate.weight",)


def test_synced_mistral3_names_are_those_sglangs_loader_routes(pins):
    """SGLang's Mistral3 is its Llava class, whose loader hands a ``language_model.X`` tensor to
    the language model's own (Mistral/Llama) loader as ``X``: an update sends exactly the files'
    ``language_model.`` names, whose rest are a Mistral's, and never the vision tower."""
    from megatron_rl.hf.layout import HFConverter
    from tests.hf.test_layout import hf_model

    assert pins["facts"]["mistral3_is_llava_for_conditional_generation"]
    assert pins["facts"]["llava_routes_language_model_prefix_to_its_loader"]
    conv = HFConverter.for_config(hf_model("mistral3").config)
    mistral = HFConverter.for_config(hf_model("mistral").config)
    assert [n.removeprefix("language_model.") for n in conv.hf_names()] == mistral.hf_names()
    assert all(n.startswith("language_model.") and not conv.is_carried(n) for n in conv.hf_names())


def test_deepseeks_fused_projections_travel_in_one_update_request(pins):
    """SGLang's DeepSeek loader fuses a layer's ``q_a_proj`` and ``kv_a_proj_with_mqa`` only when
    both arrive in one ``load_weights`` call: the broadcaster never ends a bucket (one update
    request) between them, whatever the bucket size; other tensors still split at the limit."""
    from megatron_rl.hf.layout import HFConverter
    from megatron_rl.weight_sync.broadcast import bucket_tensors
    from tests.hf.test_layout import hf_model

    assert pins["facts"]["deepseek_fuses_q_a_and_kv_a_within_one_load"]
    conv = HFConverter.for_config(hf_model("deepseek_v3").config)
    shapes = conv.expected_hf_shapes()
    named = [(n, torch.zeros(shapes[n])) for n in conv.hf_names()]
    buckets = list(bucket_tensors(named, limit=1))  # every tensor would get a bucket of its own
    where = {name: i for i, bucket in enumerate(buckets) for name, _ in bucket}
    assert [n for b in buckets for n, _ in b] == conv.hf_names()  # all, in order
    pairs = [(n, n.replace("q_a_proj", "kv_a_proj_with_mqa")) for n in where if n.endswith("q_a_proj.weight")]
    assert len(pairs) == 2 and all(where[a] == where[b] for a, b in pairs)
    # Each pair holds q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa in one bucket; every
    # other tensor has a bucket of its own, as the limit says.
    assert len(buckets) == len(named) - 3 * len(pairs)
