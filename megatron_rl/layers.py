"""The layer order of megatron_rl, written down once; ``tests/test_layers.py`` enforces it.

A module may import modules of its own part (a subpackage, or a top-level module) and of parts in
*lower* layers -- never of a part in its own layer or above. Parts in one layer meet only through
what lies below them (records of layer 1, callables passed in): e.g. the trainer hands
``weight_sync`` a function yielding named tensors and never imports it, and the engine server and
the broadcaster both build the update group from ``generation.update_group``.

Bottom first:

0. the error path and the version -- ``errors`` (the exceptions for user mistakes, their exit
   codes, and the command-line boundary every entry point runs behind), ``version`` (the
   package's version, its one home; below the root, which re-exports it);
1. records and plumbing -- ``types`` (records crossing stages), ``config`` (typed field checks, YAML
   -> dataclass with file:line errors), ``fileio`` (atomic writes, JSONL), ``layers`` (this file);
2. pure parts -- ``algorithms`` (tensor math), ``rewards`` (verifiers, sandbox, pool), ``hf`` (HF
   config facts, the HF <-> Megatron name and layout map per architecture, HF folders on disk);
3. ``batching`` (scored groups -> train batches and microbatches) and ``environments`` (multi-turn
   environments, their calls under a deadline, a trajectory's exact tokens and loss mask);
4. the engines of the loop -- ``training`` (Megatron trainer) and ``generation`` (fleet client,
   SGLang protocol, built-in engine server);
5. what joins or drives the engines -- ``weight_sync`` (trainer -> fleet broadcast), ``convert``
   (offline HF <-> Megatron checkpoints, built on the trainer's model), ``data`` (problem sets,
   curation, sampling through any generator);
6. ``evaluation`` (pass@k, reports, plots over data and generation);
7. ``orchestration`` (the RL loop and the whole recipe, ``RunConfig``);
8. ``quickstart`` (the CPU demonstration, a client of the loop);
9. entry points -- ``cli`` (the ``megatron-rl`` command and the verbs that span components);
10. ``api`` (the Python API: the recipe object and the verbs, for notebooks and programs);
11. ``__main__`` (``python -m megatron_rl``).

The package root (``megatron_rl/__init__.py``) re-exports the version and sits at layer 1. Its
one exception: it re-exports the Python API (``from megatron_rl import train``), importing ``api``
lazily on first use of one of those names, so that importing the root loads nothing but
``version``. Since the root stands for the top layer's API, no module of the package imports
names from it (``from megatron_rl import __version__`` in a leaf would reach up for a
re-export): each imports the module that defines the name (``megatron_rl.version``).
"""

from __future__ import annotations

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("the error path and the version", ("errors", "version")),
    ("records and plumbing", ("", "types", "config", "fileio", "layers")),
    ("pure parts", ("algorithms", "rewards", "hf")),
    ("batching and environments", ("batching", "environments")),
    ("engines", ("training", "generation")),
    ("joining and driving the engines", ("weight_sync", "convert", "data")),
    ("evaluation", ("evaluation",)),
    ("the loop and the recipe", ("orchestration",)),
    ("quick start", ("quickstart",)),
    ("entry points", ("cli",)),
    ("python api", ("api",)),
    ("python -m megatron_rl", ("__main__",)),
)

LAYER_OF: dict[str, int] = {part: i for i, (_, parts) in enumerate(LAYERS) for part in parts}


def part_of(module: str) -> str:
    """The part a module of megatron_rl belongs to: ``megatron_rl.training.trainer`` ->
    ``training``; the package root -> ``""``."""
    names = module.split(".")
    if names[0] != "megatron_rl":
        raise ValueError(f"not a module of megatron_rl: {module}")
    return names[1] if len(names) > 1 else ""


def check_import(importer: str, imported: str) -> str | None:
    """None if ``importer`` may import ``imported`` (both modules of megatron_rl), else why not."""
    if importer == "megatron_rl" and imported == "megatron_rl.api":
        return None  # the root's lazy re-export of the Python API (see the module docstring)
    if imported == "megatron_rl" and importer != "megatron_rl":
        return "names come from the module that defines them, not the package root (it re-exports the api)"
    a, b = part_of(importer), part_of(imported)
    if a == b:
        return None
    la, lb = LAYER_OF.get(a), LAYER_OF.get(b)
    if la is None or lb is None:
        return f"{a if la is None else b!r} has no layer in megatron_rl/layers.py"
    if lb < la:
        return None
    where = "the same layer" if lb == la else "a higher layer"
    return f"{b} is in {where} ({LAYERS[lb][0]}) than {a} ({LAYERS[la][0]})"
