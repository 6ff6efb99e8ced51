"""The fleet client's control plane: the servers' state, least-loaded routing, and every call that
is not a generation (server info, health, abort, pause and resume, weight updates, memory).

:class:`FleetControl` is the base of :class:`~megatron_rl.generation.client.FleetClient`, which
adds the generation path (an event loop of its own); it is not used alone. Its calls are plain
blocking HTTP (:func:`~megatron_rl.generation.transport.post_json`) on a small thread pool with
connections of their own, kept alive between calls (an update's pause, update and resume reach
each server within milliseconds), so a weight update never queues behind generations, whatever
the number in flight.

**Fleet state.** A :class:`ServerState` per server: routed (``alive``) or not, ``held`` (back
after a death, not routed until the trainer's weights reach it: :meth:`FleetControl.hold`, then
:meth:`FleetControl.admit` after the update), the requests in flight there and its KV capacity
and tensor-parallel size from ``/server_info`` (:meth:`FleetControl.refresh`). Routing picks the
live server with the fewest requests in flight relative to its KV capacity.

**Weight updates** (the trainer's broadcaster drives them): :meth:`~FleetControl.pause`,
:meth:`~FleetControl.begin_update`, :meth:`~FleetControl.update_weights_async` (every server
joins the broadcast that follows), :meth:`~FleetControl.end_update`,
:meth:`~FleetControl.resume`; :meth:`~FleetControl.init_update_group_async` joins every server to
the update group with consecutive ranks after the trainer's rank 0. In colocated mode,
:meth:`~FleetControl.release_memory` and :meth:`~FleetControl.resume_memory` hand the device to
the trainer and back, and :meth:`~FleetControl.update_weights_from_tensor` carries the weights.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_rl.generation.engine.weights import ENGINE_CAPABILITY, STREAM_ROUTE
from megatron_rl.generation.protocol import (
    STREAMED_BATCH,
    ProtocolError,
    abort_payload,
    api_key_from_env,
    check_api_key,
    init_group_payload,
    memory_payload,
    parse_weights_checker,
    pause_payload,
    update_group_ranks,
    update_weights_from_tensor_payload,
    weights_checker_payload,
)
from megatron_rl.generation.transport import Connections, ServerError, ServerLost, post_json

if TYPE_CHECKING:
    from megatron_rl.fileio import JsonValue

__all__ = ["FleetControl", "ServerState", "check_seconds"]


@dataclass
class ServerState:
    """One server of the fleet as the client sees it."""

    url: str
    alive: bool = True  # routed: takes generations
    held: bool = False  # back after a death, not routed until the trainer's weights reach it (admit)
    held_since: float = 0.0  # time.monotonic() of the latest hold(): an update begun before it missed it
    in_flight: int = 0
    capacity_tokens: int = 0
    max_running: int = 0
    tp_size: int = 1
    info: dict[str, JsonValue] | None = None


def check_seconds(name: str, value: float) -> None:
    """Refuse a timeout that is not a finite number of seconds > 0 (NaN included)."""
    if not 0 < value < float("inf"):
        raise ValueError(f"{name}: must be a finite number of seconds > 0, got {value!r}")


class FleetControl:
    """The servers' state, routing and control calls; the base of
    :class:`~megatron_rl.generation.client.FleetClient` (see the module docstrings)."""

    def __init__(
        self,
        urls: Iterable[str],
        *,
        update_urls: Iterable[str] | None,
        control_timeout_s: float,
        api_key: str | None,
        deterministic: bool,
    ) -> None:
        """Arguments as :class:`~megatron_rl.generation.client.FleetClient`'s."""
        check_seconds("control_timeout_s", control_timeout_s)
        # Not an attribute that reprs or logs would show; every request goes through _call.
        self._api_key = api_key_from_env() if api_key is None else check_api_key(api_key)
        self.servers = [ServerState(u.rstrip("/")) for u in urls]
        if not self.servers:
            raise ValueError("urls: need at least one server")
        self.update_urls = [u.rstrip("/") for u in (update_urls or [s.url for s in self.servers])]
        self.all_update_urls = list(self.update_urls)  # update_urls: the current group's members
        self.control_timeout_s = control_timeout_s
        self.deterministic = deterministic
        self._lock = threading.Lock()
        self._update_capacity = 0
        self._update_tp: dict[str, int] = {}
        # Control calls: a thread each, enough for one call to every server at once (an update
        # holds one per target while the broadcast runs) with room to spare.
        n_urls = len({s.url for s in self.servers} | set(self.update_urls))
        self._control = ThreadPoolExecutor(max_workers=2 * n_urls + 8, thread_name_prefix="fleet-control")
        self._connections = Connections()  # kept alive between control calls (transport.Connections)

    def _call(
        self,
        url: str,
        route: str,
        body: object,
        *,
        method: str = "POST",
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> JsonValue:
        """:func:`~megatron_rl.generation.transport.post_json` with this client's API key."""
        return post_json(
            url,
            route,
            body,
            method=method,
            timeout=timeout,
            request_id=request_id,
            api_key=self._api_key,
            connections=self._connections,
        )

    # ------------------------------------------------------------------ fleet state

    def refresh(self) -> None:
        """Re-read every server's ``/server_info``; unreachable servers are marked dead.

        A URL that answers but has no ``/server_info`` (a router) stays alive; its KV capacity
        is then that of the update targets behind it."""
        for s in self.servers:
            if not s.alive and not s.held:  # dead: back only through hold() (fleet_health.py)
                continue
            try:
                info = self._call(s.url, "/server_info", None, method="GET", timeout=self.control_timeout_s)
            except ServerLost:
                s.alive = s.held = False
                continue
            except ServerError as e:
                if e.status == 401:  # it answers, but not to this key: no point routing to it
                    raise
                answers = self._answers(s.url)
                s.alive, s.held, s.info = s.alive and answers, s.held and answers, None
                continue
            self._check_server(s.url, info)
            s.info = info
            s.capacity_tokens = int(info.get("max_total_num_tokens") or 0)
            s.max_running = int(info.get("max_running_requests") or 0)
            s.tp_size = update_group_ranks(info, s.url)
        self._update_capacity = 0
        routed = {s.url for s in self.servers}
        for u in self.update_urls:
            if u in routed:
                continue
            try:
                info = self._call(u, "/server_info", None, method="GET", timeout=self.control_timeout_s)
                self._check_server(u, info)
                self._update_capacity += int(info.get("max_total_num_tokens") or 0)
                self._update_tp[u] = update_group_ranks(info, u)
            except ServerError as e:
                if e.status == 401:
                    raise
            except ServerLost:
                pass

    def _check_server(self, url: str, info: dict[str, JsonValue]) -> None:
        """Refuse a server whose settings contradict the client's (see ``deterministic``)."""
        if self.deterministic and info.get("enable_deterministic_inference") is False:
            raise ProtocolError(
                f"{url}: fleet.deterministic is true, but this server runs without "
                "--enable-deterministic-inference, so it ignores the requests' sampling seeds; "
                "restart it with the flags `megatron-rl sglang-args server RECIPE` prints"
            )

    def revive(self, url: str) -> bool:
        """Put a (restarted) server back into routing if it answers; return whether it did."""
        for s in self.servers:
            if s.url == url.rstrip("/"):
                s.alive = True
                self.refresh()
                return s.alive
        raise KeyError(f"{url}: not a server of this fleet")

    def mark_dead(self, url: str) -> None:
        """Take a server out of routing (its process was seen dead)."""
        with self._lock:
            for s in self.servers:
                if s.url == url.rstrip("/"):
                    s.alive = s.held = False

    def hold(self, url: str) -> None:
        """A dead server answers again: it joins the next weight update, not routing (it holds
        weights of no version the trainer has now); :meth:`admit` routes it after the update."""
        with self._lock:
            for s in self.servers:
                if s.url == url.rstrip("/") and not s.alive:
                    s.held, s.held_since = True, time.monotonic()

    def held_urls(self) -> list[str]:
        return [s.url for s in self.servers if s.held]

    def admit(self, urls: Iterable[str], *, held_before: float) -> None:
        """Route these held servers again: the trainer's current weights reached them. Only
        those held before ``held_before`` (``time.monotonic()`` when the update that reached them
        began): one that died and came back during it has the old weights again."""
        wanted = {u.rstrip("/") for u in urls}
        with self._lock:
            for s in self.servers:
                if s.url in wanted and s.held and s.held_since <= held_before:
                    s.alive, s.held = True, False

    def _answers(self, url: str) -> bool:
        try:
            self._call(url, "/health", None, method="GET", timeout=5.0)
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

    def streams_batches(self) -> bool:
        """Whether every live server streams a batch's results back as each finishes (the
        built-in engine's ``/server_info`` says :data:`~megatron_rl.generation.protocol.STREAMED_BATCH`;
        SGLang's answers a batch whole). False with no live server."""
        live = self.alive
        return bool(live) and all(bool(s.info and s.info.get(STREAMED_BATCH)) for s in live)

    def in_flight(self) -> int:
        return sum(s.in_flight for s in self.servers)

    def _pick(self, exclude: frozenset[str] | set[str] = frozenset(), n: int = 1) -> ServerState:
        """The live server (not in ``exclude`` where there is another) with the fewest requests
        in flight for its KV capacity once it takes ``n`` more; counted as taken."""
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
            best = min(live, key=lambda s: (s.in_flight + n) / max(s.capacity_tokens, 1))
            best.in_flight += n
            return best

    # ------------------------------------------------------------------ aborts

    def abort(self, request_id: str | None = None) -> None:
        """Abort one request (every server is asked) or all of them; behind a router, its
        workers are asked (the router has no ``/abort_request``)."""
        urls = sorted({u for s in self.alive for u in self._abort_urls(s)})
        self._broadcast_control("/abort_request", abort_payload(request_id), urls)

    def _abort_urls(self, server: ServerState) -> list[str]:
        """Where an abort of a request sent to ``server`` must go: the server itself, or, when
        it is a router (it answers but has no ``/server_info``; sglang-router forwards only
        generation), every update target behind it."""
        if server.info is None and server.alive:
            behind = [u for u in self.update_urls if u != server.url]
            if behind:
                return behind
        return [server.url]

    # ------------------------------------------------------------------ weight updates

    def _broadcast_control(self, route: str, body: object, urls: list[str] | None = None) -> list[JsonValue]:
        urls = urls if urls is not None else [s.url for s in self.alive]
        futs = [
            self._control.submit(self._call, u, route, body, timeout=self.control_timeout_s) for u in urls
        ]
        return [f.result() for f in futs]

    def pause(self, mode: str = "in_place") -> None:
        """Pause every update target; ``in_place`` keeps running requests and their KV cache."""
        self._broadcast_control("/pause_generation", pause_payload(mode), self._live_update_urls())

    def pause_async(self, mode: str = "in_place") -> list[Future[JsonValue]]:
        """:meth:`pause` without waiting: one future per live update target."""
        body = pause_payload(mode)
        return [
            self._control.submit(self._call, u, "/pause_generation", body, timeout=self.control_timeout_s)
            for u in self._live_update_urls()
        ]

    def resume(self) -> None:
        self._broadcast_control("/continue_generation", {}, self._live_update_urls())

    def begin_update(self) -> None:
        self._broadcast_control("/begin_weight_update", {}, self._live_update_urls())

    def end_update(self) -> list[JsonValue]:
        """Close every live target's update session; returns their answers (a built-in engine
        that received a streamed update answers its outcome and timings there)."""
        return self._broadcast_control("/end_weight_update", {}, self._live_update_urls())

    def _live_update_urls(self) -> list[str]:
        dead = {s.url for s in self.servers if not s.alive and not s.held}
        return [u for u in self.update_urls if u not in dead]

    def live_update_urls(self) -> list[str]:
        """Update targets that answer (routed servers by their state, held ones included; others
        by ``/health``), out of every target the fleet was given."""
        routed = {s.url: s.alive or s.held for s in self.servers}
        return [
            u for u in self.all_update_urls if routed.get(u, None) or (u not in routed and self._answers(u))
        ]

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
            self._control.submit(
                self._call,
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
            self._control.submit(
                self._call, u, "/update_weights_from_distributed", payload, timeout=self.control_timeout_s
            )
            for u in self.update_urls
        ]

    def update_weights_stream_async(self, payload: dict[str, object]) -> list[Future[JsonValue]]:
        """Post a whole update's manifest (``engine/weights.py``) to every update target; each
        answers once it is ready for the broadcasts, or refuses the manifest (nothing sent yet)."""
        return [
            self._control.submit(self._call, u, STREAM_ROUTE, payload, timeout=self.control_timeout_s)
            for u in self.update_urls
        ]

    def takes_streamed_updates(self) -> bool:
        """Whether every update target is a built-in engine that takes streamed weight updates
        (its ``/server_info`` says so; SGLang's does not)."""
        for u in self.update_urls:
            try:
                info = self.server_info(u)
            except (ServerLost, ServerError):
                return False
            if not isinstance(info, dict) or info.get(ENGINE_CAPABILITY) != STREAM_ROUTE:
                return False
        return True

    def server_info(self, url: str) -> dict[str, JsonValue]:
        return self._call(url, "/server_info", None, method="GET", timeout=self.control_timeout_s)

    def weights_digest(self, url: str) -> dict[str, str]:
        """sha256 per parameter (built-in engine's ``/megatron_rl/weights_digest`` extension)."""
        return self._call(
            url, "/megatron_rl/weights_digest", None, method="GET", timeout=self.control_timeout_s
        )

    def weights_checksums(self, url: str) -> dict[tuple[int, int], str]:
        """SGLang's own weight check (``/weights_checker``, action ``checksum``) of one server:
        a checksum per worker, keyed by ``(pp_rank, tp_rank)``."""
        body = self._call(url, "/weights_checker", weights_checker_payload(), timeout=self.control_timeout_s)
        return parse_weights_checker(body, url)

    def flush_cache(self) -> list[str]:
        """Ask every live update target to empty its prefix cache; the URLs that refused
        (SGLang flushes only when no request runs or waits)."""
        refused = []
        for u in self._live_update_urls():
            try:
                self._call(u, "/flush_cache", None, timeout=self.control_timeout_s)
            except ServerError:
                refused.append(u)
        return refused

    def destroy_update_group(self, group_name: str) -> None:
        """Ask every live update target to leave the group (best effort)."""
        for u in self._live_update_urls():
            try:
                self._call(
                    u,
                    "/destroy_weights_update_group",
                    {"group_name": group_name},
                    timeout=self.control_timeout_s,
                )
            except (ServerLost, ServerError):
                pass

    # ------------------------------------------------------------------ colocated mode

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Ask every live update target to free the memory of ``tags`` (``protocol.MEMORY_TAGS``;
        None: all) while the trainer uses the device; a server with requests running refuses."""
        self._broadcast_control("/release_memory_occupation", memory_payload(tags), self._live_update_urls())

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Ask every live update target to take the memory of ``tags`` (None: all) back."""
        self._broadcast_control("/resume_memory_occupation", memory_payload(tags), self._live_update_urls())

    def update_weights_from_tensor(self, serialized: str, *, weight_version: int) -> None:
        """Post one ``/update_weights_from_tensor`` to every live update target: ``serialized``
        (``protocol.serialize_named_tensors``) once per tensor-parallel rank of each, inside the
        session that :meth:`begin_update` opened."""
        tp = {**self._update_tp, **{s.url: s.tp_size for s in self.servers}}
        futs = [
            self._control.submit(
                self._call,
                u,
                "/update_weights_from_tensor",
                update_weights_from_tensor_payload(
                    [serialized] * tp.get(u, 1), weight_version=weight_version
                ),
                timeout=self.control_timeout_s,
            )
            for u in self._live_update_urls()
        ]
        for f in futs:
            f.result()

    def close(self) -> None:
        """Stop the control calls: those under way are not waited for."""
        self._control.shutdown(wait=False, cancel_futures=True)
        self._connections.close()
