"""A fleet that heals: dead servers restarted or waited for, admitted again only with the trainer's weights.

Rank 0's :class:`FleetDoctor` looks at the fleet twice a second, on a thread of its own:

- a **local** engine server (``fleet.local_servers``) whose process died is taken out of routing
  and started again on its port (its URL stays what the fleet knows), at most
  ``fleet.max_restarts`` times each;
- an **external** server (``fleet.urls``) the client found dead is asked ``/health`` with
  back-off (1 s, doubling to 30 s);
- either, once it answers, is *held* (:meth:`FleetClient.hold`): not routed, since it holds the
  model folder's weights or those of whatever version it had. The broadcaster's next update
  rebuilds the update group with it and then routes it (:meth:`FleetClient.admit`). Where no
  server is routed at all, the orchestrator runs that update while it waits for its batch
  (``Orchestrator.resync_due``), so a fleet of one comes back without a training step;
- requests that find no server wait for one (``Rollouts`` parks them). When no server has been
  routed or held for ``fleet.dead_fleet_timeout_s``, :class:`FleetDead` stops the run: exit 1,
  one line naming the servers.
"""

from __future__ import annotations

import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import TYPE_CHECKING

from megatron_rl.errors import RunStopped

if TYPE_CHECKING:
    from megatron_rl.generation.client import FleetClient
    from megatron_rl.generation.engine.launch import EngineProcess

__all__ = ["FleetDead", "FleetDoctor"]

_LOOK_S = 0.5
_BACKOFF_S = (1.0, 30.0)  # first wait before asking a dead external server again, and the cap


class FleetDead(RunStopped):
    """No generation server reachable for ``fleet.dead_fleet_timeout_s``."""


class FleetDoctor:
    """Watches ``fleet``; ``engines``: the local servers by URL (empty for external ones).
    ``on_dead``: called once with :class:`FleetDead` (the run stops on it)."""

    def __init__(
        self,
        fleet: FleetClient,
        engines: dict[str, EngineProcess],
        *,
        max_restarts: int,
        dead_fleet_timeout_s: float,
        on_dead: Callable[[BaseException], None],
    ) -> None:
        self.fleet, self.engines = fleet, engines
        self.max_restarts, self.dead_fleet_timeout_s = max_restarts, dead_fleet_timeout_s
        self.on_dead = on_dead
        self.restarts: dict[str, int] = dict.fromkeys(engines, 0)
        self._next_ask: dict[str, tuple[float, float]] = {}  # url -> (when, back-off) for external ones
        self._none_since: float | None = None  # when the fleet last had no routed or held server
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rl-fleet-doctor", daemon=True)

    def start(self) -> FleetDoctor:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=150)  # a restart under way finishes (it waits for /health)

    @property
    def total_restarts(self) -> int:
        return sum(self.restarts.values())

    def _run(self) -> None:
        while not self._stop.wait(_LOOK_S):
            try:
                self.look()
            except Exception as e:  # noqa: BLE001 -- a doctor that fails must not fail silently
                print(f"[fleet] watching the servers failed: {type(e).__name__}: {e}", file=sys.stderr)

    def look(self) -> None:
        """One round: dead local processes restarted, dead external servers asked, the dead
        fleet's clock."""
        now = time.monotonic()
        for s in self.fleet.servers:
            engine = self.engines.get(s.url)
            if engine is not None and not engine.alive():
                self.fleet.mark_dead(s.url)
                self._restart(s.url, engine)
            elif engine is None and not s.alive and not s.held:
                self._ask(s.url, now)
        if any(s.alive or s.held for s in self.fleet.servers):
            self._none_since = None
            return
        self._none_since = self._none_since or now
        if now - self._none_since >= self.dead_fleet_timeout_s and not self._stop.is_set():
            self._stop.set()
            urls = ", ".join(s.url for s in self.fleet.servers)
            self.on_dead(
                FleetDead(
                    f"no generation server reachable for {self.dead_fleet_timeout_s:g} s "
                    f"(fleet.dead_fleet_timeout_s): {urls}; restarts used: {self.total_restarts}"
                )
            )

    def _restart(self, url: str, engine: EngineProcess) -> None:
        if self.restarts[url] >= self.max_restarts:
            return
        self.restarts[url] += 1
        print(
            f"[fleet] {url} died (exit {engine.proc.returncode if engine.proc else '?'}): starting it "
            f"again ({self.restarts[url]}/{self.max_restarts})",
            file=sys.stderr,
            flush=True,
        )
        try:
            engine.restart()
        except (OSError, RuntimeError, TimeoutError) as e:
            print(f"[fleet] {url}: restart failed: {e}", file=sys.stderr, flush=True)
            return
        self.fleet.hold(url)

    def _ask(self, url: str, now: float) -> None:
        when, backoff = self._next_ask.get(url, (now, _BACKOFF_S[0]))
        if now < when:
            return
        try:  # /health wants no key (SGLang's and the built-in engine's)
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                ok = r.status == 200
        except OSError:
            ok = False
        if ok:
            self._next_ask.pop(url, None)
            print(f"[fleet] {url} answers again: it rejoins after the next weight update", file=sys.stderr)
            self.fleet.hold(url)
        else:
            self._next_ask[url] = (now + backoff, min(2 * backoff, _BACKOFF_S[1]))
