"""Checkpoint conversion between Hugging Face (safetensors) and this project's Megatron format:
the format, and :class:`McoreCheckpoint`, which reads any Megatron model checkpoint one layer at
a time. The two directions: :mod:`~megatron_rl.convert.from_hf` and
:mod:`~megatron_rl.convert.to_hf`; the architecture check: :mod:`~megatron_rl.convert.architecture`.

    hf_to_mcore("Qwen2.5-7B/", "qwen-mcore/", tensor_parallel=2, pipeline_parallel=1)
    mcore_to_hf("qwen-mcore/", "qwen-hf/", max_shard_size="5GB")
    mcore_to_hf("run/checkpoints/step_00000100/dist", "step100-hf/", hf_config="Qwen2.5-7B/")

The Megatron side (what ``hf_to_mcore`` writes, ``mcore_to_hf`` reads)::

    OUT/
      megatron_rl_model.json  format + version, the HF config.json (as a dict), the padded
                              vocabulary, the Megatron params dtype, the HF dtype of every tensor
                              (one dtype + exceptions), the TP/PP it was written at, versions
      model/                  megatron.core.dist_checkpointing of the GPTModel, exactly what
                              training/model.py's save_model_checkpoint writes: every tensor by
                              its global name and shape, layers stacked, any TP/PP loads it
      hf/                     tokenizer and generation_config files of the HF model, verbatim
      carried.safetensors     a vision-language model's vision tower and projector (Mistral3):
                              not converted, never trained, the HF tensors bit for bit

``mcore_to_hf`` also reads a bare dist-checkpoint folder (``save_model_checkpoint``'s
output, or the ``dist/`` folder of a training checkpoint), given the HF config to export with.

Memory and streaming:

- HF -> Megatron: the HF files are read one tensor at a time (memory-mapped), but the Megatron
  side cannot stream: ``dist_checkpointing.save`` writes each rank's whole state dict in one
  collective call, so every rank holds its shard of the model (the model built at the given
  TP x PP, weights in the chosen dtype) until the save. Across ranks that is one copy of the
  model; with ``torchrun`` over several machines it is spread over them.
- A vision-language model: only its language model is a Megatron model; the carried tensors are
  copied into ``carried.safetensors`` and written back unchanged on export (never cast by
  ``--dtype``), after the language model's.
- Megatron -> HF: streams on both sides. No model is built: the checkpoint is read one layer at a
  time (``dist_checkpointing.load`` of that layer's slice of each stacked tensor, in one process,
  whatever layout wrote it) and HF shards are written as they fill, so peak memory is about one
  layer plus one output shard (and the embedding, read whole).

Refusals (:mod:`megatron_rl.errors` kinds; the CLI prints one line and exits with their code):
an output that is, holds or lies inside an input, or exists without ``overwrite``
(:class:`OutputError`, before anything is read); ``tensor_parallel`` / ``pipeline_parallel``
that do not divide what the config splits (:class:`UsageError`, before any rank starts); a
config.json that does not describe the weights or itself (:class:`~megatron_rl.convert.checks.ConfigMismatchError`,
an :class:`InputError` and a :class:`~megatron_rl.hf.layout.WeightsMismatchError` naming the
file and field); a truncated or corrupt safetensors file or Megatron shard (:class:`InputError`
naming the file); a tensor holding NaN or Inf (:class:`InputError` naming it, unless
``allow_nonfinite``). Outputs appear atomically (a temporary folder renamed into place), so a
refusal leaves no output behind and the inputs are only ever read.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_rl.convert.checks import check_dist_files, dist_read_error
from megatron_rl.errors import InputError
from megatron_rl.hf.arch import padded_vocab_size
from megatron_rl.hf.files import CARRIED_FILE, HFWeights
from megatron_rl.hf.layout import WeightsMismatchError, canonical_name
from megatron_rl.training.cpu_compat import apply_cpu_compat

if TYPE_CHECKING:
    # megatron-core ships no type information: to mypy this name is Any.
    from megatron.core.dist_checkpointing import ShardedTensor

    from megatron_rl.fileio import JsonValue

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "HF_FILES_DIR",
    "META_FILE",
    "MODEL_DIR",
    "McoreCheckpoint",
    "output_summary",
    "read_meta",
    "single_process_group",
]

META_FILE, MODEL_DIR, HF_FILES_DIR = "megatron_rl_model.json", "model", "hf"
# dist_checkpointing stores MoE experts (SequentialMLP) under one key per weight, stacked
# [layers, experts, ...]: "decoder.layers." + _EXPERTS_KEY + "linear_fc1.weight".
_EXPERTS_KEY, _EXPERT_NAME = "mlp.experts.experts.", "mlp.experts.local_experts."
_EXPERT_PARAM = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_STORED_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")  # a layer stored on its own
_LAYER_NUMBER = re.compile(r"^decoder\.layers\.(\d+)\.")
FORMAT, FORMAT_VERSION = "megatron-rl/mcore-model", 1


@contextlib.contextmanager
def single_process_group() -> Iterator[None]:
    """A one-rank gloo group for dist_checkpointing (which asks for ranks), unless one exists."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(
                "mcore_to_hf runs in one process; call it outside torchrun (it "
                "reads any layout's checkpoint without model-parallel ranks)"
            )
        yield
        return
    if not torch.cuda.is_available():
        apply_cpu_compat()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class McoreCheckpoint:
    """A Megatron model checkpoint read one layer at a time, without building a model.

    ``path`` is a :func:`~megatron_rl.convert.from_hf.hf_to_mcore` output folder (with its
    metadata) or a bare ``dist_checkpointing`` folder of a GPTModel (``save_model_checkpoint``'s
    output, or a training checkpoint's ``dist/``). ``shapes`` maps canonical per-layer names (as
    :class:`~megatron_rl.hf.layout.HFConverter` uses them) to full shapes.
    """

    def __init__(self, path: str | os.PathLike):
        from megatron.core import (
            dist_checkpointing,  # lazy: megatron-core takes seconds to import; only this path needs it
        )

        path = Path(path)
        self.meta: dict[str, JsonValue] | None = None
        if not path.is_dir():
            raise InputError(f"--mcore {path}: no such folder")
        if (path / META_FILE).is_file():
            self.meta = read_meta(path / META_FILE)
            self.dist_dir = path / MODEL_DIR
        elif (path / "dist" / ".metadata").is_file():
            self.dist_dir = path / "dist"
        else:
            self.dist_dir = path
        if not (self.dist_dir / ".metadata").is_file():
            raise InputError(
                f"--mcore {path}: neither a converted checkpoint ({META_FILE}) nor "
                "a dist_checkpointing folder (.metadata)"
            )
        self.side_dir = path / HF_FILES_DIR if self.meta else None
        carried = self.dist_dir.parent / CARRIED_FILE  # beside model/ (converted) or dist/ (a run's)
        self.carried_file: Path | None = carried if carried.is_file() else None
        check_dist_files(self.dist_dir)  # a missing or truncated shard, named before any read
        with single_process_group():
            try:
                stored = dist_checkpointing.load_tensors_metadata(str(self.dist_dir))
            except (Exception, CheckpointException) as e:  # noqa: BLE001 -- many types on a bad folder
                raise dist_read_error(self.dist_dir, (), e) from None
        self._stored = {
            k: (tuple(v.global_shape), v.dtype) for k, v in stored.items() if not k.startswith("optimizer.")
        }  # training checkpoints hold both
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._key_of: dict[str, str] = {}  # canonical name -> its stored key, where they differ
        self.dtypes: dict[str, torch.dtype] = {}
        for key, (shape, dtype) in self._stored.items():
            for name, sub in self._names(key, shape):
                self.shapes[name], self.dtypes[name] = sub, dtype
        layers = {int(m.group(1)) for n in self.shapes if (m := _LAYER_NUMBER.match(n))}
        self.num_layers = max(layers) + 1 if layers else 0

    def _names(self, key: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        """The per-layer (and per-expert) canonical names and shapes of a stored tensor.

        Layers of one structure are stored stacked (``decoder.layers.X [layers, ...]``); a model
        whose layers differ (DeepSeek-V3: dense and MoE layers, multi-latent attention) stores
        each layer on its own (``decoder.layers.i.X``), its experts stacked (``[experts, ...]``)."""
        if not key.startswith("decoder.layers."):
            return [(key, shape)]
        per_layer = _STORED_LAYER.match(key)
        if per_layer is not None:
            i, rest = per_layer.group(1), per_layer.group(2)
            if rest.startswith(_EXPERTS_KEY):
                leaf = rest.removeprefix(_EXPERTS_KEY)
                return [(f"decoder.layers.{i}.{_EXPERT_NAME}{e}.{leaf}", shape[1:]) for e in range(shape[0])]
            name = canonical_name(key)  # the local spec's norm names, as the converter spells them
            if name != key:
                self._key_of[name] = key
            return [(name, shape)]
        suffix = key.removeprefix("decoder.layers.")
        if suffix.startswith(_EXPERTS_KEY):  # stacked [layers, experts, ...]
            rest = suffix.removeprefix(_EXPERTS_KEY)
            return [
                (f"decoder.layers.{i}.{_EXPERT_NAME}{e}.{rest}", shape[2:])
                for i in range(shape[0])
                for e in range(shape[1])
            ]
        return [(f"decoder.layers.{i}.{suffix}", shape[1:]) for i in range(shape[0])]

    def _request(self, name: str) -> ShardedTensor:
        """A ShardedTensor asking for the stored slice that is canonical tensor ``name``."""
        from megatron.core.dist_checkpointing import (
            ShardedTensor,  # lazy: megatron-core takes seconds to import; only this path needs it
        )

        m = _EXPERT_PARAM.match(name)
        own = None if m is None else f"decoder.layers.{m.group(1)}.{_EXPERTS_KEY}{m.group(3)}"
        if m and own in self._stored:  # a layer stored on its own: a (1, ...) slice of its experts
            shape, dtype = self._stored[own]
            data = torch.empty((1, *shape[1:]), dtype=dtype)
            return ShardedTensor.from_rank_offsets(own, data, (0, int(m.group(2)), shape[0]), replica_id=0)
        stored = self._key_of.get(name, name)
        if stored in self._stored:  # a layer stored on its own, or a tensor outside the layers
            shape, dtype = self._stored[stored]
            return ShardedTensor.from_rank_offsets(stored, torch.empty(shape, dtype=dtype), replica_id=0)
        if m:  # a (1, 1, ...) slice of the [layers, experts, ...] stack
            i, e = int(m.group(1)), int(m.group(2))
            key = f"decoder.layers.{_EXPERTS_KEY}{m.group(3)}"
            shape, dtype = self._stored[key]
            data = torch.empty((1, 1, *shape[2:]), dtype=dtype)
            return ShardedTensor.from_rank_offsets(
                key, data, (0, i, shape[0]), (1, e, shape[1]), replica_id=0
            )
        parts = name.split(".")
        if name.startswith("decoder.layers.") and parts[2].isdigit():
            i, key = int(parts[2]), "decoder.layers." + ".".join(parts[3:])
            shape, dtype = self._stored[key]
            # A (1, ...) slice of the layer-stacked tensor: a plain (non-prepended)
            # ShardedTensor, which dist_checkpointing reads partially in one process.
            data = torch.empty((1, *shape[1:]), dtype=dtype)
            return ShardedTensor.from_rank_offsets(key, data, (0, i, shape[0]), replica_id=0)
        shape, dtype = self._stored[name]
        return ShardedTensor.from_rank_offsets(name, torch.empty(shape, dtype=dtype), replica_id=0)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Load the canonical ``names`` (any mix of layers) from the checkpoint."""
        from megatron.core import (
            dist_checkpointing,  # lazy: megatron-core takes seconds to import; only this path needs it
        )

        request = {name: self._request(name) for name in names}
        with single_process_group():
            try:
                loaded = dist_checkpointing.load(request, str(self.dist_dir), validate_access_integrity=False)
            # torch's checkpoint reader wraps every cause in a CheckpointException (a BaseException).
            except (Exception, CheckpointException) as e:  # noqa: BLE001
                raise dist_read_error(self.dist_dir, {r.key for r in request.values()}, e) from None
        out = {}
        for n in names:  # a training checkpoint's common state comes back too: not asked for
            t, key = loaded[n], request[n].key
            if key == self._key_of.get(n, n):  # stored whole
                pass
            elif _EXPERT_PARAM.match(n):
                t = t[0] if _STORED_LAYER.match(key) else t[0, 0]  # one layer's experts, or the stack
            elif n.startswith("decoder.layers."):
                t = t[0]
            out[n] = t
        return out

    def padded_vocab(self, vocab_size: int) -> int:
        """Rows of the stored embedding, checked against ``vocab_size`` (names the field)."""
        rows = self.shapes["embedding.word_embeddings.weight"][0]
        if self.meta is not None:
            if rows != self.meta["padded_vocab_size"]:
                raise ValueError(
                    f"{self.dist_dir}: embedding has {rows} rows, the metadata "
                    f"says {self.meta['padded_vocab_size']}"
                )
            return rows
        # Bare checkpoint: rows must be Megatron's padding of vocab_size at some TP size.
        if rows not in {padded_vocab_size(vocab_size, tp) for tp in range(1, 65)}:
            raise WeightsMismatchError(
                "vocab_size",
                f"vocab_size={vocab_size} does not pad to "
                f"the checkpoint's {rows} embedding rows at any TP size",
            )
        return rows


def read_meta(path: Path) -> dict[str, JsonValue]:
    """The metadata file of an :func:`~megatron_rl.convert.from_hf.hf_to_mcore` output, checked;
    InputError naming it."""
    try:
        meta = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise InputError(f"{path}: not a {FORMAT} v{FORMAT_VERSION} file")
    kinds = {"hf_config": dict, "padded_vocab_size": int, "hf_dtype": str, "hf_dtype_exceptions": dict}
    for field, kind in kinds.items():
        if not isinstance(meta.get(field), kind):
            raise InputError(f"{path}: {field}: expected a JSON {kind.__name__}, got {meta.get(field)!r}")
    return meta


def output_summary(path: str | os.PathLike) -> tuple[int, int]:
    """``(tensors, bytes)`` of what a conversion wrote at ``path``: an HF folder (its safetensors
    tensors) or an :func:`~megatron_rl.convert.from_hf.hf_to_mcore` output (its tensors per layer
    and expert, full shapes). Reads headers and metadata only."""
    path = Path(path)
    if (path / META_FILE).is_file():
        ckpt = McoreCheckpoint(path)
        return len(ckpt.shapes), sum(math.prod(s) * ckpt.dtypes[n].itemsize for n, s in ckpt.shapes.items())
    weights = HFWeights(path)
    try:
        return len(weights), weights.nbytes()
    finally:
        weights.close()
