"""The rollouts' multi-turn samples: each sample of a group a trajectory with its environment.

With ``env.custom`` set, :class:`~megatron_rl.orchestration.rollouts.Rollouts` holds a
:class:`Trajectories`: every sample of an issued group becomes a
:class:`~megatron_rl.environments.trajectory.TrajectoryRun` (its own environment instance,
``reset`` to its own prompt), and each model turn is one generation request of the trajectory's
ids so far -- the sampled ids and the environment's rendered deltas, never re-encoded text -- so
a server frees the sample's slot while its environment works (SGLang's radix cache keeps the
prefix; a re-sent turn after a lost server or an abort is the same request again). The turn's
result goes to the environment's ``step`` (a deadline, off the fleet's I/O thread: environment
calls run on threads of their own); its answer either sends the next turn or ends the
trajectory, which is then scored once, as a whole: the reward stack reads the last model turn
with the model-token count as its length, and the environment's ``score`` terms are added as
``env/<name>`` parts.

How each trajectory ended is counted (``env/<end>``: ``done``, ``max_turns``, ``max_tokens``,
``env_error``, ``env_timeout``, ``env_invalid``, ``timeout``; ``stopped``: still going when
the run stopped), and a failure's detail is logged
once per reason, so a broken environment shows in the run's metrics and never stops the run.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megatron_rl.config import ConfigFieldError
from megatron_rl.environments.calls import EnvCalls, load_environment
from megatron_rl.environments.config import EnvConfig
from megatron_rl.environments.trajectory import TrajectoryRun
from megatron_rl.errors import UsageError
from megatron_rl.generation.api import GenResult

if TYPE_CHECKING:
    from collections.abc import Sequence

    from megatron_rl.orchestration.group_record import GroupRecord

log = logging.getLogger(__name__)

__all__ = ["Trajectories"]


class Trajectories:
    """The trajectories of the rollouts' samples (see the module docstring)."""

    def __init__(
        self,
        cfg: EnvConfig,
        *,
        tokenizer: Any,
        stop_ids: tuple[int, ...],
        decode: Callable[[Sequence[int]], str],
        max_model_tokens: int,
        on_error: Callable[[BaseException], None],
    ):
        """``max_model_tokens``: the model's tokens over a whole trajectory (the reward's
        ``l_max``); each turn may use what is left of it and of ``env.max_tokens``;
        ``on_error(e)``: the run must stop (a chat template that cannot carry the trajectory)."""
        if cfg.custom is None:
            raise ValueError("Trajectories needs env.custom")
        cls = load_environment(cfg.custom)
        self.make = functools.partial(cls, **cfg.options)
        try:  # one instance now: a constructor or option error stops the run before it starts
            self.make()
        except ConfigFieldError as e:
            raise UsageError(f"env.options.{e.field}: {e.message}") from None
        except TypeError as e:
            raise UsageError(f"env.options: {cfg.custom} cannot be made with {cfg.options}: {e}") from None
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids
        self.decode = decode
        self.max_model_tokens = max_model_tokens
        self.on_error = on_error
        self.calls = EnvCalls(cfg.step_timeout_s)
        self._lock = threading.Lock()
        self._runs: dict[tuple[int, int], TrajectoryRun] = {}  # (group index, sample) -> its run
        self.ends: Counter[str] = Counter()
        self._logged: set[str] = set()

    def start(
        self, rec: GroupRecord, i: int, *, on_ready: Callable[[], None], on_end: Callable[[], None]
    ) -> None:
        """Make sample ``i``'s environment and reset it; then ``on_ready()`` (send its first
        turn) or, when the reset failed, ``on_end()``."""
        run = TrajectoryRun(
            self.make,
            rec.record if rec.record is not None else rec.problem.to_json(),
            calls=self.calls,
            tokenizer=self.tokenizer,
            cfg=self.cfg,
            stop_ids=self.stop_ids,
            decode=self.decode,
        )
        with self._lock:
            self._runs[(rec.index, i)] = run
        run.start().add_done_callback(lambda f: self._after(f, run, on_ready, on_end))

    def request(self, rec: GroupRecord, i: int) -> tuple[list[int], int, int]:
        """``(input_ids, max_new_tokens, turn)`` of sample ``i``'s next model turn."""
        run = self._run(rec, i)
        req = run.request()
        if req is None:
            raise RuntimeError(f"group {rec.prompt_id} sample {i}: its trajectory has ended")
        ids, room = req
        left = self.max_model_tokens - run.trajectory.model_tokens
        return ids, max(1, min(room, left)), run.trajectory.turns

    def turn(
        self,
        rec: GroupRecord,
        i: int,
        result: GenResult,
        *,
        on_next: Callable[[], None],
        on_end: Callable[[], None],
    ) -> None:
        """Sample ``i``'s model turn ``result`` came back: to its environment, then ``on_next()``
        (send the next turn) or ``on_end()`` (score the trajectory)."""
        run = self._run(rec, i)
        if result.meta.get("timed_out"):  # timed out twice: the trajectory ends as it stands
            run.add_model_turn(result)
            run.trajectory.end = "timeout"
            on_end()
            return
        step = run.add_model_turn(result)
        if step is None or run.trajectory.model_tokens >= self.max_model_tokens:
            run.trajectory.end = run.trajectory.end or "max_tokens"
            on_end()
            return
        step.add_done_callback(lambda f: self._after(f, run, on_next, on_end))

    def finish(
        self, rec: GroupRecord, i: int, on_scored: Callable[[GenResult, str, dict[str, float]], None]
    ) -> None:
        """The trajectory of sample ``i`` has ended: its environment's ``score``, then
        ``on_scored(result, text, terms)`` with the whole trajectory as one result."""
        run = self._run(rec, i)
        t = run.trajectory
        with self._lock:
            self.ends[t.end] += 1
            first = t.detail and t.end not in self._logged and t.end != "stopped"
            if first:
                self._logged.add(t.end)
        if first:
            log.warning(
                "environment: a trajectory ended with %s: %s (counted as env/%s)", t.end, t.detail, t.end
            )

        def scored(_f: Any) -> None:
            with self._lock:
                self._runs.pop((rec.index, i), None)
            result = GenResult.of_trajectory(f"{rec.prompt_id}#{rec.index}.{i}", t)
            on_scored(result, t.final_text, t.terms)

        run.finish().add_done_callback(scored)

    def end_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.ends)

    def close(self) -> None:
        self.calls.close()

    # -- internals ---------------------------------------------------------------------------

    def _run(self, rec: GroupRecord, i: int) -> TrajectoryRun:
        with self._lock:
            return self._runs[(rec.index, i)]

    def _after(
        self, fut: Any, run: TrajectoryRun, go_on: Callable[[], None], on_end: Callable[[], None]
    ) -> None:
        try:
            fut.result()  # the environment's own failures ended the trajectory already
        except BaseException as e:  # noqa: BLE001 -- a TemplateError or a bug: the run stops with it
            self.on_error(e)
            return
        (on_end if run.ended else go_on)()
