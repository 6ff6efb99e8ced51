"""A reward of your own: the boxed answer must be the right number in the unit the problem asks
for. Each record carries an extra field, ``unit``, which reaches the function in ``problem``."""

import re

from megatron_rl.rewards.format import last_boxed

UNITS = {"m": {"m", "metre", "metres", "meter", "meters"}, "s": {"s", "second", "seconds"}}
ANSWER = re.compile(r"\s*(-?\d+(?:\.\d+)?)\s*(?:\\text\{\s*(\w+)\s*\}|(\w+))?\s*")


def score(completion: str, problem: dict) -> dict:
    """1 for the right number in the right unit, 0.5 for the right number in another unit."""
    m = ANSWER.fullmatch(last_boxed(completion) or "")
    if m is None:
        return {"score": 0.0, "reason": "unparsable_answer", "detail": "no number in the box"}
    value, unit = float(m[1]), m[2] or m[3] or ""
    if abs(value - float(problem["answer"])) > 1e-9 * max(1.0, abs(value)):
        return {"score": 0.0, "reason": "wrong_answer", "detail": f"{value:g} != {problem['answer']}"}
    if unit not in UNITS[problem["unit"]]:
        return {
            "score": 0.5,
            "reason": "wrong_unit",
            "detail": f"unit {unit!r}, expected {problem['unit']!r}",
        }
    return {"score": 1.0}
