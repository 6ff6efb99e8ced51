"""The Hugging Face side of a conversion: safetensors read tensor by tensor, written shard by
shard, the files that travel with the weights, and atomic output folders.

- :class:`HFWeights` indexes a model folder (``model.safetensors.index.json`` if present, else
  every ``*.safetensors`` file) from the files' headers only, and reads one tensor per access
  (``safe_open``, memory-mapped): nothing is loaded until asked for.
- :class:`ShardWriter` collects tensors and writes a shard as soon as the next tensor would make
  it exceed ``max_shard_bytes`` (HF's ``max_shard_size`` rule: a single larger tensor gets a
  shard of its own), so at most one shard is held in memory. One shard is ``model.safetensors``;
  several are ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``.
- :func:`atomic_output_dir` writes into a fresh sibling folder and renames it into place, so the
  output either does not exist or is complete.
- :func:`carried_tensors` / :func:`write_carried` read and keep a vision-language model's carried
  tensors (vision tower, projector): one safetensors file, bit for bit.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

from megatron_rl.errors import InputError, UsageError
from megatron_rl.fileio import JsonValue, atomic_output_dir, loads_json

__all__ = [
    "CARRIED_FILE",
    "INDEX_FILE",
    "SIDE_FILE_PATTERNS",
    "SINGLE_FILE",
    "HFWeights",
    "ShardWriter",
    "carried_tensors",
    "copy_side_files",
    "dtype_name",
    "nonfinite_problem",
    "parse_dtype",
    "parse_size",
    "read_config_json",
    "write_carried",
    "write_hf_folder",
]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# Files carried across a conversion untouched (config.json is handled separately: it is checked
# against the weights and its dtype entry follows the output).
SIDE_FILE_PATTERNS = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.model",
    "*.tiktoken",
)

_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}
_SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def parse_dtype(text: str) -> torch.dtype | None:
    """``bf16|fp16|fp32`` (or the long names) -> torch dtype; ``keep`` -> None."""
    if text == "keep":
        return None
    if text not in _DTYPES:
        raise UsageError(f"dtype: {text!r} is not one of bf16, fp16, fp32, keep")
    return _DTYPES[text]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling of HF's config ``dtype`` field)."""
    return str(dtype).removeprefix("torch.")


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5 * 10**9 bytes (decimal units as in HF's ``max_shard_size``; ``GiB``
    style binary units too); a bare number is bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise UsageError(f"max_shard_size: cannot read {text!r} (use e.g. 5GB, 500MB, 1GiB)")
    unit = (m.group(2) or "B").upper()
    base = 1024 if "I" in unit else 1000
    power = "BKMGT".index(unit[0])
    size = int(float(m.group(1)) * base**power)
    if size <= 0:
        raise UsageError(f"max_shard_size: must be positive, got {text!r}")
    return size


class HFWeights(Mapping[str, torch.Tensor]):
    """The safetensors weights of an HF model folder (or of one ``.safetensors`` file) as a
    read-on-access mapping.

    ``weights[name]`` reads that tensor from its file (one ``safe_open`` handle per file, kept
    open); :meth:`shape` and :meth:`dtype` read the headers only. A folder without weights, an
    unreadable index, or a file that is not safetensors (truncated, a garbage header, an unknown
    dtype) raises :class:`~megatron_rl.errors.InputError` naming the file.
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        index = self.folder / INDEX_FILE
        if self.folder.suffix == ".safetensors" and self.folder.is_file():
            self.folder, files = self.folder.parent, [self.folder.name]
        elif index.is_file():
            files = _index_files(index)
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
        if not files:
            raise InputError(f"{self.folder}: no {INDEX_FILE} and no *.safetensors files")
        self._handles = {f: _open_safetensors(self.folder / f) for f in files}
        self._file_of: dict[str, str] = {}
        for f, handle in self._handles.items():
            for name in handle.keys():
                if name in self._file_of:
                    raise InputError(f"{self.folder}: tensor {name} is in both {self._file_of[name]} and {f}")
                self._file_of[name] = f

    def file_of(self, name: str) -> Path:
        """The safetensors file that holds tensor ``name``."""
        return self.folder / self._file_of[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self._handles[self._file_of[name]].get_tensor(name)
        except KeyError:
            raise
        except Exception as e:  # noqa: BLE001 -- safetensors' own error type is not importable
            raise InputError(f"{self.file_of(name)}: tensor {name} cannot be read ({_one_line(e)})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._file_of[name]].get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        code = self._handles[self._file_of[name]].get_slice(name).get_dtype()
        if code not in _SAFETENSORS_DTYPES:
            raise InputError(
                f"{self.file_of(name)}: tensor {name} has dtype {code}, not one of "
                f"{', '.join(_SAFETENSORS_DTYPES)}"
            )
        return _SAFETENSORS_DTYPES[code]

    def nbytes(self) -> int:
        """Total bytes of all tensors (from the headers)."""
        total = 0
        for name in self._file_of:
            numel = 1
            for n in self.shape(name):
                numel *= n
            total += numel * self.dtype(name).itemsize
        return total

    def close(self) -> None:
        self._handles.clear()


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _index_files(index: Path) -> list[str]:
    """The shard files ``model.safetensors.index.json`` names; InputError naming it if malformed."""
    try:
        weight_map = json.loads(index.read_bytes()).get("weight_map")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise InputError(f"{index}: not a safetensors index ({_one_line(e)})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise InputError(f"{index}: weight_map: expected an object of tensor name -> file name")
    files = sorted(set(weight_map.values()))
    for f in files:
        if Path(f).name != f:
            raise InputError(f"{index}: weight_map names {f!r}, not a file of this folder")
        if not (index.parent / f).is_file():
            raise InputError(f"{index.parent / f}: missing (named in {INDEX_FILE})")
    return files


def _open_safetensors(path: Path):
    """``safe_open`` of ``path``; InputError naming it when it is not a whole safetensors file."""
    from safetensors import safe_open  # lazy: only reading/writing weights needs it

    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:
        if isinstance(e, OSError) and not isinstance(e, FileNotFoundError):
            raise
        raise InputError(
            f"{path}: not a readable safetensors file ({_one_line(e)}); it may be truncated or corrupt"
        ) from None


class ShardWriter:
    """Write tensors into safetensors shards of at most ``max_shard_bytes`` as they arrive.

    Call :meth:`add` per tensor (names must be unique) and :meth:`close` once; ``close`` names
    the shards as HF does and writes the index when there is more than one.
    """

    def __init__(self, folder: str | os.PathLike, max_shard_bytes: int):
        self.folder = Path(folder)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []  # (temporary file name, tensor names)
        self.total_bytes = 0
        self.total_numel = 0
        self._seen: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._seen:
            raise ValueError(f"{name} written twice")
        self._seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        # safetensors stores contiguous CPU memory; views (q/k/v slices) are copied here.
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes
        self.total_numel += tensor.numel()

    def _flush(self) -> None:
        from safetensors.torch import save_file  # lazy: only reading/writing weights needs it

        tmp_name = f"shard-{len(self._shards):05d}.safetensors.part"
        save_file(self._pending, str(self.folder / tmp_name), metadata={"format": "pt"})
        self._shards.append((tmp_name, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Write the last shard, give the shards their final names; returns the file names."""
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        if n == 1:
            os.replace(self.folder / self._shards[0][0], self.folder / SINGLE_FILE)
            return [SINGLE_FILE]
        weight_map, files = {}, []
        for i, (tmp_name, names) in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.folder / tmp_name, self.folder / final)
            files.append(final)
            weight_map.update({name: final for name in names})
        index = {
            "metadata": {"total_size": self.total_bytes, "total_parameters": self.total_numel},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return files + [INDEX_FILE]


def copy_side_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy the tokenizer / generation-config files of :data:`SIDE_FILE_PATTERNS` from ``src``
    to ``dst`` (existing ones are replaced); returns the names copied."""
    src, dst = Path(src), Path(dst)
    copied = []
    for p in sorted(src.iterdir()):
        if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in SIDE_FILE_PATTERNS):
            shutil.copy2(p, dst / p.name)
            copied.append(p.name)
    return copied


#: Where a vision-language model's carried tensors are kept beside a Megatron model: next to
#: ``model/`` in a converted checkpoint, next to ``dist/`` in a training checkpoint.
CARRIED_FILE = "carried.safetensors"


def carried_tensors(
    source: str | os.PathLike, prefixes: tuple[str, ...]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of ``source`` (an HF folder or one safetensors file) whose names start with one
    of ``prefixes`` (a vision-language family's vision tower and projector), in name order, as
    stored; nothing when ``prefixes`` is empty. InputError naming ``source`` if it has none."""
    if not prefixes:
        return
    weights = HFWeights(source)
    try:
        names = sorted(n for n in weights if n.startswith(prefixes))
        if not names:
            raise InputError(f"{source}: no {' / '.join(prefixes)} tensors (the vision tower to carry)")
        for name in names:
            yield name, weights[name]
    finally:
        weights.close()


def write_carried(path: str | os.PathLike, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Write ``tensors`` (name, tensor) as the one safetensors file ``path`` (atomically: a
    temporary file renamed into place), as they are; returns how many."""
    from safetensors.torch import save_file  # lazy: only vision-language models carry tensors

    data = {n: t.contiguous() for n, t in tensors}
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(data, str(tmp))
    os.replace(tmp, path)
    return len(data)


def write_hf_folder(
    out: str | os.PathLike,
    config: Mapping,
    tensors,
    *,
    side_files_from: str | os.PathLike,
    max_shard: str | int = "2GB",
    dtype: torch.dtype | None = None,
    carried: Iterable[tuple[str, torch.Tensor]] = (),
) -> Path:
    """An HF model folder, published atomically (replacing ``out``): ``tensors`` (``(hf_name,
    tensor)`` pairs, streamed into safetensors shards of ``max_shard``, cast to ``dtype`` when
    given), then ``carried`` ones as they are (a vision tower: never cast), ``config`` as
    config.json, and the tokenizer/generation side files of the folder ``side_files_from``.
    Returns ``out``."""
    with atomic_output_dir(out, overwrite=True) as tmp:
        writer = ShardWriter(tmp, parse_size(max_shard))
        for name, t in tensors:
            writer.add(name, t if dtype is None else t.to(dtype))
        for name, t in carried:
            writer.add(name, t)
        writer.close()
        (tmp / "config.json").write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
        copy_side_files(side_files_from, tmp)
    return Path(out)


def nonfinite_problem(name: str, tensor: torch.Tensor, where: str) -> str | None:
    """None if ``tensor`` is finite, else the one-line refusal naming ``name`` (in ``where``)."""
    if not tensor.is_floating_point():
        return None
    finite = torch.isfinite(tensor)
    if bool(finite.all()):
        return None
    nan = int(torch.isnan(tensor).sum())
    inf = tensor.numel() - int(finite.sum()) - nan
    return (
        f"{where}: tensor {name} holds non-finite values ({nan} NaN, {inf} Inf of "
        f"{tensor.numel()}, dtype {str(tensor.dtype).removeprefix('torch.')})"
    )


_JSON_CONSTANT = re.compile(r"-?\b(NaN|Infinity)\b")


def read_config_json(folder: str | os.PathLike[str], *, flag: str) -> dict[str, JsonValue]:
    """``folder/config.json`` as a dict; InputError naming the option, the file and the line. A
    number written NaN or Infinity (Python's json writes them; JSON has no such numbers) is refused
    with its field's line: a NaN norm epsilon or rope base would load, convert and serve as NaN."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"{flag} {folder}: no such folder")
    path = folder / "config.json"
    if not path.is_file():
        raise InputError(f"{flag} {folder}: no config.json in it (an HF model folder has one)")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text (byte {e.start})") from None
    try:
        config = loads_json(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
    except ValueError as e:
        bad = _JSON_CONSTANT.search(text)
        if bad is None:
            raise InputError(f"{path}: {e}") from None
        line = text.count("\n", 0, bad.start()) + 1
        field = re.findall(r'"([^"]+)"\s*:', text[: bad.start()])
        where = f" in field {field[-1]!r}" if field else ""
        raise InputError(
            f"{path}:{line}: {bad.group(0)}{where} is not a number a model config can hold"
        ) from None
    if not isinstance(config, dict):
        raise InputError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config
