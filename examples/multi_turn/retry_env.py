"""A multi-turn environment in a few lines: the model answers; a wrong answer is told so and may
try again, up to ``env.max_turns`` turns; the reward stack scores the last answer, and the
environment adds a small bonus for getting it right on the first try."""

from megatron_rl.rewards.format import last_boxed
from megatron_rl.rewards.template import build_messages


class Retry:
    def __init__(self, system_prompt="", first_try_bonus=0.1):
        self.system_prompt = system_prompt
        self.first_try_bonus = first_try_bonus

    def reset(self, problem):
        self.answer = str(problem["answer"])
        self.turns, self.right = 0, False
        messages = build_messages(problem["problem"], "math", system_prompt=self.system_prompt)
        return messages if self.system_prompt else messages[1:]

    def step(self, assistant_text):
        self.turns += 1
        self.right = last_boxed(assistant_text) == self.answer
        if self.right:
            return [], True
        return [{"role": "user", "content": "That is not right. Check your work and answer again."}], False

    def score(self):
        return {"first_try": self.first_try_bonus if self.turns == 1 and self.right else 0.0}
