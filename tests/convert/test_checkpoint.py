"""Checkpoint conversion in one process: exact round trips (names, dtypes, bytes; sharded with an
index), dtype choices, export after training, mismatched configs named, atomic outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from megatron_rl.convert.checkpoint import McoreCheckpoint
from megatron_rl.convert.from_hf import hf_to_mcore
from megatron_rl.convert.to_hf import mcore_to_hf
from megatron_rl.errors import OutputError
from megatron_rl.hf.files import INDEX_FILE, HFWeights, ShardWriter, parse_size
from megatron_rl.hf.layout import WeightsMismatchError
from tests.hf.test_layout import VOCAB, hf_model


def save_hf(model, folder: Path, **kwargs) -> Path:
    model.save_pretrained(folder, **kwargs)
    return folder


def assert_same_weights(a: Path, b: Path) -> None:
    x, y = HFWeights(a), HFWeights(b)
    assert sorted(x) == sorted(y)
    for name in x:
        assert x[name].dtype == y[name].dtype, name
        assert torch.equal(x[name], y[name]), name


def test_round_trip_bf16_with_fp32_norms_sharded(tmp_path):
    # bf16 matrices, fp32 norms (as some checkpoints ship): --dtype keep brings back both.
    model = hf_model("llama").to(torch.bfloat16)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data = p.data.float()
    src = save_hf(model, tmp_path / "hf", max_shard_size="100KB")
    assert (src / INDEX_FILE).is_file()
    hf_to_mcore(src, tmp_path / "mcore")
    ckpt = McoreCheckpoint(tmp_path / "mcore")
    assert ckpt.meta["params_dtype"] == "bfloat16" and ckpt.meta["hf_dtype_exceptions"]
    assert ckpt.num_layers == 2 and ckpt.shapes["embedding.word_embeddings.weight"] == (1024, 64)
    mcore_to_hf(tmp_path / "mcore", tmp_path / "back", max_shard_size="150KB")
    index = json.loads((tmp_path / "back" / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((tmp_path / "back" / f).is_file() for f in shards)
    assert_same_weights(src, tmp_path / "back")
    assert (tmp_path / "back" / "generation_config.json").is_file()
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config == {**json.loads((src / "config.json").read_text()), "dtype": "bfloat16"}


def test_round_trip_qwen2_fp32_single_file_and_dtype_choice(tmp_path):
    src = save_hf(hf_model("qwen2"), tmp_path / "hf")
    hf_to_mcore(src, tmp_path / "mcore")
    mcore_to_hf(tmp_path / "mcore", tmp_path / "back")
    assert (tmp_path / "back" / "model.safetensors").is_file()
    assert not (tmp_path / "back" / INDEX_FILE).exists()
    assert_same_weights(src, tmp_path / "back")
    # fp32 -> bf16 Megatron -> HF: keep gives bf16 values; fp32 gives the matrices upcast and
    # the norms at full precision (Megatron keeps norms in fp32 inside a bf16 model).
    hf_to_mcore(src, tmp_path / "mcore16", dtype="bf16")
    mcore_to_hf(tmp_path / "mcore16", tmp_path / "keep")
    mcore_to_hf(tmp_path / "mcore16", tmp_path / "up", dtype="fp32")
    source, keep, up = HFWeights(src), HFWeights(tmp_path / "keep"), HFWeights(tmp_path / "up")
    for name in source:
        assert keep[name].dtype == torch.bfloat16 and up[name].dtype == torch.float32
        assert torch.equal(keep[name], source[name].to(torch.bfloat16)), name
        assert torch.equal(up[name], source[name] if "norm" in name else keep[name].float()), name
    assert json.loads((tmp_path / "keep" / "config.json").read_text())["dtype"] == "bfloat16"


def test_export_after_training_loads_in_transformers(single_rank, tmp_path):
    from megatron_rl.hf.layout import HFConverter, canonical_name
    from megatron_rl.training.chunks import load_hf_into_chunk
    from megatron_rl.training.model import build_gpt_model, save_model_checkpoint
    from megatron_rl.training.parallel import ParallelConfig

    src = save_hf(hf_model("qwen2"), tmp_path / "hf")
    model = build_gpt_model(src, ParallelConfig())
    load_hf_into_chunk(model, HFConverter.for_config(src), HFWeights(src), tp_rank=0, tp_size=1)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(16).expand(2, 16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(3):  # next-token cross-entropy over the real vocabulary (padding masked)
        opt.zero_grad()
        logits = model(ids, pos, None)[:, :-1, :VOCAB]
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        opt.step()
    save_model_checkpoint(model, tmp_path / "trained")  # a bare dist checkpoint
    mcore_to_hf(tmp_path / "trained", tmp_path / "export", hf_config=src)
    # ... and back: Megatron -> HF -> Megatron gives the trained tensors bit for bit.
    hf_to_mcore(tmp_path / "export", tmp_path / "reimport")
    params = {canonical_name(n): p for n, p in model.named_parameters()}
    again = McoreCheckpoint(tmp_path / "reimport").read(sorted(params))
    assert all(torch.equal(again[n], p) for n, p in params.items())
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        ours = model(ids, pos, None)[..., :VOCAB]
        theirs = exported(input_ids=ids).logits
    moved = HFWeights(tmp_path / "export")["model.layers.1.mlp.up_proj.weight"]
    assert not torch.equal(moved, HFWeights(src)["model.layers.1.mlp.up_proj.weight"])
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)


MISMATCHES = [  # (family, config.json field, wrong value, field named in the error)
    ("llama", "num_attention_heads", 8, "num_attention_heads"),
    ("llama", "num_key_value_heads", 4, "num_key_value_heads"),
    ("llama", "vocab_size", VOCAB + 1, "vocab_size"),
    ("llama", "hidden_size", 128, "hidden_size"),
    ("llama", "intermediate_size", 96, "intermediate_size"),
    ("llama", "num_hidden_layers", 3, "num_hidden_layers"),
    ("llama", "tie_word_embeddings", True, "tie_word_embeddings"),  # lm_head differs
    ("llama_tied", "tie_word_embeddings", False, "tie_word_embeddings"),  # no lm_head
    ("qwen2", "model_type", "llama", "model_type"),  # biases a Llama does not have
]


@pytest.mark.parametrize(
    "family, field, value, named", MISMATCHES, ids=[f"{m[0]}-{m[1]}" for m in MISMATCHES]
)
def test_mismatched_hf_config_is_rejected(tmp_path, family, field, value, named):
    src = save_hf(hf_model(family), tmp_path / "hf")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(WeightsMismatchError, match=named) as err:
        hf_to_mcore(src, tmp_path / "out")
    assert err.value.field.startswith(named) or named in err.value.field
    assert list(tmp_path.iterdir()) == [src]  # nothing written, not even a temporary folder


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("converted")
    src = save_hf(hf_model("mistral"), root / "hf")
    hf_to_mcore(src, root / "mcore")
    return src, root / "mcore"


@pytest.mark.parametrize(
    "field, value", [("rope_theta", 123.0), ("num_key_value_heads", 4), ("rms_norm_eps", 1e-3)]
)
def test_export_config_must_match_the_stored_one(tmp_path, converted, field, value):
    src, mcore = converted
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((src / "config.json").read_text())
    if field == "rope_theta":
        config["rope_parameters"] = {**config["rope_parameters"], "rope_theta": value}
    else:
        config[field] = value
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsMismatchError, match=field):
        mcore_to_hf(mcore, tmp_path / "out", hf_config=other)
    assert not (tmp_path / "out").exists()


def test_bare_checkpoint_needs_a_matching_config(tmp_path, converted):
    src, mcore = converted
    bare = mcore / "model"
    with pytest.raises(ValueError, match="hf_config"):
        mcore_to_hf(bare, tmp_path / "out")
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    config = json.loads((src / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "head_dim": 16}))
    with pytest.raises(WeightsMismatchError, match="head_dim"):
        mcore_to_hf(bare, tmp_path / "out", hf_config=wrong)
    mcore_to_hf(bare, tmp_path / "out", hf_config=src)  # the right config works
    assert_same_weights(src, tmp_path / "out")


def test_existing_output_is_refused_unless_overwrite(tmp_path, converted):
    _src, mcore = converted
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(OutputError, match="overwrite"):
        mcore_to_hf(mcore, out)
    mcore_to_hf(mcore, out, overwrite=True)
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no leftovers


def test_shard_writer_follows_max_shard_size(tmp_path):
    writer = ShardWriter(tmp_path, parse_size("1KB"))
    for i, n in enumerate([100, 100, 300, 10]):  # fp32: 400, 400, 1200 (alone), 40 bytes
        writer.add(f"t{i}", torch.full((n,), float(i)))
    files = writer.close()
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert files[:-1] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index["weight_map"] == {"t0": files[0], "t1": files[0], "t2": files[1], "t3": files[2]}
    assert index["metadata"]["total_size"] == 2040
    assert parse_size("5GB") == 5 * 10**9 and parse_size("1GiB") == 2**30
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size("five")


def test_mistral3_vision_tower_is_carried_bit_for_bit_and_never_cast(tmp_path):
    """The vision tower and projector are not converted: they travel in carried.safetensors, come
    back as they were (``--dtype bf16`` casts the language model only), and a bare checkpoint
    takes them from the HF folder it is exported with; a vision config that does not fit them is
    refused, naming the field."""
    src = save_hf(hf_model("mistral3"), tmp_path / "hf")
    hf_to_mcore(src, tmp_path / "mcore")
    carried = HFWeights(tmp_path / "mcore" / "carried.safetensors")
    assert sorted(carried) and all(n.startswith(("vision_tower.", "multi_modal_projector.")) for n in carried)
    mcore_to_hf(tmp_path / "mcore", tmp_path / "bf16", dtype="bf16")
    out, source = HFWeights(tmp_path / "bf16"), HFWeights(src)
    assert sorted(out) == sorted(source)
    for name in out:
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            assert out.dtype(name) == torch.float32 and torch.equal(out[name], source[name]), name
        else:
            assert out.dtype(name) == torch.bfloat16, name
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["model_type"] == "mistral3"
    mcore_to_hf(tmp_path / "mcore" / "model", tmp_path / "bare", hf_config=src)  # carried from src
    assert_same_weights(src, tmp_path / "bare")
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((src / "config.json").read_text())
    config["vision_config"] = {**config["vision_config"], "hidden_size": 32}
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsMismatchError, match="vision_config"):
        mcore_to_hf(tmp_path / "mcore", tmp_path / "wrong", hf_config=other)
