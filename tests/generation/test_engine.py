"""The built-in engine against transformers, and its batching, log-prob, version, pause and abort
contracts, on tiny random models saved with ``save_pretrained`` (no downloads)."""

from __future__ import annotations

import pytest
import torch
import transformers

from megatron_rl.algorithms.logprobs import token_logprobs
from megatron_rl.generation.engine import Decoder, Engine, EngineConfig
from tests.data.tinylm import build_model, mistral3_config
from tests.hf.test_layout import FAMILIES as LAYOUT_FAMILIES

_COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)

# name -> (config class, extra config, parameters to randomise by name suffix, save shard size)
_MODELS = {
    # head_dim 24 != 64 / 4: the projections are not square, the rope width follows head_dim.
    "llama": (transformers.LlamaConfig, dict(head_dim=24, rope_theta=500000.0), (), "40KB"),
    "llama_tied": (transformers.LlamaConfig, dict(tie_word_embeddings=True), (), None),
    "qwen2": (
        transformers.Qwen2Config,
        dict(rope_theta=1000000.0, tie_word_embeddings=False),
        (".bias",),
        None,
    ),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None), (), None),
    # q/k norms (HF initialises them to ones) randomised; head_dim 32 != 64 / 4.
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32, tie_word_embeddings=False), ("norm.weight",), None),
    # 4 experts, 2 per token, renormalised (as the released models): routing decides the logits.
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        dict(
            head_dim=32,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
        ("norm.weight", "gate.weight"),
        None,
    ),
    # Mixtral: the experts are w1/w3/w2 of intermediate_size, always renormalised; saved sharded
    # so that experts of one layer land in different files.
    "mixtral": (
        transformers.MixtralConfig,
        dict(head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
        ("norm.weight", "gate.weight"),
        "60KB",
    ),
    # DeepSeek-V3 (MLA, a dense first layer, grouped sigmoid routing with its correction bias, a
    # shared expert), and without the query bottleneck, with YaRN: tests/hf/test_layout.py's.
    **{
        name: (
            transformers.DeepseekV3Config,
            LAYOUT_FAMILIES[name][1],
            ("norm.weight", "gate.weight", "e_score_correction_bias"),
            None,
        )
        for name in ("deepseek_v3", "deepseek_v3_yarn")
    },
    # Mistral3 (vision-language): its Mistral language model under language_model., beside a
    # Pixtral vision tower the engine does not load (text prompts only).
    "mistral3": (transformers.MistralConfig, dict(head_dim=32, sliding_window=None), ("norm.weight",), None),
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, tuple[str, torch.nn.Module]]:
    """name -> (saved folder, the transformers model), built once per module."""
    out = {}
    for i, (name, (cls, extra, randomise, shard)) in enumerate(_MODELS.items()):
        torch.manual_seed(i)
        config = cls(**{**_COMMON, **extra})
        model = build_model(mistral3_config(config) if name == "mistral3" else config)
        model = model.float().eval()
        # HF initialises biases to zero and norms to one, which would not exercise them.
        with torch.no_grad():
            for n, p in [*model.named_parameters(), *model.named_buffers()]:
                if n.endswith(randomise):
                    p.normal_(1.0 if "norm" in n else 0.0, 0.5)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
        out[name] = (str(folder), model)
    return out


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, _COMMON["vocab_size"], (n,), generator=g).tolist()


def _engine(folder: str, slots: int = 4, max_len: int = 64) -> Engine:
    return Engine.from_pretrained(folder, EngineConfig(max_slots=slots, max_len=max_len))


def _run(engine: Engine, cap: int = 1000):
    out = {}
    for _ in range(cap):
        if not engine.has_work():
            return out
        out.update({f.request_id: f for f in engine.step()})
    raise AssertionError("engine did not finish")


@pytest.mark.parametrize("name", list(_MODELS))
def test_logits_match_transformers(hf_models, name):
    folder, hf = hf_models[name]
    model = Decoder.from_pretrained(folder)
    ids = torch.tensor([_prompt(11, 1), _prompt(11, 2)])
    with torch.no_grad():
        ref = hf(ids).logits
    torch.testing.assert_close(model.full_logits(ids), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(_MODELS))
def test_sampled_logprobs_match_transformers(hf_models, name):
    # What the engine reports for the tokens it sampled is what transformers gives those tokens.
    folder, hf = hf_models[name]
    engine = _engine(folder)
    prompt = _prompt(6, 30)
    engine.add_request("r", prompt, max_new_tokens=10, temperature=1.0, seed=3)
    out = _run(engine)["r"]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert len(out.token_ids) == 10
    torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "name,expected",
    [
        (
            "qwen3_moe",
            ("model.layers.1.mlp.experts.3.down_proj.weight", "model.layers.0.self_attn.q_norm.weight"),
        ),
        (
            "mixtral",
            (
                "model.layers.1.block_sparse_moe.experts.3.w2.weight",
                "model.layers.0.block_sparse_moe.gate.weight",
            ),
        ),
    ],
)
def test_moe_weights_are_the_files_per_expert_names(hf_models, name, expected):
    # transformers 5 fuses the experts in memory; the engine (like SGLang and the converter)
    # uses the per-expert names of the safetensors files.
    from megatron_rl.hf.files import HFWeights

    folder, _ = hf_models[name]
    names = set(Decoder.from_pretrained(folder).named_weights())
    files = HFWeights(folder)
    try:
        assert names == set(files)
    finally:
        files.close()
    assert set(expected) <= names


def test_sharded_folder_was_sharded(hf_models):
    import os

    assert "model.safetensors.index.json" in os.listdir(hf_models["llama"][0])


@pytest.mark.parametrize("name", ["llama", "llama_tied", "qwen2", "qwen3"])
def test_load_state_dict_takes_transformers_tensors(hf_models, name):
    folder, hf = hf_models[name]
    model = Decoder.from_pretrained(folder)
    fresh = Decoder(model.cfg)
    fresh.load_state_dict(hf.state_dict())  # tied: includes lm_head.weight, accepted
    ids = torch.tensor([_prompt(7)])
    torch.testing.assert_close(fresh.full_logits(ids), model.full_logits(ids), atol=0, rtol=0)
    names = set(fresh.named_weights())
    assert names == {
        n for n in hf.state_dict() if not (n == "lm_head.weight" and model.cfg.tie_word_embeddings)
    }
    if model.cfg.tie_word_embeddings:  # an explicit tied head is accepted only if it matches
        state = dict(hf.state_dict(), **{"lm_head.weight": hf.state_dict()["model.embed_tokens.weight"]})
        fresh.load_state_dict(state)
        state["lm_head.weight"] = state["lm_head.weight"] + 1.0
        with pytest.raises(ValueError, match="lm_head.weight"):
            fresh.load_state_dict(state)
    bad = dict(hf.state_dict())
    bad.pop("model.norm.weight")
    with pytest.raises(KeyError, match="model.norm.weight"):
        fresh.load_state_dict(bad)


def test_named_weights_are_live(hf_models):
    model = Decoder.from_pretrained(hf_models["llama"][0])
    ids = torch.tensor([_prompt(5)])
    before = model.full_logits(ids)
    model.named_weights()["model.norm.weight"].mul_(2.0)  # an in-place broadcast would do this
    assert not torch.allclose(model.full_logits(ids), before)


@pytest.mark.parametrize(
    "name", ["llama", "llama_tied", "qwen2", "qwen3", "qwen3_moe", "mixtral", "mistral3", "deepseek_v3_yarn"]
)
def test_greedy_matches_generate(hf_models, name):
    folder, hf = hf_models[name]
    prompt = _prompt(9, 3)
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=16, min_new_tokens=16, pad_token_id=0
        )[0, len(prompt) :].tolist()
    engine = _engine(folder)
    engine.add_request("r", prompt, max_new_tokens=16, temperature=0.0)
    assert _run(engine)["r"].token_ids == ref


def test_kv_cache_decode_matches_full_forward(hf_models):
    from megatron_rl.generation.engine import KVCache

    model = Decoder.from_pretrained(hf_models["qwen2"][0])
    seqs = [_prompt(14, 4), _prompt(14, 5)]
    full = [model.full_logits(torch.tensor([s]))[0] for s in seqs]
    cache = KVCache(model.cfg, slots=3, max_len=32)
    # Slot 2 gets a 6-token prompt, slot 0 a 3-token one: the decode batch mixes lengths.
    starts = {2: (seqs[0], 6), 0: (seqs[1], 3)}
    for slot, (s, p) in starts.items():
        got = model(torch.tensor([s[:p]]), torch.tensor([slot]), cache)[0]
        torch.testing.assert_close(got, full[0 if slot == 2 else 1][:p], atol=1e-5, rtol=0)
    for step in range(8):
        ids = torch.tensor([[seqs[0][6 + step]], [seqs[1][3 + step]]])
        got = model(ids, torch.tensor([2, 0]), cache)[:, 0]
        torch.testing.assert_close(got[0], full[0][6 + step], atol=1e-5, rtol=0)
        torch.testing.assert_close(got[1], full[1][3 + step], atol=1e-5, rtol=0)
    assert cache.lengths.tolist() == [11, 0, 14]


def test_batched_requests_equal_each_alone(hf_models):
    folder = hf_models["llama"][0]
    specs = [(f"r{i}", _prompt(n, 10 + i), 100 + i) for i, n in enumerate([3, 12, 7, 1, 9])]
    batched = _engine(folder, slots=3)  # 5 requests, 3 slots: some wait, slots get reused
    for rid, prompt, seed in specs:
        batched.add_request(
            rid, prompt, max_new_tokens=10 + len(prompt) % 4, temperature=0.9, top_p=0.95, seed=seed
        )
    together = _run(batched)
    for rid, prompt, seed in specs:
        alone = _engine(folder, slots=1)
        alone.add_request(
            rid, prompt, max_new_tokens=10 + len(prompt) % 4, temperature=0.9, top_p=0.95, seed=seed
        )
        got = _run(alone)[rid]
        assert together[rid].token_ids == got.token_ids
        torch.testing.assert_close(together[rid].logprobs, got.logprobs, atol=1e-5, rtol=0)


def test_a_group_shares_one_prefill_and_equals_each_sample_alone(hf_models):
    """G samples of one prompt: the prompt is prefilled once and its KV forked; samples that end
    at different steps (and an abort mid-run) hand their slots to the others, whose sequences move
    in the cache. Every sample still writes what it writes alone, with the same log-probs."""
    folder = hf_models["qwen2"][0]
    shared, other = _prompt(7, 30), _prompt(7, 31)  # same length: one prefill forward for both
    specs = [(f"g{k}", shared, 3 + 4 * k, 200 + k) for k in range(5)] + [("o", other, 12, 300)]
    engine = _engine(folder, slots=6)
    for rid, prompt, n, seed in specs:
        engine.add_request(rid, prompt, max_new_tokens=n, temperature=1.0, seed=seed)
    out = {f.request_id: f for f in engine.step()}
    assert engine.prefill_tokens == 14  # two distinct prompts of 7, not six
    assert engine.running == 6
    for _ in range(4):
        out.update({f.request_id: f for f in engine.step()})
    aborted = engine.abort("g4")  # a middle slot, while shorter and longer ones run
    out.update(_run(engine))
    assert aborted is not None and len(aborted.token_ids) == 6
    assert sorted(engine.cache.lengths.tolist()) == [0] * 6 and engine.running == 0
    for rid, prompt, n, seed in specs:
        alone = _engine(folder, slots=1)
        alone.add_request(rid, prompt, max_new_tokens=n, temperature=1.0, seed=seed)
        want = _run(alone)[rid]
        got = aborted if rid == "g4" else out[rid]
        assert got.token_ids == want.token_ids[: len(got.token_ids)], rid
        torch.testing.assert_close(got.logprobs, want.logprobs[: len(got.logprobs)], atol=1e-5, rtol=0)
    assert [len(out[f"g{k}"].token_ids) for k in range(4)] == [3, 7, 11, 15]


def test_a_sample_admitted_while_its_siblings_run_shares_their_prefill_and_writes_what_it_writes_alone(
    hf_models,
):
    """A busy engine admits a group's samples as slots free: the late ones copy the running
    siblings' prompt KV and first-token logits (no second prefill) and still write, token for
    token, what each writes alone. New weights drop the shared prompt: it is prefilled again."""
    folder = hf_models["qwen2"][0]
    shared = _prompt(7, 30)
    engine = _engine(folder, slots=2)
    specs = [(f"g{k}", 4 + 3 * k, 200 + k) for k in range(4)]
    for rid, n, seed in specs:  # two slots: g2 and g3 wait for g0 and g1 to end
        engine.add_request(rid, shared, max_new_tokens=n, temperature=1.0, seed=seed)
    out: dict = {}
    while engine.has_work():
        out.update({f.request_id: f for f in engine.step()})
    assert engine.prefill_tokens == 7  # g2 and g3 entered while a sibling ran: no prefill
    for rid, n, seed in specs:
        alone = _engine(folder, slots=1)
        alone.add_request(rid, shared, max_new_tokens=n, temperature=1.0, seed=seed)
        want = _run(alone)[rid]
        assert out[rid].token_ids == want.token_ids, rid
        torch.testing.assert_close(out[rid].logprobs, want.logprobs, atol=1e-5, rtol=0)
    engine.add_request("a", shared, max_new_tokens=20, temperature=1.0, seed=1)
    engine.step()
    engine.weights_changed(1)
    engine.add_request("b", shared, max_new_tokens=5, temperature=1.0, seed=2)
    engine.step()
    assert engine.prefill_tokens == 21  # "a" after the group ended, "b" after new weights


def test_kv_cache_move_and_fork_copy_sequences(hf_models):
    from megatron_rl.generation.engine import KVCache

    model = Decoder.from_pretrained(hf_models["llama"][0])
    cache = KVCache(model.cfg, slots=4, max_len=16)
    model(torch.tensor([_prompt(5, 40)]), torch.tensor([3]), cache)
    k3 = cache.k[:, 3, :, :5].clone()
    cache.fork(3, [0, 1])
    cache.move(3, 2)
    assert cache.lengths.tolist() == [5, 5, 5, 0]
    for slot in (0, 1, 2):
        assert torch.equal(cache.k[:, slot, :, :5], k3)
    # Reading the leading slots in place (an int) equals gathering them (a tensor).
    ids = torch.tensor([[1], [2], [3]])
    gathered = KVCache(model.cfg, slots=4, max_len=16)
    gathered.k.copy_(cache.k), gathered.v.copy_(cache.v), gathered.lengths.copy_(cache.lengths)
    torch.testing.assert_close(
        model(ids, 3, cache), model(ids, torch.tensor([0, 1, 2]), gathered), atol=1e-6, rtol=0
    )


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8), (1.3, 0.5)])
def test_logprobs_are_full_vocab_tempered_logsoftmax(hf_models, temperature, top_p):
    folder = hf_models["qwen2"][0]
    engine = _engine(folder)
    prompts = {"a": _prompt(5, 20), "b": _prompt(10, 21)}
    for rid, p in prompts.items():
        engine.add_request(rid, p, max_new_tokens=12, temperature=temperature, top_p=top_p, seed=7)
    out = _run(engine)
    for rid, p in prompts.items():
        toks = out[rid].token_ids
        logits = engine.model.full_logits(torch.tensor([p + toks]))[0, len(p) - 1 : -1]
        ref = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(toks)[:, None])
        got = torch.tensor(out[rid].logprobs)
        torch.testing.assert_close(got, ref[:, 0], atol=1e-5, rtol=0)
        # ... which is what the trainer recomputes.
        trainer, _ = token_logprobs(logits, torch.tensor(toks), temperature=temperature)
        torch.testing.assert_close(got, trainer, atol=1e-5, rtol=0)


def test_versions_follow_set_version(hf_models):
    engine = _engine(hf_models["llama"][0])
    engine.add_request("a", _prompt(4), max_new_tokens=6, seed=1)
    engine.step()  # admission step: prefill token + one decode token at version 0
    engine.set_version(3)
    engine.step()
    engine.add_request("b", _prompt(6), max_new_tokens=3, seed=2)
    engine.set_version(4)
    out = _run(engine)
    assert out["a"].versions == [0, 0, 3, 4, 4, 4]
    assert out["b"].versions == [4, 4, 4]


def test_pause_keeps_state_and_resume_continues(hf_models):
    folder = hf_models["llama"][0]
    kwargs = dict(max_new_tokens=10, temperature=1.0, seed=5)
    reference = _engine(folder)
    reference.add_request("a", _prompt(6), **kwargs)
    expected = _run(reference)["a"]

    engine = _engine(folder)
    engine.add_request("a", _prompt(6), **kwargs)
    engine.step()
    engine.step()
    engine.pause()
    lengths = engine.cache.lengths.clone()
    for _ in range(3):
        assert engine.step() == []
    assert engine.running == 1 and torch.equal(engine.cache.lengths, lengths)
    engine.resume()
    got = _run(engine)["a"]
    assert got.token_ids == expected.token_ids and len(got.token_ids) == 10
    assert got.logprobs == pytest.approx(expected.logprobs, abs=1e-6)


def test_abort_frees_the_slot(hf_models):
    engine = _engine(hf_models["llama"][0], slots=1)
    engine.add_request("a", _prompt(4), max_new_tokens=20, seed=1)
    engine.add_request("b", _prompt(5), max_new_tokens=2, seed=2)
    engine.step()
    assert (engine.running, engine.waiting) == (1, 1)
    aborted = engine.abort("a")
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) == 2
    assert len(aborted.logprobs) == len(aborted.versions) == 2
    assert (engine.running, engine.waiting) == (0, 1) and engine.cache.lengths.tolist() == [0]
    assert engine.abort("a") is None
    out = _run(engine)
    assert out["b"].finish_reason == "length" and len(out["b"].token_ids) == 2
    engine.add_request("c", _prompt(3), max_new_tokens=5)
    assert engine.abort("c").token_ids == [] and engine.waiting == 0


def test_stop_token_ends_the_request(hf_models):
    folder = hf_models["llama"][0]
    engine = _engine(folder)
    engine.add_request("a", _prompt(8), max_new_tokens=12, temperature=0.0)
    full = _run(engine)["a"].token_ids
    stop = full[4]
    engine.add_request("b", _prompt(8), max_new_tokens=12, temperature=0.0, stop_token_ids=[stop])
    got = _run(engine)["b"]
    cut = full.index(stop) + 1
    assert got.finish_reason == "stop" and got.token_ids == full[:cut]
    eos_engine = Engine.from_pretrained(folder, EngineConfig(max_slots=2, max_len=32), eos_token_ids=[stop])
    eos_engine.add_request("c", _prompt(8), max_new_tokens=12, temperature=0.0)
    assert _run(eos_engine)["c"].token_ids == full[:cut]


def test_counts_capacity_and_validation(hf_models):
    engine = _engine(hf_models["llama"][0], slots=2, max_len=16)
    assert engine.capacity_tokens == 32
    for rid in "abc":
        engine.add_request(rid, _prompt(3), max_new_tokens=4)
    assert (engine.running, engine.waiting) == (0, 3)
    engine.step()
    assert (engine.running, engine.waiting) == (2, 1)
    with pytest.raises(ValueError, match="already"):
        engine.add_request("a", _prompt(3), max_new_tokens=4)
    with pytest.raises(ValueError, match="max_len"):
        engine.add_request("d", _prompt(10), max_new_tokens=7)
    with pytest.raises(ValueError, match="input_ids"):
        engine.add_request("d", [97], max_new_tokens=1)
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request("d", [1], max_new_tokens=1, top_p=0.0)
    with pytest.raises(ValueError, match="max_slots"):
        EngineConfig(max_slots=0)


@pytest.mark.parametrize(
    "field, value",
    [
        ("mlp_only_layers", [0]),
        ("num_experts_per_tok", 9),
        ("moe_intermediate_size", 0),
        ("num_experts", None),
    ],
)
def test_moe_configs_the_engine_cannot_run_are_refused_by_field(hf_models, field, value):
    import json
    from pathlib import Path

    from megatron_rl.generation.engine.model import DecoderConfig

    cfg = json.loads((Path(hf_models["qwen3_moe"][0]) / "config.json").read_text())
    DecoderConfig.from_hf(cfg)  # as saved: fine
    cfg = {k: v for k, v in cfg.items() if k != "num_local_experts"} | {field: value}
    if field != "num_experts":
        cfg["num_experts"] = 4
    with pytest.raises(ValueError, match=field):
        DecoderConfig.from_hf(cfg)


def test_mistral3_engine_is_its_language_model_named_as_in_the_files(hf_models):
    """The engine loads a Mistral3 checkpoint's language model under the files' names (what a
    weight update sends) and leaves the vision tower and projector in the files."""
    from megatron_rl.hf.files import HFWeights

    folder, _ = hf_models["mistral3"]
    names = set(Decoder.from_pretrained(folder).named_weights())
    files = HFWeights(folder)
    try:
        on_disk = set(files)
    finally:
        files.close()
    carried = {n for n in on_disk if n.startswith(("vision_tower.", "multi_modal_projector."))}
    assert carried and names == on_disk - carried
    assert {"language_model.lm_head.weight", "language_model.model.layers.1.mlp.up_proj.weight"} <= names


def _hf_routed(hf, ids: list[int]) -> torch.Tensor:
    """transformers' experts for every position of ``ids``: ``[T, layers, top_k]``, each
    position's experts sorted (the order within a top-k is not part of the contract)."""
    chosen: list[torch.Tensor] = []
    routers = [
        m
        for m in hf.modules()
        if type(m).__name__.endswith("TopkRouter") or type(m).__name__.endswith("TopKRouter")
    ]
    hooks = [r.register_forward_hook(lambda _m, _i, out: chosen.append(out[-1])) for r in routers]
    try:
        with torch.no_grad():
            hf(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    assert len(chosen) == len(routers) > 0  # one call per MoE layer, in layer order
    return torch.stack(chosen, dim=1).sort(dim=-1).values


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_routed_experts_are_the_experts_transformers_routes_to(hf_models, name):
    """Every fed position's experts (prompt and generated tokens but the last), also for a
    group's sample admitted after its siblings (its prompt routing comes from the prefix kept),
    and for samples decoded in one batch."""
    folder, hf = hf_models[name]
    engine = _engine(folder, slots=2)
    prompt = _prompt(7, 9)
    # Three samples of one prompt, two slots: s2 starts when s1 ends, while s0 still holds the
    # prompt, so s2's prompt is not prefilled again (its KV and routing come from s0's).
    for i, n in enumerate((9, 3, 5)):
        engine.add_request(
            f"s{i}", prompt, max_new_tokens=n, temperature=1.0, seed=i, return_routed_experts=True
        )
    engine.add_request("plain", _prompt(5, 2), max_new_tokens=3, temperature=0.0)
    done = _run(engine)
    assert engine.prefill_tokens == len(prompt) + 5  # the prompt once, the plain request once
    assert done["plain"].routed_experts is None  # not asked for
    k, layers = hf.config.num_experts_per_tok, hf.config.num_hidden_layers
    dense = getattr(hf.config, "first_k_dense_replace", 0)  # DeepSeek's leading dense layers: zeros
    for i in range(3):
        out = done[f"s{i}"]
        routed = out.routed_experts
        assert routed.dtype == torch.int32 and routed.shape == (
            len(prompt) + len(out.token_ids) - 1,
            layers,
            k,
        )
        reference = _hf_routed(hf, prompt + out.token_ids[:-1])
        assert torch.equal(routed[:, dense:].sort(dim=-1).values.long(), reference)
        assert not routed[:, :dense].any()
    with pytest.raises(ValueError, match="return_routed_experts"):
        _engine(hf_models["llama"][0]).add_request("x", prompt, max_new_tokens=2, return_routed_experts=True)
