"""``megatron-rl convert`` and ``megatron-rl bench convert`` as a user runs them (subprocesses).

The convert verb is reached through ``tools/convert_checkpoint.py`` and ``python -m
megatron_rl.convert`` (the same parser that ``megatron-rl convert`` mounts)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from megatron_rl.errors import NO_ACCELERATED_KERNELS_NOTE
from megatron_rl.hf.files import HFWeights
from tests.convert.test_checkpoint import assert_same_weights
from tests.hf.test_layout import hf_model

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def tiny_tokenizer(folder: Path) -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<s>": 1, "hello": 2, "world": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>")
    fast.save_pretrained(folder)
    return fast


@pytest.mark.distributed  # the CLI starts two gloo ranks for --tp 2
def test_cli_hf_to_mcore_at_tp2_and_back(tmp_path):
    src = tmp_path / "hf"
    hf_model("qwen2").save_pretrained(src, max_shard_size="200KB")
    tokenizer = tiny_tokenizer(src)
    proc = run(
        "tools/convert_checkpoint.py",
        "hf-to-mcore",
        "--hf",
        str(src),
        "--out",
        str(tmp_path / "mcore"),
        "--tp",
        "2",
    )  # two local gloo ranks write it
    meta = json.loads((tmp_path / "mcore" / "megatron_rl_model.json").read_text())
    assert meta["written_at"] == {"tensor_parallel": 2, "pipeline_parallel": 1}
    assert "tokenizer.json" in meta["side_files"]
    # The one-line summary: 2 layers x 7 tensors (q/k/v biases fused) + embedding, norm, output.
    assert re.fullmatch(
        rf"megatron-rl convert: wrote 17 tensors, 0\.00\d+ GB, in [\d.]+ s to {tmp_path / 'mcore'} .*",
        proc.stderr.strip().splitlines()[-1],
    ), proc.stderr[-500:]
    # What runs in place of TE/Apex is said once, in the CLI's words, by rank 0 only; the warnings
    # of other packages a user cannot act on are not shown (issue 49: 17 lines before the first).
    assert proc.stderr.count(NO_ACCELERATED_KERNELS_NOTE) == 1, proc.stderr
    assert "Falling back" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr
    proc = run(
        "-m",
        "megatron_rl.convert",
        "mcore-to-hf",
        "--mcore",
        str(tmp_path / "mcore"),
        "--out",
        str(tmp_path / "back"),
        "--max-shard-size",
        "200KB",
    )
    assert_same_weights(src, tmp_path / "back")
    tensors = len(HFWeights(src))  # 2 layers x 12 + embedding, norm, lm_head
    assert f"megatron-rl convert: wrote {tensors} tensors, " in proc.stderr.strip().splitlines()[-1]
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "back" / name).read_bytes() == (src / name).read_bytes(), name
    # (AutoTokenizer would pick Qwen2's tokenizer class from config.json for this toy vocab.)
    again = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path / "back")
    assert again("hello world")["input_ids"] == tokenizer("hello world")["input_ids"] == [2, 3]
    # A config that disagrees with the stored one: exit 3, one line naming the file and the field.
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((src / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 1.0
    (other / "config.json").write_text(json.dumps(config))
    proc = run(
        "-m",
        "megatron_rl.convert",
        "mcore-to-hf",
        "--mcore",
        str(tmp_path / "mcore"),
        "--out",
        str(tmp_path / "bad"),
        "--hf-config",
        str(other),
        check=False,
    )
    assert (
        proc.returncode == 3 and f"megatron-rl convert: {other / 'config.json'}: rope_theta:" in proc.stderr
    )
    assert not (tmp_path / "bad").exists()


def test_bench_convert_small():
    out = run("-m", "megatron_rl", "bench", "convert", "--small").stdout
    figures = json.loads(out.strip().splitlines()[-1])
    assert "round trip exact: yes" in out and "safetensors load+save" in out
    assert figures["convert_gbps"] > 0 and figures["ratio_to_safetensors_copy"] > 0
    assert figures["size"] == "small"
