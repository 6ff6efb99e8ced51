"""Test set-up: ``gpu`` and ``sglang`` tests skip cleanly, with the reason, where they cannot run;
``fault`` tests are checked for their kind and, with ``$MEGATRON_RL_FAULT_REPORT`` set to a
path, each one's kind and outcome are written there (``tools/fault_report.py`` reads it)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch


def _sglang_reason() -> str | None:
    if not torch.cuda.is_available():
        return "sglang: needs a CUDA GPU for a real SGLang server"
    if importlib.util.find_spec("sglang") is None:
        return "sglang: the sglang package is not installed (pip install -e '.[gpu]')"
    return None


#: What a fault test exercises: a bad input refused at the door, a hostile client or program, a
#: process killed, stuck or a file corrupted, a non-finite number, load at the scale of real use.
FAULT_KINDS = ("input", "abuse", "crash", "numeric", "load")


def pytest_collection_modifyitems(config, items):
    gpu_reason = None if torch.cuda.is_available() else "gpu: no CUDA device on this machine"
    sglang_reason = _sglang_reason()
    for item in items:
        for mark in item.iter_markers("fault"):
            if len(mark.args) != 1 or mark.args[0] not in FAULT_KINDS:
                raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.fault(kind), kind one of {FAULT_KINDS}")
            item.user_properties.append(("fault", mark.args[0]))
        if gpu_reason and "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=gpu_reason))
        if sglang_reason and "sglang" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=sglang_reason))


@pytest.fixture(autouse=True, scope="session")
def _quiet_threads():
    # Two cores here: keep intra-op threads from oversubscribing when tests spawn ranks.
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_runtest_logreport(report):
    """With ``$MEGATRON_RL_FAULT_REPORT``: one JSON line per fault test (kind, outcome)."""
    path = os.environ.get("MEGATRON_RL_FAULT_REPORT")
    kinds = [v for k, v in report.user_properties if k == "fault"]
    if not path or not kinds:
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        # A fuzz test (tests/test_cli_fuzz.py) also says how many cases of which verb it ran.
        fuzz = [v for k, v in report.user_properties if k == "fuzz"]
        row = {"test": report.nodeid, "kind": kinds[0], "outcome": report.outcome}
        with open(path, "a") as f:
            f.write(json.dumps(row | ({"fuzz": fuzz} if fuzz else {})) + "\n")
