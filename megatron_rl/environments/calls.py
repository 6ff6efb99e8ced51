"""The environment contract, the class a recipe names, and its calls under a deadline.

An environment is a class, named in the recipe as ``reward.custom`` is (``env.custom:
module:Class``, or ``python`` for :class:`~megatron_rl.environments.python_tool.PythonTool`),
made once per trajectory with ``env.options`` as keyword arguments::

    class Mine:
        def reset(self, problem: dict) -> list[dict]: ...            # the conversation to start from
        def step(self, assistant_text: str) -> tuple[list[dict], bool]: ...  # its answer, and done
        def score(self) -> dict[str, float]: ...                      # optional: reward terms it adds

``problem`` is the whole input record (every extra field of the data included); messages are
``{"role": ..., "content": str}`` dicts (``role`` one of :data:`ROLES`; other keys are passed to
the chat template as they are). Any of the three may be ``async def``.

**What goes wrong ends the trajectory, never the run.** Every call runs under
``env.step_timeout_s`` and its result is checked before anything uses it; a failure is an
:class:`EnvFailure` whose ``reason`` the run counts:

============================  =================================================================
the environment ...           reason
============================  =================================================================
raises                        ``env_error`` (``step raised ValueError: ...``)
runs past the time limit      ``env_timeout`` (a plain call keeps running on its own daemon
                              thread, which nothing waits for; an ``async`` one is cancelled)
returns something malformed   ``env_invalid`` (``step returned str, not (messages, done)``)
============================  =================================================================

Plain calls run each on a thread of its own (a hung call holds only its own thread, never a
pool's slot); ``async def`` calls on one event-loop thread shared by every trajectory.
"""

from __future__ import annotations

import asyncio
import heapq
import inspect
import itertools
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from megatron_rl.config import ConfigFieldError
from megatron_rl.rewards.custom import load_attribute

__all__ = ["ROLES", "EnvCalls", "EnvFailure", "Environment", "check_messages", "load_environment"]

#: Roles an environment message may have.
ROLES = ("system", "user", "assistant", "tool")


class Environment(Protocol):
    def reset(self, problem: dict[str, Any]) -> list[dict[str, Any]]: ...

    def step(self, assistant_text: str) -> tuple[list[dict[str, Any]], bool]: ...


class EnvFailure(Exception):
    """An environment call that failed; ``reason`` is what the run counts."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def load_environment(spec: str) -> Callable[..., Any]:
    """The class (or factory) ``spec`` names; :class:`ConfigFieldError` on ``custom`` when it
    cannot be had or does not have ``reset`` and ``step``."""
    if spec.strip() == "python":
        from megatron_rl.environments.python_tool import PythonTool  # lazy: no cycle through the tool

        return PythonTool
    cls = load_attribute(spec, "custom", kind="class")
    if not callable(cls):
        raise ConfigFieldError("custom", f"{spec!r} is a {type(cls).__name__}, not a class")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if inspect.isclass(cls) and missing:
        raise ConfigFieldError(
            "custom",
            f"{spec!r} has no {' or '.join(missing)} method; an environment answers reset(problem) and step(text)",
        )
    return cls


def check_messages(value: object, what: str, *, allow_empty: bool) -> list[dict[str, Any]]:
    """``value`` if it is a list of messages, else :class:`EnvFailure` ``env_invalid`` saying
    what is wrong with it (``what``: the call, e.g. ``"step"``)."""
    if not isinstance(value, list):
        raise EnvFailure("env_invalid", f"{what} returned {type(value).__name__}, not a list of messages")
    if not value and not allow_empty:
        raise EnvFailure("env_invalid", f"{what} returned no messages")
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise EnvFailure("env_invalid", f"{what}: message {i} is a {type(m).__name__}, not a dict")
        if m.get("role") not in ROLES:
            raise EnvFailure(
                "env_invalid", f"{what}: message {i} has role {m.get('role')!r}, not one of {list(ROLES)}"
            )
        if not isinstance(m.get("content"), str):
            raise EnvFailure(
                "env_invalid", f"{what}: message {i}'s content is {type(m.get('content')).__name__}, not str"
            )
    return value


def check_step(value: object) -> tuple[list[dict[str, Any]], bool]:
    """A step's ``(messages, done)``, checked (:class:`EnvFailure` ``env_invalid`` otherwise)."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise EnvFailure("env_invalid", f"step returned {type(value).__name__}, not (messages, done)")
    messages, done = value
    if not isinstance(done, bool):
        raise EnvFailure("env_invalid", f"step's done is {type(done).__name__}, not bool")
    return check_messages(messages, "step", allow_empty=done), done


def check_terms(value: object) -> dict[str, float]:
    """A score's reward terms: ``{name: finite number}`` (None: no terms)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise EnvFailure("env_invalid", f"score returned {type(value).__name__}, not a dict of reward terms")
    out: dict[str, float] = {}
    for k, v in value.items():
        if (
            not isinstance(k, str)
            or isinstance(v, bool)
            or not isinstance(v, (int, float))
            or not math.isfinite(v)
        ):
            raise EnvFailure("env_invalid", f"score: term {k!r} is {v!r}, not a finite number")
        out[k] = float(v)
    return out


class EnvCalls:
    """Runs environment calls with a deadline: :meth:`submit` returns a future that holds the
    call's result, or an :class:`EnvFailure` (raised, timed out), whichever comes first. One
    instance serves every trajectory of a run; :meth:`close` stops its threads."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._deadlines: list[tuple[float, int, Future[Any], str]] = []
        self._order = itertools.count()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer = threading.Thread(target=self._expire, name="env-deadlines", daemon=True)
        self._timer.start()

    def submit(self, fn: Callable[..., Any], *args: Any, what: str) -> Future[Any]:
        """``fn(*args)`` (plain or ``async def``) under the deadline; ``what`` names the call in
        failures (``"step"``)."""
        fut: Future[Any] = Future()
        fut.set_running_or_notify_cancel()
        with self._lock:
            if self._closed:  # the run is stopping: a trajectory still going ends here
                fut.set_exception(EnvFailure("stopped", f"{what}: the run is stopping"))
                return fut
            heapq.heappush(self._deadlines, (time.monotonic() + self.timeout_s, next(self._order), fut, what))
            self._wake.notify()
        if inspect.iscoroutinefunction(fn):  # async def (a bound method too)
            task = asyncio.run_coroutine_threadsafe(self._guard_async(fn, args, what), self._event_loop())
            task.add_done_callback(lambda t: None if t.cancelled() else _settle(fut, t.result()))
            fut.add_done_callback(lambda _f: task.cancel())  # a timed-out coroutine is cancelled
        else:
            threading.Thread(
                target=self._run, args=(fn, args, what, fut), name=f"env-{what}", daemon=True
            ).start()
        return fut

    def call(self, fn: Callable[..., Any], *args: Any, what: str) -> Any:
        """:meth:`submit`, waited for: the result, or the :class:`EnvFailure` raised."""
        return self.submit(fn, *args, what=what).result()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)

    # -- internals ---------------------------------------------------------------------------

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], what: str, fut: Future[Any]) -> None:
        try:
            value = fn(*args)
        except BaseException as e:  # noqa: BLE001 -- whatever the environment raises ends its trajectory
            value = EnvFailure("env_error", f"{what} raised {type(e).__name__}: {e}")
        _settle(fut, value)

    async def _guard_async(self, fn: Callable[..., Any], args: tuple[Any, ...], what: str) -> Any:
        try:
            return await fn(*args)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 -- as in _run
            return EnvFailure("env_error", f"{what} raised {type(e).__name__}: {e}")

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="env-async", daemon=True).start()
                self._loop = loop
            return self._loop

    def _expire(self) -> None:
        while True:
            expired: list[tuple[Future[Any], str]] = []
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                while self._deadlines and (self._deadlines[0][0] <= now or self._deadlines[0][2].done()):
                    _, _, fut, what = heapq.heappop(self._deadlines)
                    if not fut.done():
                        expired.append((fut, what))
                if not expired:
                    self._wake.wait(self._deadlines[0][0] - now if self._deadlines else None)
            # Settled outside the lock: a future's callbacks may submit the trajectory's next call.
            for fut, what in expired:
                _settle(fut, EnvFailure("env_timeout", f"{what} ran past {self.timeout_s:g}s"))


def _settle(fut: Future[Any], value: Any) -> None:
    """Complete ``fut`` with ``value`` (an :class:`EnvFailure` as its exception) unless the
    other side (the call or its deadline) already did."""
    try:
        if isinstance(value, EnvFailure):
            fut.set_exception(value)
        else:
            fut.set_result(value)
    except Exception:  # noqa: BLE001 -- InvalidStateError: the deadline or the call came first
        pass
