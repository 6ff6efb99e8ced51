import pytest

from megatron_rl.rewards.language import detect_language, language_consistent, strip_for_language

SENTENCES = {
    "en": "We add the two numbers and find that the total is five, which answers the question.",
    "fr": "Nous additionnons les deux nombres et trouvons que le total vaut cinq, ce qui répond à la question.",
    "es": "Sumamos los dos números y encontramos que el total es cinco, lo que responde a la pregunta.",
    "it": "Sommiamo i due numeri e troviamo che il totale è cinque, il che risponde alla domanda.",
    "de": "Wir addieren die beiden Zahlen und stellen fest, dass die Summe fünf ist, was die Frage beantwortet.",
    "zh": "我们把这两个数相加，发现总和是五，这就回答了这个问题。",
    "ru": "Мы складываем два числа и получаем, что сумма равна пяти, что и отвечает на вопрос.",
}


@pytest.mark.parametrize("lang", sorted(SENTENCES))
def test_detects_each_language_with_latex_and_code_stripped(lang):
    text = SENTENCES[lang] + " $\\frac{a}{b} + \\sqrt{2}$\n```python\nprint('hello world')\n```\n$$x^2$$"
    assert detect_language(text)[0] == lang


def test_whole_span_not_truncated():
    # 200 characters of English, then a long German paragraph: the whole text is German-dominant.
    text = "Let us think about this. " * 8 + SENTENCES["de"] * 6
    assert detect_language(text)[0] == "de"


def test_stripping():
    s = strip_for_language(
        "Voici $x^2$ et \\(y\\) puis \\[z\\]\n`code` \\textbf{gras} \\begin{align}a\\end{align} fin"
    )
    assert s == "Voici et puis gras fin"
    assert detect_language("$$x^2 + 1 = 2$$ ```\nx=1\n```") == (None, 0.0)


@pytest.mark.parametrize("lang", sorted(SENTENCES))
def test_consistent_when_all_three_agree(lang):
    ok, langs = language_consistent(SENTENCES[lang], SENTENCES[lang], SENTENCES[lang] + " $\\boxed{5}$")
    assert ok and set(langs.values()) == {lang}


@pytest.mark.parametrize(
    "problem, thinking, answer",
    [
        ("fr", "en", "fr"),  # reasoned in English on a French problem
        ("zh", "zh", "en"),  # summary switched language
        ("ru", "de", "ru"),
    ],
)
def test_mixed_languages_get_no_bonus(problem, thinking, answer):
    ok, langs = language_consistent(SENTENCES[problem], SENTENCES[thinking], SENTENCES[answer])
    assert not ok and langs == {"problem": problem, "thinking": thinking, "answer": answer}


def test_empty_span_is_not_consistent():
    ok, langs = language_consistent(SENTENCES["en"], SENTENCES["en"], "$\\boxed{5}$")
    assert not ok and langs["answer"] is None
