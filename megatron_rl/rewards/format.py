"""The format check (Magistral: 0.1, and a failure stops all further checks).

1. The completion starts with ``<think>`` (leading whitespace allowed: tokenizers often emit it).
2. Exactly one ``<think>`` and exactly one ``</think>``, in that order; what follows is the answer.
3. Math: the answer part holds a ``\\boxed{...}`` with balanced braces.
   Code: the answer part holds a fenced code block with a language (```` ```python ````).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from megatron_rl.rewards.template import THINK_CLOSE, THINK_OPEN

__all__ = ["FENCE_RE", "ParsedCompletion", "check_format", "last_boxed"]

# A fenced block: ``` + language + newline + body + closing ```. The language is required.
FENCE_RE = re.compile(r"```[ \t]*([A-Za-z][\w+#.-]*)[^\n]*\n(.*?)```", re.DOTALL)
_BOXED = "\\boxed"


@dataclass
class ParsedCompletion:
    thinking: str
    answer: str


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text``, nested and escaped braces handled.

    Returns None when there is no box or the last one is never closed. Linear in the text.
    """
    start = text.rfind(_BOXED)
    while start != -1:
        i = start + len(_BOXED)
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                c = text[j]
                if c == "\\" and j + 1 < len(text) and text[j + 1] in "{}":
                    j += 2  # \{ and \} are literal braces (sets), not grouping
                    continue
                if c == "{":
                    depth += 1
                elif c == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j]
                j += 1
            return None
        start = text.rfind(_BOXED, 0, start)  # "\boxed" not followed by "{": look further back
    return None


def check_format(text: str, task: str) -> tuple[ParsedCompletion | None, str]:
    """``(parsed, "")`` when the format holds, else ``(None, why)``."""
    body = text.lstrip()
    if not body.startswith(THINK_OPEN):
        return None, f"does not start with {THINK_OPEN}"
    n_open, n_close = body.count(THINK_OPEN), body.count(THINK_CLOSE)
    if n_open != 1 or n_close != 1:
        return None, f"needs exactly one {THINK_OPEN} and one {THINK_CLOSE}, found {n_open} and {n_close}"
    thinking, _, answer = body[len(THINK_OPEN) :].partition(THINK_CLOSE)
    if task == "math":
        if last_boxed(answer) is None:
            return None, "no \\boxed{...} in the answer part"
    elif task == "code":
        if not FENCE_RE.search(answer):
            return None, "no fenced code block with a language in the answer part"
    else:
        raise ValueError(f"task must be 'math' or 'code', got {task!r}")
    return ParsedCompletion(thinking=thinking, answer=answer), ""
