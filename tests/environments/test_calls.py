"""Environments that raise, hang or return garbage end their trajectory with a counted reason;
the calls, plain or async, keep their deadline with a thousand in flight."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from concurrent.futures import wait

import pytest

from megatron_rl.config import ConfigFieldError
from megatron_rl.environments.calls import EnvCalls, EnvFailure, load_environment
from megatron_rl.environments.config import EnvConfig
from megatron_rl.environments.python_tool import PythonTool
from megatron_rl.environments.trajectory import TrajectoryRun, run_trajectory
from tests.environments.bpe import chatml_tokenizer
from tests.environments.test_tokens import Turn

RELEASE = threading.Event()  # set when the module's tests are done: the hung threads then return


@pytest.fixture(autouse=True, scope="module")
def _release_hung_threads():
    yield
    RELEASE.set()


class Good:
    def reset(self, problem):
        return [{"role": "user", "content": problem["problem"]}]

    def step(self, text):
        return [{"role": "tool", "content": "ok"}], False


class Raises(Good):
    def step(self, text):
        raise ValueError("the tool broke")


class Hangs(Good):
    def step(self, text):
        RELEASE.wait(60)
        return [], True


class NotAList(Good):
    def step(self, text):
        return "ok", False


class DoneNotBool(Good):
    def step(self, text):
        return [], "yes"


class BadRole(Good):
    def step(self, text):
        return [{"role": "robot", "content": "hi"}], False


class ResetRaises(Good):
    def reset(self, problem):
        raise KeyError("problem")


class ConstructorRaises(Good):
    def __init__(self):
        raise RuntimeError("no licence")


class AsyncRaises(Good):
    async def step(self, text):
        await asyncio.sleep(0)
        raise ValueError("async broke")


class AsyncHangs(Good):
    cancelled = 0

    async def step(self, text):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            AsyncHangs.cancelled += 1
            raise
        return [], True


class AsyncGarbage(Good):
    async def step(self, text):
        return {"messages": []}


class NanScore(Good):
    def step(self, text):
        return [], True

    def score(self):
        return {"bonus": float("nan")}


class Scores(Good):
    async def step(self, text):
        return [], True

    async def score(self):
        return {"bonus": 0.5}


def _trajectory(env, timeout_s=0.3):
    tok = chatml_tokenizer()
    calls = EnvCalls(timeout_s=timeout_s)
    try:
        run = TrajectoryRun(
            env,
            {"problem": "What is 2 + 2?"},
            calls=calls,
            tokenizer=tok,
            cfg=EnvConfig(custom="python", max_turns=3),
            stop_ids=(tok.eos_token_id,),
            decode=tok.decode,
        )
        return run_trajectory(run, lambda ids, n: Turn([tok.eos_token_id], [-1.0], [0]))
    finally:
        calls.close()


@pytest.mark.parametrize(
    ("env", "reason", "detail"),
    [
        (Raises, "env_error", "step raised ValueError: the tool broke"),
        (Hangs, "env_timeout", "step ran past 0.3s"),
        (NotAList, "env_invalid", "step returned str, not a list of messages"),
        (DoneNotBool, "env_invalid", "step's done is str, not bool"),
        (BadRole, "env_invalid", "step: message 0 has role 'robot'"),
        (ResetRaises, "env_error", "reset raised KeyError"),
        (ConstructorRaises, "env_error", "the environment's constructor raised RuntimeError: no licence"),
        (AsyncRaises, "env_error", "step raised ValueError: async broke"),
        (AsyncHangs, "env_timeout", "step ran past 0.3s"),
        (AsyncGarbage, "env_invalid", "step returned dict, not (messages, done)"),
    ],
)
def test_a_failing_environment_ends_its_trajectory_with_the_reason(env, reason, detail):
    t = _trajectory(env)
    assert t.end == reason
    assert detail in t.detail
    assert t.turns == (0 if env in (ResetRaises, ConstructorRaises) else 1)


def test_an_async_call_past_its_deadline_is_cancelled():
    before = AsyncHangs.cancelled
    _trajectory(AsyncHangs)
    deadline = time.monotonic() + 5
    while AsyncHangs.cancelled == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert AsyncHangs.cancelled == before + 1


def test_score_terms_are_checked_and_added():
    assert _trajectory(Scores).terms == {"bonus": 0.5}
    t = _trajectory(NanScore)
    assert t.end == "done" and t.terms == {}
    assert "score: term 'bonus' is nan" in t.detail


def test_a_thousand_calls_in_flight_each_end_by_result_or_deadline():
    calls = EnvCalls(timeout_s=0.5)
    try:

        async def quick(i):
            await asyncio.sleep(0.01)
            return i

        def hang(i):
            RELEASE.wait(60)
            return i

        futures = [calls.submit(quick if i % 2 else hang, i, what="step") for i in range(1000)]
        _done, pending = wait(futures, timeout=60)
        assert not pending
        outcomes = Counter(
            "ok" if f.exception() is None and f.result() == i else f.exception().reason  # type: ignore[union-attr]
            for i, f in enumerate(futures)
        )
        assert outcomes == {"ok": 500, "env_timeout": 500}
        assert all(isinstance(futures[i].exception(), EnvFailure) for i in range(0, 1000, 2))
    finally:
        calls.close()


def test_the_recipe_names_an_environment_class_or_the_built_in_tool(tmp_path, monkeypatch):
    assert load_environment("python") is PythonTool
    assert load_environment("tests.environments.test_calls:Good") is Good
    with pytest.raises(ConfigFieldError, match="no module named 'no_such_env'"):
        load_environment("no_such_env:Env")
    with pytest.raises(ConfigFieldError, match="has no attribute 'Missing'"):
        load_environment("tests.environments.test_calls:Missing")
    (tmp_path / "half_env.py").write_text("class Env:\n    def reset(self, problem):\n        return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigFieldError, match="has no step method"):
        load_environment("half_env:Env")
    with pytest.raises(ConfigFieldError, match="cannot be loaded by the worker processes"):
        load_environment("__main__:Env")
