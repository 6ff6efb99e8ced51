"""The Python API (``from megatron_rl import ...``): the same verbs as the command line, from a
program -- a recipe trained, records scored, a checkpoint converted and back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
THINK = "<think>We add two and two, which makes four in total, so that is it.</think>"


def test_importing_the_package_loads_nothing_else():
    code = "import sys, megatron_rl; print('torch' in sys.modules, 'megatron_rl.api' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
    from megatron_rl import RunConfig
    from megatron_rl.orchestration.recipe import RunConfig as Real

    assert RunConfig is Real
    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        import megatron_rl

        megatron_rl.trian  # noqa: B018


def test_score_scores_records_and_names_a_bad_one():
    from megatron_rl import score
    from megatron_rl.data.problems import DataError
    from megatron_rl.rewards.compose import RewardConfig

    records = [
        {"problem": "What is 2 + 2?", "answer": "4", "completion": THINK + "It is $\\boxed{4}$."},
        {"problem": "What is 2 + 2?", "answer": "4", "completion": THINK + "It is $\\boxed{5}$."},
        {"problem": "What is 2 + 2?", "answer": "4", "completion": "no template"},
    ]
    results = score(records, RewardConfig(workers=1))
    assert [r.reason for r in results] == ["ok", "wrong_answer", "format_error"]
    assert results[0].correct and results[0].reward > results[1].reward > results[2].reward == 0.0
    with pytest.raises(DataError, match=r"records\[1\]: completion"):
        score([records[0], {"problem": "p", "answer": "1"}])


@pytest.mark.slow
def test_convert_there_and_back(tmp_path):
    import transformers
    from safetensors.torch import load_file

    from megatron_rl import convert_checkpoint as convert

    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(tmp_path / "hf")
    mcore = convert(tmp_path / "hf", tmp_path / "mcore", to="mcore")
    back = convert(mcore, tmp_path / "back", to="hf")
    a, b = load_file(tmp_path / "hf" / "model.safetensors"), load_file(Path(back) / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="to: must be"):
        convert(tmp_path / "hf", tmp_path / "x", to="gguf")  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.distributed
def test_train_a_recipe_object(tmp_path):
    from megatron_rl import load_config, train
    from tests.data.tinylm import answering_model

    answering_model(tmp_path / "model")
    rows = [
        f'{{"id": "q{i}", "problem": "What is {i} + {4 - i}?", "answer": "{4 if i % 2 else 5}"}}'
        for i in range(8)
    ]
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    cfg = load_config(ROOT / "examples" / "quickstart.yaml")
    cfg.model.hf = str(tmp_path / "model")
    cfg.run.dir = str(tmp_path / "run")
    cfg.data.train, cfg.data.eval = str(tmp_path / "train.jsonl"), ""
    cfg.loop.max_steps, cfg.loop.n_batch, cfg.loop.n_async, cfg.loop.group_size = 2, 16, 32, 4
    cfg.reward.l_max, cfg.reward.l_cache, cfg.fleet.max_slots = 48, 16, 16
    summary = train(cfg, progress=False)
    assert summary["steps"] == 2 and summary["stopped"] == "max_steps"
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 2


def test_the_docs_python_block_runs():
    section = (ROOT / "docs" / "python-api.md").read_text()
    code = section[
        section.index("```python\n") + len("```python\n") : section.index("```\n", section.index("```python"))
    ]
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    reward, reason = out.stdout.split()
    assert reason == "ok" and float(reward) == pytest.approx(1.1)


@pytest.mark.fault("input")
def test_train_checks_a_config_changed_in_python_as_the_loader_does(tmp_path):
    """A field set after the RunConfig was built is checked again at train(): the CLI's message,
    before anything starts (no run directory), however the config was made."""
    from megatron_rl import load_config, train
    from megatron_rl.config import ConfigError

    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}"])
    cfg.loop.group_size = -3
    with pytest.raises(ConfigError, match=r"loop\.group_size: must be in \[2, inf\), got -3"):
        train(cfg)
    cfg.loop.group_size = 4
    cfg.algorithm.eps_high = "high"  # a wrong type, as the loader refuses it
    with pytest.raises(ConfigError, match=r"algorithm\.eps_high: expected a number"):
        train(cfg)
    cfg.algorithm.eps_high = 0.28
    cfg.model.hf = str(tmp_path / "nope")
    with pytest.raises(ConfigError, match="model.hf: no such file or folder"):
        train(cfg)
    assert not (tmp_path / "run").exists()
