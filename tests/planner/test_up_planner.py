"""``splitserve up --simulate --planner``: the planner, a child of ``up``, starts the instances
(one process each) and the gateway routes to them; with no traffic it shrinks the decode pool
to its minimum; the gateway's status page shows the planner's decisions; Ctrl-C (SIGINT) stops everything, the
planner's instances included. Without ``--simulate`` the planner starts real ``prefill`` and
``decode`` processes of the model, priced by the capacity profile ``up`` passes on, and a
streamed completion runs through them."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import openai
import pytest

from launcher.processes import UP_STOP_TIMEOUT_S
from planner.capacity import InstanceCapacity, Slo
from planner.capacity_profile import CapacityProfile
from planner.observations import GatewayScraper
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
        assert up.stop(UP_STOP_TIMEOUT_S) == 0, up.log_text()[-6000:]
    assert below and not [pid for pid in below if alive(pid)], "up --planner left processes behind"


def splitserve_commands(pids: list[int]) -> dict[str, list[str]]:
    """The ``splitserve`` subcommand of each live process among ``pids`` (``gateway``, ``planner``,
    ``prefill`` ...), by pid, with its whole argv."""
    commands = {}
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "splitserve" in argv:
            after = argv[argv.index("splitserve") + 1 :]
            while after and after[0] == "--log-level":  # the global flag before the subcommand
                after = after[2:]
            commands[str(pid)] = after
    return commands


def blocks_held(gateway_url: str) -> int:
    scraper = GatewayScraper([gateway_url])
    try:
        return sum(view.total_blocks - view.free_blocks for view in scraper.scrape().instances.values())
    finally:
        scraper.close()


@pytest.mark.slow  # a gateway, a planner and two real instances of the tiny model on two busy cores
def test_up_with_a_planner_starts_real_instances_of_the_model(tmp_path: Path, model: Path) -> None:
    # What `splitserve profile` would have measured, made up: one instance of each role carries
    # any load this test sends, and the bounds keep the pools at one each.
    CapacityProfile("the test", Slo(5.0, 1.0), 24, 6, InstanceCapacity(20.0, 20.0, 16)).save(tmp_path / "cap.json")
    port = free_port()
    up = HTTPProcess(
        "up-planner-real",
        "up",
        "--planner",
        "--capacity-profile", str(tmp_path / "cap.json"),
        "--ttft-slo", "5",
        "--itl-slo", "1",
        "--max-prefill", "1",
        "--max-decode", "1",
        "--model", str(model),
        "--dtype", "float32",
        "--kv-cache-memory", str(8 << 20),
        "--port", str(port),
        "--grpc-port", str(free_port()),
        port=port,
    )  # fmt: skip
    below: list[int] = []
    try:
        # up is ready once the gateway routes to each role, which the planner's instances registered as.
        assert ready_counts(up.url) == {"prefill": 1, "decode": 1, "colocated": 0}
        below = descendants(up.process.pid)
        commands = splitserve_commands(below)
        subcommands = sorted(argv[0] for argv in commands.values())
        assert subcommands == ["decode", "gateway", "planner", "prefill"], commands
        for argv in commands.values():
            if argv[0] in ("prefill", "decode"):
                assert argv[1:3] == ["--model", str(model)], argv
                assert argv[argv.index("--kv-cache-memory") + 1] == str(8 << 20), argv
        client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(
            model=client.models.list().data[0].id,
            prompt="The quick brown fox",
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 8
        # Every block of the finished request comes back to the pools' free lists.
        wait_for(lambda: blocks_held(up.url) == 0, "the instances to hold no KV block once idle")
    finally:
        below = below or descendants(up.process.pid)
        up.process.send_signal(signal.SIGINT)
        assert up.stop(UP_STOP_TIMEOUT_S) == 0, up.log_text()[-6000:]
    assert below and not [pid for pid in below if alive(pid)], "up --planner left processes behind"
