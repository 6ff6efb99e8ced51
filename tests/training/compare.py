"""Judging the per-rank ``(error, scale)`` diffs that the layout tests collect."""

from __future__ import annotations

from collections.abc import Callable


def diff_failures(
    per_rank: list[list[dict]], tolerance: Callable[[str, float], float], *, require_scale: bool = False
) -> tuple[list[str], dict[str, int]]:
    """Lines for every diff over its tolerance, and how many diffs each layout compared.

    ``per_rank[r]`` holds rank ``r``'s results, each ``{"layout": name, "diffs": {what: (err,
    scale)}}``; ``tolerance(what, scale)`` is the largest error allowed. ``require_scale`` also
    fails a diff whose reference is all zeros (a comparison that could not fail).
    """
    bad: list[str] = []
    compared: dict[str, int] = {}
    for rank, results in enumerate(per_rank):
        for res in results:
            compared[res["layout"]] = compared.get(res["layout"], 0) + len(res["diffs"])
            for what, (err, scale) in res["diffs"].items():
                if err > tolerance(what, scale) or (require_scale and not scale > 0):
                    bad.append(f"rank {rank} {res['layout']}: {what} off by {err:.3g} (scale {scale:.3g})")
    return bad, compared
