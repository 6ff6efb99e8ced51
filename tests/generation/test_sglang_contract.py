"""Our SGLang client (``generation/protocol.py``) against the pinned SGLang release's own source.

SGLang parses request bodies with pydantic set to ignore unknown keys, so a misspelt key (a seed,
``flush_cache``, a load format) is dropped without an error and the server silently does something
else. These tests read the pinned wheel's source (``make install`` puts it in
``.cache/sglang-<SGLANG_VERSION>``; it needs a GPU to import, so nothing imports it) and check:

- every route in ``ROUTES`` is registered with that HTTP method, and the class its handler parses;
- every key of every payload we build is a field of that class (``sampling_params`` keys: of
  ``SamplingParams``), with a value its annotation admits, and every required field is sent;
- the ``/generate`` body passes SGLang's generated JSON contract gate, run as is;
- the reply keys we read are the ones SGLang writes; replies built with SGLang's own functions
  (finish reasons, log-prob triples, weight-version spans) read back correctly;
- our flattened bucket is the byte layout of SGLang's ``FlattenedTensorBucket``, run as is.

Pure-Python pieces of SGLang are run by compiling just those definitions (or the whole file when it
imports only torch / msgspec) with a stand-in for ``msgspec.Struct``.
"""

from __future__ import annotations
import __future__

import ast
import dataclasses
import difflib
import functools
import importlib.util
import json
import os
import random
import re
import sys
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Union
from unittest import mock

import pytest
import torch

from megatron_rl.generation.api import GenRequest
from megatron_rl.generation.protocol import (
    MEMORY_TAGS,
    ROUTES,
    SGLANG_VERSION,
    abort_payload,
    bucket_layout,
    generate_batch_payload,
    generate_payload,
    init_group_payload,
    memory_payload,
    pack_bucket,
    parse_generate,
    pause_payload,
    unpack_bucket,
    update_weights_from_tensor_payload,
    update_weights_payload,
    versions_per_token,
    weights_checker_payload,
)

REPO = Path(__file__).resolve().parents[2]
IO_STRUCT = "srt/managers/io_struct.py"
SAMPLING = "srt/sampling/sampling_params.py"


# ---------------------------------------------------------------------------- the source


class _Source:
    """The ``sglang`` package folder of the pinned wheel; files parsed once."""

    def __init__(self, pkg: Path):
        self.pkg = pkg

    def path(self, rel: str) -> Path:
        return self.pkg / rel

    def text(self, rel: str) -> str:
        return self.path(rel).read_text(encoding="utf-8")

    @functools.cache
    def tree(self, rel: str) -> ast.Module:
        return ast.parse(self.text(rel), filename=str(self.path(rel)))


@pytest.fixture(scope="module")
def src() -> _Source:
    v = SGLANG_VERSION
    root = os.environ.get("MEGATRON_RL_SGLANG_SRC") or REPO / ".cache" / f"sglang-{v}"
    pkg = Path(root) / "sglang"
    if not (pkg / IO_STRUCT).is_file():
        pytest.fail(
            f"SGLang {v}'s source is not at {pkg}: run `make install` (it runs `pip "
            f"install --no-deps --target .cache/sglang-{v} sglang=={v}`), or set "
            "MEGATRON_RL_SGLANG_SRC to a folder that holds sglang/",
            pytrace=False,
        )
    return _Source(pkg)


def _msgspec_stub() -> types.ModuleType:
    """``msgspec`` with just ``Struct``: keyword construction, class attributes as defaults.

    The SGLang code run here only builds structs and reads their attributes; a stand-in keeps the
    test independent of whether (and which) msgspec is installed."""

    class Struct:
        def __init_subclass__(cls, **options):  # tag=, frozen=, kw_only=, array_like=
            super().__init_subclass__()

        def __init__(self, **fields):
            for k, v in fields.items():
                object.__setattr__(self, k, v)

    stub = types.ModuleType("msgspec")
    stub.Struct = Struct
    return stub


def _load_defs(src: _Source, rel: str, names: Iterable[str], **env) -> dict:
    """Compile only the named top-level definitions of a file (``Class.method`` for a method)."""
    body = {}
    for node in src.tree(rel).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            body[node.name] = node
            for sub in node.body if isinstance(node, ast.ClassDef) else ():
                if isinstance(sub, ast.FunctionDef):
                    body[f"{node.name}.{sub.name}"] = sub
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            body[node.targets[0].id] = node
    missing = [n for n in names if n not in body]
    assert not missing, f"{rel}: SGLang no longer defines {missing}"
    code = compile(
        ast.Module(body=[body[n] for n in names], type_ignores=[]),
        str(src.path(rel)),
        "exec",
        dont_inherit=True,
        flags=__future__.annotations.compiler_flag,
    )
    module = types.ModuleType(f"_sglang_{Path(rel).stem}")
    module.__dict__.update(env)
    with mock.patch.dict(sys.modules, {module.__name__: module}):  # dataclasses look it up
        exec(code, module.__dict__)
    return module.__dict__


def _load_module(src: _Source, rel: str) -> types.ModuleType:
    """Run a whole SGLang file that imports nothing of SGLang (under a private module name)."""
    spec = importlib.util.spec_from_file_location(f"_sglang_{Path(rel).stem}", src.path(rel))
    module = importlib.util.module_from_spec(spec)
    with mock.patch.dict(sys.modules, {"msgspec": _msgspec_stub()}):
        spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def api(src) -> types.ModuleType:
    """SGLang's generated HTTP JSON types and codecs (``sglang/api/v1/api_types.py``)."""
    return _load_module(src, "api/v1/api_types.py")


def _release(src: _Source) -> str | None:
    # version.py re-exports __version__ from the generated _version.py (else a dev fallback).
    for rel in ("_version.py", "version.py"):
        if not src.path(rel).is_file():
            continue
        for node in ast.walk(src.tree(rel)):
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant)
                and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)
            ):
                return node.value.value
    return None


# ---------------------------------------------------------------------------- the checkers


def _routes(tree: ast.Module) -> dict[str, tuple[set[str], str | None]]:
    """path -> (HTTP methods, class of the handler's ``obj`` body) for each ``@app`` route
    registered unconditionally (at module level) with a literal path."""
    verbs = {"get", "post", "put", "delete", "patch", "head"}
    out: dict[str, tuple[set[str], str | None]] = {}
    for fn in tree.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in fn.decorator_list:
            if not (
                isinstance(dec, ast.Call)
                and isinstance(dec.func, ast.Attribute)
                and isinstance(dec.func.value, ast.Name)
                and dec.func.value.id == "app"
                and dec.args
                and isinstance(dec.args[0], ast.Constant)
            ):
                continue
            verb, kw = dec.func.attr, {k.arg: k.value for k in dec.keywords}
            if verb == "api_route":  # FastAPI's default is GET
                methods = set(ast.literal_eval(kw["methods"])) if "methods" in kw else {"GET"}
            elif verb in verbs:
                methods = {verb.upper()}
            else:
                continue
            known, _ = out.get(dec.args[0].value, (set(), None))
            out[dec.args[0].value] = (known | methods, _body_class(fn))
    return out


def _body_class(fn: ast.AsyncFunctionDef | ast.FunctionDef) -> str | None:
    """``obj: X``, ``obj: Annotated[X, Body()]`` or ``Annotated[Optional[X], Body()]`` -> ``"X"``."""
    for arg in fn.args.args:
        if arg.arg == "obj" and arg.annotation is not None:
            ann = arg.annotation
            if isinstance(ann, ast.Subscript) and getattr(ann.value, "id", "") == "Annotated":
                ann = ann.slice.elts[0]
            if isinstance(ann, ast.Subscript) and getattr(ann.value, "id", "") == "Optional":
                ann = ann.slice
            return getattr(ann, "id", None)
    return None


def _route_errors(ours: dict[str, str], theirs: dict[str, tuple[set[str], str | None]]) -> list[str]:
    errors = []
    for route, method in ours.items():
        if route not in theirs:
            errors.append(f"{route}: SGLang {SGLANG_VERSION} registers no such route")
        elif method not in theirs[route][0]:
            errors.append(f"{route}: SGLang accepts {sorted(theirs[route][0])}, we send {method}")
    return errors


@dataclasses.dataclass(frozen=True)
class _Field:
    annotation: ast.expr
    required: bool  # no default: pydantic answers 422 without it


def _class_fields(tree: ast.Module, name: str) -> dict[str, _Field]:
    """Annotated class-level names of a class, inherited ones (same module) first."""
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    assert name in classes, f"SGLang no longer defines {name}"
    fields: dict[str, _Field] = {}
    for base in classes[name].bases:
        if isinstance(base, ast.Name) and base.id in classes:
            fields.update(_class_fields(tree, base.id))
    for stmt in classes[name].body:
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and "ClassVar" not in ast.unparse(stmt.annotation)
        ):
            fields[stmt.target.id] = _Field(stmt.annotation, _no_default(stmt.value))
    return fields


def _no_default(value: ast.expr | None) -> bool:
    if value is None:
        return True
    if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "field":
        return not {k.arg for k in value.keywords} & {"default", "default_factory"}
    return False


_SCALARS = {
    "str": (str,),
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "dict": (dict,),
    "list": (list,),
}


def _admits(ann: ast.expr, v: Any) -> bool:
    """Whether a JSON value fits a type annotation; names it cannot judge are admitted."""
    if isinstance(ann, ast.Constant):
        return v is None if ann.value is None else True
    if isinstance(ann, ast.BinOp):  # X | Y
        return _admits(ann.left, v) or _admits(ann.right, v)
    if isinstance(ann, (ast.Name, ast.Attribute)):
        name = getattr(ann, "id", None) or ann.attr
        if name not in _SCALARS:
            return True
        return isinstance(v, _SCALARS[name]) and (name == "bool" or not isinstance(v, bool))
    if not isinstance(ann, ast.Subscript):
        return True
    base = getattr(ann.value, "id", None) or getattr(ann.value, "attr", "")
    args = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
    if base == "Optional":
        return v is None or _admits(args[0], v)
    if base == "Union":
        return any(_admits(a, v) for a in args)
    if base == "Annotated":
        return _admits(args[0], v)
    if base == "Literal":
        return v in [ast.literal_eval(a) for a in args]
    if base in ("List", "list", "Set", "set", "Sequence"):  # JSON arrays
        return isinstance(v, list) and all(_admits(args[0], x) for x in v)
    if base in ("Dict", "dict", "Mapping"):
        return isinstance(v, dict)
    return True


def _payload_errors(payload: dict, fields: dict[str, _Field], where: str) -> list[str]:
    errors = []
    for key, value in payload.items():
        if key not in fields:
            near = difflib.get_close_matches(key, fields, n=1)
            errors.append(
                f"{where}: SGLang has no field {key!r}, it would be silently ignored"
                + (f" (did you mean {near[0]!r}?)" if near else "")
            )
        elif not _admits(fields[key].annotation, value):
            errors.append(f"{where}.{key}: {value!r} does not fit {ast.unparse(fields[key].annotation)}")
    errors += [
        f"{where}: required field {k!r} not sent"
        for k, f in fields.items()
        if f.required and k not in payload
    ]
    return errors


def _contract_errors(src: _Source, route: str, cls: str, payload: dict) -> list[str]:
    """Everything wrong with one request body against its SGLang request class."""
    errors = _payload_errors(payload, _class_fields(src.tree(IO_STRUCT), cls), f"{route} {cls}")
    if isinstance(payload.get("sampling_params"), dict):
        errors += _payload_errors(
            payload["sampling_params"],
            _class_fields(src.tree(SAMPLING), "SamplingParams"),
            f"{route} sampling_params",
        )
    return errors


# ---------------------------------------------------------------------------- what we send


def _gen_request(**over) -> GenRequest:
    args = dict(
        request_id="rollout-7-3",
        input_ids=[151644, 872, 198],
        max_new_tokens=512,
        temperature=0.7,
        top_p=0.95,
        seed=1234,
        stop_token_ids=(151645, 151643),
    )
    return GenRequest(**{**args, **over})


def _update_payload(**over) -> dict:
    names, dtypes, shapes, _ = pack_bucket(
        [
            ("model.embed_tokens.weight", torch.zeros(8, 4)),
            ("model.norm.weight", torch.zeros(4, dtype=torch.bfloat16)),
        ]
    )
    return update_weights_payload(
        **{
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": "megatron_rl",
            "weight_version": 12,
            **over,
        }
    )


def _cases() -> list[tuple[str, str, dict]]:
    """(route, SGLang class its handler parses, body) for every body the client sends."""
    gen = _gen_request()
    return [
        ("/generate", "GenerateReqInput", generate_payload(gen)),
        ("/generate", "GenerateReqInput", generate_payload(_gen_request(seed=None, stop_token_ids=()))),
        # A group in one request (fleet.group_requests): SGLang's batch form.
        (
            "/generate",
            "GenerateReqInput",
            generate_batch_payload([_gen_request(request_id=f"g.{i}", seed=i) for i in range(4)]),
        ),
        # MoE routing replay: every position's experts, for one request and for a group.
        ("/generate", "GenerateReqInput", generate_payload(_gen_request(return_routed_experts=True))),
        (
            "/generate",
            "GenerateReqInput",
            generate_batch_payload(
                [_gen_request(request_id=f"r.{i}", return_routed_experts=True) for i in range(2)]
            ),
        ),
        *[
            ("/pause_generation", "PauseGenerationReqInput", pause_payload(m))
            for m in ("in_place", "abort", "retract")
        ],
        (
            "/init_weights_update_group",
            "InitWeightsUpdateGroupReqInput",
            init_group_payload(
                master_address="10.0.0.1",
                master_port=29600,
                rank_offset=1,
                world_size=3,
                group_name="megatron_rl",
                backend="nccl",
            ),
        ),
        ("/update_weights_from_distributed", "UpdateWeightsFromDistributedReqInput", _update_payload()),
        (
            "/update_weights_from_distributed",
            "UpdateWeightsFromDistributedReqInput",
            _update_payload(flattened_bucket=False),
        ),
        ("/abort_request", "AbortReq", abort_payload(gen.request_id)),
        ("/abort_request", "AbortReq", abort_payload()),
        # Bodies the client writes inline (client.py, weight_sync): they must need no field.
        ("/continue_generation", "ContinueGenerationReqInput", {}),
        ("/begin_weight_update", "BeginWeightUpdateReqInput", {}),
        ("/end_weight_update", "EndWeightUpdateReqInput", {}),
        ("/destroy_weights_update_group", "DestroyWeightsUpdateGroupReqInput", {"group_name": "megatron_rl"}),
        ("/weights_checker", "CheckWeightsReqInput", weights_checker_payload()),
        # Colocated mode (weight_sync/colocated.py).
        ("/release_memory_occupation", "ReleaseMemoryOccupationReqInput", memory_payload()),
        ("/release_memory_occupation", "ReleaseMemoryOccupationReqInput", memory_payload(MEMORY_TAGS)),
        ("/resume_memory_occupation", "ResumeMemoryOccupationReqInput", memory_payload(["weights"])),
        (
            "/update_weights_from_tensor",
            "UpdateWeightsFromTensorReqInput",
            update_weights_from_tensor_payload(["c2VyaWFsaXplZA=="], weight_version=3),
        ),
    ]


# POST routes the client calls without a body (their SGLang handlers parse none).
BODYLESS = {"/flush_cache"}


def _json(x):
    return json.loads(json.dumps(x))  # what the server receives


# ---------------------------------------------------------------------------- tests


def test_pinned_release(src):
    assert _release(src) == SGLANG_VERSION, f"{src.pkg} is not SGLang {SGLANG_VERSION}"
    make = re.search(r"^SGLANG_VERSION\s*\?=\s*(\S+)", (REPO / "Makefile").read_text(), re.M)
    assert make and make.group(1) == SGLANG_VERSION, "Makefile SGLANG_VERSION != protocol's"


def test_routes_exist_with_our_methods(src):
    errors = _route_errors(ROUTES, _routes(src.tree("srt/entrypoints/http_server.py")))
    assert not errors, "\n".join(errors)


def test_each_body_is_checked_against_the_class_its_route_parses(src):
    routes = _routes(src.tree("srt/entrypoints/http_server.py"))
    for route, cls, _ in _cases():
        assert routes[route][1] == cls, f"{route} parses {routes[route][1]}, not {cls}"
    for route in BODYLESS:
        assert routes[route][1] is None, f"{route} parses {routes[route][1]}: send it a body"
    posted = {r for r, m in ROUTES.items() if m == "POST"}
    assert posted == {r for r, _, _ in _cases()} | BODYLESS, "a POST route in ROUTES has no contract case"


def test_payloads_fit_sglang_request_classes(src):
    errors = [e for route, cls, body in _cases() for e in _contract_errors(src, route, cls, _json(body))]
    assert not errors, "\n".join(errors)


def test_generate_and_abort_pass_sglang_contract_gate(api):
    # /generate runs this generated decoder before anything else (entrypoints/api_contract.py);
    # it rejects unknown sampling_params keys and wrong JSON types.
    for route, _, body in _cases():
        if route == "/generate":
            api.GenerateRequest.from_json_value(_json(body))
        if route == "/abort_request":
            api.AbortRequest.from_json_value(_json(body))


def test_literal_values_we_send(src):
    modes = _class_fields(src.tree(IO_STRUCT), "PauseGenerationReqInput")["mode"].annotation
    assert pause_payload()["mode"] == "in_place"
    assert {"in_place", "abort", "retract"} <= {ast.literal_eval(a) for a in modes.slice.elts}
    # The updater branches on load_format where it receives a broadcast.
    handled = {
        cmp.comparators[0].value
        for fn in ast.walk(src.tree("srt/model_executor/model_runner_components/weight_updater.py"))
        if isinstance(fn, ast.FunctionDef) and "from_distributed" in fn.name
        for cmp in ast.walk(fn)
        if isinstance(cmp, ast.Compare)
        and getattr(cmp.left, "id", "") == "load_format"
        and isinstance(cmp.ops[0], ast.Eq)
        and isinstance(cmp.comparators[0], ast.Constant)
    }
    assert _update_payload()["load_format"] in handled, f"weight updater handles {handled}"


def _keys_written(tree: ast.AST, var: str) -> set[str]:
    """Constant keys stored into ``var``: ``var["k"] = ...``, ``var = {...}``,
    ``var.update({...})``."""
    keys = set()
    for node in ast.walk(tree):
        dicts = []
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if (
                    isinstance(t, ast.Subscript)
                    and getattr(t.value, "id", "") == var
                    and isinstance(t.slice, ast.Constant)
                ):
                    keys.add(t.slice.value)
                if isinstance(t, ast.Name) and t.id == var and isinstance(node.value, ast.Dict):
                    dicts.append(node.value)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "update"
            and getattr(node.func.value, "id", "") == var
            and node.args
            and isinstance(node.args[0], ast.Dict)
        ):
            dicts.append(node.args[0])
        keys |= {k.value for d in dicts for k in d.keys if isinstance(k, ast.Constant)}
    return keys


def test_reply_keys_we_read_are_written_by_sglang(src, api):
    tm = src.tree("srt/managers/tokenizer_manager.py")
    assert {"finish_reason", "weight_version", "output_token_logprobs", "routed_experts"} <= _keys_written(
        tm, "meta_info"
    )
    assert {"output_ids", "meta_info"} <= _keys_written(tm, "out_dict")
    assert {"weight_versions", "weight_version"} <= _keys_written(
        src.tree("srt/utils/weight_versions.py"), "meta_info"
    )
    init_info = next(
        n
        for n in ast.walk(src.tree("srt/managers/scheduler.py"))
        if isinstance(n, ast.FunctionDef) and n.name == "get_init_info"
    )
    assert "max_total_num_tokens" in _keys_written(init_info, "result_dict")
    # The schema both SGLang servers (Python and Rust) answer with.
    assert {"output_ids", "meta_info"} <= set(api.GenerateResponse.__annotations__)
    assert {"finish_reason", "output_token_logprobs", "weight_version", "weight_versions"} <= set(
        api.GenerateMetaInfo.__annotations__
    )
    assert {"version", "start", "end"} <= set(api.WeightVersionSpan.__annotations__)
    assert "max_total_num_tokens" in api.GetServerInfoResponse.__annotations__


@pytest.fixture(scope="module")
def sg(src) -> dict:
    """SGLang's own reply builders: finish reasons, log-prob triples, weight-version spans."""
    ns = _load_defs(
        src,
        "srt/managers/schedule_batch.py",
        ["BaseFinishReason", "FINISH_MATCHED_TOKEN", "FINISH_LENGTH", "FINISH_ABORT"],
    )
    ns.update(
        _load_defs(src, "srt/managers/tokenizer_manager.py", ["TokenizerManager.detokenize_logprob_tokens"])
    )
    ns.update(
        _load_defs(
            src,
            "srt/utils/weight_versions.py",
            [
                "WeightVersionSpan",
                "WeightVersionSpans",
                "WeightVersionEvent",
                "compute_weight_version_spans",
                "add_weight_versions_to_meta_info",
            ],
            msgspec=_msgspec_stub(),
            dataclasses=dataclasses,
            List=list,
            Dict=dict,
            Any=Any,
            Union=Union,
            msgspec_struct_pydantic_core_schema=None,
        )
    )
    return ns


def _sglang_meta(sg, n: int, events: list[tuple[str, int]], current: str, **meta) -> dict:
    """``meta_info["weight_versions"]`` as SGLang's scheduler + tokenizer manager write it."""
    ev = [sg["WeightVersionEvent"](old_version=v, num_output_tokens=k) for v, k in events]
    spans = sg["compute_weight_version_spans"](ev, current_version=current, num_output_tokens=n)
    sg["add_weight_versions_to_meta_info"](meta, spans, num_output_tokens=n)
    return meta


@pytest.mark.parametrize(
    "finish, reason",
    [("FINISH_MATCHED_TOKEN", "stop"), ("FINISH_LENGTH", "length"), ("FINISH_ABORT", "abort")],
)
def test_parse_generate_reads_a_reply_built_by_sglang(sg, api, finish, reason):
    req, ids, lps = _gen_request(), [17, 4, 151645, 9], [-0.25, -1.5, -0.125, -3.0]
    fr = {
        "FINISH_MATCHED_TOKEN": lambda c: c(matched=151645),
        "FINISH_LENGTH": lambda c: c(length=4),
        "FINISH_ABORT": lambda c: c(),
    }[finish](sg[finish])
    triples = sg["detokenize_logprob_tokens"](None, lps, ids, False)  # (logprob, id, None)
    meta = _sglang_meta(
        sg,
        len(ids),
        [("default", 1), ("3", 3)],
        "4",
        id=req.request_id,
        finish_reason=fr.to_json(),
        prompt_tokens=3,
        completion_tokens=len(ids),
        output_token_logprobs=triples,
    )
    body = _json({"text": "", "output_ids": ids, "meta_info": meta})
    api.GenerateResponse.from_json_value(body)  # a well-formed SGLang reply
    res = parse_generate(req, body, server="http://gen-0", initial_version=0)
    assert (res.token_ids, res.logprobs, res.finish_reason) == (ids, lps, reason)
    assert res.versions == [0, 3, 3, 4] and res.meta["weight_version"] == "4"


def test_versions_per_token_expands_sglang_spans(sg):
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(0, 12)
        # Each update records (version being replaced, tokens generated so far), if any.
        counts = sorted(rng.randint(1, n) for _ in range(rng.randint(0, 4))) if n else []
        versions = ["default", *map(str, range(1, len(counts) + 1))]
        events = list(zip(versions, counts))
        want = [
            next((int(v) if v.isdigit() else 0 for v, k in events if k > t), len(counts)) for t in range(n)
        ]
        meta = _json(_sglang_meta(sg, n, events, str(len(counts))))
        assert versions_per_token(meta["weight_versions"], n, initial_version=0) == want, events


@pytest.fixture(scope="module")
def bucket_cls(src):
    return _load_module(src, "srt/weight_sync/tensor_bucket.py").FlattenedTensorBucket


def _mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.norm.bias", torch.arange(3, dtype=torch.int8)),  # odd size first: unaligned
        ("model.embed_tokens.weight", torch.randn(5, 3, generator=g).bfloat16()),
        ("model.layers.0.mlp.fc.weight", torch.randn(4, 6, generator=g).t()),  # strided
        ("model.rotary.inv_freq", torch.rand(4, generator=g, dtype=torch.float64)),
        ("lm_head.bias", torch.randn(7, generator=g).half()),
        ("step", torch.tensor([3], dtype=torch.int64)),
        ("mask", torch.tensor([True, False, True])),
    ]


def test_bucket_matches_sglang_flattened_tensor_bucket(bucket_cls):
    tensors = _mixed_tensors()
    orig = dict(tensors)
    names, dtypes, shapes, flat = pack_bucket(tensors)
    body = _json(
        update_weights_payload(names=names, dtypes=dtypes, shapes=shapes, group_name="g", weight_version=1)
    )
    # Receiver: SGLang allocates from the metadata we post; the broadcast fills its uint8 tensor.
    bucket = bucket_cls.empty(body["names"], body["dtypes"], body["shapes"], "cpu")
    recv = bucket.get_flattened_tensor()
    assert recv.dtype == torch.uint8 and recv.shape == flat.shape
    recv.copy_(flat)
    rebuilt = bucket.reconstruct_tensors()
    assert [n for n, _ in rebuilt] == names and set(names) == set(orig)
    for name, t in rebuilt:
        assert t.dtype == orig[name].dtype and torch.equal(t, orig[name]), name
    # Sender: SGLang's own flattening of the same tensors in our order is our bytes and layout.
    theirs = bucket_cls(named_tensors=[(n, orig[n]) for n in names])
    assert torch.equal(theirs.get_flattened_tensor(), flat)
    spans = [(m.start_idx, m.end_idx) for m in theirs.get_metadata()]
    assert spans == bucket_layout(dtypes, shapes)[0]
    for name, t in unpack_bucket(names, dtypes, shapes, theirs.get_flattened_tensor()):
        assert torch.equal(t, orig[name]), name


def test_unaligned_bucket_is_refused_by_both(bucket_cls):
    with pytest.raises(ValueError, match="Unaligned"):
        bucket_cls.empty(["a", "b"], ["int8", "float32"], [[3], [2]], "cpu")
    with pytest.raises(ValueError, match="not aligned"):
        bucket_layout(["int8", "float32"], [[3], [2]])


# ---------------------------------------------------------------------------- the checks bite


def _gen_with(**sampling_over) -> dict:
    body = generate_payload(_gen_request())
    return {**body, "sampling_params": {**body["sampling_params"], **sampling_over}}


_UPDATE = "UpdateWeightsFromDistributedReqInput"
_MUTANTS = {
    "misspelt sampling key": (
        "/generate",
        "GenerateReqInput",
        lambda: _gen_with(sampling_seeds=1),
        "'sampling_seeds'",
    ),
    "misspelt top-level key": (
        "/generate",
        "GenerateReqInput",
        lambda: {**generate_payload(_gen_request()), "return_logprobs": 1},
        "did you mean 'return_logprob'",
    ),
    "int weight version": (
        "/update_weights_from_distributed",
        _UPDATE,
        lambda: {**_update_payload(), "weight_version": 12},
        "weight_version: 12",
    ),
    "missing names": (
        "/update_weights_from_distributed",
        _UPDATE,
        lambda: {k: v for k, v in _update_payload().items() if k != "names"},
        "required field 'names'",
    ),
    "unknown pause mode": (
        "/pause_generation",
        "PauseGenerationReqInput",
        lambda: {"mode": "inplace"},
        "mode: 'inplace'",
    ),
}


@pytest.mark.parametrize("mutant", list(_MUTANTS))
def test_checker_reports_a_broken_payload(src, mutant):
    route, cls, body, expect = _MUTANTS[mutant]
    errors = _contract_errors(src, route, cls, body())
    assert any(expect in e for e in errors), errors


def test_gate_and_route_checks_bite(src, api):
    with pytest.raises(api.JsonContractError, match="unknown field `sampling_seeds`"):
        api.GenerateRequest.from_json_value(_gen_with(sampling_seeds=1))
    bad = {"/get_server_info": "POST", "/update_weights": "POST"}
    errors = _route_errors(bad, _routes(src.tree("srt/entrypoints/http_server.py")))
    assert len(errors) == 2 and "accepts ['GET']" in errors[0] and "no such route" in errors[1]


def test_weights_checker_reply_is_read_by_sglangs_field_names(src):
    """``parse_weights_checker`` reads ``ranks[*].per_gpu_checksum`` and the placement's
    ``pp_rank``/``tp_rank``: the names of SGLang's ``ChecksumInfo`` / ``ParallelismInfo`` and of
    the keys its ``/weights_checker`` handler writes."""
    from megatron_rl.generation.protocol import ProtocolError, parse_weights_checker

    tree = src.tree(IO_STRUCT)
    assert {"checksums", "per_gpu_checksum", "parallelism_info"} <= set(_class_fields(tree, "ChecksumInfo"))
    assert {"tp_rank", "pp_rank", "role"} <= set(_class_fields(tree, "ParallelismInfo"))
    handler = src.text("srt/entrypoints/http_server.py")
    assert 'body["ranks"] = ranks' in handler and '"success": success' in handler
    placement = dict(
        role="target", tp_rank=1, tp_size=2, dp_rank=0, dp_size=1, pp_rank=0, pp_size=1, rank=1, size=2
    )
    reply = {
        "success": True,
        "message": "",
        "ranks": [
            {
                "checksums": {"w": "00"},
                "per_gpu_checksum": "a",
                "parallelism_info": [{**placement, "tp_rank": 0}],
            },
            {"checksums": {"w": "01"}, "per_gpu_checksum": "b", "parallelism_info": placement},
        ],
    }
    assert parse_weights_checker(reply) == {(0, 0): "a", (0, 1): "b"}
    with pytest.raises(ProtocolError, match="failed"):
        parse_weights_checker({"success": False, "message": "no model"})
    with pytest.raises(ProtocolError, match="lacks"):
        parse_weights_checker({"success": True, "ranks": [{"per_gpu_checksum": "a"}]})


def test_routed_experts_are_read_as_sglang_encodes_them():
    """SGLang's ``meta_info.routed_experts``: base64 of int32 experts, position by position; a
    reply whose size does not fit the positions fed is refused, naming the field."""
    import base64

    from megatron_rl.generation.protocol import ProtocolError, parse_generate

    req = _gen_request(return_routed_experts=True)  # a 3-token prompt
    experts = torch.arange(4 * 2 * 2, dtype=torch.int32)  # 3 + 2 - 1 positions, 2 layers, top 2
    reply = {
        "output_ids": [5, 6],
        "meta_info": {
            "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None]],
            "routed_experts": base64.b64encode(experts.numpy().tobytes()).decode(),
        },
    }
    assert torch.equal(parse_generate(req, reply).routed_experts, experts)
    reply["meta_info"]["routed_experts"] = base64.b64encode(experts[:-3].numpy().tobytes()).decode()
    with pytest.raises(ProtocolError, match="routed_experts"):
        parse_generate(req, reply)
    reply["meta_info"]["routed_experts"] = "not base64!"
    with pytest.raises(ProtocolError, match="routed_experts"):
        parse_generate(req, reply)
