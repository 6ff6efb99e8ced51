"""Checkpoints that can be trusted: every file listed with its size and sha256 in a manifest
written last; a flipped byte, a truncated file, a deleted manifest or a garbled ``latest`` is
found and reported, and resuming from the root falls back to the previous intact checkpoint;
non-finite weights are never saved; ``keep_last`` never deletes the newest intact checkpoint.

Single process (the ``single_rank`` fixture) on the tiny Llama of test_checkpoint.py, and one
spawn of 2 gloo ranks: each rank digests its own shards, and a flipped byte in rank 1's shard is
found by the rank that hashes it and makes both ranks fall back together.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from megatron_rl.training import CheckpointCorruptError, NonFiniteError
from megatron_rl.training.checkpoint import load_checkpoint, save_checkpoint
from megatron_rl.training.checkpoint_manifest import MANIFEST, latest_checkpoint, list_checkpoints
from tests.spawn import run_ranks
from tests.training.test_checkpoint import _build, _train_step


def _weights(ddp) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in ddp[0].module.parameters()])


def _two_checkpoints(root: Path):
    """Model, optimizer, scheduler; checkpoints after steps 1 and 2 and each one's weights."""
    ddp, opt, sched = _build()
    weights = {}
    for step in (1, 2):
        _train_step(ddp, opt, sched, step)
        save_checkpoint(root, step, ddp, opt, sched, extra={"step": step})
        weights[step] = _weights(ddp)
    assert not torch.equal(weights[1], weights[2])
    return ddp, opt, sched, weights


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _shard(ckpt: Path, rank: int = 0) -> Path:
    return sorted((ckpt / "dist").glob(f"__{rank}_*.distcp"))[0]


def test_manifest_lists_every_file_with_size_and_digest(single_rank, tmp_path):
    import hashlib

    ddp, opt, sched = _build()
    _train_step(ddp, opt, sched, 1)
    path = save_checkpoint(tmp_path, 1, ddp, opt, sched)
    manifest = json.loads((path / MANIFEST).read_text())
    on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {MANIFEST}
    assert set(manifest["files"]) == on_disk and "complete" in on_disk and "dist/.metadata" in on_disk
    for rel, entry in manifest["files"].items():
        data = (path / rel).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, rel
    assert json.loads((path / "complete").read_text())["format"] == 2
    assert load_checkpoint(path, ddp, opt, sched) == (1, {})


@pytest.mark.fault("crash")
def test_flipped_byte_is_found_and_the_root_resumes_from_the_previous_checkpoint(
    single_rank, tmp_path, caplog
):
    ddp, opt, sched, weights = _two_checkpoints(tmp_path)
    step2 = tmp_path / "step_00000002"
    shard = _shard(step2)
    _flip_byte(shard)
    assert latest_checkpoint(tmp_path) == step2  # the cheap check sees sizes only
    with pytest.raises(CheckpointCorruptError, match=rf"{shard}.*is corrupt: sha256"):
        load_checkpoint(step2, ddp, opt, sched)  # a folder given by name: no fallback
    assert torch.equal(_weights(ddp), weights[2])  # nothing was loaded
    with caplog.at_level(logging.WARNING, logger="megatron_rl.training.checkpoint"):
        assert load_checkpoint(tmp_path, ddp, opt, sched) == (1, {"step": 1})
    assert torch.equal(_weights(ddp), weights[1]) and sched.num_steps == 1
    assert any(str(shard) in r.getMessage() and "passed over" in r.getMessage() for r in caplog.records)


@pytest.mark.fault("crash")
@pytest.mark.parametrize("damage", ["truncate", "delete manifest", "delete shard", "garble manifest"])
def test_partial_checkpoint_is_passed_over(single_rank, tmp_path, damage):
    ddp, opt, sched, weights = _two_checkpoints(tmp_path)
    step2 = tmp_path / "step_00000002"
    shard, manifest = _shard(step2), step2 / MANIFEST
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:100])
        named = rf"{shard} has 100 bytes"
    elif damage == "delete manifest":
        manifest.unlink()
        named = rf"{manifest} is missing"
    elif damage == "delete shard":
        shard.unlink()
        named = rf"{shard} is missing"
    else:
        manifest.write_bytes(b"\xff\xfe not json")
        named = rf"{manifest} is not valid JSON"
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"
    with pytest.raises(CheckpointCorruptError, match=named):
        load_checkpoint(step2, ddp, opt, sched)
    assert load_checkpoint(tmp_path, ddp, opt, sched) == (1, {"step": 1})
    assert torch.equal(_weights(ddp), weights[1])


@pytest.mark.fault("crash")
@pytest.mark.parametrize(
    "latest",
    [b"\xff\xfe\x00garbage", b"", b"step_00000002", b"hello\n", b"step_00000009\n", b"../../etc\n" * 100],
)
def test_any_latest_file_falls_back_to_a_scan(single_rank, tmp_path, latest):
    ddp, opt, sched, _ = _two_checkpoints(tmp_path)
    (tmp_path / "latest").write_bytes(latest)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000002"
    assert load_checkpoint(tmp_path, ddp, opt, sched) == (2, {"step": 2})
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").mkdir()  # not even a file
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000002"


@pytest.mark.fault("crash")
def test_no_intact_checkpoint_is_an_error_not_a_fresh_start(single_rank, tmp_path):
    ddp, opt, sched, _ = _two_checkpoints(tmp_path)
    _flip_byte(_shard(tmp_path / "step_00000001"))
    (tmp_path / "step_00000002" / MANIFEST).unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"  # sizes still fit
    with pytest.raises(CheckpointCorruptError, match="no intact checkpoint under") as err:
        load_checkpoint(tmp_path, ddp, opt, sched)
    assert "step_00000002" in str(err.value) and "step_00000001" in str(err.value)
    (tmp_path / "step_00000001" / MANIFEST).unlink()
    with pytest.raises(CheckpointCorruptError, match="no intact checkpoint under"):
        latest_checkpoint(tmp_path)


def test_checkpoint_from_before_manifests_loads_with_a_warning(single_rank, tmp_path, caplog):
    ddp, opt, sched, weights = _two_checkpoints(tmp_path)
    step2 = tmp_path / "step_00000002"
    (step2 / MANIFEST).unlink()
    marker = json.loads((step2 / "complete").read_text())
    (step2 / "complete").write_text(json.dumps({**marker, "format": 1}))
    with caplog.at_level(logging.WARNING, logger="megatron_rl.training.checkpoint_manifest"):
        assert load_checkpoint(tmp_path, ddp, opt, sched) == (2, {"step": 2})
    assert torch.equal(_weights(ddp), weights[2])
    assert any("predates manifests" in r.getMessage() for r in caplog.records)


@pytest.mark.fault("numeric")
def test_non_finite_weights_are_not_saved(single_rank, tmp_path):
    ddp, opt, sched, _ = _two_checkpoints(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    latest = (tmp_path / "latest").read_bytes()
    name, param = next(iter(ddp[0].module.named_parameters()))
    with torch.no_grad():
        param.view(-1)[3] = float("nan")
    with pytest.raises(NonFiniteError, match=rf"parameter '{name}' holds NaN or inf.*nothing was written"):
        save_checkpoint(tmp_path, 3, ddp, opt, sched)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no step_3, no tmp folder
    assert (tmp_path / "latest").read_bytes() == latest


@pytest.mark.fault("crash")
def test_keep_last_never_deletes_the_newest_intact_checkpoint(single_rank, tmp_path):
    ddp, opt, sched = _build()
    for step in (1, 2):
        save_checkpoint(tmp_path, step, ddp, opt, sched, keep_last=2)
    (tmp_path / "step_00000002" / MANIFEST).unlink()  # step 2 is broken: it does not count
    save_checkpoint(tmp_path, 3, ddp, opt, sched, keep_last=2)
    # A plain count would have kept 2 and 3 and deleted 1, the only intact one below 3.
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 2, 3]
    save_checkpoint(tmp_path, 4, ddp, opt, sched, keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4]
    save_checkpoint(tmp_path, 5, ddp, opt, sched, keep_last=1)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [5]
    assert load_checkpoint(tmp_path, ddp, opt, sched)[0] == 5


def test_trainer_resumes_from_the_previous_checkpoint_when_the_latest_is_corrupt(single_rank, tmp_path):
    from tests.training.test_nonfinite import _batch, _trainer

    trainer = _trainer()
    trainer.rl_step(_batch(0))
    trainer.save_checkpoint(tmp_path, extra={"cursor": 1})
    want = {n: p.detach().clone() for n, p in trainer.chunks[0].named_parameters()}
    trainer.rl_step(_batch(1))
    bad = trainer.save_checkpoint(tmp_path, extra={"cursor": 2})
    _flip_byte(_shard(bad))
    resumed = _trainer()
    assert resumed.load_checkpoint(tmp_path) == {"cursor": 1} and resumed.step == 1
    for n, p in resumed.chunks[0].named_parameters():
        assert torch.equal(p, want[n]), n


# -- two ranks: each digests its own files; both fall back together ------------------------------


def _two_ranks(rank: int, world_size: int, root: str) -> dict:
    import os

    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch.distributed as dist

    from megatron_rl.training.parallel import ParallelConfig, destroy_parallel, init_parallel

    # TP2: each rank holds its own half of the weights, written to its own shard files.
    init_parallel(ParallelConfig(tensor_parallel=2), seed=1)
    try:
        ddp, opt, sched = _build(tp=2)
        out: dict = {"weights": {}}
        for step in (1, 2):
            _train_step(ddp, opt, sched, step)
            save_checkpoint(root, step, ddp, opt, sched)
            out["weights"][step] = _weights(ddp)
        step2 = Path(root) / "step_00000002"
        out["manifest"] = json.loads((step2 / MANIFEST).read_text())["files"]
        dist.barrier()
        if rank == 1:
            _flip_byte(_shard(step2, rank=1))
        dist.barrier()
        out["loaded"] = load_checkpoint(root, ddp, opt, sched)[0]
        out["now"] = _weights(ddp)
        return out
    finally:
        destroy_parallel()


@pytest.mark.distributed
@pytest.mark.fault("crash")
def test_two_ranks_digest_their_own_shards_and_fall_back_together(tmp_path):
    ranks = run_ranks(_two_ranks, 2, args=(str(tmp_path),), timeout=180)
    files = ranks[0]["manifest"]
    assert "rng/rank_00000.pt" in files and "rng/rank_00001.pt" in files
    assert any(f.startswith("dist/__0_") for f in files) and any(f.startswith("dist/__1_") for f in files)
    for r in ranks:
        assert r["loaded"] == 1
        assert torch.equal(r["now"], r["weights"][1])
