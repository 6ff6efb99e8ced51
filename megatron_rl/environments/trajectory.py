"""One multi-turn trajectory: a single list of token ids, its loss mask, and the driver.

:class:`Trajectory` holds what the trainer reads: ``token_ids`` after the prompt (the model's
turns as sampled and the environment's turns as rendered deltas, in order), ``loss_mask`` (True
where the model sampled the token), the behaviour log-prob and the policy version of each token
(``0.0`` and ``-1`` on environment tokens, which are context: no loss, no version, not counted in
the group's token normaliser or the length penalty). A trajectory may span weight updates: each
model token keeps the version that sampled it.

:class:`TrajectoryRun` is the state machine of one trajectory, shared by the synchronous driver
(:func:`run_trajectory`, for evaluation, curation and tests) and the rollouts' callbacks:
``start()`` (the environment's ``reset``: the prompt), then while ``request()`` gives the next
generation's ``(input_ids, max_new_tokens)``, ``add_model_turn(result)`` (returns the future of
the environment's ``step``, or None when the trajectory has ended), then ``finish()`` (its
optional ``score``). How it ends is ``end``:

========================  ==========================================================================
``done``                  the environment said so
``max_turns``             ``env.max_turns`` model turns (the last step's messages are not rendered)
``max_tokens``            ``env.max_tokens`` reached by a model turn or by the environment's answer
``abort``                 the generator aborted the turn (the rollouts re-send it; never trained)
``env_error`` ...         the environment failed (:class:`~megatron_rl.environments.calls.EnvFailure`)
========================  ==========================================================================

The reward stack scores ``final_text`` (the last model turn: the answer) with ``model_tokens``
as the completion length; the environment's ``score`` terms are added beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from megatron_rl.environments.calls import EnvCalls, EnvFailure, check_messages, check_step, check_terms
from megatron_rl.environments.config import EnvConfig
from megatron_rl.environments.tokens import TurnRenderer
from megatron_rl.types import FinishReason

__all__ = ["Sampled", "Trajectory", "TrajectoryRun", "run_trajectories", "run_trajectory", "wait_all"]


class Sampled(Protocol):
    """A model turn as a generator returns it (``generation.api.GenResult`` is one)."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason


@dataclass(kw_only=True)
class Trajectory:
    """A trajectory's ids after its prompt, with the per-token fields (see the module docstring)."""

    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    model_texts: list[str] = field(default_factory=list)  # each model turn, decoded (for the verifiers)
    env_messages: list[list[dict[str, Any]]] = field(default_factory=list)  # each answer, as given
    end: str = ""  # why it ended ("" while it runs)
    detail: str = ""  # the environment's failure, when it failed
    cut: bool = False  # the last model turn was cut by the token budget
    terms: dict[str, float] = field(default_factory=dict)  # the environment's reward terms

    @property
    def turns(self) -> int:
        return len(self.model_texts)

    @property
    def model_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def final_text(self) -> str:
        return self.model_texts[-1] if self.model_texts else ""

    def add(
        self,
        ids: Sequence[int],
        *,
        sampled: bool,
        logprobs: Sequence[float] = (),
        versions: Sequence[int] = (),
    ) -> None:
        n = len(ids)
        if sampled and (len(logprobs) != n or len(versions) != n):
            raise ValueError(
                f"a model turn of {n} tokens came with {len(logprobs)} log-probs, {len(versions)} versions"
            )
        self.token_ids.extend(ids)
        self.loss_mask.extend([sampled] * n)
        self.logprobs.extend(logprobs if sampled else [0.0] * n)
        self.versions.extend(versions if sampled else [-1] * n)


class TrajectoryRun:
    """The state machine of one trajectory (see the module docstring).

    ``make_env``: the environment class (called with no arguments: bind ``env.options`` first);
    ``problem``: the input record; ``decode``: ids -> text as the verifiers read it."""

    def __init__(
        self,
        make_env: Callable[[], Any],
        problem: dict[str, Any],
        *,
        calls: EnvCalls,
        tokenizer: Any,
        cfg: EnvConfig,
        stop_ids: tuple[int, ...],
        decode: Callable[[Sequence[int]], str],
    ):
        self.problem = problem
        self.calls = calls
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.stop_ids = stop_ids
        self.decode = decode
        self.trajectory = Trajectory()
        self._make_env = make_env
        self._env: Any = None
        self._renderer: TurnRenderer | None = None

    @property
    def ended(self) -> bool:
        return bool(self.trajectory.end)

    def start(self) -> Future[None]:
        """Make the environment and call its ``reset``; the future completes when the prompt is
        set (or the trajectory has ended with the failure)."""
        try:
            self._env = self._make_env()
        except Exception as e:  # noqa: BLE001 -- the user's constructor
            return self._done_future(
                EnvFailure("env_error", f"the environment's constructor raised {type(e).__name__}: {e}")
            )
        return self._then(self.calls.submit(self._env.reset, self.problem, what="reset"), self._on_reset)

    def request(self) -> tuple[list[int], int] | None:
        """``(input_ids, max_new_tokens)`` of the next model turn; None once it has ended."""
        if self.ended:
            return None
        t = self.trajectory
        return t.prompt_ids + t.token_ids, self.cfg.max_tokens - len(t.token_ids)

    def add_model_turn(self, result: Sampled) -> Future[None] | None:
        """Append a model turn; the future of the environment's answer to it (appended when it
        completes), or None when the trajectory has ended here."""
        t = self.trajectory
        if result.finish_reason == "abort":
            t.end = "abort"
            return None
        t.add(result.token_ids, sampled=True, logprobs=result.logprobs, versions=result.versions)
        t.model_texts.append(self.decode(result.token_ids))
        if result.finish_reason == "length" or len(t.token_ids) >= self.cfg.max_tokens:
            t.cut = result.finish_reason == "length"
            t.end = "max_tokens"
            return None
        last = result.token_ids[-1] if result.token_ids else None
        return self._then(
            self.calls.submit(self._env.step, t.final_text, what="step"), lambda v: self._on_step(v, last)
        )

    def finish(self) -> Future[None]:
        """The environment's ``score`` terms, if it has the method (its failure ends nothing: the
        trajectory is over; it is recorded in ``detail`` and the terms stay empty)."""
        score = getattr(self._env, "score", None)
        if not callable(score) or self.trajectory.end in ("abort",) or not self.trajectory.prompt_ids:
            return self._done_future(None)
        fut: Future[None] = Future()

        def done(f: Future[Any]) -> None:
            try:
                self.trajectory.terms = check_terms(f.result())
            except EnvFailure as e:
                self.trajectory.detail = self.trajectory.detail or f"{e.reason}: {e.detail}"
            fut.set_result(None)

        self.calls.submit(score, what="score").add_done_callback(done)
        return fut

    # -- internals ---------------------------------------------------------------------------

    def _on_reset(self, value: Any) -> None:
        start = check_messages(value, "reset", allow_empty=False)
        self._renderer = TurnRenderer(self.tokenizer, start, stop_ids=self.stop_ids)
        self.trajectory.prompt_ids = self._renderer.prompt()

    def _on_step(self, value: Any, last_token: int | None) -> None:
        messages, done = check_step(value)
        t = self.trajectory
        if done:
            t.end = "done"
            return
        if t.turns >= self.cfg.max_turns:
            t.end = "max_turns"
            return
        assert self._renderer is not None  # set by _on_reset, which ran before any model turn
        messages = [self._cut(m) for m in messages]
        delta = self._renderer.delta(messages, last_token=last_token, turn=t.turns)
        if len(t.token_ids) + len(delta) >= self.cfg.max_tokens:
            t.end = "max_tokens"  # no room for another model token after the answer
            return
        t.env_messages.append(messages)
        t.add(delta, sampled=False)

    def _cut(self, message: dict[str, Any]) -> dict[str, Any]:
        """``message`` with its content cut to ``env.message_tokens`` tokens of the model's tokenizer."""
        ids = self.tokenizer(message["content"], add_special_tokens=False)["input_ids"]
        if len(ids) <= self.cfg.message_tokens:
            return message
        kept = self.tokenizer.decode(ids[: self.cfg.message_tokens])
        return {**message, "content": f"{kept}\n[... {len(ids) - self.cfg.message_tokens} tokens cut]"}

    def _then(self, fut: Future[Any], handle: Callable[[Any], None]) -> Future[None]:
        """A future completed after ``handle(fut's value)`` has run; an :class:`EnvFailure` (from
        the call or from checking its value) ends the trajectory instead."""
        out: Future[None] = Future()

        def done(f: Future[Any]) -> None:
            try:
                handle(f.result())
            except EnvFailure as e:
                self._fail(e)
            except Exception as e:  # noqa: BLE001 -- a TemplateError or a bug: the caller stops the run with it
                out.set_exception(e)
                return
            out.set_result(None)

        fut.add_done_callback(done)
        return out

    def _fail(self, e: EnvFailure) -> None:
        self.trajectory.end = e.reason
        self.trajectory.detail = e.detail

    def _done_future(self, failure: EnvFailure | None) -> Future[None]:
        if failure is not None:
            self._fail(failure)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def run_trajectories(
    runs: Sequence[TrajectoryRun],
    generate: Callable[[list[tuple[int, list[int], int]]], Iterable[tuple[int, Sampled]]],
) -> list[Trajectory]:
    """Drive many trajectories turn by turn: every trajectory still going sends its next turn in
    one call of ``generate([(index, input_ids, max_new_tokens), ...])`` (a generator batches
    them), which yields ``(index, result)`` as each finishes; the environments' answers are
    awaited together. Evaluation and curation run an environment so; the RL loop's rollouts
    drive the same :class:`TrajectoryRun` from the fleet's callbacks instead."""
    wait_all(r.start() for r in runs)
    while True:
        turns = [(k, *req) for k, r in enumerate(runs) if (req := r.request()) is not None]
        if not turns:
            break
        steps = [runs[k].add_model_turn(result) for k, result in generate(turns)]
        wait_all(s for s in steps if s is not None)
    wait_all(r.finish() for r in runs)
    return [r.trajectory for r in runs]


def wait_all(futures: Iterable[Future[None]]) -> None:
    """Wait for every future; the first failure (a bug, a template error) is raised."""
    for f in list(futures):
        f.result()


def run_trajectory(run: TrajectoryRun, generate: Callable[[list[int], int], Sampled]) -> Trajectory:
    """Drive ``run`` to its end with ``generate(input_ids, max_new_tokens)`` (one model turn,
    waited for); its :class:`Trajectory`, scored by the environment if it scores."""
    run.start().result()
    while (req := run.request()) is not None:
        step = run.add_model_turn(generate(*req))
        if step is not None:
            step.result()
    run.finish().result()
    return run.trajectory
