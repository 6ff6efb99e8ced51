"""Verifier throughput: the math pool against plain math-verify, and C++ compile with the PCH.

    megatron-rl bench verifiers [--repeat 4] [--workers 2] [--compiles 3]

Math: the equivalence table of the tests (68 pairs) repeated ``--repeat`` times is verified (a)
by math-verify's ``parse`` + ``verify`` called one after another in this process and (b) through
the :class:`VerifierPool` with ``--workers`` processes (started and warmed before timing).
C++: a typical competitive-programming solution is compiled ``--compiles`` times with and without
the precompiled ``bits/stdc++.h`` (built once, before timing); the median times are compared.
The last line is one JSON object (``math_pool_speedup``, ``cpp_pch_compile_ratio``, ...).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.rewards.math_pairs

from megatron_rl.rewards.code import CodeConfig, compile_cpp
from megatron_rl.rewards.math import verify_math
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


def plain_math(pairs) -> float:
    from math_verify import parse, verify

    t0 = time.perf_counter()
    for ref, ans in pairs:
        verify(parse(f"${ref}$"), parse(f"$\\boxed{{{ans}}}$"))
    return time.perf_counter() - t0


def pool_math(pairs, workers: int) -> float:
    with VerifierPool(workers, preload=("megatron_rl.rewards.math",)) as pool:
        pool.map(verify_math, [(r"\boxed{1}", "1")] * workers * 2)  # start and warm every worker
        t0 = time.perf_counter()
        results = pool.map(verify_math, [(f"\\boxed{{{ans}}}", ref) for ref, ans in pairs])
        seconds = time.perf_counter() - t0
    failed = [r for r in results if not hasattr(r, "correct")]
    if failed:
        raise SystemExit(f"{len(failed)} pool tasks failed: {failed[:3]}")
    return seconds


def cpp_compiles(n: int) -> tuple[float, float]:
    cfg = CodeConfig()
    times = {True: [], False: []}
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


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=4, help="repetitions of the 68-pair table")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--compiles", type=int, default=3)
    args = ap.parse_args(argv)

    pairs = (EQUIVALENT + NOT_EQUIVALENT) * args.repeat
    print(f"math: {len(pairs)} verifications ...", file=sys.stderr, flush=True)
    t_plain = plain_math(pairs)
    t_pool = pool_math(pairs, args.workers)
    print(f"c++: {args.compiles} compiles with and without the PCH ...", file=sys.stderr, flush=True)
    t_pch, t_nopch = cpp_compiles(args.compiles)

    print(f"{'what':42} {'seconds':>8} {'per second':>11}")
    print(f"{'math-verify, one plain process':42} {t_plain:8.2f} {len(pairs) / t_plain:11.1f}")
    print(f"{f'verifier pool, {args.workers} workers':42} {t_pool:8.2f} {len(pairs) / t_pool:11.1f}")
    print(f"{'C++ compile, precompiled bits/stdc++.h':42} {t_pch:8.2f}")
    print(f"{'C++ compile, no precompiled header':42} {t_nopch:8.2f}")
    out = {
        "math_pool_speedup": round(t_plain / t_pool, 3),
        "math_plain_per_s": round(len(pairs) / t_plain, 2),
        "math_pool_per_s": round(len(pairs) / t_pool, 2),
        "cpp_pch_compile_ratio": round(t_pch / t_nopch, 3),
        "cpp_pch_s": round(t_pch, 3),
        "cpp_no_pch_s": round(t_nopch, 3),
        "workers": args.workers,
        "verifications": len(pairs),
    }
    print(
        f"pool speed-up {out['math_pool_speedup']}x; compile with PCH takes "
        f"{out['cpp_pch_compile_ratio']}x the time without"
    )
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
