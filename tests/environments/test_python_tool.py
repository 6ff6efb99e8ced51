"""The Python tool: calls parsed in both syntaxes, run in the real sandbox, output cut; a
trajectory that calls it and then answers."""

from __future__ import annotations

import socket

import pytest

from megatron_rl.environments.calls import EnvCalls
from megatron_rl.environments.config import EnvConfig
from megatron_rl.environments.python_tool import PythonTool, parse_tool_call
from megatron_rl.environments.trajectory import TrajectoryRun, run_trajectory
from megatron_rl.rewards.sandbox import sandbox_problem
from tests.environments.bpe import chatml_tokenizer
from tests.environments.test_tokens import Turn

needs_sandbox = pytest.mark.skipif(
    bool(sandbox_problem("auto")), reason=f"no code sandbox here: {sandbox_problem('auto')}"
)
FENCE = "```"


def test_tool_calls_are_parsed_in_both_syntaxes_and_the_last_one_runs():
    assert parse_tool_call("The answer is \\boxed{4}.") is None
    assert parse_tool_call(f"Let me compute.\n{FENCE}python\nprint(2 + 2)\n{FENCE}") == "print(2 + 2)\n"
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
    assert parse_tool_call(call) == "print(6 * 7)"
    assert parse_tool_call(f"{call}\n{FENCE}py\nprint(1)\n{FENCE}") == "print(1)\n"
    bad = parse_tool_call('<tool_call>{"name": "shell", "arguments": {"cmd": "ls"}}</tool_call>')
    assert bad is not None and bad.startswith("\x00tool_call must be")
    assert parse_tool_call("<tool_call>not json</tool_call>").startswith("\x00")


@needs_sandbox
def test_the_tool_runs_code_in_the_sandbox_and_answers_what_it_printed():
    tool = PythonTool(timeout_s=2.0, output_chars=200)
    assert tool.step(f"{FENCE}python\nprint(123 * 456)\n{FENCE}") == (
        [{"role": "tool", "content": "56088\n"}],
        False,
    )
    assert tool.step("No call: \\boxed{56088}") == ([], True)
    # Inside the thinking a call is only mused about.
    assert tool.step(f"<think>{FENCE}python\nprint(1)\n{FENCE}</think>\\boxed{{1}}") == ([], True)
    (err,), _ = tool.step(f"{FENCE}python\n1 / 0\n{FENCE}")
    assert "ZeroDivisionError: division by zero" in err["content"]
    (slow,), _ = tool.step(f"{FENCE}python\nwhile True:\n    pass\n{FENCE}")
    assert slow["content"].endswith("[timed out after 2s]")
    (big,), _ = tool.step(f"{FENCE}python\nprint('x' * 10000)\n{FENCE}")
    assert len(big["content"]) < 300 and big["content"].endswith("characters cut]")
    (quiet,), _ = tool.step(f"{FENCE}python\nx = 1\n{FENCE}")
    assert quiet["content"] == "[no output: print what you need]"


@needs_sandbox
def test_the_tool_cannot_reach_the_hosts_loopback():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        code = (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
        )
        (out,), _ = PythonTool(timeout_s=3.0).step(f"{FENCE}python\n{code}\n{FENCE}")
    assert "connected" not in out["content"]
    assert "Error" in out["content"]


@needs_sandbox
def test_a_trajectory_calls_the_tool_then_answers():
    tok = chatml_tokenizer()
    turns = [f"{FENCE}python\nprint(123 * 456)\n{FENCE}", "The answer is \\boxed{56088}."]

    def generate(input_ids, max_new):
        ids = tok(turns.pop(0), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return Turn(ids, [-0.5] * len(ids), [3] * len(ids))

    calls = EnvCalls(timeout_s=10.0)
    try:
        run = TrajectoryRun(
            lambda: PythonTool(timeout_s=5.0),
            {"problem": "What is 123 * 456?"},
            calls=calls,
            tokenizer=tok,
            cfg=EnvConfig(custom="python"),
            stop_ids=(tok.eos_token_id,),
            decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
        )
        t = run_trajectory(run, generate)
    finally:
        calls.close()
    assert t.end == "done" and t.turns == 2
    assert t.env_messages == [[{"role": "tool", "content": "56088\n"}]]
    assert t.final_text == "The answer is \\boxed{56088}."
    assert "What is 123 * 456?" in tok.decode(t.prompt_ids) and "run Python" in tok.decode(t.prompt_ids)
