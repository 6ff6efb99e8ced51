"""The SFT batch builder: (prompt, answer) token pairs -> :class:`TrainBatch` for the trainer's
``sft_step`` (e.g. a cold start before RL).

The loss is the mean next-token NLL over all answer tokens of the minibatch, so every answer token
gets the weight ``1 / (total answer tokens)`` -- the same normalisation-in-the-weights contract as
the GRPO batch (``batching/weights.py``): microbatches and ranks add up their partial sums. Prompt
tokens carry no loss (the collation gives label positions of prompt tokens weight 0).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_rl.types import TrainBatch, TrainSequence

__all__ = ["build_sft_batch"]


def build_sft_batch(pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> TrainBatch:
    """One :class:`TrainSequence` per ``(prompt_ids, answer_ids)`` pair.

    Every answer token has weight ``1 / sum_i |answer_i|``; advantage 0, behaviour log-probs 0 and
    version -1 (no policy produced the answer). Each sequence is its own group. Raises ValueError
    on an empty prompt or answer (there would be nothing to condition on, or nothing to learn).
    """
    total = sum(len(answer) for _, answer in pairs)
    sequences = []
    for i, (prompt, answer) in enumerate(pairs):
        if not prompt or not answer:
            raise ValueError(
                f"pair {i}: prompt ({len(prompt)} tokens) and answer "
                f"({len(answer)} tokens) must both be non-empty"
            )
        n = len(answer)
        sequences.append(
            TrainSequence(
                tokens=torch.tensor(list(prompt) + list(answer), dtype=torch.long),
                prompt_length=len(prompt),
                behaviour_logprobs=torch.zeros(n, dtype=torch.float32),
                versions=torch.full((n,), -1, dtype=torch.long),
                advantage=0.0,
                weight=1.0 / total,
                group_id=i,
            )
        )
    return TrainBatch(sequences=sequences)
