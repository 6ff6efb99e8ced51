"""Token in, token out: an environment's turn as the token delta after the model's own ids.

A trajectory is one list of ids. The model's turns are the ids it sampled, never decoded and
encoded again: a text round trip may change them (BPE merges across a turn boundary, a space the
decoder drops, an end-of-turn token that is text to one tokenizer and special to another), and
then the trainer would score tokens the policy never sampled. What the environment says is
rendered through the model's chat template and appended as the *delta*: the ids the template
puts between the end of the model's turn and the start of its next one.

:meth:`TurnRenderer.delta` finds that delta without rendering the model's text. It renders the
conversation's start (the environment's first messages) with one assistant turn holding a
sentinel, then the same with the environment's new messages and the generation prompt after it.
The second must start with the first (the template is append-only at this turn; otherwise
:class:`TemplateError` names the turn); what follows is new. The template's own text after the
assistant content (``<|im_end|>\\n`` in ChatML) belongs to the delta too, except the end-of-turn
token the model sampled itself -- so the newline after it, which verl's users lost at exactly
this boundary (verl #3720), is kept.

:func:`check_append_only` is the start-of-run check, token for token: rendering turns ``1..k+1``
starts with the ids of rendering turns ``1..k``, for an assistant turn with a thinking block and
the roles the environment answers in. A template that drops earlier thinking (Qwen3's does) or
re-renders history fails it, naming the turn; the run refuses to start rather than train on a
sequence the model would never be shown at inference.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.errors import UsageError
from megatron_rl.rewards.template import DEFAULT_THINK_TAGS, has_chat_template, merge_system

__all__ = ["TemplateError", "TurnRenderer", "check_append_only"]

_SENTINEL = "\u2063sentinel\u2063"  # invisible separators: no template writes them or strips them


class TemplateError(UsageError):
    """The chat template cannot carry a multi-turn trajectory exactly (names the turn)."""


class TurnRenderer:
    """Renders an environment's messages as token deltas with ``tokenizer``'s chat template.

    ``start``: the conversation the trajectory starts from (what the environment's ``reset``
    returned); ``stop_ids``: the ids that end a model turn (EOS, the end-of-turn token)."""

    def __init__(self, tokenizer: Any, start: list[dict[str, Any]], *, stop_ids: tuple[int, ...]):
        if not has_chat_template(tokenizer):
            raise TemplateError(
                "a multi-turn environment needs a chat template (the tokenizer has none): its turns "
                "are rendered by it; set data.chat_template to a template file"
            )
        self.tokenizer = tokenizer
        self.start = list(start)
        self.stop_ids = stop_ids
        self._merge_system = False

    def prompt(self) -> list[int]:
        """The ids of the start of the conversation with the generation prompt."""
        return self._ids(self._render(self.start, add_generation_prompt=True))

    def delta(self, messages: list[dict[str, Any]], *, last_token: int | None, turn: int) -> list[int]:
        """The ids to append after a model turn whose last sampled id is ``last_token`` (None:
        it sampled none), for the environment's ``messages``, up to and including the next
        generation prompt. ``turn`` (1-based, the model turn just ended) names it in errors."""
        before = self._render(
            [*self.start, {"role": "assistant", "content": _SENTINEL}], add_generation_prompt=False
        )
        after = self._render(
            [*self.start, {"role": "assistant", "content": _SENTINEL}, *messages], add_generation_prompt=True
        )
        if not after.startswith(before):
            raise TemplateError(
                f"turn {turn}: the chat template is not append-only: rendering the environment's "
                f"messages changes the text before them ({_first_difference(before, after)})"
            )
        tail = before[before.rindex(_SENTINEL) + len(_SENTINEL) :]  # the template's end of an assistant turn
        if last_token is not None and last_token in self.stop_ids:
            own = self.tokenizer.decode([last_token], skip_special_tokens=False)
            if own and tail.startswith(own):
                tail = tail[len(own) :]  # the model sampled that token: it is in its ids already
        return self._ids(tail + after[len(before) :])

    # -- internals ---------------------------------------------------------------------------

    def _render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        from jinja2 import TemplateError as JinjaError  # lazy: jinja2 comes with transformers

        msgs = merge_system(messages) if self._merge_system else messages
        try:
            return self.tokenizer.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except JinjaError as e:
            if not self._merge_system and messages and messages[0]["role"] == "system":
                self._merge_system = True  # as render_messages does for templates without a system role
                return self._render(messages, add_generation_prompt=add_generation_prompt)
            roles = [m["role"] for m in messages]
            raise TemplateError(f"the chat template cannot render the roles {roles}: {e}") from None

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def check_append_only(
    tokenizer: Any,
    start: list[dict[str, Any]],
    *,
    roles: tuple[str, ...] = ("user",),
    turns: int = 3,
    think_tags: tuple[str, str] | list[str] = DEFAULT_THINK_TAGS,
) -> None:
    """:class:`TemplateError` naming the first model turn whose addition (with the environment's
    answer) changes the ids of the conversation before it (see the module docstring); ``roles``:
    those the environment answers in, taken in turn; ``turns``: model turns checked."""
    renderer = TurnRenderer(tokenizer, start, stop_ids=())
    opening, closing = think_tags
    conversation = list(start)
    previous = renderer._ids(renderer._render(conversation, add_generation_prompt=True))
    for turn in range(1, turns + 1):
        conversation.append(
            {"role": "assistant", "content": f"{opening}step {turn}{closing}Answer {turn}: 12 + 3 = 15."}
        )
        conversation.append({"role": roles[(turn - 1) % len(roles)], "content": f"Result {turn}: 15\n"})
        ids = renderer._ids(renderer._render(conversation, add_generation_prompt=True))
        if ids[: len(previous)] != previous:
            pairs = enumerate(zip(previous, ids, strict=False))
            at = next((i for i, (a, b) in pairs if a != b), min(len(previous), len(ids)))
            raise TemplateError(
                f"turn {turn}: the chat template is not append-only: adding model turn {turn} changes "
                f"token {at} of the conversation before it ({tokenizer.decode(previous[at : at + 8])!r} -> "
                f"{tokenizer.decode(ids[at : at + 8])!r}); a multi-turn trajectory would train on ids "
                "the model is never shown (a template that drops earlier thinking does this: use one "
                "that keeps it, or data.chat_template)"
            )
        previous = ids


def _first_difference(a: str, b: str) -> str:
    i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"at character {i}: {a[i : i + 24]!r} became {b[i : i + 24]!r}"
