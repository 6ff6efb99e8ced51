"""The fault and abuse suite, counted: runs every test marked ``@pytest.mark.fault(kind)`` and
prints how many faults of each kind were tried and survived (the README's Reliability table).

    python tools/fault_report.py [--out benchmarks/faults.json] [--readme] [-- extra pytest args]

A fault test injects one fault (a bad input, a hostile client or program, a killed process or a
corrupted file, a non-finite number, load at real scale) into the real components and asserts
what a user relies on: a clear refusal naming the file/line/field, nothing lost, nothing changed
that should not be, no hang. "Survived" is a passed test; each parametrized case counts once.
The last line is JSON: ``{"faults": N, "survived": N, "by_kind": {...}}``.
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

ROOT = Path(__file__).resolve().parents[1]
KINDS = {
    "input": "bad inputs refused at the door (file:line or field named, exit non-zero)",
    "abuse": "hostile clients and programs (no key, hostile code in the sandbox)",
    "crash": "processes killed or stuck, files cut or corrupted",
    "numeric": "non-finite values (NaN, inf) in config, loss, weights",
    "load": "load at real scale (a thousand requests in flight)",
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="also write the counts here (JSON)")
    p.add_argument("--readme", action="store_true", help="rewrite README's table between its faults markers")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "faults.jsonl"
        env = {**os.environ, "MEGATRON_RL_FAULT_REPORT": str(report)}
        cmd = [sys.executable, "-m", "pytest", "-m", "fault", "-p", "no:cacheprovider", *args.pytest_args]
        print("+", " ".join(cmd), flush=True)
        rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
        rows = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
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
    if args.readme and rc == 0:
        readme = ROOT / "README.md"
        text = readme.read_text()
        begin, end = "<!-- faults:begin -->\n", "<!-- faults:end -->"
        head, rest = text.split(begin, 1)
        readme.write_text(head + begin + table + "\n" + end + rest.split(end, 1)[1])
    summary = {
        "faults": sum(tried.values()),
        "survived": sum(survived.values()),
        "skipped": sum(skipped.values()),
        "by_kind": {k: {"tried": tried[k], "survived": survived[k]} for k in KINDS},
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return rc


if __name__ == "__main__":
    sys.exit(main())
