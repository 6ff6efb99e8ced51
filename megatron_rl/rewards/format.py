"""The format check (Magistral: 0.1, and a failure stops all further checks).

1. The completion starts with ``<think>`` (leading whitespace allowed: tokenizers often emit it).
2. Exactly one ``<think>`` and exactly one ``</think>``, in that order; what follows is the answer.
   (The tags are the recipe's ``reward.think_tags``; ``<think>``/``</think>`` by default.)
3. Math: the answer part holds a ``\\boxed{...}`` with balanced braces.
   Code: the answer part holds a fenced code block with a language (```` ```python ````).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from megatron_rl.config import ConfigFieldError
from megatron_rl.rewards.template import DEFAULT_THINK_TAGS

__all__ = ["FENCE_RE", "ParsedCompletion", "check_format", "check_think_tags", "last_boxed"]

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


def check_think_tags(tags: object) -> None:
    """``reward.think_tags``: two different non-empty strings without surrounding white space,
    neither inside the other (the check counts each once). Raises :class:`ConfigFieldError`."""
    if not (isinstance(tags, (list, tuple)) and len(tags) == 2 and all(isinstance(t, str) for t in tags)):
        raise ConfigFieldError(
            "think_tags",
            f'must be two strings, the opening and the closing tag (e.g. ["[THINK]", "[/THINK]"]), got {tags!r}',
        )
    think_open, think_close = tags
    for t in tags:
        if not t or t != t.strip():
            raise ConfigFieldError(
                "think_tags", f"a tag must be non-empty, without white space around it, got {t!r}"
            )
    if think_open in think_close or think_close in think_open:
        raise ConfigFieldError(
            "think_tags",
            f"neither tag may hold the other (each is counted once), got {think_open!r} and {think_close!r}",
        )


def check_format(
    text: str, task: str, tags: tuple[str, str] | list[str] = DEFAULT_THINK_TAGS
) -> tuple[ParsedCompletion | None, str]:
    """``(parsed, "")`` when the format holds (thinking between ``tags``), else ``(None, why)``."""
    think_open, think_close = tags
    body = text.lstrip()
    if not body.startswith(think_open):
        return None, f"does not start with {think_open}"
    n_open, n_close = body.count(think_open), body.count(think_close)
    if n_open != 1 or n_close != 1:
        return None, f"needs exactly one {think_open} and one {think_close}, found {n_open} and {n_close}"
    thinking, _, answer = body[len(think_open) :].partition(think_close)
    if task == "math":
        if last_boxed(answer) is None:
            return None, "no \\boxed{...} in the answer part"
    elif task == "code":
        if not FENCE_RE.search(answer):
            return None, "no fenced code block with a language in the answer part"
    else:
        raise ValueError(f"task must be 'math' or 'code', got {task!r}")
    return ParsedCompletion(thinking=thinking, answer=answer), ""
