"""What a curation tool kept and dropped, and why: counts per reason, printed and saved as JSON."""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import TextIO

__all__ = ["CurationReport"]


@dataclass
class CurationReport:
    """Counts of one tool's run.

    ``kept``/``dropped`` count output records against input records (``dropped`` per reason);
    ``notes`` count changes made to kept records, or finer-grained events (a repaired test, a
    converted multiple-choice problem), so they need not add up to anything.
    """

    tool: str
    total: int = 0  # input records seen
    kept: int = 0  # records written
    dropped: Counter = field(default_factory=Counter)  # reason -> records
    notes: Counter = field(default_factory=Counter)  # event -> count

    def keep(self, n: int = 1) -> None:
        self.kept += n

    def drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] += n

    def note(self, event: str, n: int = 1) -> None:
        self.notes[event] += n

    def summary(self) -> str:
        """Human-readable lines: totals, then every drop reason and note, most frequent first."""
        lines = [f"{self.tool}: {self.total} in, kept {self.kept}, dropped {sum(self.dropped.values())}"]
        lines += [f"  dropped  {n:>8}  {reason}" for reason, n in self.dropped.most_common()]
        lines += [f"  note     {n:>8}  {event}" for event, n in self.notes.most_common()]
        return "\n".join(lines)

    def print(self, file: TextIO | None = None) -> None:
        print(self.summary(), file=file or sys.stderr)

    def to_json(self) -> dict:
        return {
            "tool": self.tool,
            "total": self.total,
            "kept": self.kept,
            "dropped": dict(self.dropped.most_common()),
            "notes": dict(self.notes.most_common()),
        }
