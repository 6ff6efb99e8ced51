"""A Python interpreter tool, run in the code sandbox: ``env.custom: python``.

The model is asked to solve the problem and may run Python on the way. A turn that calls the
tool gets the program's output back as a ``tool`` message (a ``user`` message for templates
without a tool role: ``env.options: {role: user}``); a turn without a call is the final answer
and ends the trajectory (the reward stack scores it). A call is either of

- ``<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>`` -- the syntax of
  chat templates that declare tools (Qwen, Hermes, SmolLM's), or
- a fenced block: three backticks, ``python``, the code, three backticks -- for templates that
  declare none;

the last call of the turn runs. The program runs as ``python -I -c CODE`` in the sandbox
(:func:`~megatron_rl.rewards.sandbox.run_sandboxed`: bubblewrap or namespaces, a throwaway uid,
no network, rlimits) with ``timeout_s`` of wall clock and ``memory_mb`` of address space; what
comes back is its stdout, then the last lines of stderr when it failed, cut to ``output_chars``
(the trajectory also cuts every message to ``env.message_tokens`` tokens).

**No state is kept between calls**: each runs in a fresh interpreter, so a name defined in one
call is gone in the next. A fresh process per call is what the sandbox guarantees (nothing
survives a run, not even a daemon), and it makes a call's output a function of its code alone,
so a re-issued trajectory replays exactly; a model that needs a value again prints it again.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from typing import Any

from megatron_rl.config import ConfigFieldError, check_choice, check_range
from megatron_rl.rewards.code import CodeConfig, interpreter
from megatron_rl.rewards.sandbox import run_sandboxed, sandbox_problem
from megatron_rl.rewards.template import THINK_CLOSE, build_messages

__all__ = ["TOOL_INSTRUCTION", "PythonTool", "parse_tool_call", "run_python"]

TOOL_INSTRUCTION = (
    "You may run Python to compute: write a fenced python code block, or "
    '<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>, and end your turn; '
    "its output comes back to you. Answer without a tool call when you are done."
)

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_FENCE = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL)


def parse_tool_call(text: str) -> str | None:
    """The code of the turn's last tool call, or None when it makes none; a ``<tool_call>``
    that is not JSON naming ``python`` with a ``code`` string is returned as a marker the tool
    answers with an error (``\\x00`` + why), so the model learns the syntax."""
    calls: list[tuple[int, str]] = []
    for m in _TOOL_CALL.finditer(text):
        try:
            call = json.loads(m.group(1))
            code = call["arguments"]["code"]
            if call.get("name") != "python" or not isinstance(code, str):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            code = '\x00tool_call must be {"name": "python", "arguments": {"code": "<program>"}}'
        calls.append((m.start(), code))
    calls += [(m.start(), m.group(1)) for m in _FENCE.finditer(text)]
    return max(calls)[1] if calls else None


def run_python(
    code: str, *, timeout_s: float, memory_mb: int, output_chars: int, sandbox: str = "auto"
) -> str:
    """What running ``code`` in the sandbox printed (see the module docstring)."""
    python, ro_paths = interpreter(CodeConfig())
    work = tempfile.mkdtemp(prefix="megatron-rl-tool-")
    try:
        res = run_sandboxed(
            [python, "-I", "-c", code],
            stdin=b"",
            workdir=work,
            timeout_s=timeout_s,
            memory_mb=memory_mb,
            output_limit_bytes=max(4096, 4 * output_chars),
            max_processes=8,
            mode=sandbox,
            extra_ro_paths=ro_paths,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = res.stdout.decode(errors="replace")
    if res.status == "sandbox_error":
        raise RuntimeError(f"the Python tool's sandbox does not work here: {res.detail}")
    if res.status != "ok":
        err = "\n".join(res.stderr.decode(errors="replace").strip().splitlines()[-5:])
        why = {"timeout": f"timed out after {timeout_s:g}s"}.get(res.status, res.status)
        out = f"{out}{err}\n[{why}]" if err else f"{out}[{why}]"
    if len(out) > output_chars:
        out = out[:output_chars] + f"\n[... {len(out) - output_chars} characters cut]"
    return out if out.strip() else "[no output: print what you need]"


class PythonTool:
    """The environment (see the module docstring). Options: ``system_prompt`` (the recipe's
    prompt is not passed in: set it here), ``role`` (``tool`` or ``user``), ``timeout_s``,
    ``memory_mb``, ``output_chars``, ``sandbox`` (``auto``, ``bwrap``, ``plain``), ``think_close``
    (the recipe's closing think tag: calls inside the thinking are not made)."""

    def __init__(
        self,
        *,
        system_prompt: str = "",
        role: str = "tool",
        timeout_s: float = 5.0,
        memory_mb: int = 512,
        output_chars: int = 2000,
        sandbox: str = "auto",
        think_close: str = THINK_CLOSE,
    ):
        check_choice("role", role, ("tool", "user"))
        check_choice("sandbox", sandbox, ("auto", "bwrap", "plain"))
        problem = sandbox_problem(sandbox)
        if problem:
            raise ConfigFieldError("sandbox", f"the Python tool cannot run here: {problem}")
        check_range("timeout_s", timeout_s, low=0.1, high=600.0)
        check_range("memory_mb", memory_mb, low=64, high=1 << 20)
        check_range("output_chars", output_chars, low=16, high=1 << 24)
        if not isinstance(system_prompt, str):
            raise ConfigFieldError("system_prompt", f"must be a string, got {system_prompt!r}")
        self.system_prompt = system_prompt
        self.role = role
        self.think_close = think_close
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.output_chars = output_chars
        self.sandbox = sandbox

    def reset(self, problem: dict[str, Any]) -> list[dict[str, Any]]:
        messages = build_messages(
            f"{problem['problem']}\n\n{TOOL_INSTRUCTION}", "math", system_prompt=self.system_prompt
        )
        return messages if self.system_prompt else messages[1:]

    def step(self, assistant_text: str) -> tuple[list[dict[str, Any]], bool]:
        # A call written inside the thinking is the model musing about one, not making it.
        code = parse_tool_call(assistant_text.rpartition(self.think_close)[2])
        if code is None:
            return [], True
        out = (
            code[1:]
            if code.startswith("\x00")
            else run_python(
                code,
                timeout_s=self.timeout_s,
                memory_mb=self.memory_mb,
                output_chars=self.output_chars,
                sandbox=self.sandbox,
            )
        )
        return [{"role": self.role, "content": out}], False
