"""Your own reward, named in the recipe: ``fn(completion: str, problem: dict) -> float | dict``.

    reward:
      custom: unit_reward:score      # module:function (installed, or its folder on PYTHONPATH)
      custom: unit_match             # or a name a package registers (entry-point group below)
      custom_mode: replace           # replace the correctness term (default), or add beside it
      custom_weight: 1.0             # the term is custom_weight * score

A value with ``:`` is ``module:attribute`` (the attribute may be dotted, ``module:Class.method``);
any other value is the name of a reward that an installed package registers in the
``megatron_rl.rewards`` entry-point group, in its ``pyproject.toml``::

    [project.entry-points."megatron_rl.rewards"]
    unit_match = "my_package.rewards:unit_match"

:func:`resolve` runs when the recipe is read (``RewardConfig.__post_init__``): an unknown name, a
module that does not import, a missing attribute, something that is not callable or cannot be
called with two arguments is a :class:`ConfigFieldError` on ``custom`` (the loader reports it as
``FILE:LINE: reward.custom: ...``), before anything starts.

The function is called in the verifier pool's workers (``rewards/pool.py``), after the format check
has passed (a format failure scores 0 and stops, as for the built-in verifiers). The workers
import its module by name and do not run the script that started them, so ``__main__:score`` is
refused: a reward lives in a module of its own.
``completion`` is the whole completion text, thinking included (``rewards.format.last_boxed`` finds
the final ``\\boxed{}``); ``problem`` is the whole input record as the data has it, every extra
field included. It returns a number or a dict ``{"score": number, "reason": label, "detail": text,
"correct": bool}`` (only ``score`` required; ``reason`` is a short label that runs count, e.g.
``wrong_unit``, free text goes in ``detail``; without ``correct``, a score of 1 or more is correct:
pass rate, solved prompts, SFT traces). What goes wrong is scored, never raised:

========================================  ==================================================
the function ...                          the sample
========================================  ==================================================
raises                                    custom term 0, ``verifier_error``,
                                          ``custom: raised ValueError: ...``
returns NaN / inf / not a number          custom term 0, ``verifier_error``,
                                          ``custom: score is nan``
runs past ``custom_timeout_s``            custom term 0, ``timeout``, ``custom: timed out after 10s``
                                          (SIGALRM in the worker; the worker stays)
ignores that (blocks SIGALRM, C code)     the pool kills the worker at the hard limit: sample 0,
                                          ``worker_timeout``
kills its process (``os._exit``, segv)    the pool replaces the worker: sample 0, ``worker_crash``
========================================  ==================================================

What this does not protect against: the function runs with the verifier's rights, in the same
process as the built-in verifiers (it is your code, not the model's: use ``rewards/sandbox.py``
to run anything the model wrote). A function that itself uses ``signal.alarm`` (math-verify does)
replaces the soft limit; the pool's hard limit still holds.
"""

from __future__ import annotations

import importlib
import inspect
import math
import signal
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from megatron_rl.config import ConfigFieldError
from megatron_rl.rewards.result import REASON_LABEL

__all__ = [
    "ENTRY_POINT_GROUP",
    "CustomScore",
    "call_custom",
    "load_attribute",
    "registered_rewards",
    "resolve",
    "warm_up",
]

#: The entry-point group in which installed packages register named rewards.
ENTRY_POINT_GROUP = "megatron_rl.rewards"
_FIELD = "custom"  # the RewardConfig field every resolution error names
_RESULT_KEYS = ("score", "reason", "detail", "correct")

# A custom reward's function: fn(completion, problem) -> number | dict.
CustomFn = Callable[[str, dict[str, Any]], object]


def registered_rewards() -> dict[str, list[EntryPoint]]:
    """Every name in the ``megatron_rl.rewards`` group, with its entry points (one, unless two
    installed distributions register the same name)."""
    out: dict[str, list[EntryPoint]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        known = out.setdefault(ep.name, [])
        if all(e.value != ep.value for e in known):  # one distribution seen twice on sys.path
            known.append(ep)
    return out


def _where_it_failed(e: BaseException) -> str:
    """`` (file:line)`` of the innermost frame outside importlib, or of a syntax error."""
    if isinstance(e, SyntaxError) and e.filename:
        return f" ({e.filename}:{e.lineno})"
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith("<frozen")]
    return f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _import(module: str, what: str, field: str = _FIELD) -> Any:
    try:
        return importlib.import_module(module)
    except KeyboardInterrupt:
        raise
    except ModuleNotFoundError as e:
        if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
            raise ConfigFieldError(
                field,
                f"{what}: no module named {e.name!r} (install it, or put its folder on PYTHONPATH, "
                f"e.g. PYTHONPATH=path/to/dir)",
            ) from None
        raise ConfigFieldError(
            field, f"{what}: importing {module!r} failed: {e}{_where_it_failed(e)}"
        ) from None
    except BaseException as e:  # noqa: BLE001 -- whatever the user's module does on import
        raise ConfigFieldError(
            field, f"{what}: importing {module!r} raised {type(e).__name__}: {e}{_where_it_failed(e)}"
        ) from None


def _own_callable(obj: Any, name: str) -> bool:
    """Whether ``obj.name`` is callable and, when ``obj`` is a module, defined there (not imported)."""
    value = getattr(obj, name, None)
    if not callable(value):
        return False
    return not inspect.ismodule(obj) or getattr(value, "__module__", obj.__name__) == obj.__name__


def _attribute(obj: Any, dotted: str, module: str, what: str, field: str = _FIELD) -> Any:
    for i, name in enumerate(dotted.split(".")):
        if not hasattr(obj, name):
            where = module if i == 0 else f"{module}:{'.'.join(dotted.split('.')[:i])}"
            public = sorted(n for n in dir(obj) if not n.startswith("_") and _own_callable(obj, n))
            raise ConfigFieldError(
                field,
                f"{what}: {where!r} has no attribute {name!r}"
                + (f" (callables there: {', '.join(public[:12])})" if public else ""),
            )
        obj = getattr(obj, name)
    return obj


def _check_callable(fn: Any, what: str) -> CustomFn:
    if not callable(fn):
        raise ConfigFieldError(_FIELD, f"{what} is a {type(fn).__name__}, not a function")
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise ConfigFieldError(_FIELD, f"{what} is an async function; a reward is a plain function")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature to read: called as they are
        return fn
    try:
        sig.bind("completion", {})
    except TypeError:
        raise ConfigFieldError(_FIELD, f"{what}{sig} cannot be called as fn(completion, problem)") from None
    return fn


def load_attribute(spec: str, field: str, *, kind: str) -> Any:
    """What ``module:attribute`` names (the attribute may be dotted), for the recipe field
    ``field``; :class:`ConfigFieldError` on ``field`` saying why it cannot be had: a malformed
    spec, ``__main__`` (worker processes do not run the caller's script), a module that does not
    import (with the file and line where it failed), a missing attribute (with what is there).
    ``kind`` names what the attribute should be in those messages ("function", "class")."""
    module, _, attr = spec.strip().partition(":")
    if not module or not attr or ":" in attr:
        raise ConfigFieldError(field, f"expected 'module:{kind}', got {spec!r}")
    if module == "__main__":  # the worker processes do not run the caller's script
        raise ConfigFieldError(
            field,
            f"{spec!r}: a {kind} of the script being run cannot be loaded by the worker processes; "
            f"put it in a module (e.g. my_module.py beside the script) and name it 'my_module:{attr}'",
        )
    return _attribute(_import(module, repr(spec), field), attr, module, repr(spec), field)


@cache
def resolve(spec: str) -> CustomFn:
    """The function that ``spec`` names (see the module docstring); :class:`ConfigFieldError` on
    ``custom`` when it cannot be had. Cached per process: a worker imports it once."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigFieldError(
            _FIELD, f"must be 'module:function' or the name of a registered reward, got {spec!r}"
        )
    spec = spec.strip()
    if ":" in spec:
        return _check_callable(load_attribute(spec, _FIELD, kind="function"), repr(spec))
    known = registered_rewards()
    eps = known.get(spec)
    if not eps:
        mod, _, name = spec.rpartition(".")
        hint = f"; did you mean '{mod}:{name}'?" if mod else "; a function in a module is 'module:function'"
        raise ConfigFieldError(
            _FIELD,
            f"no reward is registered as {spec!r} in the entry-point group {ENTRY_POINT_GROUP!r} "
            f"(registered: {', '.join(sorted(known)) or 'none'}){hint}",
        )
    if len(eps) > 1:
        raise ConfigFieldError(
            _FIELD,
            f"{spec!r} is registered more than once: "
            + ", ".join(f"{e.value} (by {e.dist.name if e.dist else '?'})" for e in eps)
            + "; name one as 'module:function'",
        )
    ep = eps[0]
    what = f"registered reward {spec!r} (= {ep.value})"
    module, _, attr = ep.value.partition(":")
    target = _import(module.strip(), what)
    if attr.strip():
        target = _attribute(target, attr.strip(), module.strip(), what)
    return _check_callable(target, what)


def warm_up(spec: str) -> None:
    """Import the function in a pool worker before it takes tasks (``VerifierPool(warmup=...)``
    with ``functools.partial(warm_up, spec)``), so the import is not charged to a sample's limit."""
    resolve(spec)


@dataclass
class CustomScore:
    """What one call of a custom reward gave: its score (0 when it failed) and why."""

    score: float
    reason: str
    detail: str
    correct: bool
    failed: bool = False  # raised, timed out or returned something that is not a finite score


class _TimedOut(BaseException):
    """Raised into the function by SIGALRM: a BaseException, so ``except Exception`` in the
    user's code does not swallow it."""


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`_TimedOut` in this (main) thread after ``seconds``. SIGALRM works only in the
    main thread: elsewhere (an in-process caller's thread) no soft limit, the pool's hard one
    remains. The handler raises only while armed and the handler is put back in an outer
    ``finally``, so an alarm landing as the function returns cannot leave it installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    armed = [True]

    def on_alarm(signum, frame):
        if armed[0]:
            raise _TimedOut

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            armed[0] = False
    finally:
        signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)


def _failure(reason: str, detail: str) -> CustomScore:
    return CustomScore(0.0, reason, f"custom: {detail}", False, failed=True)


def _as_number(value: object) -> float | str:
    """The score as a float, or why it is not one."""
    if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):
        return f"score must be a number or a dict with 'score', got {type(value).__name__} {value!r:.80}"
    try:
        x = float(value)  # type: ignore[arg-type]  # has __float__: int, float, bool, numpy, 0-d tensors
    except Exception as e:  # noqa: BLE001 -- e.g. a tensor of several elements
        return f"score {value!r:.80} is not one number: {type(e).__name__}: {e}"
    return x if math.isfinite(x) else f"score is {x}"


def _check_result(value: object) -> CustomScore:
    if not isinstance(value, dict):
        x = _as_number(value)
        if isinstance(x, str):
            return _failure("verifier_error", x)
        return CustomScore(x, "ok" if x >= 1 else "wrong_answer", "", x >= 1)
    unknown = [k for k in value if k not in _RESULT_KEYS]
    if unknown:
        return _failure(
            "verifier_error", f"unknown key {unknown[0]!r} in the result (known: {', '.join(_RESULT_KEYS)})"
        )
    if "score" not in value:
        return _failure("verifier_error", "the result dict has no 'score'")
    x = _as_number(value["score"])
    if isinstance(x, str):
        return _failure("verifier_error", x)
    correct = value.get("correct", x >= 1)
    if not isinstance(correct, bool):
        return _failure("verifier_error", f"'correct' must be true or false, got {correct!r:.80}")
    reason = value.get("reason", "ok" if correct else "wrong_answer")
    if not isinstance(reason, str) or not REASON_LABEL.fullmatch(reason):
        return _failure(
            "verifier_error",
            f"'reason' must be a short label (letters, digits, _ . : -, at most 64), got {reason!r:.80}; "
            "put free text in 'detail'",
        )
    detail = value.get("detail", "")
    return CustomScore(x, reason, detail if isinstance(detail, str) else repr(detail), correct)


def call_custom(fn: CustomFn, completion: str, problem: dict[str, Any], *, timeout_s: float) -> CustomScore:
    """``fn(completion, problem)`` under a soft time limit, checked; every failure is a
    :class:`CustomScore` with ``failed`` set (see the module docstring), never an exception."""
    try:
        with _time_limit(timeout_s):
            value = fn(completion, problem)
    except _TimedOut:
        return _failure("timeout", f"timed out after {timeout_s:g}s")
    except BaseException as e:  # noqa: BLE001 -- SystemExit too: the user's bug is the sample's, not the run's
        return _failure("verifier_error", f"raised {type(e).__name__}: {e}"[:2000])
    try:
        return _check_result(value)
    except Exception as e:  # noqa: BLE001 -- e.g. a result whose __float__ or __repr__ raises
        return _failure("verifier_error", f"bad result: {type(e).__name__}: {e}"[:2000])
