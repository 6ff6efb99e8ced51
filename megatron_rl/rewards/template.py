"""The system prompt (Magistral's, Figure 2 of the paper), the output template it asks for, and
the chat messages of a prompt (rendered by a tokenizer's chat template, or as plain text for a
tokenizer without one: :func:`render_plain`).

The model answers ``<think>`` + inner monologue + ``</think>`` + a self-contained summary in
Markdown/LaTeX, both in the language of the problem. The tags are the recipe's
(``reward.think_tags``): Magistral Small/Medium 1.2 think between the single special tokens
``[THINK]`` and ``[/THINK]`` (:data:`MAGISTRAL_THINK_TAGS`); :func:`system_prompt` writes the
paper's prompt with the run's tags. "Be as casual and as long as you want until
you are confident" is kept verbatim: the paper reports it raises entropy and helps exploration,
and that RL is sensitive to the exact prompt.
"""

from __future__ import annotations

__all__ = [
    "CODE_INSTRUCTION",
    "DEFAULT_THINK_TAGS",
    "MAGISTRAL_THINK_TAGS",
    "MATH_INSTRUCTION",
    "SYSTEM_PROMPT",
    "THINK_CLOSE",
    "THINK_OPEN",
    "build_messages",
    "fill_think_tags",
    "has_chat_template",
    "merge_system",
    "render_messages",
    "render_plain",
    "resolve_system_prompt",
    "system_prompt",
]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
DEFAULT_THINK_TAGS = (THINK_OPEN, THINK_CLOSE)
MAGISTRAL_THINK_TAGS = ("[THINK]", "[/THINK]")  # Magistral 1.2's: single special tokens of its tekken


def fill_think_tags(text: str, tags: tuple[str, str] | list[str] = DEFAULT_THINK_TAGS) -> str:
    """``text`` with ``{think_open}`` and ``{think_close}`` replaced by ``tags`` (a recipe's own
    system prompt may name the run's tags so; nothing else in it is read as a placeholder)."""
    return text.replace("{think_open}", tags[0]).replace("{think_close}", tags[1])


def system_prompt(tags: tuple[str, str] | list[str] = DEFAULT_THINK_TAGS) -> str:
    """Magistral's system prompt (Figure 2 of the paper) with ``tags`` as its template's."""
    think_open, think_close = tags
    return f"""A user will ask you to solve a task. You should first draft your thinking process \
(inner monologue) until you have derived the final answer. Afterwards, write a self-contained \
summary of your thoughts (i.e. your summary should be succinct but contain all the critical steps \
you needed to reach the conclusion). You should use Markdown and LaTeX to format your response. \
Write both your thoughts and summary in the same language as the task posed by the user.

Your thinking process must follow the template below:
{think_open}
Your thoughts or/and draft, like working through an exercise on scratch paper. Be as casual and as \
long as you want until you are confident to generate a correct answer.
{think_close}

Here, provide a concise summary that reflects your reasoning and presents a clear final answer to \
the user.

Problem:

"""


SYSTEM_PROMPT = system_prompt()

MATH_INSTRUCTION = "Put your final answer within \\boxed{}."
CODE_INSTRUCTION = (
    "Give your solution as one fenced code block with its language, e.g. ```python "
    "or ```cpp, reading from standard input and writing to standard output."
)


def resolve_system_prompt(value: str, tags: tuple[str, str] | list[str] = DEFAULT_THINK_TAGS) -> str:
    """A recipe's ``data.system_prompt``: "paper" is Magistral's with ``tags``, "none" is no
    system prompt, anything else is the text itself with its ``{think_open}``/``{think_close}``
    filled with ``tags``."""
    if value == "paper":
        return system_prompt(tags)
    return "" if value == "none" else fill_think_tags(value, tags)


def build_messages(problem: str, task: str = "math", *, system_prompt: str = SYSTEM_PROMPT) -> list[dict]:
    """Chat messages for a problem: the system prompt, then the problem with its task instruction."""
    instruction = {"math": MATH_INSTRUCTION, "code": CODE_INSTRUCTION}.get(task)
    if instruction is None:
        raise ValueError(f"task must be 'math' or 'code', got {task!r}")
    return [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": f"{problem}\n\n{instruction}"},
    ]


def render_plain(messages: list[dict]) -> str:
    """The prompt as plain text, for a tokenizer without a chat template (a base model): the
    messages' contents, each stripped of trailing white space, separated and ended by a blank
    line. Magistral's system prompt ends with ``Problem:``, so the text reads as the paper's
    prompt followed by the problem; the completion starts on a new paragraph."""
    return "".join(f"{m['content'].rstrip()}\n\n" for m in messages)


def merge_system(messages: list[dict]) -> list[dict]:
    """The messages with a leading system message folded into the first user message (system
    text, a blank line, the user text), for chat templates that refuse a system role."""
    if not messages or messages[0]["role"] != "system" or len(messages) < 2:
        return messages
    system, user, *rest = messages
    return [{**user, "content": f"{system['content'].rstrip()}\n\n{user['content']}"}, *rest]


def has_chat_template(tokenizer) -> bool:
    """Whether the tokenizer carries a chat template (``tokenizer_config.json``'s
    ``chat_template``, or ``chat_template.jinja`` beside it)."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_messages(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` as the model reads them.

    With a chat template: rendered by it and tokenized without adding special tokens (the
    template holds any BOS it wants). A template that refuses a system role (it raises, as some
    Mistral and Gemma templates do) gets the system message folded into the first user message
    (:func:`merge_system`). Without a template (a base model): :func:`render_plain`, with the
    tokenizer's own special tokens (its BOS)."""
    if not has_chat_template(tokenizer):
        return list(tokenizer(render_plain(messages))["input_ids"])
    from jinja2 import TemplateError  # lazy: jinja2 comes with transformers, like the tokenizer

    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except TemplateError:
        if not messages or messages[0]["role"] != "system":
            raise
        text = tokenizer.apply_chat_template(
            merge_system(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
