"""``splitserve up --simulate --planner``: the planner, a child of ``up``, starts the instances
(one process each) and the gateway routes to them; with no traffic it shrinks the decode pool
to its minimum; the gateway's status page shows the planner's decisions; Ctrl-C (SIGINT) stops everything, the
planner's instances included."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import openai

from tests.gateway.processes import HTTPProcess
from tests.gateway.test_tensor_parallel_up import alive, descendants
from tests.simulator.cluster import ready_counts, wait_for, write_profile
from tests.stores import free_port


def test_up_with_a_planner_starts_the_pools_and_shrinks_an_idle_one(tmp_path: Path) -> None:
    port = free_port()
    up = HTTPProcess(
        "up-planner",
        "up",
        "--simulate",
        "--simulate-profile",
        str(write_profile(tmp_path)),
        "--planner",
        "--num-prefill", "1",
        "--num-decode", "2",
        "--min-decode", "1",
        "--plan-interval", "1",
        "--down-cooldown", "0",
        "--port", str(port),
        "--grpc-port", str(free_port()),
        port=port,
    )  # fmt: skip
    below = descendants(up.process.pid)
    try:
        # up is ready once the gateway routes to each role (HTTPProcess waited for /ready).
        below = descendants(up.process.pid)
        client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0)
        reply = client.completions.create(model=client.models.list().data[0].id, prompt="Hello", max_tokens=8)
        assert reply.usage is not None and reply.usage.completion_tokens == 8
        # No traffic: one decode instance is enough. The other is drained and stopped once ready,
        # or stopped before any gateway listed it (it held nothing), whichever it was by then.
        wait_for(lambda: "decode 2 -> 1 (load_down" in up.log_text(), "the planner to shrink decode to one")
        wait_for(lambda: "stopped decode instance planned-decode-" in up.log_text(), "a decode instance stopped")
        wait_for(lambda: ready_counts(up.url) == {"prefill": 1, "decode": 1, "colocated": 0}, "one of each role")
        # up gives the planner a metrics port and the gateway's status page its address.
        planner = httpx.get(f"{up.url}/status.json", timeout=10).json()["planner"]
        assert planner["reachable"], planner
        assert {role["role"]: role["desired"] for role in planner["roles"]} == {"prefill": 1, "decode": 1}
    finally:
        below = below or descendants(up.process.pid)
        up.process.send_signal(signal.SIGINT)
        assert up.stop() == 0, up.log_text()[-3000:]
    assert below and not [pid for pid in below if alive(pid)], "up --planner left processes behind"
