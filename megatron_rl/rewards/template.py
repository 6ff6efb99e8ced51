"""The system prompt (Magistral's, Figure 2 of the paper) and the output template it asks for.

The model answers ``<think>`` + inner monologue + ``</think>`` + a self-contained summary in
Markdown/LaTeX, both in the language of the problem. "Be as casual and as long as you want until
you are confident" is kept verbatim: the paper reports it raises entropy and helps exploration,
and that RL is sensitive to the exact prompt.
"""

from __future__ import annotations

__all__ = [
    "CODE_INSTRUCTION",
    "MATH_INSTRUCTION",
    "SYSTEM_PROMPT",
    "THINK_CLOSE",
    "THINK_OPEN",
    "build_messages",
]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

SYSTEM_PROMPT = f"""A user will ask you to solve a task. You should first draft your thinking process \
(inner monologue) until you have derived the final answer. Afterwards, write a self-contained \
summary of your thoughts (i.e. your summary should be succinct but contain all the critical steps \
you needed to reach the conclusion). You should use Markdown and LaTeX to format your response. \
Write both your thoughts and summary in the same language as the task posed by the user.

Your thinking process must follow the template below:
{THINK_OPEN}
Your thoughts or/and draft, like working through an exercise on scratch paper. Be as casual and as \
long as you want until you are confident to generate a correct answer.
{THINK_CLOSE}

Here, provide a concise summary that reflects your reasoning and presents a clear final answer to \
the user.

Problem:

"""

MATH_INSTRUCTION = "Put your final answer within \\boxed{}."
CODE_INSTRUCTION = (
    "Give your solution as one fenced code block with its language, e.g. ```python "
    "or ```cpp, reading from standard input and writing to standard output."
)


def build_messages(problem: str, task: str = "math", *, system_prompt: str = SYSTEM_PROMPT) -> list[dict]:
    """Chat messages for a problem: the system prompt, then the problem with its task instruction."""
    instruction = {"math": MATH_INSTRUCTION, "code": CODE_INSTRUCTION}.get(task)
    if instruction is None:
        raise ValueError(f"task must be 'math' or 'code', got {task!r}")
    return [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": f"{problem}\n\n{instruction}"},
    ]
