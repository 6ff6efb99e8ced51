"""The ``megatron-rl`` command.

    megatron-rl bench collation            # benchmark programs under tools/ (bench_NAME.py)
    megatron-rl config RECIPE.yaml [k=v]   # resolve and check a recipe, print it as YAML
    megatron-rl config --reference         # every recipe field: type, default, meaning, checks
    megatron-rl train RECIPE.yaml          # the RL loop (docs/loop.md)
    megatron-rl ablate async --out DIR     # what asynchrony costs: sync vs async arms over seeds
    megatron-rl sglang-args server|router RECIPE.yaml   # SGLang launch flags the recipe implies
    megatron-rl verifier-server --workers 64 --host 0.0.0.0   # score for orchestrators elsewhere

Also runnable as ``python -m megatron_rl``. Every verb runs behind one error path
(:mod:`megatron_rl.errors`): a mistake in what you give it is one line on stderr and an exit code
of its kind (2 argument or recipe, 3 input file, 4 output refused, 5 resource, 1 run stopped);
``--debug`` shows the stack.
"""

from __future__ import annotations

import argparse
import importlib
import os
import runpy
import sys
from pathlib import Path

import yaml

from megatron_rl.errors import ArgumentParser, UsageError, run_cli

# Verbs implemented by a module's ``main(argv) -> int``, which parses its own arguments.
_PASSTHROUGH = {
    "quickstart": (
        "megatron_rl.quickstart.pipeline",
        "the CPU quick start: SFT warm-up of a tiny model (or --model smollm2: a real one), then GRPO, pass@1 and plots",
    ),
    "train": ("megatron_rl.orchestration.run", "run the GRPO loop (async or sync) from a YAML recipe"),
    "curate": (
        "megatron_rl.cli.curate",
        "curate problem sets: math format, difficulty, code tests, SFT traces, translation marks",
    ),
    "eval": ("megatron_rl.cli.evaluate", "pass@k / maj@k evaluation with a JSON + Markdown report and plots"),
    "ablate": (
        "megatron_rl.cli.ablate",
        "what asynchrony costs: sync vs async arms, Figure 6b, decoupled PPO, over seeds (ablate async)",
    ),
    "serve-engine": (
        "megatron_rl.generation.engine.server",
        "serve an HF model with the built-in engine (SGLang API subset)",
    ),
}

TOOLS_DIR = Path(__file__).resolve().parents[2] / "tools"


def _benchmarks() -> dict[str, Path]:
    # tools/bench_train_step.py is `megatron-rl bench train-step`.
    return {p.stem[len("bench_") :].replace("_", "-"): p for p in sorted(TOOLS_DIR.glob("bench_*.py"))}


def _bench(args: argparse.Namespace) -> int:
    benches = _benchmarks()
    if not TOOLS_DIR.is_dir():
        print(
            f"megatron-rl bench: no tools/ folder next to the package ({TOOLS_DIR}); benchmarks run "
            "from a source checkout (pip install -e .)",
            file=sys.stderr,
        )
        return 2
    args.name = args.name.replace("_", "-")
    if args.name not in benches:
        print(
            f"megatron-rl bench: unknown benchmark {args.name!r}; available: {', '.join(benches)}",
            file=sys.stderr,
        )
        return 2
    sys.argv = [str(benches[args.name]), *args.args]
    if str(TOOLS_DIR) not in sys.path:  # as `python tools/bench_x.py` has it: tools/ imports its own
        sys.path.insert(0, str(TOOLS_DIR))
    try:
        runpy.run_path(str(benches[args.name]), run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, str):  # sys.exit("message"): show it, as the interpreter would
            print(e.code, file=sys.stderr)
            return 1
        return int(e.code or 0)
    return 0


def _config(args: argparse.Namespace) -> int:
    if args.reference:
        if args.recipe or args.overrides:
            raise UsageError("--reference takes no recipe or overrides: it documents every field")
        from megatron_rl.cli.config_reference import reference_markdown  # lazy: the recipe imports torch

        print(reference_markdown(), end="")
        return 0
    from megatron_rl.config import (  # lazy: each verb imports only what it runs, so --help stays quick
        config_to_dict,
    )
    from megatron_rl.orchestration.recipe import (
        load_config,  # lazy: the recipe imports torch; the parser must not
    )

    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe and not os.path.exists(recipe):
        # `megatron-rl config fleet.urls=[...]`: overrides of the defaults, not a recipe file.
        recipe, overrides = None, [recipe, *overrides]
    cfg = load_config(recipe, overrides, paths=args.check_paths)  # ConfigError: one line, exit 2
    print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
    return 0


def _sglang_args(args: argparse.Namespace) -> int:
    """Print the SGLang server (or sglang-router) flags that follow from a recipe, as shell
    words, for launch scripts: ``python -m sglang.launch_server ... $(megatron-rl sglang-args
    server R.yaml)``."""
    import shlex  # lazy: each verb imports only what it runs

    from megatron_rl.generation.protocol import router_launch_args, server_launch_args  # lazy: as above
    from megatron_rl.orchestration.recipe import load_config  # lazy: the recipe imports torch

    cfg = load_config(args.recipe, args.overrides)  # ConfigError: one line, exit 2
    if args.target == "router":
        words = router_launch_args(request_timeout_s=cfg.fleet.request_timeout_s)
    else:
        words = server_launch_args(
            deterministic=cfg.fleet.deterministic, routed_experts=cfg.algorithm.routing_replay == "rollout"
        )
    print(shlex.join(words))
    return 0


def _passthrough(module: str):
    def run(args: argparse.Namespace) -> int:

        return int(importlib.import_module(module).main(args.args) or 0)

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="megatron-rl", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    b = sub.add_parser("bench", help="run a benchmark program from tools/ (bench_NAME.py)")
    b.add_argument("name", help=f"one of: {', '.join(_benchmarks()) or '(none found)'}")
    b.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    b.set_defaults(func=_bench)
    c = sub.add_parser("config", help="resolve and validate a recipe, print it as YAML")
    c.add_argument("recipe", nargs="?", help="YAML recipe (defaults only when omitted)")
    c.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algorithm.eps_high=0.3")
    c.add_argument(
        "--check-paths",
        action="store_true",
        help="also check that every path the recipe names exists (train always does)",
    )
    c.add_argument(
        "--reference",
        action="store_true",
        help="print every recipe field (type, default, meaning, checks) as Markdown: docs/config.md",
    )
    c.set_defaults(func=_config)
    g = sub.add_parser("sglang-args", help="print the SGLang server or router flags a recipe implies")
    g.add_argument(
        "target",
        choices=("server", "router"),
        help="server: python -m sglang.launch_server; router: python -m sglang_router.launch_router",
    )
    g.add_argument("recipe", help="YAML recipe")
    g.add_argument("overrides", nargs="*", help="dotted overrides, e.g. fleet.deterministic=true")
    g.set_defaults(func=_sglang_args)
    from megatron_rl.cli.reward import (
        build_parser as reward_parser,  # lazy: each verb imports only what it runs, so --help stays quick
    )
    from megatron_rl.convert.cli import (
        build_parser as convert_parser,  # lazy: each verb imports only what it runs, so --help stays quick
    )

    convert_parser(
        sub.add_parser(
            "convert",
            help="convert checkpoints between Hugging Face and Megatron-Core (hf-to-mcore, mcore-to-hf)",
        )
    )
    reward_parser(
        sub.add_parser("reward", help="score a JSONL of completions (format, math, code, length, language)")
    )
    from megatron_rl.cli.verifier_server import (
        build_parser as verifier_server_parser,  # lazy: each verb imports only what it runs
    )

    verifier_server_parser(
        sub.add_parser(
            "verifier-server",
            help="serve a verifier pool over HTTP to orchestrators on other nodes (reward.remote)",
        )
    )
    for verb, (module, text) in _PASSTHROUGH.items():
        p = sub.add_parser(verb, help=text, add_help=False)
        p.add_argument("args", nargs=argparse.REMAINDER)
        p.set_defaults(func=_passthrough(module))
    return parser


def _main(argv: list[str]) -> int:
    if argv and argv[0] in _PASSTHROUGH:  # argparse's REMAINDER would swallow "--flag" badly
        return _passthrough(_PASSTHROUGH[argv[0]][0])(argparse.Namespace(args=argv[1:]))
    args = build_parser().parse_args(argv)
    return args.func(args)


def main(argv: list[str] | None = None) -> int:
    """The console script: every verb runs behind the one error path (:func:`run_cli`): an input
    mistake is one line naming what is wrong and an exit code of its kind; ``--debug`` anywhere
    shows the stack."""
    argv = sys.argv[1:] if argv is None else list(argv)
    words = [a for a in argv if not a.startswith("-")][:2]
    if words[:1] != ["curate"]:  # curate's next word is one of its tools
        words = words[:1]
    prog = " ".join(["megatron-rl", *words])
    return run_cli(prog, _main, argv)


if __name__ == "__main__":
    sys.exit(main())
