"""The fleet doctor on real ``serve-engine`` processes over HTTP: an external server that dies is
asked again with back-off, held (never routed) once it answers, and routed only once admitted
(what the broadcaster does after the update that gave it the trainer's weights); a dead fleet
past its timeout is reported once."""

from __future__ import annotations

import time

import pytest

from megatron_rl.generation.api import GenRequest
from megatron_rl.generation.client import FleetClient, ServerLost
from megatron_rl.generation.engine.launch import EngineProcess
from megatron_rl.orchestration.fleet_health import FleetDead, FleetDoctor
from tests.generation.conftest import prompt, tiny_llama  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.slow, pytest.mark.fault("crash")]


def _req(i: int) -> GenRequest:
    return GenRequest(request_id=f"r{i}", input_ids=prompt(8, i), max_new_tokens=4, seed=i)


def test_an_external_server_back_after_a_death_is_held_until_admitted(tiny_llama):  # noqa: F811
    dead: list[BaseException] = []
    with EngineProcess(tiny_llama, max_slots=4, max_len=64, api_key="k") as server:
        fleet = FleetClient([server.url], api_key="k")
        # No local engines: to the doctor, this is someone else's server (fleet.urls).
        doctor = FleetDoctor(fleet, {}, max_restarts=3, dead_fleet_timeout_s=60, on_dead=dead.append)
        try:
            assert fleet.submit(_req(0)).result(timeout=60).token_ids
            server.kill()
            fleet.refresh()  # what the next update does: the client finds it dead
            assert not fleet.alive and not fleet.held_urls()
            with pytest.raises(ServerLost, match="no live server"):
                fleet.submit(_req(1))
            doctor.look()  # asks: nobody answers; the next ask waits 1 s, then 2 s ...
            doctor.look()
            assert not fleet.held_urls()
            server.restart()  # its operator brings it back, on its port
            deadline = time.monotonic() + 40
            while not fleet.held_urls() and time.monotonic() < deadline:
                doctor.look()
                time.sleep(0.2)
            assert fleet.held_urls() == [server.url] and not fleet.alive
            # Held: it joins the next update (live_update_urls), but takes no generation.
            assert fleet.live_update_urls() == [server.url]
            with pytest.raises(ServerLost, match="no live server"):
                fleet.submit(_req(2))
            # An update begun before it was held (it died and came back during it) missed it.
            fleet.admit([server.url], held_before=fleet.servers[0].held_since - 1.0)
            assert not fleet.alive and fleet.held_urls() == [server.url]
            fleet.admit([server.url], held_before=time.monotonic())
            assert fleet.submit(_req(3)).result(timeout=60).token_ids
            assert not dead
        finally:
            doctor.close()
            fleet.close()


def test_a_fleet_with_no_server_past_its_timeout_is_reported_once(tiny_llama):  # noqa: F811
    dead: list[BaseException] = []
    with EngineProcess(tiny_llama, max_slots=4, max_len=64, api_key="k") as server:
        fleet = FleetClient([server.url], api_key="k")
        doctor = FleetDoctor(
            fleet, {server.url: server}, max_restarts=0, dead_fleet_timeout_s=1.0, on_dead=dead.append
        )
        try:
            server.kill()
            doctor.look()  # its process is dead: out of routing, no restart left
            assert not fleet.alive and not dead
            time.sleep(1.1)
            doctor.look()
            doctor.look()
            assert len(dead) == 1 and isinstance(dead[0], FleetDead)
            assert (
                f"no generation server reachable for 1 s (fleet.dead_fleet_timeout_s): {server.url}"
                in str(dead[0])
            )
        finally:
            doctor.close()
            fleet.close()
