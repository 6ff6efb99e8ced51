"""Preemption: a run asked to stop (SIGTERM, SIGUSR1, or a file ``RUN/STOP``) stops cleanly, in time.

What a cluster sends before it takes the machines back: SIGTERM (Kubernetes, SLURM at the end
of the time limit or on preemption, ``torchrun`` passing on its own), SIGUSR1 (what
``#SBATCH --signal=USR1@SECONDS`` sends ahead of the limit). The launch scripts cannot always
reach the trainer with a signal (``torchrun`` ends its workers 30 s after its own SIGTERM, and
dies of a SIGUSR1), so a file ``STOP`` in the run directory asks the same: the SLURM script
touches it when its batch shell gets the signal, and so can a user who wants a run to stop at
the next step (the run deletes the file when it starts).

:class:`Preemption` only records the request (a signal handler must not do more: the trainer
may be in the middle of a collective) and arms a watchdog: the run checks :attr:`reason` at
every step boundary, finishes the step under way or abandons the wait for its batch, writes a
checkpoint and ``summary.json`` and exits 0. If that has not happened ``grace_s`` seconds after
the request, the watchdog ends the process at once (exit 1, one line): the previous checkpoint
stays the latest, and every child dies with the process (servers, verifier workers: see
``generation/engine/launch.py`` and ``rewards/pool.py``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from megatron_rl.errors import EXIT_STOPPED

__all__ = ["STOP_FILE", "Preemption"]

STOP_FILE = "STOP"  # in the run directory: ask the run to stop after its current step
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_POLL_S = 0.5  # how often the stop file is looked for


def _ignore(reason: str) -> None:
    """``on_request`` of a run that is over."""


class Preemption:
    """Stop requests for one run: :meth:`install` while the run runs, :meth:`uninstall` after.

    ``on_request``: called (from the signal handler or the stop-file thread) with the reason
    when the first request arrives: it must only set flags (the run's wait for its batch looks
    at a deadline). ``exit``: how the watchdog ends the process past the grace (``os._exit``:
    no cleanup that could hang; the children die with the process).
    """

    def __init__(
        self,
        grace_s: float,
        *,
        stop_file: Path | None = None,
        on_request: Callable[[str], None] = lambda reason: None,
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        self.grace_s = grace_s
        self.stop_file = stop_file
        self.on_request, self._exit = on_request, exit
        self.reason: str | None = None  # why the run was asked to stop (None: it was not)
        self.requested_at: float | None = None  # time.monotonic() of the request
        self._previous: dict[int, object] = {}
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._watchdog: threading.Timer | None = None
        self._poller: threading.Thread | None = None

    def install(self) -> None:
        """Take SIGTERM and SIGUSR1 (from the main thread only: Python runs handlers there; a run
        started from another thread leaves them alone) and start looking for the stop file,
        deleting one left from before (it asked an earlier invocation to stop)."""
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        if self.stop_file is not None:
            self.stop_file.unlink(missing_ok=True)
            self._poller = threading.Thread(target=self._poll, name="rl-stop-file", daemon=True)
            self._poller.start()

    def uninstall(self) -> None:
        """The run is over (stopped in time or not asked to): handlers back, watchdog off, the
        stop-file thread joined and ``on_request`` dropped.

        The join and the drop matter at exit: a daemon thread still running when the interpreter
        finalizes is ended inside ``take_gil`` by ``pthread_exit``, and if the last reference to
        the run (``on_request`` is its bound method: the model's tensors behind it) is released
        there, torch's tensor destructor is unwound by force and the process aborts ("terminate
        called without an active exception", SIGABRT) after a run that succeeded.
        """
        with self._lock:
            self._done.set()
            watchdog, self._watchdog = self._watchdog, None
            self.on_request = _ignore
        if watchdog is not None:
            watchdog.cancel()
            watchdog.join()
        if self._poller is not None and self._poller is not threading.current_thread():
            self._poller.join()  # it wakes at once: _done is set
        self._poller = None
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]  # what signal.signal returned
        self._previous = {}

    def request(self, reason: str) -> None:
        """Ask the run to stop (the first request counts; later ones only say so)."""
        with self._lock:
            if self.reason is not None or self._done.is_set():
                return
            self.reason, self.requested_at = reason, time.monotonic()
            self._watchdog = threading.Timer(self.grace_s, self._expired)
            self._watchdog.daemon = True
            self._watchdog.start()
        print(
            f"[preempt] {reason}: stopping after the current step (checkpoint, summary; "
            f"at most run.preempt_grace_s={self.grace_s:g} s)",
            file=sys.stderr,
            flush=True,
        )
        self.on_request(reason)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.request(signal.Signals(signum).name)

    def _poll(self) -> None:
        path = self.stop_file
        while path is not None and not self._done.wait(_POLL_S):
            if path.exists():
                self.request(f"{path} exists")
                return

    def _expired(self) -> None:
        if self._done.is_set():
            return
        print(
            f"[preempt] {self.reason}: not stopped within run.preempt_grace_s={self.grace_s:g} s: "
            "exiting now without a new checkpoint (the latest one stays; run again to resume)",
            file=sys.stderr,
            flush=True,
        )
        self._exit(EXIT_STOPPED)
