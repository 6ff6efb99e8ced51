"""A tokenizer and a tiny model folder built once per session, for the quick start tests."""

from __future__ import annotations

import pytest

from megatron_rl.quickstart.problems import ProblemConfig, generate_problems, split_problems
from megatron_rl.quickstart.sft import format_trace
from megatron_rl.quickstart.tokenizer import QUICKSTART_SYSTEM_PROMPT
from megatron_rl.rewards.template import MATH_INSTRUCTION


@pytest.fixture(scope="session")
def problems():
    """``(train, held_out)`` of a small problem set."""
    return split_problems(generate_problems(ProblemConfig(count=600, seed=3)), 0.1)


@pytest.fixture(scope="session")
def tokenizer_dir(problems, tmp_path_factory):
    from megatron_rl.quickstart.tokenizer import build_tokenizer

    train, _ = problems
    corpus = [QUICKSTART_SYSTEM_PROMPT, MATH_INSTRUCTION]
    corpus += [t for p in train for t in (p.problem, format_trace(p), format_trace(p, slip="0"))]
    return build_tokenizer(corpus, tmp_path_factory.mktemp("tok") / "tokenizer")


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from megatron_rl.quickstart.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_dir)
