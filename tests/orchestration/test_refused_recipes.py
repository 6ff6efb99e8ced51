"""Recipes that can never apply are refused before anything starts, in one line naming the field
or file: a column mapping to a column no record has, a curriculum stage on a metric the loop never
logs, a tokenizer folder without tokenizer files, a policy holding a NaN weight."""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from tests.data.tinylm import answering_model

    folder = tmp_path_factory.mktemp("refused") / "model"
    answering_model(folder)
    return folder


def _train(tmp_path: Path, model: Path, *overrides: str) -> subprocess.CompletedProcess:
    from tests.data.tinylm import tiny_train_command

    problems = tmp_path / "train.jsonl"
    problems.write_text(
        "".join(json.dumps({"id": f"p{i}", "question": "1+1?", "answer": "2"}) + "\n" for i in range(8))
    )
    cmd = tiny_train_command(
        model, tmp_path / "run", 1, f"data.train={problems}", "data.columns={problem: question}", *overrides
    )
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def _one_line(proc: subprocess.CompletedProcess, code: int) -> str:
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return proc.stderr.strip().splitlines()[-1]


@pytest.mark.fault("input")
def test_a_column_mapping_no_record_can_use_is_refused(tmp_path, model):
    line = _one_line(_train(tmp_path, model, "data.columns={problem: question, answer: solution}"), 3)
    assert (
        "data.columns.answer: no record of" in line
        and "'solution'" in line
        and "answer, id, question" in line
    )


@pytest.mark.fault("input")
def test_a_curriculum_stage_on_a_metric_the_loop_never_logs_is_refused(tmp_path, model):
    line = _one_line(_train(tmp_path, model, "curriculum=[{metric: pass_rat, threshold: 0.5}]"), 2)
    assert "curriculum.0.metric: 'pass_rat' is not a metric the loop logs; did you mean 'pass_rate'?" in line


@pytest.mark.fault("input")
def test_a_tokenizer_folder_without_tokenizer_files_is_named(tmp_path, model):
    empty = tmp_path / "tok"
    empty.mkdir()
    shutil.copy(model / "config.json", empty / "config.json")
    line = _one_line(_train(tmp_path, model, f"model.tokenizer={empty}"), 3)
    assert (
        f"{empty}: not a Hugging Face tokenizer folder: it holds no tokenizer files" in line
        and "tokenizer.json" in line
    )


@pytest.mark.slow
@pytest.mark.fault("numeric")
def test_a_policy_holding_a_nan_weight_is_refused_before_any_server_starts(tmp_path, model):
    bad = tmp_path / "bad"
    shutil.copytree(model, bad)
    (file,) = bad.glob("*.safetensors")
    tensors = load_file(file)
    name = sorted(k for k in tensors if "layers.0.mlp" in k)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[3] = torch.nan
    save_file(tensors, file, metadata={"format": "pt"})
    proc = _train(tmp_path, bad)
    line = _one_line(proc, 3)
    assert line.startswith(f"megatron-rl train: model.hf: {bad}: tensor ") and "1 NaN" in line, line
    assert not (tmp_path / "run" / "logs" / "pids.json").exists()  # no server was started


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.fault("input")
def test_a_tokenizer_of_another_model_is_refused_before_any_server_starts(tmp_path, model):
    from megatron_rl.quickstart.tokenizer import build_tokenizer

    texts = [
        f"What is {i}+{7 * i}? a quick brown fox <think> hmm </think> \\boxed{{{8 * i}}}" for i in range(300)
    ]
    other = build_tokenizer(texts, tmp_path / "other")
    before = _digest(other)
    line = _one_line(_train(tmp_path, model, f"model.tokenizer={other}"), 2)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    assert (
        line.startswith("megatron-rl train: model.tokenizer: the tokenizer of")
        and f"embeds only {vocab}" in line
    )
    assert not (tmp_path / "run" / "logs" / "pids.json").exists()  # no server was started
    assert _digest(other) == before


@pytest.mark.fault("input")
def test_a_context_shorter_than_a_prompt_and_its_completion_is_refused_at_load(tmp_path, model):
    line = _one_line(_train(tmp_path, model, "fleet.max_len=40", "reward.l_max=32", "reward.l_cache=8"), 2)
    assert line.startswith("megatron-rl train: fleet.max_len: 40 is too short for data.train: its problem")
    assert "raise fleet.max_len" in line
    assert not (tmp_path / "run" / "logs" / "pids.json").exists()


@pytest.mark.fault("input")
def test_a_fleet_url_where_nothing_listens_is_named_before_the_run_starts(tmp_path, model):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed below: nothing listens there
    url = f"http://127.0.0.1:{port}"
    line = _one_line(_train(tmp_path, model, f"fleet.urls=[{url}]"), 2)
    assert line.startswith(f"megatron-rl train: fleet.urls[0]: nothing answers at {url} (connection refused)")
    assert "internal error" not in line
