"""Several gateways in front of one simulated cluster (16 decode instances, 4 prefill, found
through a real Redis registry): two gateways given a burst at the same moment spread it over
disjoint decode instances (no herding), and ``--api-server-count 2`` serves one port from two
processes and stops them all on SIGTERM.

Each gateway sees the other's dispatches only through the instances' load reports, a poll or
heartbeat later; a burst is routed within that window, so what keeps the gateways apart is
each one's own tie order (gateway/tie_break.py), which these tests check.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import psutil
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.processes import HTTPProcess
from tests.simulator.cluster import (
    MODEL,
    SimulatedInstances,
    instance_metrics,
    prompt,
    ready_counts,
    registry_gateway,
    stream_completion,
    wait_for,
    write_profile,
)
from tests.stores import free_port, start_redis, stop

NUM_PREFILL = 4
NUM_DECODE = 16
EXPECTED = {"prefill": NUM_PREFILL, "decode": NUM_DECODE, "colocated": 0}


@dataclass
class Cluster:
    registry_url: str
    processes: tuple[SimulatedInstances, ...]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    profile = write_profile(tmp_path_factory.mktemp("profile"))
    redis_process, registry_url = start_redis()
    started: list[SimulatedInstances] = []
    try:
        started.append(SimulatedInstances("prefill", NUM_PREFILL, profile, registry_url, "gws-prefill"))
        started.append(SimulatedInstances("decode", NUM_DECODE, profile, registry_url, "gws-decode"))
        yield Cluster(registry_url, tuple(started))
    finally:
        for process in started:
            process.stop()
        stop(redis_process)


def start_gateway(cluster: Cluster, name: str, *extra: str) -> HTTPProcess:
    """A gateway on the cluster, once it routes to every instance."""
    gateway = registry_gateway(name, cluster.registry_url, *extra)
    try:
        wait_for(
            lambda: ready_counts(gateway.url) == EXPECTED,
            f"{name} routes to {EXPECTED}",
            processes=cluster.processes,
        )
    except BaseException:
        gateway.stop()
        raise
    return gateway


def decode_routed(url: str) -> dict[str, float]:
    """Requests this gateway routed to each decode instance, those it routed none left out."""
    return {
        name: n for name, n in instance_metrics(url, "routed_requests").items() if name.startswith("gws-decode") and n
    }


def test_two_gateways_spread_a_simultaneous_burst_over_disjoint_decode_instances(cluster: Cluster) -> None:
    """8 streams to each of two gateways at once, 16 idle decode instances: each gateway ranks
    them all equal, and neither learns of the other's streams before it has routed its own.
    Given their indexes, they route to disjoint instances (with one tie order, as before
    ``gateway/tie_break.py``, both bursts went to the same 8 instances, two streams each)."""
    num_streams, max_tokens = 8, 64
    gateways = [
        start_gateway(
            cluster, f"gws-{index}", "--grpc-port", "-1", "--gateway-index", str(index), "--num-gateways", "2"
        )
        for index in range(2)
    ]
    try:

        async def bursts() -> list[tuple[int, str | None]]:
            clients = [
                AsyncOpenAI(base_url=f"{g.url}/v1", api_key="unused", max_retries=0, timeout=120) for g in gateways
            ]
            try:
                return await asyncio.gather(
                    *(
                        stream_completion(client, prompt(100 * g + i, num_words=100), max_tokens)
                        for g, client in enumerate(clients)
                        for i in range(num_streams)
                    )
                )
            finally:
                for client in clients:
                    await client.close()

        assert asyncio.run(bursts()) == [(max_tokens, "length")] * (2 * num_streams)
        routed = [decode_routed(g.url) for g in gateways]
        assert [sum(r.values()) for r in routed] == [num_streams, num_streams], routed
        assert not set(routed[0]) & set(routed[1]), routed
    finally:
        for gateway in gateways:
            gateway.stop()


def served_by(url: str, body: dict[str, object]) -> int:
    """One completion over a connection of its own, then a scrape over the same connection:
    the index of the gateway process that served both."""
    with httpx.Client(timeout=60) as client:
        response = client.post(f"{url}/v1/completions", json=body)
        assert response.status_code == 200, response.text
        families = text_string_to_metric_families(client.get(f"{url}/metrics").text)
    for family in families:
        for sample in family.samples:
            if sample.name == "splitserve_api_server_info":
                return int(sample.labels["index"])
    raise AssertionError("no splitserve_api_server_info in /metrics")


def test_api_server_count_2_serves_one_port_from_two_processes_and_stops_them_all(cluster: Cluster) -> None:
    """The kernel spreads new connections over the processes' SO_REUSEPORT sockets by a hash of
    their addresses: new connections (each from a port of its own) reach both, and each routes
    on its own (a request it serves needs its own discovery). SIGTERM to the parent stops them
    all and it exits 0."""
    gateway = start_gateway(cluster, "gws-api-servers", "--grpc-port", str(free_port()), "--api-server-count", "2")
    try:
        parent = psutil.Process(gateway.process.pid)
        children = parent.children(recursive=True)
        assert len(children) == 2, children
        body = {"model": MODEL, "prompt": prompt(900, num_words=100), "max_tokens": 4, "temperature": 0}
        # Each connection reaches either process; one never reached in 64 tries means the kernel does not
        # spread them (the chance that it does and misses one is 2 ** -63).
        seen: set[int] = set()
        for _ in range(64):
            seen.add(served_by(gateway.url, body))
            if seen == {0, 1}:
                break
        assert seen == {0, 1}
    finally:
        returncode = gateway.stop()
    assert returncode == 0, gateway.log_text()[-3000:]
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, alive


def test_a_gateway_process_that_dies_takes_the_gateway_down(cluster: Cluster) -> None:
    """One of the processes killed: the parent stops the other and exits 1, for whatever runs
    it to restart the whole gateway rather than serve on with part of it."""
    gateway = start_gateway(cluster, "gws-api-servers-kill", "--grpc-port", "-1", "--api-server-count", "2")
    try:
        children = psutil.Process(gateway.process.pid).children(recursive=True)
        assert len(children) == 2, children
        children[0].send_signal(signal.SIGKILL)
        assert gateway.process.wait(timeout=120) == 1
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, alive
    finally:
        gateway.stop()
