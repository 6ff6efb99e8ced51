"""The recipe's problem sets: ``data.*`` read into the training problems and the held-out ones,
every problem checked before anything of the run starts (:func:`read_problem_sets`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_rl.data.problems import DataError, OptionError, hold_out, read_problems

if TYPE_CHECKING:
    from megatron_rl.data.problems import Problem
    from megatron_rl.orchestration.config import DataConfig

__all__ = ["read_problem_sets"]


def read_problem_sets(
    data: DataConfig, *, needs_reference: bool = True
) -> tuple[list[Problem], list[Problem] | None]:
    """The training problems and the held-out ones (None without ``data.eval`` or
    ``data.eval_fraction``), read as ``data`` says: column mapping, split, filter, limit,
    hold-out. Every problem is checked before anything starts (a math problem without an answer
    is a file:line error here, not a group that can never be scored an hour in); an option the
    data cannot satisfy names its recipe field (``data.where.source: no record of ... has a
    column 'source'``). ``needs_reference`` False: a custom reward replaces the built-in check, so
    a problem needs no reference answer or tests."""
    if not data.train:
        raise ValueError("data.train: required (a file, a datasets folder or hf:NAME of problems)")

    def option(e: OptionError, split_field: str) -> DataError:  # a recipe field the data cannot satisfy
        name = split_field if e.option == "split" else f"data.{e.option}"
        return DataError(f"{name}: {e.message}")

    try:
        problems = read_problems(
            data.train,
            scorable=True,
            needs_reference=needs_reference,
            columns=data.columns,
            where=data.where,
            limit=data.limit or None,
            split=data.split,
        )
    except OptionError as e:
        raise option(e, "data.split") from None
    if not problems:
        raise DataError(f"data.train: {data.train} holds no problems")
    eval_problems = None
    if data.eval:
        try:
            eval_problems = read_problems(
                data.eval,
                scorable=True,
                needs_reference=needs_reference,
                columns=data.columns,
                split=data.eval_split,
                default_split=None,
            )
        except OptionError as e:
            raise option(e, "data.eval_split") from None
    elif data.eval_fraction:
        try:
            problems, eval_problems = hold_out(problems, data.eval_fraction, seed=data.holdout_seed)
        except ValueError as e:
            raise DataError(f"data.eval_fraction: {e}") from None
    return problems, eval_problems
