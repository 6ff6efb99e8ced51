"""The translation hook: a stable 10% marked, a pluggable translator, and one served by a model
through a Generator."""

from __future__ import annotations

import pytest

from megatron_rl.data.problems import Problem
from megatron_rl.data.sampling import load_tokenizer
from megatron_rl.data.translate import (
    GeneratorTranslator,
    load_translator,
    mark_for_translation,
    translate_marked,
)
from megatron_rl.generation.api import LocalGenerator
from tests.data.translators import word_for_word


def problems(n: int, start: int = 0) -> list[Problem]:
    return [
        Problem(id=f"p{i}", problem=f"What is the sum of {i} and 1", answer=str(i + 1))
        for i in range(start, start + n)
    ]


def test_marking_takes_the_fraction_stably():
    marked, report = mark_for_translation(problems(1000), fraction=0.1, languages=["fr", "de"])
    chosen = {p.id: p.meta["translate_to"] for p in marked if "translate_to" in p.meta}
    assert 70 <= len(chosen) <= 130 and set(chosen.values()) == {"fr", "de"}
    assert report.kept == 1000 and sum(n for k, n in report.notes.items() if k.startswith("marked")) == len(
        chosen
    )
    # Adding problems does not change the marks of the others.
    more, _ = mark_for_translation(
        problems(1000) + problems(500, start=1000), fraction=0.1, languages=["fr", "de"]
    )
    assert {p.id: p.meta["translate_to"] for p in more[:1000] if "translate_to" in p.meta} == chosen
    assert not any(
        "translate_to" in p.meta
        for p in mark_for_translation(problems(50), fraction=0.0, languages=["fr"])[0]
    )
    with pytest.raises(ValueError, match="fraction"):
        mark_for_translation(problems(1), fraction=1.5, languages=["fr"])


def test_translate_marked_appends_copies_and_keeps_answers():
    marked, _ = mark_for_translation(problems(20), fraction=1.0, languages=["fr"])
    marked[3].problem = "-"  # the translator returns nothing for this one
    out, report = translate_marked(marked, word_for_word, batch_size=7, progress=False)
    copies = out[20:]
    assert len(copies) == 19 and report.dropped == {"empty_translation": 1}
    c = copies[0]
    assert (c.id, c.lang, c.answer, c.problem) == ("p0@fr", "fr", "1", "Quel est le somme de 0 et 1")
    assert c.meta == {"translated_from": "p0"}
    assert out[:20] == marked  # originals untouched


def test_unmarked_sets_pass_through_without_a_translator():
    out, report = translate_marked(problems(5), word_for_word, progress=False)
    assert out == problems(5) and report.kept == 5


def test_load_translator():
    assert load_translator("tests.data.translators:word_for_word") is word_for_word
    with pytest.raises(ValueError, match="MODULE:FUNCTION"):
        load_translator("tests.data.translators")
    with pytest.raises(ValueError, match="not a callable"):
        load_translator("tests.data.translators:WORDS")


def test_generator_translator_runs_a_served_model(random_folder):
    tok = load_tokenizer(random_folder)
    gen = LocalGenerator.from_pretrained(random_folder, max_slots=4, max_len=512)
    translate = GeneratorTranslator(gen, tok, max_new_tokens=12)
    texts = ["What is 2+2?", "Find x.", "Compute 3 * 3."]
    first = translate(texts, "fr")
    assert len(first) == 3 and all(isinstance(t, str) for t in first)
    assert translate(texts, "fr") == first  # greedy: the same model says the same thing
    assert all(first)  # the random model does write something (nothing is cut as "thinking")
