"""Write what we rely on in SGLang and sglang-router, read from their source, as a JSON fixture.

    python tools/sglang_fixture.py [--sglang .cache/sglang-0.5.23/sglang] [--router PATH]
                                   [--out tests/generation/fixtures/sglang-0.5.23.json]

The fixture holds, for the pinned releases (``generation/protocol.py`` ``SGLANG_VERSION`` and
``ROUTER_VERSION``):

- ``routes``: every HTTP route of SGLang's server (``srt/entrypoints/http_server.py``) with its
  methods;
- ``server_flags``: every ``python -m sglang.launch_server`` flag (SGLang builds them from the
  annotated fields of ``srt/arg_groups/fields/*.py``: ``--field-name``, or ``Arg(cli_name=...)``,
  plus ``Arg(aliases=[...])``, plus the ``add_argument`` calls of ``srt/server_args.py``);
- ``router_flags`` and ``router_defaults``: the flags of ``python -m sglang_router.launch_router``
  (``router_args.py``, ``f"--{prefix}name"`` with an empty prefix) and the defaults of the
  ``RouterArgs`` fields we set;
- ``facts``: lines of SGLang's source our code depends on (how a server's workers join the
  weight-update group, the refusal of data-parallel replicas), each ``true`` when present;
- ``moe_loaders``: for each MoE family, the names SGLang's model loader reads a synced expert
  under (``make_expert_params_mapping``'s ``ckpt_*_proj_name`` keywords, and the decoder layer's
  attribute holding the sparse block, whose name is the tensors' prefix).

``tests/generation/test_sglang_pins.py`` checks our routes, payload routes, launch flags and
scripts against this file (no SGLang needed), and, where the sources are on the machine
(``make install`` puts both there), that regenerating it gives the committed file.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_rl.generation.protocol import ROUTER_VERSION, SGLANG_VERSION  # noqa: E402

DEFAULT_SGLANG = REPO / ".cache" / f"sglang-{SGLANG_VERSION}" / "sglang"
DEFAULT_OUT = REPO / "tests" / "generation" / "fixtures" / f"sglang-{SGLANG_VERSION}.json"

#: RouterArgs fields whose defaults matter to us (the launch scripts set or rely on them).
ROUTER_FIELDS = ("request_timeout_secs", "host", "api_key", "policy")

#: Source lines whose presence our code relies on: (name, file under sglang/, the line's text).
FACTS = (
    (
        "update_group_rank_is_rank_offset_plus_tp_rank",
        "srt/model_executor/model_runner_components/weight_updater.py",
        "rank = rank_offset + self.tp_rank",
    ),
    (
        "distributed_update_refuses_dp_replicas",
        "srt/managers/tokenizer_control_mixin.py",
        '"data-parallel replicas are not supported for update weights from distributed"',
    ),
    (
        "flush_cache_needs_idle_scheduler",
        "srt/managers/scheduler.py",
        "if self.is_fully_idle(ignore_waiting=self._engine_paused):",
    ),
    (  # a Mistral3 update's language_model.* names reach the language model's own loader
        "mistral3_is_llava_for_conditional_generation",
        "srt/models/mistral.py",
        "class Mistral3ForConditionalGeneration(LlavaForConditionalGeneration):",
    ),
    (
        "llava_routes_language_model_prefix_to_its_loader",
        "srt/models/llava.py",
        'for part in ("language_model", "vision_tower"):',
    ),
    (  # FUSED_IN_ONE_LOAD: the two halves wait in a dict that lives for one load_weights call
        "deepseek_fuses_q_a_and_kv_a_within_one_load",
        "srt/models/deepseek_common/deepseek_weight_loader.py",
        "cached_a_proj = {} if fuse_qkv_a_proj else None",
    ),
    (
        "sampling_seed_read_only_when_deterministic",
        "srt/sampling/sampling_batch_info.py",
        "enable_deterministic = get_exec().deterministic.enable_deterministic_inference",
    ),
)


#: MoE family -> its SGLang model file (under sglang/), whose loader reads our synced experts.
MOE_LOADERS = {"qwen3_moe": "srt/models/qwen3_moe.py", "mixtral": "srt/models/mixtral.py"}


def moe_loader(model_file: Path) -> dict[str, str]:
    """``{"block": <sparse block attribute>, "gate"/"up"/"down": <checkpoint name>}`` of one
    SGLang MoE model: the keywords of its ``make_expert_params_mapping`` call, and the ``self.X``
    assigned a ``...MoE(...)`` / ``...SparseMoeBlock(...)`` in its decoder layer."""
    out: dict[str, str] = {}
    for node in ast.walk(ast.parse(model_file.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "make_expert_params_mapping":
            for kw in node.keywords:
                if kw.arg and kw.arg.startswith("ckpt_") and (c := _const_str(kw.value)):
                    out[kw.arg.removeprefix("ckpt_").removesuffix("_proj_name")] = c
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and node.value.func.id.endswith(("MoE", "SparseMoeBlock"))
            and isinstance(target := node.targets[0], ast.Attribute)
            and getattr(target.value, "id", "") == "self"
        ):
            out["block"] = target.attr
    return dict(sorted(out.items()))


def _const_str(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def routes(http_server: Path) -> dict[str, list[str]]:
    """``{path: [methods]}`` of the ``@app.get/post/api_route`` decorators of the server."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(http_server.read_text(encoding="utf-8"))):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in node.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)):
                continue
            if not (isinstance(dec.func.value, ast.Name) and dec.func.value.id == "app"):
                continue
            path = _const_str(dec.args[0]) if dec.args else None
            if path is None:
                continue
            kind = dec.func.attr
            if kind in ("get", "post", "put", "delete"):
                methods = {kind.upper()}
            elif kind == "api_route":
                methods = set()
                for kw in dec.keywords:
                    if kw.arg == "methods" and isinstance(kw.value, (ast.List, ast.Tuple)):
                        methods = {m for e in kw.value.elts if (m := _const_str(e))}
            else:
                continue
            out.setdefault(path, set()).update(methods)
    return {p: sorted(m) for p, m in sorted(out.items())}


def _arg_call(annotation: ast.AST) -> ast.Call | None:
    """The ``Arg(...)`` inside ``A[type, Arg(...)]``, if any."""
    if isinstance(annotation, ast.Subscript) and isinstance(annotation.slice, ast.Tuple):
        for e in annotation.slice.elts:
            if isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id == "Arg":
                return e
    return None


def server_flags(sglang: Path) -> list[str]:
    """Every flag of ``sglang.launch_server``, as SGLang's ``add_cli_args_from_dataclass`` and
    ``ServerArgs.add_cli_args`` make them."""
    flags: set[str] = set()
    for path in sorted((sglang / "srt" / "arg_groups" / "fields").glob("*.py")):
        for cls in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(cls, ast.ClassDef):
                continue
            for stmt in cls.body:
                if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                    continue
                if not (
                    isinstance(stmt.annotation, ast.Subscript)
                    and getattr(stmt.annotation.value, "id", "") == "A"
                ):
                    continue
                name = "--" + stmt.target.id.replace("_", "-")
                call = _arg_call(stmt.annotation)
                if call is not None:
                    for kw in call.keywords:
                        if kw.arg == "cli_name" and (c := _const_str(kw.value)):
                            name = c
                        if kw.arg == "aliases" and isinstance(kw.value, (ast.List, ast.Tuple)):
                            flags.update(a for e in kw.value.elts if (a := _const_str(e)))
                flags.add(name)
    for node in ast.walk(ast.parse((sglang / "srt" / "server_args.py").read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            flags.update(c for a in node.args if (c := _const_str(a)) and c.startswith("--"))
    return sorted(flags)


def _flag_of(node: ast.AST) -> str | None:
    """``"--x"`` or ``f"--{prefix}x"`` (with an empty prefix) as a flag."""
    if (c := _const_str(node)) is not None:
        return c if c.startswith("--") else None
    if isinstance(node, ast.JoinedStr):
        text = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
        return text if text.startswith("--") else None
    return None


def router_facts(router: Path) -> tuple[list[str], dict[str, object]]:
    """The flags of ``sglang_router.launch_router`` and the defaults of :data:`ROUTER_FIELDS`."""
    tree = ast.parse((router / "router_args.py").read_text(encoding="utf-8"))
    flags: set[str] = set()
    defaults: dict[str, object] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            flags.update(f for a in node.args if (f := _flag_of(a)))
        if isinstance(node, ast.ClassDef) and node.name == "RouterArgs":
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    if stmt.target.id in ROUTER_FIELDS and stmt.value is not None:
                        defaults[stmt.target.id] = ast.literal_eval(stmt.value)
    return sorted(flags), dict(sorted(defaults.items()))


def build(sglang: Path, router: Path) -> dict[str, object]:
    """The fixture's content, read from the two source trees."""
    version = (sglang / "_version.py").read_text(encoding="utf-8")
    router_version = (router / "version.py").read_text(encoding="utf-8")
    if f"'{SGLANG_VERSION}'" not in version and f'"{SGLANG_VERSION}"' not in version:
        raise SystemExit(f"{sglang}: not SGLang {SGLANG_VERSION} ({version.strip()})")
    if f'"{ROUTER_VERSION}"' not in router_version:
        raise SystemExit(f"{router}: not sglang-router {ROUTER_VERSION} ({router_version.strip()})")
    rflags, rdefaults = router_facts(router)
    return {
        "sglang_version": SGLANG_VERSION,
        "router_version": ROUTER_VERSION,
        "routes": routes(sglang / "srt" / "entrypoints" / "http_server.py"),
        "server_flags": server_flags(sglang),
        "router_flags": rflags,
        "router_defaults": rdefaults,
        "facts": {name: text in (sglang / rel).read_text(encoding="utf-8") for name, rel, text in FACTS},
        "moe_loaders": {family: moe_loader(sglang / rel) for family, rel in MOE_LOADERS.items()},
    }


def default_router_source() -> Path | None:
    """The installed ``sglang_router`` package folder (the ``router`` extra), if any."""
    import importlib.util  # lazy: only this lookup needs it

    spec = importlib.util.find_spec("sglang_router")
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sglang", type=Path, default=DEFAULT_SGLANG, help="the sglang package folder")
    ap.add_argument("--router", type=Path, default=None, help="the sglang_router package folder")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    router = args.router or default_router_source()
    if router is None or not args.sglang.is_dir():
        print(
            f"need SGLang's source at {args.sglang} (make install) and sglang-router installed "
            "(pip install -e '.[router]')",
            file=sys.stderr,
        )
        return 2
    data = build(args.sglang, router)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(
        f"wrote {args.out}: {len(data['routes'])} routes, {len(data['server_flags'])} server flags, "
        f"{len(data['router_flags'])} router flags, facts {data['facts']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
