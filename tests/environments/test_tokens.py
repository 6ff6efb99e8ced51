"""Token in, token out: a multi-turn trajectory is the model's sampled ids plus the environment's
rendered deltas, token for token, with a real BPE tokenizer whose round trip changes the ids."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from megatron_rl.environments.calls import EnvCalls
from megatron_rl.environments.config import EnvConfig
from megatron_rl.environments.tokens import TemplateError, TurnRenderer, check_append_only
from megatron_rl.environments.trajectory import TrajectoryRun, run_trajectory
from megatron_rl.types import FinishReason
from tests.environments.bpe import DROPS_THINKING, chatml_tokenizer

TOOL_SAYS = "Result {k}: 56088"


class Answers3Times:
    """Answers the first three model turns as a tool; the fourth is the last."""

    def __init__(self):
        self.turn = 0

    def reset(self, problem):
        return [{"role": "user", "content": problem["problem"]}]

    def step(self, text):
        self.turn += 1
        return (
            ([], True)
            if self.turn == 4
            else ([{"role": "tool", "content": TOOL_SAYS.format(k=self.turn)}], False)
        )


@dataclass
class Turn:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason = "stop"


def _run(tok, generate, cfg=None, env=Answers3Times):
    calls = EnvCalls(timeout_s=10.0)
    try:
        run = TrajectoryRun(
            env,
            {"problem": "What is 123 * 456?"},
            calls=calls,
            tokenizer=tok,
            cfg=cfg or EnvConfig(custom="python", max_turns=4, max_tokens=1024),
            stop_ids=(tok.eos_token_id,),
            decode=lambda ids: tok.decode(ids, skip_special_tokens=False),
        )
        return run_trajectory(run, generate)
    finally:
        calls.close()


def test_a_four_turn_trajectory_is_the_sampled_ids_plus_the_rendered_deltas():
    tok = chatml_tokenizer()
    text = "The answer is 56088"
    # One id per character: a sampler may emit these, and decode -> encode merges them.
    spelled = [tok(c, add_special_tokens=False)["input_ids"][0] for c in text]
    assert tok(text, add_special_tokens=False)["input_ids"] != spelled
    sampled: list[list[int]] = []

    def generate(input_ids, max_new):
        k = len(sampled)
        ids = spelled + [tok.eos_token_id]
        sampled.append(ids)
        return Turn(ids, [-0.25 - k] * len(ids), [k] * len(ids))  # each turn under another version

    t = _run(tok, generate)
    assert t.end == "done" and t.turns == 4
    # The deltas, written out: the newline after the model's own <|im_end|> is kept (verl #3720).
    deltas = [
        tok(
            f"\n<|im_start|>tool\n{TOOL_SAYS.format(k=k)}<|im_end|>\n<|im_start|>assistant\n",
            add_special_tokens=False,
        )["input_ids"]
        for k in (1, 2, 3)
    ]
    want = sampled[0] + deltas[0] + sampled[1] + deltas[1] + sampled[2] + deltas[2] + sampled[3]
    assert t.token_ids == want
    assert t.loss_mask == [
        m for s, d in zip(sampled, [*deltas, []]) for m in [True] * len(s) + [False] * len(d)
    ]
    assert [v for v, m in zip(t.versions, t.loss_mask) if m] == [k for k in range(4) for _ in sampled[k]]
    assert all(v == -1 and lp == 0.0 for v, lp, m in zip(t.versions, t.logprobs, t.loss_mask) if not m)
    assert t.model_tokens == sum(map(len, sampled))
    # The text is exactly what the template renders for the whole conversation ...
    conversation = [{"role": "user", "content": "What is 123 * 456?"}]
    for k in range(4):
        conversation.append({"role": "assistant", "content": text})
        if k < 3:
            conversation.append({"role": "tool", "content": TOOL_SAYS.format(k=k + 1)})
    whole = t.prompt_ids + t.token_ids
    assert tok.decode(whole, skip_special_tokens=False) + "\n" == tok.apply_chat_template(
        conversation, tokenize=False
    )
    # ... but re-encoding that text would train on other ids than the model sampled.
    assert tok(tok.decode(whole, skip_special_tokens=False), add_special_tokens=False)["input_ids"] != whole


def test_the_real_engine_sampling_each_turn_from_the_trajectorys_ids(tmp_path):
    import torch
    import transformers

    from megatron_rl.generation.api import GenRequest, LocalGenerator

    tok = chatml_tokenizer()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    gen = LocalGenerator.from_pretrained(tmp_path, max_slots=2, max_len=2048)
    stops = tuple(range(0, len(tok), 3))  # a third of the vocabulary ends a turn: short random turns
    results = []

    def generate(input_ids, max_new):
        req = GenRequest(
            request_id=f"t{len(results)}",
            input_ids=input_ids,
            max_new_tokens=min(max_new, 24),
            seed=len(results),
            stop_token_ids=stops,
        )
        (r,) = gen.generate([req])
        assert r.prompt_ids == input_ids  # each turn continues from the trajectory's own ids
        results.append(r)
        return r

    t = _run(tok, generate)
    assert t.end == "done" and len(results) == 4
    assert all(r.finish_reason == "stop" for r in results)
    got = [i for i, m in zip(t.token_ids, t.loss_mask) if m]
    assert got == [i for r in results for i in r.token_ids]
    assert [lp for lp, m in zip(t.logprobs, t.loss_mask) if m] == [lp for r in results for lp in r.logprobs]
    # A turn stopped by a token that is not <|im_end|>: the template's whole end of turn is the delta's.
    first_env = t.token_ids[len(results[0].token_ids) :][
        : t.loss_mask[len(results[0].token_ids) :].index(True)
    ]
    end_of_turn = tok("<|im_end|>\n<|im_start|>tool\n", add_special_tokens=False)["input_ids"]
    if results[0].token_ids[-1] != tok.eos_token_id:
        assert first_env[: len(end_of_turn)] == end_of_turn


def test_append_only_templates_pass_and_one_that_drops_thinking_is_named():
    start = [{"role": "user", "content": "What is 123 * 456?"}]
    check_append_only(chatml_tokenizer(), start, roles=("tool", "user"), turns=4)
    # Turn 2 is the first whose addition rewrites an earlier turn (turn 1 loses its thinking).
    with pytest.raises(
        TemplateError, match="turn 2: the chat template is not append-only: adding model turn 2"
    ):
        check_append_only(chatml_tokenizer(DROPS_THINKING), start, roles=("tool",))


def test_a_delta_that_rewrites_history_is_refused_with_its_turn():
    tok = chatml_tokenizer(DROPS_THINKING)
    r = TurnRenderer(tok, [{"role": "user", "content": "q"}], stop_ids=(tok.eos_token_id,))
    # The sentinel turn has no thinking, so this template stays append-only for a delta ...
    assert r.delta([{"role": "tool", "content": "4"}], last_token=tok.eos_token_id, turn=1)
    rewrites = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if messages|length > 2 %}!{% endif %}"
    tok2 = chatml_tokenizer("{% if messages|length > 2 %}#{% endif %}" + rewrites)
    r2 = TurnRenderer(tok2, [{"role": "user", "content": "q"}], stop_ids=(tok2.eos_token_id,))
    with pytest.raises(TemplateError, match="turn 3: the chat template is not append-only"):
        r2.delta([{"role": "tool", "content": "4"}], last_token=None, turn=3)


def test_a_long_environment_message_is_cut_to_its_token_budget():
    tok = chatml_tokenizer()
    long = "The result of the program is printed below. " * 40

    class Long(Answers3Times):
        def step(self, text):
            self.turn += 1
            return ([], True) if self.turn == 2 else ([{"role": "tool", "content": long}], False)

    def generate(input_ids, max_new):
        return Turn([tok.eos_token_id], [-1.0], [0])

    t = _run(tok, generate, EnvConfig(custom="python", message_tokens=16), env=Long)
    (message,) = t.env_messages[0]
    assert len(tok(long, add_special_tokens=False)["input_ids"]) > 16
    assert message["content"].endswith("tokens cut]")
    kept = message["content"].rsplit("\n[...", 1)[0]
    assert len(tok(kept, add_special_tokens=False)["input_ids"]) <= 16
