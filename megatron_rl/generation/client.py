"""A client for a fleet of servers that speak SGLang's HTTP API (SGLang 0.5.23, or the built-in
``megatron-rl serve-engine``); payloads in ``generation/protocol.py``.

    fleet = FleetClient(["http://10.0.0.1:30000", "http://10.0.0.2:30000"])
    for result in fleet.generate(requests):      # yields each completion as it finishes
        ...
    future = fleet.submit(request)               # or one at a time (the RL orchestrator does)

**Routing.** Each request goes to the live server with the fewest requests in flight relative to
its KV capacity (``max_total_num_tokens`` from ``/server_info``): the client's own
least-loaded routing. With sglang-router in front of the servers, give the router's single URL
instead; the router balances and the client sees one server (weight updates then go to the
servers themselves: pass ``update_urls``).

**Lost requests.** If a server dies (connection refused, reset, or closed mid-reply), every
request in flight there fails with :class:`ServerLost`, the server is marked dead and taken out
of routing, and the loss is recorded in :attr:`FleetClient.lost` as ``(request_id, url)``.
:meth:`generate` re-sends lost requests to another live server (``resend_lost=True``, the
default) or raises; :meth:`submit` leaves the choice to the caller.
:meth:`FleetClient.revive` (or :meth:`refresh`) puts a restarted server back.

**Weight updates** (the trainer's broadcaster drives them): :meth:`pause`, :meth:`begin_update`,
:meth:`update_weights_async` (every server joins the broadcast that follows), :meth:`end_update`,
:meth:`resume`; :meth:`init_update_group_async` joins every server to the update group with
consecutive ranks after the trainer's rank 0.
"""

from __future__ import annotations

import http.client
import json
import threading
import urllib.parse
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_rl.generation.api import GenRequest, GenResult
from megatron_rl.generation.protocol import (
    ROUTES,
    SGLANG_VERSION,
    ProtocolError,
    abort_payload,
    generate_payload,
    init_group_payload,
    parse_generate,
    pause_payload,
)

if TYPE_CHECKING:
    from megatron_rl.fileio import JsonValue

__all__ = ["FleetClient", "ServerError", "ServerLost", "ServerState"]


class ServerLost(ConnectionError):
    """The server went away with a request in flight."""

    def __init__(self, url: str, request_id: str | None, cause: BaseException):
        super().__init__(
            f"{url}: lost{' request ' + request_id if request_id else ''} ({type(cause).__name__}: {cause})"
        )
        self.url, self.request_id, self.cause = url, request_id, cause


class ServerError(RuntimeError):
    """The server answered with an error status."""

    def __init__(self, url: str, route: str, status: int, body: JsonValue):
        message = body.get("message") if isinstance(body, dict) else body
        super().__init__(f"{url}{route}: HTTP {status}: {message}")
        self.url, self.route, self.status, self.body = url, route, status, body


@dataclass
class ServerState:
    url: str
    alive: bool = True
    in_flight: int = 0
    capacity_tokens: int = 0
    max_running: int = 0
    tp_size: int = 1
    info: dict[str, JsonValue] | None = None


def _post_json(
    url: str,
    route: str,
    body: object,
    *,
    method: str = "POST",
    timeout: float | None = None,
    request_id: str | None = None,
) -> JsonValue:
    """``body`` (None: no body) sent as JSON; the answer parsed as JSON (its text if it is not)."""
    # Only routes the SGLang contract test has checked (protocol.ROUTES), with their method; our
    # own extensions of the built-in engine live under /megatron_rl/.
    if ROUTES.get(route, "GET" if route.startswith("/megatron_rl/") else None) != method:
        raise ProtocolError(
            f"{method} {route} is not a route of SGLang {SGLANG_VERSION}'s API "
            "that the client speaks (generation/protocol.py ROUTES)"
        )
    parts = urllib.parse.urlsplit(url)
    if parts.hostname is None:
        raise ValueError(f"{url}: not a server URL (expected http://host[:port])")
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, parts.path.rstrip("/") + route, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
    except (ConnectionError, http.client.HTTPException, OSError) as e:
        raise ServerLost(url, request_id, e) from e
    finally:
        conn.close()
    try:
        payload = json.loads(raw) if raw else {}
    except ValueError:
        payload = raw.decode(errors="replace")
    if resp.status != 200:
        raise ServerError(url, route, resp.status, payload)
    return payload


class FleetClient:
    """Least-loaded routing over SGLang-API servers; see the module docstring."""

    def __init__(
        self,
        urls: Iterable[str],
        *,
        update_urls: Iterable[str] | None = None,
        request_timeout_s: float | None = None,
        control_timeout_s: float = 600.0,
        initial_version: int = 0,
        max_workers: int = 256,
    ) -> None:
        self.servers = [ServerState(u.rstrip("/")) for u in urls]
        if not self.servers:
            raise ValueError("urls: need at least one server")
        self.update_urls = [u.rstrip("/") for u in (update_urls or [s.url for s in self.servers])]
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.initial_version = initial_version
        self.lost: list[tuple[str, str]] = []  # (request_id, server url), in order of loss
        self._lock = threading.Lock()
        self._update_capacity = 0
        self._update_tp: dict[str, int] = {}
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="fleet")
        self.refresh()

    # ------------------------------------------------------------------ fleet state

    def refresh(self) -> None:
        """Re-read every server's ``/server_info``; unreachable servers are marked dead.

        A URL that answers but has no ``/server_info`` (a router) stays alive; its KV capacity
        is then that of the update targets behind it."""
        for s in self.servers:
            try:
                info = _post_json(s.url, "/server_info", None, method="GET", timeout=self.control_timeout_s)
            except ServerLost:
                s.alive = False
                continue
            except ServerError:
                s.alive, s.info = self._answers(s.url), None
                continue
            s.alive, s.info = True, info
            s.capacity_tokens = int(info.get("max_total_num_tokens") or 0)
            s.max_running = int(info.get("max_running_requests") or 0)
            s.tp_size = int(info.get("tp_size") or 1)
        self._update_capacity = 0
        routed = {s.url for s in self.servers}
        for u in self.update_urls:
            if u in routed:
                continue
            try:
                info = _post_json(u, "/server_info", None, method="GET", timeout=self.control_timeout_s)
                self._update_capacity += int(info.get("max_total_num_tokens") or 0)
                self._update_tp[u] = int(info.get("tp_size") or 1)
            except (ServerLost, ServerError):
                pass

    def revive(self, url: str) -> bool:
        """Put a (restarted) server back into routing if it answers; return whether it did."""
        for s in self.servers:
            if s.url == url.rstrip("/"):
                s.alive = True
                self.refresh()
                return s.alive
        raise KeyError(f"{url}: not a server of this fleet")

    def _answers(self, url: str) -> bool:
        try:
            _post_json(url, "/health", None, method="GET", timeout=5.0)
            return True
        except (ServerLost, ServerError):
            return False

    @property
    def alive(self) -> list[ServerState]:
        return [s for s in self.servers if s.alive]

    def capacity_tokens(self) -> int:
        """KV capacity of the live servers together (behind a router: of the update targets),
        in tokens; 0 when unknown."""
        return sum(s.capacity_tokens for s in self.alive) + self._update_capacity

    def in_flight(self) -> int:
        return sum(s.in_flight for s in self.servers)

    def _pick(self, exclude: frozenset[str] | set[str] = frozenset()) -> ServerState:
        with self._lock:
            live = [s for s in self.servers if s.alive and s.url not in exclude] or [
                s for s in self.servers if s.alive
            ]
            if not live:
                raise ServerLost(
                    ",".join(s.url for s in self.servers),
                    None,
                    ConnectionError("no live server in the fleet"),
                )
            best = min(live, key=lambda s: (s.in_flight + 1) / max(s.capacity_tokens, 1))
            best.in_flight += 1
            return best

    # ------------------------------------------------------------------ generation

    def submit(
        self, req: GenRequest, *, url: str | None = None, exclude: frozenset[str] | set[str] = frozenset()
    ) -> Future[GenResult]:
        """Send one request (to ``url``, or the least-loaded live server not in ``exclude``).

        The future fails with :class:`ServerLost` if its server dies (recorded in :attr:`lost`),
        or :class:`ServerError` if the server refuses it.
        """
        if url is None:
            server = self._pick(exclude)
        else:
            server = next(s for s in self.servers if s.url == url.rstrip("/"))
            with self._lock:
                server.in_flight += 1
        return self._pool.submit(self._run, server, req)

    def _run(self, server: ServerState, req: GenRequest) -> GenResult:
        try:
            body = _post_json(
                server.url,
                "/generate",
                generate_payload(req),
                timeout=self.request_timeout_s,
                request_id=req.request_id,
            )
        except ServerLost:
            alive = self._answers(server.url)  # a reset connection is not always a dead server
            with self._lock:
                server.alive = alive
                self.lost.append((req.request_id, server.url))
            raise
        finally:
            with self._lock:
                server.in_flight -= 1
        return parse_generate(req, body, server=server.url, initial_version=self.initial_version)

    def generate(self, requests: Iterable[GenRequest], *, resend_lost: bool = True) -> Iterator[GenResult]:
        """Yield a result per request as each finishes; lost requests are re-sent elsewhere
        (``resend_lost``) or raise :class:`ServerLost`."""
        pending: dict[Future[GenResult], tuple[GenRequest, set[str]]] = {}
        for r in requests:
            pending[self.submit(r)] = (r, set())
        while pending:
            done, _ = wait(list(pending), return_when="FIRST_COMPLETED")
            for fut in done:
                req, tried = pending.pop(fut)
                try:
                    yield fut.result()
                except ServerLost as e:
                    if not resend_lost:
                        raise
                    tried = tried | {e.url}
                    pending[self.submit(req, exclude=tried)] = (req, tried)

    def abort(self, request_id: str | None = None) -> None:
        """Abort one request (every server is asked) or all of them."""
        self._broadcast_control("/abort_request", abort_payload(request_id))

    # ------------------------------------------------------------------ weight updates

    def _broadcast_control(self, route: str, body: object, urls: list[str] | None = None) -> list[JsonValue]:
        urls = urls if urls is not None else [s.url for s in self.alive]
        futs = [self._pool.submit(_post_json, u, route, body, timeout=self.control_timeout_s) for u in urls]
        return [f.result() for f in futs]

    def pause(self, mode: str = "in_place") -> None:
        """Pause every update target; ``in_place`` keeps running requests and their KV cache."""
        self._broadcast_control("/pause_generation", pause_payload(mode), self._live_update_urls())

    def resume(self) -> None:
        self._broadcast_control("/continue_generation", {}, self._live_update_urls())

    def begin_update(self) -> None:
        self._broadcast_control("/begin_weight_update", {}, self._live_update_urls())

    def end_update(self) -> None:
        self._broadcast_control("/end_weight_update", {}, self._live_update_urls())

    def _live_update_urls(self) -> list[str]:
        dead = {s.url for s in self.servers if not s.alive}
        return [u for u in self.update_urls if u not in dead]

    def live_update_urls(self) -> list[str]:
        """Update targets that answer (routed servers by their state, others by ``/health``)."""
        routed = {s.url: s.alive for s in self.servers}
        return [u for u in self.update_urls if routed.get(u, None) or (u not in routed and self._answers(u))]

    def update_ranks(self) -> dict[str, int]:
        """Rank offset of each update target in the update group (rank 0 is the trainer)."""
        tp = {**self._update_tp, **{s.url: s.tp_size for s in self.servers}}
        ranks: dict[str, int] = {}
        nxt = 1
        for u in self.update_urls:
            ranks[u] = nxt
            nxt += tp.get(u, 1)
        return ranks

    def update_world_size(self) -> int:
        tp = {**self._update_tp, **{s.url: s.tp_size for s in self.servers}}
        return 1 + sum(tp.get(u, 1) for u in self.update_urls)

    def init_update_group_async(
        self, *, master_address: str, master_port: int, group_name: str, backend: str
    ) -> list[Future[JsonValue]]:
        """Ask every update target to join the group; the futures complete once the trainer
        (rank 0) has joined too, so call this first, then join, then wait on them."""
        world = self.update_world_size()
        return [
            self._pool.submit(
                _post_json,
                u,
                "/init_weights_update_group",
                init_group_payload(
                    master_address=master_address,
                    master_port=master_port,
                    rank_offset=r,
                    world_size=world,
                    group_name=group_name,
                    backend=backend,
                ),
                timeout=self.control_timeout_s,
            )
            for u, r in self.update_ranks().items()
        ]

    def update_weights_async(self, payload: dict[str, object]) -> list[Future[JsonValue]]:
        """Post one ``/update_weights_from_distributed`` to every update target; they return
        after receiving the broadcast the caller makes next."""
        return [
            self._pool.submit(
                _post_json, u, "/update_weights_from_distributed", payload, timeout=self.control_timeout_s
            )
            for u in self.update_urls
        ]

    def server_info(self, url: str) -> dict[str, JsonValue]:
        return _post_json(url, "/server_info", None, method="GET", timeout=self.control_timeout_s)

    def weights_digest(self, url: str) -> dict[str, str]:
        """sha256 per parameter (built-in engine's ``/megatron_rl/weights_digest`` extension)."""
        return _post_json(
            url, "/megatron_rl/weights_digest", None, method="GET", timeout=self.control_timeout_s
        )

    def destroy_update_group(self, group_name: str) -> None:
        """Ask every live update target to leave the group (best effort)."""
        for u in self._live_update_urls():
            try:
                _post_json(
                    u,
                    "/destroy_weights_update_group",
                    {"group_name": group_name},
                    timeout=self.control_timeout_s,
                )
            except (ServerLost, ServerError):
                pass

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
