"""Start built-in engine servers as child processes and stop exactly those (by PID, never by name).

    key = secrets.token_urlsafe(32)
    with EngineProcess(model_folder, max_slots=16, max_len=1024, api_key=key) as server:
        fleet = FleetClient([server.url], api_key=key)

The server binds a free port (``--port 0``) and reports it through an atomically written port
file; :meth:`EngineProcess.start` waits until ``/health`` answers. Each server runs in its own
session, so :meth:`stop` can end its whole process group; a server also dies with its parent
(``PR_SET_PDEATHSIG`` on Linux), so a crashed launcher leaves no orphans. Linux ties that signal
to the *thread* that started the child: start servers from a thread that outlives them (the
main thread), not from a pool worker that exits.

The API key reaches the child in its environment (``$MEGATRON_RL_API_KEY``), not on its command
line, where any user on the machine could read it in ``ps``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from megatron_rl.generation.protocol import API_KEY_ENV, api_key_from_env, check_api_key

__all__ = ["EngineProcess"]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class EngineProcess:
    """One ``megatron-rl serve-engine`` child process."""

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        max_slots: int = 16,
        max_len: int = 2048,
        threads: int = 1,
        host: str = "127.0.0.1",
        weight_version: int = 0,
        log_path: str | os.PathLike[str] | None = None,
        extra_args: Sequence[str] = (),
        api_key: str | None = None,
    ) -> None:
        """``api_key``: what every route but ``/health`` will want (``Authorization: Bearer``);
        "" for none; None (default): this process's ``$MEGATRON_RL_API_KEY``, if any."""
        self.model = str(model)
        self.api_key = api_key_from_env() if api_key is None else check_api_key(api_key)
        self.args = [
            "--max-slots",
            str(max_slots),
            "--max-len",
            str(max_len),
            "--threads",
            str(threads),
            "--host",
            host,
            "--weight-version",
            str(weight_version),
            *extra_args,
        ]
        self.host = host
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None
        self._port_file: Path | None = None  # where the launched server writes its port

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("server not started")
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self, timeout_s: float = 120.0) -> EngineProcess:
        """Start the server and wait until it answers ``/health``."""
        return self.launch().wait_ready(timeout_s)

    def restart(self, timeout_s: float = 120.0) -> EngineProcess:
        """Start it again (after it died) on the port it had, so its URL stays what the fleet
        knows; wait until it answers. It loads the model folder's weights again."""
        self.stop()
        return self.launch(port=self.port or 0).wait_ready(timeout_s)

    def launch(self, port: int = 0) -> EngineProcess:
        """Start the server process without waiting for it (:meth:`wait_ready` waits): a fleet's
        servers then import and load side by side instead of one after another. ``port``: 0 (a
        free one, reported back) or the one to bind."""
        tmp = tempfile.mkdtemp(prefix="megatron-rl-engine-")
        self._port_file = Path(tmp) / "port"
        port_file = self._port_file
        log = open(self.log_path, "ab") if self.log_path else None
        env = dict(os.environ, OMP_NUM_THREADS=self.args[self.args.index("--threads") + 1])
        env[API_KEY_ENV] = self.api_key  # "" reads as no key
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "megatron_rl",
                "serve-engine",
                "--model",
                self.model,
                "--port",
                str(port),
                "--port-file",
                str(port_file),
                *self.args,
            ],
            stdout=log if log is not None else subprocess.DEVNULL,
            stderr=subprocess.STDOUT if log is not None else subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent,
            env=env,
        )
        if log is not None:
            log.close()
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> EngineProcess:
        """Wait until the launched server answers ``/health``; stopped and ``TimeoutError`` past
        ``timeout_s``, ``RuntimeError`` if it exits first."""
        if self.proc is None or self._port_file is None:
            raise RuntimeError("EngineProcess.wait_ready: launch() first")
        port_file = self._port_file
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"serve-engine exited with {self.proc.returncode} while "
                    f"starting ({self.model}; log: {self.log_path or 'none'})"
                )
            if port_file.exists():
                self.port = int(port_file.read_text())
                try:
                    urllib.request.urlopen(f"{self.url}/health", timeout=5).read()
                    port_file.unlink()
                    os.rmdir(port_file.parent)
                    return self
                except OSError:
                    pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"serve-engine did not answer within {timeout_s:.0f}s")

    def _running(self) -> subprocess.Popen[bytes] | None:
        """The server process while it runs, else None."""
        return self.proc if self.proc is not None and self.proc.poll() is None else None

    def alive(self) -> bool:
        return self._running() is not None

    def kill(self) -> None:
        """SIGKILL the server's process group (simulates a crashed node)."""
        proc = self._running()
        if proc is not None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``."""
        proc = self._running()
        if proc is None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> EngineProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
