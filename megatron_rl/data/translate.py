"""Translation hook: mark a share of problems for translation, and translate the marked ones
through any translator.

Magistral trains on problems in several languages so the language reward has something to ask
for. Here the pipeline works in two steps, and runs unchanged without a translator:

1. :func:`mark_for_translation` picks ``fraction`` (default 10%) of the problems -- by a hash of
   ``(seed, id)``, so the choice is stable when the set grows -- and writes the target language
   into each picked record as ``translate_to`` (languages taken in turn by the same hash);
2. :func:`translate_marked` calls a *translator* on the marked statements and appends a
   translated copy of each (id ``ID@LANG``, ``lang`` set, ``translated_from`` the source id;
   the answer and tests are unchanged). Originals are kept.

A translator is any callable ``(texts: list[str], language: str) -> list[str]``: a Python function
named on the command line as ``module:function``, or :class:`GeneratorTranslator`, which asks any
served model (a :class:`~megatron_rl.generation.api.Generator` and its tokenizer) to translate.
"""

from __future__ import annotations

import hashlib
import importlib
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace

from tqdm import tqdm

from megatron_rl.data.problems import Problem
from megatron_rl.data.report import CurationReport
from megatron_rl.data.sampling import stop_token_ids
from megatron_rl.errors import UsageError
from megatron_rl.generation.api import GenRequest
from megatron_rl.rewards.language import detect_language

__all__ = [
    "LANGUAGE_NAMES",
    "GeneratorTranslator",
    "Translator",
    "load_translator",
    "mark_for_translation",
    "translate_marked",
]

Translator = Callable[[Sequence[str], str], list[str]]

LANGUAGE_NAMES = {
    "en": "English",
    "fr": "French",
    "de": "German",
    "es": "Spanish",
    "it": "Italian",
    "pt": "Portuguese",
    "ru": "Russian",
    "zh": "Chinese",
    "ja": "Japanese",
    "ko": "Korean",
    "ar": "Arabic",
    "hi": "Hindi",
    "nl": "Dutch",
    "pl": "Polish",
    "tr": "Turkish",
    "uk": "Ukrainian",
}


def _unit(seed: int, key: str) -> float:
    """A number in [0, 1) fixed by (seed, key). (A cryptographic hash: CRC32 is linear, and
    ids that differ in one digit would land close together.)"""
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def mark_for_translation(
    problems: Sequence[Problem], *, fraction: float = 0.1, languages: Sequence[str], seed: int = 0
) -> tuple[list[Problem], CurationReport]:
    """Every problem, ``fraction`` of them with ``translate_to`` set (see the module docstring).
    A problem already in a target language is not marked for it; one without a ``lang`` field has
    its statement's language detected (fastText, as the language reward does), and the report
    counts those."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction: must be in [0, 1], got {fraction}")
    if not languages:
        raise ValueError("languages: give at least one target language")
    report = CurationReport("curate translate-mark", total=len(problems))
    out = []
    for p in problems:
        if _unit(seed, p.id) >= fraction:
            out.append(p)
            continue
        source = p.lang
        if source is None:  # no `lang` field: what the statement is in decides what it is not
            source = detect_language(p.problem)[0]
            report.note(f"no lang field: detected {source or 'no language'}")
        choices = [lang for lang in languages if lang != source]
        if not choices:
            report.note("already in the only target language")
            out.append(p)
            continue
        lang = choices[int(_unit(seed + 1, p.id) * len(choices))]
        out.append(replace(p, meta={**p.meta, "translate_to": lang}))
        report.note(f"marked for {lang}")
    report.keep(len(out))
    return out, report


def translate_marked(
    problems: Sequence[Problem], translator: Translator, *, batch_size: int = 32, progress: bool = True
) -> tuple[list[Problem], CurationReport]:
    """The problems followed by a translated copy of each marked one (see the module docstring).
    An empty translation is not written (``empty_translation``)."""

    report = CurationReport("curate translate", total=len(problems))
    by_lang: dict[str, list[Problem]] = {}
    for p in problems:
        if p.meta.get("translate_to"):
            by_lang.setdefault(p.meta["translate_to"], []).append(p)
    copies: list[Problem] = []
    bar = tqdm(
        total=sum(map(len, by_lang.values())),
        desc="translate",
        unit="problem",
        file=sys.stderr,
        disable=not progress,
    )
    try:
        for lang, todo in by_lang.items():
            for start in range(0, len(todo), batch_size):
                batch = todo[start : start + batch_size]
                texts = translator([p.problem for p in batch], lang)
                if len(texts) != len(batch):
                    raise ValueError(f"translator returned {len(texts)} texts for {len(batch)}")
                for p, text in zip(batch, texts):
                    if not text or not text.strip():
                        report.drop("empty_translation")
                        continue
                    meta = {k: v for k, v in p.meta.items() if k != "translate_to"}
                    copies.append(
                        replace(
                            p,
                            id=f"{p.id}@{lang}",
                            problem=text.strip(),
                            lang=lang,
                            meta={**meta, "translated_from": p.id},
                        )
                    )
                    report.note(f"translated to {lang}")
                bar.update(len(batch))
    finally:
        bar.close()
    report.keep(len(problems) + len(copies))
    return list(problems) + copies, report


_THOUGHTS = re.compile(r"^.*?</think>", re.DOTALL)

TRANSLATION_PROMPT = (
    "Translate the following problem into {language}. Keep every number, formula, LaTeX command, "
    "code identifier and input/output example exactly as it is; translate only the prose. Reply "
    "with the translation only.\n\n{text}"
)


class GeneratorTranslator:
    """A translator served by any model: one greedy chat request per statement through a
    :class:`~megatron_rl.generation.api.Generator` (the in-process engine or the fleet).

    A reasoning model's ``<think>...</think>`` part, if any, is cut from the reply.
    """

    def __init__(self, generator, tokenizer, *, max_new_tokens: int = 2048, prompt: str = TRANSLATION_PROMPT):
        self.generator = generator
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.prompt = prompt

    def __call__(self, texts: Sequence[str], language: str) -> list[str]:

        name = LANGUAGE_NAMES.get(language, language)
        requests = []
        for i, text in enumerate(texts):
            messages = [{"role": "user", "content": self.prompt.format(language=name, text=text)}]
            rendered = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            ids = self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
            requests.append(
                GenRequest(
                    request_id=str(i),
                    input_ids=list(ids),
                    max_new_tokens=self.max_new_tokens,
                    temperature=0.0,
                    stop_token_ids=stop_token_ids(self.tokenizer),
                )
            )
        out = [""] * len(texts)
        for res in self.generator.generate(requests):
            reply = self.tokenizer.decode(res.token_ids, skip_special_tokens=True)
            out[int(res.request_id)] = _THOUGHTS.sub("", reply).strip()
        return out


def load_translator(spec: str) -> Translator:
    """``module:function`` -> that callable (a user's own translator)."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise UsageError(f"--translator: expected MODULE:FUNCTION, got {spec!r}")
    try:
        fn = getattr(importlib.import_module(module), name, None)
    except Exception as e:  # noqa: BLE001 -- the user's module: missing, or failing as it imports
        raise UsageError(f"--translator: cannot import module {module!r}: {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise UsageError(
            f"--translator: {spec!r} is not a callable (module {module!r} has no function {name!r})"
        )
    return fn
