"""The CLI fuzz suite: every verb, fed generated bad inputs, is handled.

For each verb Hypothesis generates hostile files (truncated, not UTF-8, a byte-order mark, deep
nesting, alias bombs, duplicate keys, wrong types, NaN, empty) and arguments (out of range, of
the wrong type, output paths that are, contain or lie inside an input), and runs the real command
in this process (``megatron_rl.cli.main``, the console script's own entry). The property a user
relies on, for every case:

- the command exits 0 (the input was fine after all), or exits with the code of an input
  mistake (2 argument/recipe, 3 input file, 4 output refused, 5 resource) and prints exactly one
  line on stderr, naming the command -- never a traceback, never the internal-error code 70;
- no input file changed (sha256 of every byte before and after).

Each verb's number of cases is reported to ``tools/fault_report.py`` (the README's Reliability
table). Generation is derandomised, so a run is reproducible and CI sees the same cases.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_rl.cli import _benchmarks
from megatron_rl.cli import main as cli_main
from megatron_rl.errors import EXIT_INPUT, EXIT_OUTPUT, EXIT_RESOURCE, EXIT_USAGE

pytestmark = [pytest.mark.fault("input")]

HANDLED = {EXIT_USAGE, EXIT_INPUT, EXIT_OUTPUT, EXIT_RESOURCE}
FUZZ = settings(
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

GOOD_RECIPE = b"""\
algorithm:
  eps_high: 0.28
loop:
  group_size: 4
  n_batch: 8
reward:
  l_max: 512
  l_cache: 128
"""
GOOD_RECORD = {"problem": "What is 2+2?", "answer": "4", "completion": "<think>2+2</think> \\boxed{4}"}
GOOD_PROBLEM = {"problem": "What is 2+2?", "answer": "4"}


# -- generated content ----------------------------------------------------------------------------


def _nested(depth: int, kind: str) -> bytes:
    if kind == "json":
        return b'{"a": ' + b"[" * depth + b"]" * depth + b"}"
    return (
        b"a:\n" + b"".join(b"  " * (i + 1) + b"k:\n" for i in range(depth)) + b"  " * (depth + 1) + b"v: 1\n"
    )


def _laughs(levels: int) -> bytes:
    lines = [b'l0: &l0 ["x","x","x","x","x","x","x","x","x","x"]']
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [".encode() + b",".join([f"*l{i - 1}".encode()] * 10) + b"]")
    return b"\n".join(lines) + b"\n"


def mutated(good: bytes, kind: str) -> st.SearchStrategy[bytes]:
    """Hostile versions of a good file (``kind``: "yaml" or "json" lines)."""
    cut = st.integers(0, max(0, len(good) - 1)).map(lambda i: good[:i])
    spliced = st.tuples(st.integers(0, len(good)), st.binary(min_size=1, max_size=8)).map(
        lambda t: good[: t[0]] + t[1] + good[t[0] :]
    )
    not_utf8 = st.integers(0, len(good)).map(lambda i: good[:i] + b"\xff\xfe\xc3" + good[i:])
    bom = st.just(b"\xef\xbb\xbf" + good)
    deep = st.integers(40, 3000).map(lambda d: _nested(d, kind))
    noise = st.binary(max_size=64)
    options = [cut, spliced, not_utf8, bom, deep, noise, st.just(b"")]
    if kind == "yaml":
        options += [
            st.just(b"a: &a [*a]\n"),
            st.integers(3, 9).map(_laughs),
            st.just(good + b"loop:\n  group_size: 8\n"),  # a duplicate section
            st.just(b"loop:\n"),  # a null section
            st.just(b"- 1\n- 2\n"),  # not a mapping
            st.just(b"loop:\n  seed: " + b"9" * 400 + b"\n"),
            st.just(b"loop:\n  group_size: .nan\n"),
            st.just(b"loop: !!python/object:os.system\n  x: 1\n"),
        ]
    else:
        options += [
            st.just(b'{"problem": "x", "answer": NaN, "completion": "y"}\n'),
            st.just(b'{"problem": "x", "answer": "4", "completion": "y", "num_tokens": -1}\n'),
            st.just(b"[1, 2, 3]\n"),
            st.just(b'{"problem": 5, "answer": [], "completion": {}}\n'),
            st.just(b'{"problem": "x", "answer": "4"' + b"\n"),
        ]
    return st.one_of(*options)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
records = st.fixed_dictionaries(
    {},
    optional={
        "problem": json_values,
        "answer": json_values,
        "completion": json_values,
        "tests": json_values,
        "language": st.sampled_from(["python", "cpp", "fortran", ""]) | json_values,
        "num_tokens": st.integers(-5, 10**20) | json_values,
    },
)
record_lines = st.lists(records, min_size=1, max_size=3).map(
    lambda rs: b"".join(json.dumps(r).encode() + b"\n" for r in rs)
)
jsonl_files = st.one_of(mutated(json.dumps(GOOD_RECORD).encode() + b"\n", "json"), record_lines)
problem_files = st.one_of(mutated(json.dumps(GOOD_PROBLEM).encode() + b"\n", "json"), record_lines)
recipe_files = mutated(GOOD_RECIPE, "yaml")
bad_ints = st.one_of(
    st.integers(-(10**12), 0), st.integers(10**6, 10**30), st.sampled_from(["abc", "1.5", "", "nan", "-"])
)
bad_floats = st.one_of(st.sampled_from(["nan", "inf", "-inf", "abc", "", "1e999"]), st.floats(-1e9, -1e-9))
override_keys = st.sampled_from(
    [
        "loop.group_size",
        "loop.n_batch",
        "algorithm.eps_high",
        "reward.l_max",
        "reward.workers",
        "trainer.optim.lr",
        "run.checkpoint_every",
        "fleet.local_servers",
        "nosuch.key",
        "loop",
        "loop.group_size.x",
    ]
)
override_values = st.one_of(
    st.sampled_from(["-3", "0", ".nan", ".inf", "abc", "[1, 2]", "{a: 1}", "", "null", "9" * 30, "&a [*a]"]),
    st.text(max_size=10),
)
overrides = st.lists(st.tuples(override_keys, override_values).map(lambda kv: f"{kv[0]}={kv[1]}"), max_size=3)
# Where an output goes relative to the input: the input itself, a hard link to it, its folder, a
# folder inside a folder input, or somewhere fresh (then the content or an argument is at fault).
out_places = st.sampled_from(["same", "hardlink", "parent", "fresh", "symlink"])


# -- running a case --------------------------------------------------------------------------------


def _digests(paths: list[Path]) -> dict[str, str]:
    out = {}
    for p in paths:
        for f in [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else []:
            out[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


class Cases:
    """Counts one verb's cases (in ``record``, which the fault report reads) and checks each."""

    def __init__(self, record: dict):
        self.record = record

    def check(self, argv: list[str], inputs: list[Path]) -> int:
        before = _digests(inputs)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = cli_main(argv)
        text = err.getvalue()
        self.record["cases"] += 1
        assert "Traceback" not in text, f"{argv}: a stack reached the user:\n{text}"
        assert _digests(inputs) == before, f"{argv}: an input file changed"
        if code != 0:
            lines = [ln for ln in text.splitlines() if ln.strip()]
            assert code in HANDLED, f"{argv}: exit {code} (not an input-mistake code):\n{text}"
            assert lines and lines[-1].startswith("megatron-rl"), f"{argv}: no one-line error:\n{text}"
            assert len(lines) == 1, f"{argv}: {len(lines)} lines on stderr, not one:\n{text}"
        return code


@pytest.fixture
def cases(request):
    """``cases(verb)``: a :class:`Cases` whose count goes into this test's report as it runs (the
    report of the call is made after it, and holds the same dict)."""

    def make(verb: str) -> Cases:
        record = {"verb": verb, "cases": 0}
        request.node.user_properties.append(("fuzz", record))
        return Cases(record)

    return make


@contextlib.contextmanager
def scratch():
    d = Path(tempfile.mkdtemp(prefix="fuzz-"))
    cwd = os.getcwd()
    os.chdir(d)  # relative outputs land here, never in the checkout
    try:
        yield d
    finally:
        os.chdir(cwd)
        shutil.rmtree(d, ignore_errors=True)


def _place_output(d: Path, inp: Path, place: str, name: str) -> Path:
    if place == "same":
        return inp
    if place == "hardlink":
        os.link(inp, d / "hard.jsonl")
        return d / "hard.jsonl"
    if place == "symlink":
        (d / "sym.jsonl").symlink_to(inp)
        return d / "sym.jsonl"
    if place == "parent":
        return inp.parent
    return d / name


def _given(*strategies, n: int = 25) -> Callable:
    return lambda fn: settings(FUZZ, max_examples=n)(given(*strategies)(fn))


# -- the verbs -------------------------------------------------------------------------------------


def test_fuzz_config(cases):
    c = cases("config")

    @_given(recipe_files, overrides, n=200)
    def run(content, over):
        with scratch() as d:
            (d / "r.yaml").write_bytes(content)
            c.check(["config", str(d / "r.yaml"), *over], [d / "r.yaml"])

    run()


def test_fuzz_sglang_args(cases):
    c = cases("sglang-args")

    @_given(recipe_files, st.sampled_from(["server", "router", "other"]), n=40)
    def run(content, target):
        with scratch() as d:
            (d / "r.yaml").write_bytes(content)
            c.check(["sglang-args", target, str(d / "r.yaml")], [d / "r.yaml"])

    run()


@pytest.mark.slow
def test_fuzz_train(cases):
    """``train`` checks the whole recipe (paths included) before it starts anything: with a model
    folder that does not exist every case must end at the door."""
    c = cases("train")

    @_given(recipe_files, overrides, n=30)
    def run(content, over):
        with scratch() as d:
            (d / "r.yaml").write_bytes(content)
            code = c.check(["train", str(d / "r.yaml"), "model.hf=/nonexistent/model", *over], [d / "r.yaml"])
            assert code != 0

    run()


def test_fuzz_reward(cases):
    c = cases("reward")

    @_given(jsonl_files, out_places, st.one_of(st.none(), bad_ints), st.booleans(), n=120)
    def run(content, place, workers, skip_bad):
        with scratch() as d:
            inp = d / "in.jsonl"
            inp.write_bytes(content)
            out = _place_output(d, inp, place, "out.jsonl")
            argv = ["reward", "--input", str(inp), "--output", str(out), "--quiet"]
            argv += ["--workers", str(workers if workers is not None else 1)]
            c.check(argv + (["--skip-bad"] if skip_bad else []), [inp])

    run()


def test_fuzz_reward_arguments(cases):
    c = cases("reward")

    @_given(
        st.sampled_from(["--tokenizer", "--recipe", "--input"]),
        st.sampled_from(["missing", "dir", "file"]),
        overrides,
        n=20,
    )
    def run(flag, what, over):
        with scratch() as d:
            inp = d / "in.jsonl"
            inp.write_text(json.dumps(GOOD_RECORD) + "\n")
            (d / "empty").mkdir()
            (d / "junk").write_bytes(b"\x00\xff junk")
            target = {"missing": d / "missing", "dir": d / "empty", "file": d / "junk"}[what]
            argv = [
                "reward",
                "--input",
                str(inp),
                "--output",
                str(d / "o.jsonl"),
                "--quiet",
                "--workers",
                "1",
            ]
            argv += [flag, str(target), *[o for o in over if o.startswith("reward.")]]
            code = c.check(argv, [inp, d / "junk"])
            assert code != 0

    run()


@pytest.mark.parametrize("tool", ["math-format", "translate-mark", "code-tests"])
def test_fuzz_curate(cases, tool):
    c = cases(f"curate {tool}")
    extra = {
        "math-format": lambda n: ["--workers", str(n)],
        "translate-mark": lambda n: ["--languages", "fr,de", "--fraction", str(n)],
        "code-tests": lambda n: ["--min-tests", str(n), "--workers", "1"],
    }[tool]

    @_given(problem_files, out_places, st.one_of(bad_ints, bad_floats, st.just(1)), n=50)
    def run(content, place, number):
        with scratch() as d:
            inp = d / "in.jsonl"
            inp.write_bytes(content)
            out = _place_output(d, inp, place, "out.jsonl")
            c.check(
                ["curate", tool, "--input", str(inp), "--output", str(out), "--quiet", *extra(number)], [inp]
            )

    run()


def test_fuzz_curate_difficulty_scored(cases):
    c = cases("curate difficulty")

    @_given(jsonl_files, out_places, st.one_of(bad_floats, st.just(0.0)), n=15)
    def run(content, place, low):
        with scratch() as d:
            inp, scored = d / "in.jsonl", d / "scored.jsonl"
            inp.write_text(json.dumps(GOOD_PROBLEM) + "\n")
            scored.write_bytes(content)
            out = _place_output(d, scored, place, "out.jsonl")
            argv = [
                "curate",
                "difficulty",
                "--input",
                str(inp),
                "--scored",
                str(scored),
                "--output",
                str(out),
            ]
            c.check([*argv, "--quiet", "--workers", "1", "--low", str(low)], [inp, scored])

    run()


def test_fuzz_eval(cases):
    c = cases("eval")

    @_given(problem_files, out_places, st.one_of(bad_ints, st.just(2)), n=50)
    def run(content, place, k):
        with scratch() as d:
            inp = d / "in.jsonl"
            inp.write_bytes(content)
            out = _place_output(d, inp, place, "ev")
            argv = [
                "eval",
                "--data",
                str(inp),
                "--out",
                str(out),
                "--model",
                str(d / "no-model"),
                "--k",
                str(k),
            ]
            code = c.check([*argv, "--quiet"], [inp])
            assert code != 0  # no model folder: it never gets to sampling

    run()


def test_fuzz_convert_arguments(cases):
    c = cases("convert")

    @_given(
        st.sampled_from(["hf-to-mcore", "mcore-to-hf"]),
        st.sampled_from(["same", "inside", "parent", "fresh"]),
        st.one_of(bad_ints, st.just(1)),
        mutated(b'{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}', "json"),
        n=20,
    )
    def run(direction, place, tp, config):
        with scratch() as d:
            src = d / "src"
            src.mkdir()
            (src / "config.json").write_bytes(config)
            out = {"same": src, "inside": src / "out", "parent": d, "fresh": d / "out"}[place]
            flag_in, flag_out = ("--hf", "--out") if direction == "hf-to-mcore" else ("--mcore", "--out")
            argv = ["convert", direction, flag_in, str(src), flag_out, str(out)]
            if direction == "hf-to-mcore":
                argv += ["--tp", str(tp)]
            code = c.check(argv, [src])
            assert code != 0  # no weights in src: nothing to convert

    run()


def test_fuzz_quickstart(cases):
    """Every case holds one mistake; each must be refused before the minutes of warm-up start."""
    c = cases("quickstart")

    @_given(st.sampled_from(["out-file", "recipe", "override"]), recipe_files, overrides, n=50)
    def run(mistake, content, over):
        with scratch() as d:
            (d / "r.yaml").write_bytes(content if mistake == "recipe" else GOOD_RECIPE)
            (d / "afile").write_text("not a folder")
            out = d / ("afile" if mistake == "out-file" else "qs")
            extra = over + ["loop.group_size=-1"] if mistake == "override" else []
            if mistake == "recipe":  # a mutation can leave a good recipe: keep one mistake in
                extra = ["loop.group_size=1"]
            code = c.check(
                ["quickstart", "--out", str(out), "--recipe", str(d / "r.yaml"), *extra],
                [d / "r.yaml", d / "afile"],
            )
            assert code != 0

    run()


def test_fuzz_serve_engine(cases):
    c = cases("serve-engine")
    flags = st.sampled_from(
        [
            "--port",
            "--max-len",
            "--max-slots",
            "--max-body-mb",
            "--threads",
            "--read-timeout-s",
            "--max-conns-per-client",
        ]
    )

    @_given(st.lists(st.tuples(flags, st.one_of(bad_ints, st.just(70000))), min_size=1, max_size=3), n=50)
    def run(pairs):
        with scratch() as d:
            argv = ["serve-engine", "--model", str(d / "no-model")]
            for flag, value in pairs:
                argv += [flag, str(value)]
            code = c.check(argv, [])
            assert code != 0

    run()


def test_fuzz_bench_names(cases):
    c = cases("bench")

    real = set(_benchmarks())

    @_given(
        st.text(min_size=1, max_size=12).filter(
            lambda s: not s.startswith("-") and s.replace("_", "-") not in real
        ),
        n=10,
    )
    def run(name):
        c.check(["bench", name, "--help-not-a-flag"], [])

    run()
