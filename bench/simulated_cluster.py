"""A simulated cluster for the benchmarks, started as a deployment runs one: a Redis registry,
gateway processes each on its own port (replicas, ``--gateway-index`` of ``--num-gateways``, each
its own ``splitserve gateway --registry-url``), and ``splitserve simulate`` processes of a role,
each serving several instances with their Prometheus endpoints on consecutive ports.

:class:`Cluster` keeps every process it started by group, so that a benchmark reads each
group's counters by pid and :meth:`Cluster.stop` stops them all by pid, whatever happened.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import redis

from bench.socket_bytes import SocketBytes
from launcher.processes import free_port, splitserve_command

START_TIMEOUT_S = 600.0  # dozens of instances loading their tokenizers on a small host
GROUPS = ("gateways", "instances", "redis", "client")  # the client: this process


@dataclass(slots=True)
class Cluster:
    """The processes started, by group, and where to reach them."""

    redis_port: int
    log_path: Path
    processes: dict[str, list[subprocess.Popen[bytes]]] = field(default_factory=dict)
    gateway_ports: list[int] = field(default_factory=list)
    metrics_urls: list[str] = field(default_factory=list)  # every instance's /metrics

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}"

    @property
    def gateway_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.gateway_ports]

    def peer_of(self, group: str) -> Callable[[SocketBytes], str]:
        """What a socket of ``group`` connects to, for its bytes' breakdown."""

        def peer(socket_: SocketBytes) -> str:
            if group == "redis":
                return "its_clients"
            if socket_.peer_port == self.redis_port:
                return "redis"
            if group == "gateways":
                return "clients" if socket_.local_port in self.gateway_ports else "instances"
            return {"instances": "gateways_and_instances", "client": "gateways"}.get(group, "other")

        return peer

    def pids(self, group: str) -> list[int]:
        if group == "client":
            return [os.getpid()]
        return [process.pid for process in self.processes.get(group, [])]

    def check_alive(self) -> None:
        for group, processes in self.processes.items():
            for process in processes:
                if process.poll() is not None:
                    raise RuntimeError(f"a {group} process exited with {process.returncode}: see {self.log_path}")

    def stop(self) -> None:
        everything = [p for group in ("gateways", "instances", "redis") for p in self.processes.get(group, [])]
        for process in everything:
            if process.poll() is None:
                process.terminate()
        for process in everything:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def free_port_block(count: int) -> int:
    """The first of ``count`` consecutive ports free now (``simulate --metrics-port`` numbers
    its instances' endpoints from it)."""
    for _ in range(200):
        first = free_port()
        sockets = []
        try:
            for port in range(first, first + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"found no {count} consecutive free ports")


def get_json(url: str) -> dict:
    """A JSON body, whatever the status (``/ready`` answers 503 with its counts)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        return json.loads(error.read())


def ready_bodies(cluster: Cluster) -> list[dict]:
    """Each gateway's /ready body (its healthy instances by role), or {} while it does not answer."""
    bodies = []
    for url in cluster.gateway_urls:
        try:
            bodies.append(get_json(f"{url}/ready"))
        except (OSError, ValueError):
            bodies.append({})
    return bodies


def wait_until(cluster: Cluster, condition: Callable[[], bool], what: str) -> None:
    """Until ``condition``; bounded, and failing at once when a process of the cluster exits."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not condition():
        cluster.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"never happened: {what}")
        time.sleep(0.5)


def start_redis(cluster: Cluster, log: IO[bytes]) -> None:
    """The registry on the cluster's port, with nothing saved to disk."""
    command = ["redis-server", "--bind", "127.0.0.1", "--port", str(cluster.redis_port), "--save", "",
               "--appendonly", "no"]  # fmt: skip
    cluster.processes["redis"] = [subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)]


def start_gateways(cluster: Cluster, args: argparse.Namespace, env: dict[str, str], log: IO[bytes]) -> None:
    for index in range(args.num_gateways):
        port = free_port()
        command = splitserve_command(
            "--log-level", "WARNING", "gateway", "--port", str(port), "--grpc-port", "-1",
            "--registry-url", cluster.redis_url, "--poll-interval", str(args.poll_interval),
            "--gateway-index", str(index), "--num-gateways", str(args.num_gateways),
            "--max-pending-requests", str(4 * args.streams),
        )  # fmt: skip
        cluster.processes.setdefault("gateways", []).append(
            subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        )
        cluster.gateway_ports.append(port)


def start_instances(
    cluster: Cluster, args: argparse.Namespace, env: dict[str, str], log: IO[bytes], role: str, index: int, count: int
) -> None:
    """One ``splitserve simulate ROLE`` process serving ``count`` instances."""
    metrics_port = free_port_block(count)
    command = splitserve_command(
        "--log-level", "WARNING", "simulate", role, "--profile", args.profile, "--num-instances", str(count),
        "--instance-id", f"{role}-p{index}", "--port", "0", "--registry-url", cluster.redis_url,
        "--heartbeat-seconds", str(args.heartbeat_seconds), "--metrics-port", str(metrics_port),
    )  # fmt: skip
    cluster.processes.setdefault("instances", []).append(
        subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    )
    cluster.metrics_urls += [f"http://127.0.0.1:{metrics_port + i}/metrics" for i in range(count)]


def split(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` as even as can be (the first ones larger)."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def redis_answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
