"""``megatron-rl convert`` refuses every bad input as a user meets it: the real CLI in a
subprocess, one line on stderr (no stack), the exit code of the error's kind, the file, tensor or
flag named, no output left behind and every input byte for byte as it was. Also: the Python API
starts its own ranks exactly as the CLI does, and reports progress."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.convert.checkpoint import McoreCheckpoint
from megatron_rl.convert.from_hf import hf_to_mcore
from megatron_rl.errors import EXIT_INPUT, EXIT_OUTPUT, EXIT_USAGE, InputError, OutputError, UsageError
from tests.hf.test_layout import hf_model

ROOT = Path(__file__).resolve().parents[2]


def convert_cli(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_rl", "convert", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def digests(*folders: Path) -> dict[str, str]:
    """sha256 of every file under ``folders`` (symlinks followed), by path."""
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest()
        for folder in folders
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def assert_refused(proc: subprocess.CompletedProcess, code: int, *named: str | Path) -> str:
    """Exit ``code``, exactly one stderr line, no stack, every one of ``named`` in it."""
    lines = proc.stderr.splitlines()
    assert proc.returncode == code, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert lines[0].startswith("megatron-rl convert"), lines[0]
    for name in named:
        assert str(name) in lines[0], (name, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny HF Llama (two safetensors shards) and its Megatron conversion, shared read-only."""
    root = tmp_path_factory.mktemp("models")
    hf_model("llama").save_pretrained(root / "hf", max_shard_size="300KB")
    hf_to_mcore(root / "hf", root / "mcore", progress=False)
    return root / "hf", root / "mcore"


def copy_of(folder: Path, tmp_path: Path) -> Path:
    dst = tmp_path / folder.name
    shutil.copytree(folder, dst)
    return dst


# --------------------------------------------------------------------------- bad input files


@pytest.mark.fault("input")
@pytest.mark.parametrize("damage", ["truncated", "garbage-header"])
def test_broken_safetensors_file_is_named(tmp_path, models, damage):
    src = copy_of(models[0], tmp_path)
    shard = sorted(src.glob("*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\xff" * 16 + data[16:])
    before = digests(src)
    proc = convert_cli("hf-to-mcore", "--hf", src, "--out", tmp_path / "out")
    assert_refused(proc, EXIT_INPUT, shard, "safetensors")
    assert digests(src) == before and not (tmp_path / "out").exists()


@pytest.mark.fault("input")
@pytest.mark.parametrize("damage", ["truncated", "corrupt-tail"])
def test_broken_megatron_shard_is_named(tmp_path, models, damage):
    ckpt = copy_of(models[1], tmp_path)
    shard = ckpt / "model" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    if damage == "truncated":
        shard.write_bytes(bytes(data[: len(data) // 2]))
    else:  # same length: the end of the embedding's zip record (its central directory) zeroed
        from torch.distributed.checkpoint import FileSystemReader

        meta = FileSystemReader(str(ckpt / "model")).read_metadata()
        info = next(v for k, v in meta.storage_data.items() if k.fqn == "embedding.word_embeddings.weight")
        end = info.offset + info.length
        data[end - 200 : end] = bytes(200)
        shard.write_bytes(bytes(data))
    before = digests(ckpt)
    proc = convert_cli("mcore-to-hf", "--mcore", ckpt, "--out", tmp_path / "out")
    line = assert_refused(proc, EXIT_INPUT, shard)
    assert ("truncated" if damage == "truncated" else "embedding.word_embeddings.weight") in line
    assert "PytorchStreamReader" not in line or "corrupt" in line
    assert digests(ckpt) == before and not (tmp_path / "out").exists()


@pytest.mark.fault("input")
def test_heads_that_do_not_divide_the_hidden_size_name_the_fields(tmp_path, models):
    src = copy_of(models[0], tmp_path)
    config = json.loads((src / "config.json").read_text())
    config.pop("head_dim", None)
    (src / "config.json").write_text(
        json.dumps({**config, "num_attention_heads": 5, "num_key_value_heads": 5})
    )
    before = digests(src)
    proc = convert_cli("hf-to-mcore", "--hf", src, "--out", tmp_path / "out")
    assert_refused(proc, EXIT_INPUT, src / "config.json", "num_attention_heads", "hidden_size=64")
    assert digests(src) == before and not (tmp_path / "out").exists()


@pytest.mark.fault("input")
@pytest.mark.parametrize(
    "flag, size, field",
    [
        ("--tp", "3", "num_attention_heads=4"),
        ("--pp", "3", "num_hidden_layers=2"),
        ("--tp", "0", "in [1, 4096]"),
    ],
)
def test_parallel_size_that_does_not_fit_the_config_is_refused_before_any_rank(
    tmp_path, models, flag, size, field
):
    src = models[0]
    before = digests(src)
    proc = convert_cli("hf-to-mcore", "--hf", src, "--out", tmp_path / "out", flag, size)
    line = assert_refused(proc, EXIT_USAGE, f"{flag}", field)
    if size == "3":
        assert "it can be 1, 2" in line  # the sizes that would divide
    assert digests(src) == before and not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- outputs at risk


@pytest.mark.fault("input")
@pytest.mark.parametrize(
    "direction, where",
    [
        ("hf-to-mcore", "same"),
        ("hf-to-mcore", "inside"),
        ("hf-to-mcore", "symlink"),
        ("hf-to-mcore", "holds"),
        ("mcore-to-hf", "same"),
        ("mcore-to-hf", "holds"),
        ("mcore-to-hf", "inside"),
    ],
)
def test_output_that_would_overwrite_its_input_is_refused(tmp_path, models, direction, where):
    """With ``--overwrite`` too: the input survives byte for byte, exit 4 before any write."""
    src = copy_of(models[0] if direction == "hf-to-mcore" else models[1], tmp_path / "models")
    out = {
        "same": src,
        "inside": src / "out",
        "holds": tmp_path / "models",
        "symlink": tmp_path / "link",
    }[where]
    if where == "symlink":
        out.symlink_to(src, target_is_directory=True)
    before = digests(tmp_path / "models")
    flag = "--hf" if direction == "hf-to-mcore" else "--mcore"
    proc = convert_cli(direction, flag, src, "--out", out, "--overwrite")
    assert_refused(proc, EXIT_OUTPUT, "--out", out, src)
    assert digests(tmp_path / "models") == before
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [src.name]  # no temporary folder


@pytest.mark.fault("input")
def test_existing_output_is_refused_with_exit_4(tmp_path, models):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    before = digests(out, models[1])
    proc = convert_cli("mcore-to-hf", "--mcore", models[1], "--out", out)
    assert_refused(proc, EXIT_OUTPUT, out, "--overwrite")
    assert digests(out, models[1]) == before


# --------------------------------------------------------------------------- non-finite weights


@pytest.fixture(scope="module")
def nan_models(tmp_path_factory, models) -> tuple[Path, Path]:
    """``models`` with one NaN and one Inf in a layer-1 MLP weight, both formats."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("nan")
    src = root / "hf"
    shutil.copytree(models[0], src)
    shard = next(
        p for p in sorted(src.glob("*.safetensors")) if "model.layers.1.mlp.up_proj.weight" in load_file(p)
    )
    tensors = load_file(shard)
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    tensors["model.layers.1.mlp.up_proj.weight"][4, 1] = float("inf")
    save_file(tensors, shard, metadata={"format": "pt"})
    hf_to_mcore(src, root / "mcore", allow_nonfinite=True, progress=False)
    return src, root / "mcore"


@pytest.mark.fault("numeric")
@pytest.mark.parametrize("direction", ["hf-to-mcore", "mcore-to-hf"])
def test_nonfinite_weights_are_refused_naming_the_tensor(tmp_path, nan_models, direction):
    src = nan_models[0] if direction == "hf-to-mcore" else nan_models[1]
    flag = "--hf" if direction == "hf-to-mcore" else "--mcore"
    tensor = (
        "model.layers.1.mlp.up_proj.weight"
        if direction == "hf-to-mcore"
        else "decoder.layers.1.mlp.linear_fc1.weight"
    )
    before = digests(src)
    proc = convert_cli(direction, flag, src, "--out", tmp_path / "out")
    assert_refused(proc, EXIT_INPUT, tensor, "1 NaN, 1 Inf", "--allow-nonfinite")
    assert digests(src) == before and not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []  # no temporary folder left either
    proc = convert_cli(direction, flag, src, "--out", tmp_path / "out", "--allow-nonfinite")
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "warning:" in line]
    assert len(warnings) == 1 and tensor in warnings[0], proc.stderr
    assert digests(src) == before


def test_python_api_raises_the_same_kinds(tmp_path, models):
    from megatron_rl import convert_checkpoint

    with pytest.raises(OutputError, match="is the input"):
        convert_checkpoint(models[0], models[0], to="mcore", overwrite=True)
    with pytest.raises(UsageError, match=r"--tp 3: does not divide num_attention_heads=4"):
        convert_checkpoint(models[0], tmp_path / "out", to="mcore", tensor_parallel=3)
    with pytest.raises(UsageError, match="an HF export has no layout"):
        convert_checkpoint(models[1], tmp_path / "out", to="hf", tensor_parallel=2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no config.json"):
        convert_checkpoint(tmp_path / "empty", tmp_path / "out", to="mcore")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- the API's ranks


@pytest.mark.distributed  # both the CLI and the API start two local gloo ranks for TP=2
def test_api_starts_its_ranks_like_the_cli(tmp_path, models, single_rank, capfd):
    """Issue 32: ``convert_checkpoint(tensor_parallel=2)`` in a process that holds a one-rank
    group (as after ``train`` or in this module's fixture) raised 'world size 1 is not a
    multiple of ...'; now it starts two ranks, as the CLI does, and writes the same checkpoint."""
    from megatron_rl import convert_checkpoint

    src = models[0]
    proc = convert_cli("hf-to-mcore", "--hf", src, "--out", tmp_path / "cli", "--tp", "2")
    assert proc.returncode == 0, proc.stderr
    capfd.readouterr()
    out = convert_checkpoint(src, tmp_path / "api", to="mcore", tensor_parallel=2)
    err = capfd.readouterr().err
    assert "starting 2 local CPU ranks" in err and "saving the Megatron checkpoint" in err, err
    assert "wrote 15 tensors" in err.strip().splitlines()[-1], err
    cli, api = McoreCheckpoint(tmp_path / "cli"), McoreCheckpoint(out)
    assert cli.meta == api.meta
    assert cli.shapes == api.shapes
    names = sorted(cli.shapes)
    a, b = cli.read(names), api.read(names)
    assert all(torch.equal(a[n], b[n]) for n in names)
