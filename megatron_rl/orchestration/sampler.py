"""The prompt sampler whose cursor is part of every checkpoint.

Problems are :class:`megatron_rl.data.problems.Problem` records (read with
:func:`~megatron_rl.data.problems.read_problems`: JSONL, Parquet or a ``datasets`` spec, errors
naming ``file:line: field``); an optional ``difficulty`` field (in ``meta``) lets curriculum
stages bound the difficulty of the problems sampled.

:class:`PromptSampler` walks a seeded permutation of the eligible problems, epoch after epoch. Its
state (epoch, position, the prompts to re-issue first, solved prompts) is a small dict saved with
each checkpoint, so a resumed run continues where the checkpoint was taken: prompts that were in
flight then are re-issued, none is skipped, none repeated beyond those.

The sampler is shared by threads (the loop's generation thread draws prompts, the trainer thread
sends groups back to be re-issued, scoring callbacks record solved prompts, the checkpoint reads
the cursor): every method that reads or changes the cursor, the re-issue queue or the solved set
takes the sampler's own lock. The difficulty bounds and ``drop_solved`` are plain attributes the
curriculum sets between steps.
"""

from __future__ import annotations

import random
import threading
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_rl.data.problems import Problem
    from megatron_rl.fileio import JsonValue

__all__ = ["PromptSampler", "difficulty"]


def difficulty(p: Problem) -> float | None:
    d = p.meta.get("difficulty")
    return float(d) if isinstance(d, (int, float)) and not isinstance(d, bool) else None


class PromptSampler:
    """Seeded epochs over the eligible problems; a checkpointable cursor (see module docstring)."""

    def __init__(self, problems: list[Problem], *, seed: int = 0, shuffle: bool = True):
        ids = [p.id for p in problems]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"problems: id {dup!r} appears more than once")
        self.problems = {p.id: p for p in problems}
        self.order = [p.id for p in problems]
        self.seed, self.shuffle = seed, shuffle
        self.min_difficulty: float | None = None
        self.max_difficulty: float | None = None
        self.drop_solved = False
        self.epoch, self.position = 0, 0
        self._lock = threading.Lock()
        self._reissue: deque[tuple[str, int]] = deque()  # (prompt id, epoch) to send again first
        self._solved: set[str] = set()
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> list[str]:
        ids = list(self.order)
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(ids)
        return ids

    def eligible(self, pid: str) -> bool:
        p = self.problems[pid]
        if self.drop_solved and pid in self._solved:
            return False
        d = difficulty(p)
        if d is not None and self.min_difficulty is not None and d < self.min_difficulty:
            return False
        if d is not None and self.max_difficulty is not None and d > self.max_difficulty:
            return False
        return True

    def next(self) -> tuple[Problem, int]:
        """The next problem and the epoch it belongs to (re-issues first)."""
        with self._lock:
            return self._next()

    def _next(self) -> tuple[Problem, int]:
        if self._reissue:
            pid, epoch = self._reissue.popleft()
            return self.problems[pid], epoch
        for _ in range(2 * len(self.order) + 2):
            if self.position >= len(self._perm):
                self.epoch += 1
                self.position = 0
                self._perm = self._permutation(self.epoch)
                if not any(self.eligible(pid) for pid in self._perm):
                    break
            pid = self._perm[self.position]
            self.position += 1
            if self.eligible(pid):
                return self.problems[pid], self.epoch
        raise RuntimeError(
            "prompt sampler: no eligible problem left (difficulty bounds or drop_solved excluded them all)"
        )

    def requeue(self, key: tuple[str, int], *, first: bool = False) -> None:
        """Send ``(prompt id, epoch)`` again before any new prompt; ``first``: ahead of those
        already waiting to be re-issued."""
        with self._lock:
            if first:
                self._reissue.appendleft(key)
            else:
                self._reissue.append(key)

    def mark_solved(self, pid: str) -> None:
        """A whole group of ``pid`` was correct (``drop_solved`` skips it from now on)."""
        with self._lock:
            self._solved.add(pid)

    def state_dict(self, pending: list[tuple[str, int]]) -> dict[str, object]:
        """The cursor; ``pending``: prompts issued but not yet trained (they are re-issued)."""
        with self._lock:
            return {
                "epoch": self.epoch,
                "position": self.position,
                "reissue": [list(x) for x in (*pending, *self._reissue)],
                "solved": sorted(self._solved),
                "min_difficulty": self.min_difficulty,
                "max_difficulty": self.max_difficulty,
                "drop_solved": self.drop_solved,
            }

    def load_state_dict(self, state: dict[str, JsonValue]) -> None:
        """Back to the cursor of :meth:`state_dict`, as read back from a checkpoint (JSON)."""
        missing = [pid for pid, _ in state["reissue"] if pid not in self.problems]
        if missing:
            raise ValueError(
                f"resume: prompts {missing[:5]} of the checkpoint are not in the problem file any more"
            )
        with self._lock:
            self.epoch, self.position = int(state["epoch"]), int(state["position"])
            self._perm = self._permutation(self.epoch)
            self._reissue = deque((str(pid), int(ep)) for pid, ep in state["reissue"])
            self._solved = set(state.get("solved", []))
            self.min_difficulty = state.get("min_difficulty")
            self.max_difficulty = state.get("max_difficulty")
            self.drop_solved = bool(state.get("drop_solved", False))
