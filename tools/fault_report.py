"""The fault and abuse suite, counted: runs every test marked ``@pytest.mark.fault(kind)`` and
prints how many faults of each kind were tried and survived (the tables of docs/reliability.md).

    python tools/fault_report.py [--out benchmarks/faults.json] [--docs] [-- extra pytest args]

A fault test injects one fault (a bad input, a hostile client or program, a killed process or a
corrupted file, a non-finite number, load at real scale) into the real components and asserts
what a user relies on: a clear refusal naming the file/line/field, nothing lost, nothing changed
that should not be, no hang. "Survived" is a passed test; each parametrized case counts once.
A second table counts the CLI fuzz suite (``tests/test_cli_fuzz.py``): the generated bad inputs
each verb was given, and whether every one was handled (one line, an input-mistake exit code, no
input changed). The last line is JSON: ``{"faults": N, "survived": N, "by_kind": {...},
"fuzz_cases": N}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from doc_tables import write_table

ROOT = Path(__file__).resolve().parents[1]
KINDS = {
    "input": "bad inputs refused at the door (file:line or field named, exit non-zero)",
    "abuse": "hostile clients and programs (no key, hostile code in the sandbox)",
    "crash": "processes killed or stuck, files cut or corrupted",
    "numeric": "non-finite values (NaN, inf) in config, loss, weights",
    "load": "load at real scale (a thousand requests in flight)",
}


def _fuzz_counts(rows: list[dict]) -> list[tuple[str, int, bool]]:
    """(verb, cases tried, all handled) per verb of the CLI fuzz suite (tests/test_cli_fuzz.py)."""
    tried: Counter = Counter()
    failed: set[str] = set()
    for r in rows:
        for f in r.get("fuzz", []):
            tried[f["verb"]] += f["cases"]
            if r["outcome"] != "passed":
                failed.add(f["verb"])
    return [(verb, n, verb not in failed) for verb, n in sorted(tried.items())]


def _fuzz_table(rows: list[dict]) -> str:
    lines = ["| verb | generated bad inputs tried | all handled |", "|---|---:|---|"]
    counts = _fuzz_counts(rows)
    lines += [f"| `{verb}` | {n} | {'yes' if ok else '**no**'} |" for verb, n, ok in counts]
    total, ok = sum(n for _, n, _ in counts), all(ok for _, _, ok in counts)
    lines.append(f"| **all** | **{total}** | {'yes' if ok else '**no**'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="also write the counts here (JSON)")
    p.add_argument(
        "--docs", action="store_true", help="rewrite docs/reliability.md's tables between their markers"
    )
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "faults.jsonl"
        env = {**os.environ, "MEGATRON_RL_FAULT_REPORT": str(report)}
        cmd = [sys.executable, "-m", "pytest", "-m", "fault", "-p", "no:cacheprovider", *args.pytest_args]
        print("+", " ".join(cmd), flush=True)
        rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
        faults = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    rows = faults
    if not rows:
        print("fault_report: no fault test ran", file=sys.stderr)
        return 1
    tried = Counter(r["kind"] for r in rows)
    survived = Counter(r["kind"] for r in rows if r["outcome"] == "passed")
    skipped = Counter(r["kind"] for r in rows if r["outcome"] == "skipped")
    rows = ["| fault kind | tried | survived | skipped here |", "|---|---:|---:|---:|"]
    for kind, what in KINDS.items():
        rows.append(f"| {kind}: {what} | {tried[kind]} | {survived[kind]} | {skipped[kind]} |")
    rows.append(
        f"| **all** | **{sum(tried.values())}** | **{sum(survived.values())}** | {sum(skipped.values())} |"
    )
    table = "\n".join(rows)
    print("\n" + table)
    fuzz_table = _fuzz_table(faults)
    print("\n" + fuzz_table)
    if args.docs and rc == 0:
        write_table("faults", table)
        write_table("fuzz", fuzz_table)
    summary = {
        "faults": sum(tried.values()),
        "survived": sum(survived.values()),
        "skipped": sum(skipped.values()),
        "by_kind": {k: {"tried": tried[k], "survived": survived[k]} for k in KINDS},
        "fuzz_cases": sum(n for _, n, _ in _fuzz_counts(faults)),
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return rc


if __name__ == "__main__":
    sys.exit(main())
