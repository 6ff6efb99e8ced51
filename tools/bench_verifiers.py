"""Verifier throughput on an RL scoring batch, against the baselines a user would pick.

    megatron-rl bench verifiers [--samples-per-prompt 8] [--workers 2] [--rounds 5] [--compiles 3]

Math. The workload is what the trainer scores after each generation step: many samples per
prompt, a few hundred per batch, right and wrong answers mixed. Each of the 68 (reference,
answer) pairs of the tests' equivalence table (``tests/rewards/math_pairs.py``) is a prompt with
``--samples-per-prompt`` completions, ``... So the answer is $\\boxed{X}$.``: the first answers with
the table's own answer (so one sample per prompt is the table itself); each other one, with even
odds, with one of the prompt's right answers (an equivalent form from the table or the reference
as written) or with another pair's answer (nearly always wrong), as a group's samples do.

Baseline: math-verify's ``verify(parse(gold), parse(completion))`` in a loop in this one process,
what a user would write. It is warm: :func:`~megatron_rl.rewards.math.warm_up` (the import and a
few verifications) runs before timing, as it runs in every pool worker before that worker takes
tasks. Also shown: our :func:`~megatron_rl.rewards.math.verify_math` in the same loop, so the
pool's gain is not a cheaper verifier; both it and the pool run with the verdict cache off
(``verdict_cache=0``), so ``math_pool_speedup`` is what the cores buy. The cache's own gain, on
one batch's repeated answers (emptied before each round), is ``math_verdict_cache_speedup``:
``verify_math`` with its default cache in the same one-process loop. Ours: the same batch through
:class:`~megatron_rl.rewards.pool.VerifierPool` with ``--workers`` processes, started and warmed
before timing (a trainer keeps its pool for the run). Each of ``--rounds`` rounds draws a fresh
batch and times the three sides one after another (rotating which goes first); the speed-up is the
median over rounds of the baseline's time over the pool's, measured back to back.

C++: a typical competitive-programming solution is compiled ``--compiles`` times with and without
the precompiled ``bits/stdc++.h`` (built once, before timing); the ratio of the median times is
``cpp_pch_compile_ratio`` (lower is better).

Capacity per core: ``math_verifications_per_s_per_core`` (``verify_math`` in one process, the
batch above), ``python_code_verifications_per_s_per_core`` and
``cpp_code_verifications_per_s_per_core``: one solution ("print the sum of n numbers") verified
in one process against 20 stdin/stdout tests (Magistral's count), sandboxed, C++ with the PCH,
all tests passing (a failing test ends a run early, so this is the costly case); what sizes a
verifier pool against a fleet's completion rate (docs/scale.md). The last line is one JSON
object of the figures.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.rewards.math_pairs

from megatron_rl.errors import ArgumentParser, int_arg, run_cli
from megatron_rl.rewards.code import CodeConfig, compile_cpp, verify_code
from megatron_rl.rewards.math import MathConfig, clear_verdict_cache, verify_math, warm_up
from megatron_rl.rewards.pool import VerifierPool
from tests.rewards.math_pairs import EQUIVALENT, NOT_EQUIVALENT

CPP_SOLUTION = r"""
#include <bits/stdc++.h>
using namespace std;
int main() {
    ios::sync_with_stdio(false);
    int n; cin >> n;
    vector<long long> a(n);
    for (auto &x : a) cin >> x;
    map<long long, int> freq;
    for (auto x : a) freq[x]++;
    sort(a.begin(), a.end());
    long long best = accumulate(a.begin(), a.end(), 0LL);
    priority_queue<long long> pq(a.begin(), a.end());
    set<long long> seen(a.begin(), a.end());
    string s = to_string(best);
    cout << s << ' ' << freq.size() << ' ' << seen.size() << ' ' << (pq.empty() ? 0 : pq.top()) << '\n';
}
"""

Batch = list[tuple[str, str]]  # (completion, reference) per sample, prompt by prompt


def rl_batch(samples_per_prompt: int, seed: int) -> Batch:
    """One scoring batch: every table pair is a prompt with ``samples_per_prompt`` completions."""
    rng = random.Random(seed)
    pairs = EQUIVALENT + NOT_EQUIVALENT
    right: dict[str, list[str]] = {}
    for ref, ans in EQUIVALENT:
        right.setdefault(ref, [ref]).append(ans)
    answers = [ans for _, ans in pairs]
    batch = []
    for ref, ans in pairs:
        group = [ans] + [
            rng.choice(right.get(ref, [ref])) if rng.random() < 0.5 else rng.choice(answers)
            for _ in range(samples_per_prompt - 1)
        ]
        batch += [(f"Adding the cases up, so the answer is $\\boxed{{{a}}}$.", ref) for a in group]
    return batch


def plain_math_verify(batch: Batch) -> list[bool]:
    """The baseline: math-verify as its README shows it, one sample after another."""
    from math_verify import parse, verify

    return [bool(verify(parse(f"${ref}$"), parse(text))) for text, ref in batch]


UNCACHED = MathConfig(verdict_cache=0)  # the pool's scaling, not the cache, is measured


def one_process_verify_math(batch: Batch) -> list[bool]:
    return [verify_math(text, ref, UNCACHED).correct for text, ref in batch]


def one_process_cached(batch: Batch) -> list[bool]:
    """verify_math with its verdict cache, emptied first: one batch's repeats only."""
    clear_verdict_cache()
    return [verify_math(text, ref).correct for text, ref in batch]


def timed(fn: Callable[[Batch], list[bool]], batch: Batch) -> tuple[float, list[bool]]:
    t0 = time.perf_counter()
    verdicts = fn(batch)
    return time.perf_counter() - t0, verdicts


def math_rounds(samples_per_prompt: int, workers: int, rounds: int) -> dict[str, list]:
    """Seconds per side and round, and the share each side judged right in the last round."""
    warm_up()  # the baseline's warm-up, the same one every pool worker runs
    with VerifierPool(workers, preload=("megatron_rl.rewards.math", "math_verify"), warmup=warm_up) as pool:
        if not pool.wait_ready(timeout_s=120):
            raise SystemExit("the verifier pool did not start")

        def through_pool(batch: Batch) -> list[bool]:
            results = pool.map(verify_math, [(text, ref, UNCACHED) for text, ref in batch])
            failed = [r for r in results if not hasattr(r, "correct")]
            if failed:
                raise SystemExit(f"{len(failed)} pool tasks failed: {failed[:3]}")
            return [r.correct for r in results]

        sides = {
            "plain": plain_math_verify,
            "verify_math": one_process_verify_math,
            "pool": through_pool,
            "cached": one_process_cached,
        }
        names = list(sides)
        seconds: dict[str, list] = {name: [] for name in names}
        right: dict[str, float] = {}
        for r in range(rounds):
            batch = rl_batch(samples_per_prompt, seed=r)
            for name in names[r % len(names) :] + names[: r % len(names)]:  # no side always first
                t, verdicts = timed(sides[name], batch)
                seconds[name].append(t)
                right[name] = sum(verdicts) / len(verdicts)
    return {"seconds": [seconds[n] for n in names], "right": [right[n] for n in names]}


def cpp_compiles(n: int) -> tuple[float, float]:
    cfg = CodeConfig()
    times: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as d:
        ok, msg, _ = compile_cpp(CPP_SOLUTION, d, cfg, use_pch=True)  # builds the PCH once
        if not ok:
            raise SystemExit(f"compile failed: {msg}")
        for _ in range(n):
            for use_pch in (True, False):
                ok, msg, seconds = compile_cpp(CPP_SOLUTION, d, cfg, use_pch=use_pch)
                if not ok:
                    raise SystemExit(f"compile failed (pch={use_pch}): {msg}")
                times[use_pch].append(seconds)
    return statistics.median(times[True]), statistics.median(times[False])


SUM_CPP = r"""
#include <bits/stdc++.h>
int main() { long long n, x, s = 0; std::cin >> n; while (n-- && std::cin >> x) s += x; std::cout << s << "\n"; }
"""
SUM_PY = "n = int(input())\nprint(sum(map(int, input().split())))\n"


def sum_tests(k: int, seed: int) -> list[dict]:
    """``k`` stdin/stdout tests of "print the sum of n numbers", answers computed here."""
    rng = random.Random(seed)
    tests = []
    for _ in range(k):
        xs = [rng.randint(-(10**9), 10**9) for _ in range(rng.randint(1, 200))]
        tests.append({"input": f"{len(xs)}\n{' '.join(map(str, xs))}\n", "output": f"{sum(xs)}\n"})
    return tests


def code_capacity(runs: int, tests_per_problem: int) -> dict[str, float]:
    """Code verifications per second in one process (one core: the sandboxed compile and test
    runs are its children and run one after another), ``tests_per_problem`` tests each, all
    passing (the costliest verdict: a failing test stops the run early): median over ``runs``."""
    cfg = CodeConfig(tests_per_problem=tests_per_problem)
    tests = sum_tests(tests_per_problem, seed=7)
    out = {}
    for lang, code in (("python", SUM_PY), ("cpp", SUM_CPP)):
        verdict = verify_code(code, lang, tests, cfg)  # warm: the PCH is built here, once
        if not verdict.correct:
            raise SystemExit(f"{lang} capacity solution failed: {verdict.reason} {verdict.detail}")
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            verify_code(code, lang, tests, cfg)
            times.append(time.perf_counter() - t0)
        out[lang] = 1.0 / statistics.median(times)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--samples-per-prompt",
        "--repeat",  # its former name
        dest="samples_per_prompt",
        type=int_arg(1),
        default=8,
        help="completions per prompt; the batch is 68 prompts times this",
    )
    ap.add_argument("--workers", type=int_arg(1), default=2)
    ap.add_argument("--rounds", type=int_arg(1), default=5, help="batches timed on every side")
    ap.add_argument("--compiles", type=int_arg(1), default=3)
    ap.add_argument(
        "--capacity-runs",
        type=int_arg(1),
        default=5,
        help="code verifications timed per language (20 tests each)",
    )
    args = ap.parse_args(argv)

    n = len(EQUIVALENT + NOT_EQUIVALENT) * args.samples_per_prompt
    print(
        f"math: {args.rounds} rounds of {n} samples ({args.samples_per_prompt} per prompt) ...",
        file=sys.stderr,
        flush=True,
    )
    math = math_rounds(args.samples_per_prompt, args.workers, args.rounds)
    (plain, ours_inline, pool, cached), right = math["seconds"], math["right"]
    speedups = [p / q for p, q in zip(plain, pool)]
    print(f"c++: {args.compiles} compiles with and without the PCH ...", file=sys.stderr, flush=True)
    t_pch, t_nopch = cpp_compiles(args.compiles)
    print(f"code: {args.capacity_runs} verifications per language ...", file=sys.stderr, flush=True)
    code_rate = code_capacity(args.capacity_runs, CodeConfig().tests_per_problem)

    print(
        f"math: {n} samples per batch, {len(EQUIVALENT + NOT_EQUIVALENT)} prompts x "
        f"{args.samples_per_prompt}; median of {args.rounds} rounds, all sides warm"
    )
    print(f"{'what':48} {'seconds':>8} {'per second':>11} {'speed-up':>9} {'right':>6}")
    rows = [
        ("math-verify parse+verify, one process (baseline)", plain),
        ("verify_math, one process", ours_inline),
        (f"verifier pool, {args.workers} workers", pool),
        ("verify_math + verdict cache, one process", cached),
    ]
    for (what, times), share in zip(rows, right):
        t = statistics.median(times)
        print(f"{what:48} {t:8.2f} {n / t:11.1f} {statistics.median(plain) / t:8.2f}x {share:6.1%}")
    print(f"{'C++ compile, precompiled bits/stdc++.h':48} {t_pch:8.2f}")
    print(f"{'C++ compile, no precompiled header (baseline)':48} {t_nopch:8.2f}")
    tests = CodeConfig().tests_per_problem
    print(
        f"capacity per core (one process): math {n / statistics.median(ours_inline):.0f}/s, "
        f"Python code {code_rate['python']:.2f}/s and C++ code {code_rate['cpp']:.2f}/s "
        f"({tests} tests each, PCH on, all passing)"
    )
    out = {
        "math_pool_speedup": round(statistics.median(speedups), 3),
        "math_plain_per_s": round(n / statistics.median(plain), 2),
        "math_verify_math_per_s": round(n / statistics.median(ours_inline), 2),
        "math_pool_per_s": round(n / statistics.median(pool), 2),
        "math_verdict_cache_speedup": round(statistics.median(plain) / statistics.median(cached), 3),
        "math_pool_speedup_rounds": [round(s, 3) for s in speedups],
        "cpp_pch_compile_ratio": round(t_pch / t_nopch, 3),
        "cpp_pch_s": round(t_pch, 3),
        "cpp_no_pch_s": round(t_nopch, 3),
        # Per core (one process): what sizes the verifier pool against the fleet's completion rate.
        "math_verifications_per_s_per_core": round(n / statistics.median(ours_inline), 1),
        "python_code_verifications_per_s_per_core": round(code_rate["python"], 3),
        "cpp_code_verifications_per_s_per_core": round(code_rate["cpp"], 3),
        "workers": args.workers,
        "verifications": n,
        "samples_per_prompt": args.samples_per_prompt,
        "rounds": args.rounds,
    }
    print(
        f"pool speed-up {out['math_pool_speedup']}x over warm one-process math-verify "
        f"(rounds: {', '.join(f'{s:.2f}' for s in speedups)}); compile with PCH takes "
        f"{out['cpp_pch_compile_ratio']}x the time without"
    )
    print(json.dumps(out))
    return out


if __name__ == "__main__":  # an argument mistake: one line, exit 2 (errors.run_cli)
    sys.exit(run_cli("megatron-rl bench verifiers", main))
