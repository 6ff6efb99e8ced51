"""A Hub id in model.hf resolves through the local Hugging Face cache, never the network; an id
the cache lacks is refused before anything starts, saying what to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.hf.hub import looks_like_hub_id

ROOT = Path(__file__).resolve().parents[2]
RESOLVE = (
    "import sys; from megatron_rl.orchestration.recipe import load_config; "
    "cfg = load_config(sys.argv[1], sys.argv[2:], paths=True); print(cfg.model.hf)"
)


def _cache(root: Path, repo_id: str) -> Path:
    """The layout huggingface_hub writes: models--OWNER--NAME/{refs/main, snapshots/REV/...}."""
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 64}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    return snap


def _resolve(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "0"}
    return subprocess.run(
        [sys.executable, "-c", RESOLVE, str(ROOT / "examples" / "quickstart.yaml"), *overrides],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )


def test_a_cached_hub_id_resolves_to_its_snapshot(tmp_path):
    snap = _cache(tmp_path / "cache", "acme/tiny-llama")
    proc = _resolve(tmp_path, "model.hf=acme/tiny-llama", "data.train=", "data.eval=")
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == snap


def test_an_id_the_cache_lacks_names_the_field_and_the_fix(tmp_path):
    (tmp_path / "cache").mkdir()
    proc = _resolve(tmp_path, "model.hf=HuggingFaceTB/SmolLM2-135M-Instruct", "data.train=", "data.eval=")
    assert proc.returncode != 0
    err = proc.stderr
    for words in (
        "model.hf",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "hf download",
        "gguf-to-hf --gguf smollm2",
    ):
        assert words in err, (words, err)


def test_cli_refuses_an_uncached_id_in_one_line_before_starting(tmp_path):
    (tmp_path / "cache").mkdir()
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [
            "megatron-rl",
            "train",
            str(ROOT / "examples" / "quickstart.yaml"),
            "model.hf=acme/none",
            f"run.dir={tmp_path}/r",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "model.hf" in lines[0] and "acme/none" in lines[0] and "hf download" in lines[0]
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "value, is_id",
    [
        ("HuggingFaceTB/SmolLM2-135M-Instruct", True),
        ("Qwen/Qwen2.5-0.5B", True),
        ("./models/x", False),
        ("/abs/path", False),
        ("a/b/c", False),
        ("runs/model.gguf", False),
        ("tiny", False),
    ],
)
def test_hub_id_shape(value, is_id):
    assert looks_like_hub_id(value) is is_id
