"""Separate nodes on one machine: a network namespace per part, each with one veth pair into a
bridge the test makes, the link shaped with ``tc``. A process in one namespace reaches
another only through its ``eth0``, the bridge and the peer's ``eth0``, never over loopback:
binds, advertised addresses, the registry and the KV pulls all work as across hosts.

The bridge has an address in the test's own namespace, so the test reaches every part.
Shaping: ``netem`` (rate and delay) where the kernel has it, else ``tbf`` (rate only; the
kernel of these VMs has no netem). Everything made is removed on exit, even on failure:
removing a namespace removes its veth pair, and the bridge goes last.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Node:
    namespace: str | None  # None: the test's own namespace (loopback, for comparison)
    address: str  # on the bridge's subnet

    def command(self, *argv: str) -> list[str]:
        """``argv`` run inside this node's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv] if self.namespace else list(argv)


@dataclass(slots=True)
class Network:
    nodes: dict[str, Node]
    bridge_address: str  # the test's own address on the bridge
    shaping: str  # what tc applied to every link, e.g. "netem rate 10gbit delay 100us"
    _made: list[list[str]] = field(default_factory=list)  # undo commands, run in reverse


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def _shape(device: str, namespace: str | None, rate: str, delay_us: int) -> str:
    """Shape egress of ``device``: netem (rate and delay) if the kernel has it, else tbf (rate)."""
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    attempts = (
        ["netem", "rate", rate, "delay", f"{delay_us}us", "limit", "100000"],
        ["tbf", "rate", rate, "burst", "4mb", "latency", "50ms"],
    )
    errors = []
    for qdisc in attempts:
        result = subprocess.run(
            [*prefix, "tc", "qdisc", "add", "dev", device, "root", *qdisc], capture_output=True, text=True, timeout=30
        )
        if result.returncode == 0:
            return " ".join(qdisc[:5] if qdisc[0] == "netem" else qdisc[:3])
        errors.append(f"{qdisc[0]}: {result.stderr.strip()}")
    raise RuntimeError(f"tc could not shape {device}: {errors}")


@contextmanager
def separate_nodes(parts: tuple[str, ...], rate: str = "10gbit", delay_us: int = 100) -> Iterator[Network]:
    """One namespace per part, joined through a bridge; skips where namespaces cannot be made."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("network namespaces need root and iproute2 (ip, tc)")
    tag = f"ss{os.getpid() % 100000}"
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    bridge = f"{tag}br"
    network = Network(nodes={}, bridge_address=f"{subnet}.254", shaping="")
    try:
        try:
            _ip("link", "add", bridge, "type", "bridge")
        except RuntimeError as error:
            pytest.skip(f"cannot make a bridge here: {error}")
        network._made.append(["link", "del", bridge])
        _ip("addr", "add", f"{network.bridge_address}/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for index, part in enumerate(parts, start=1):
            namespace = f"{tag}-{part}"
            _ip("netns", "add", namespace)
            network._made.append(["netns", "del", namespace])
            host_end = f"{tag}v{index}"
            _ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            _ip("link", "set", host_end, "master", bridge, "up")
            _ip("-n", namespace, "addr", "add", f"{subnet}.{index}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            # Both directions: the host end's egress goes into the namespace, eth0's out of it.
            network.shaping = _shape(host_end, None, rate, delay_us)
            _shape("eth0", namespace, rate, delay_us)
            network.nodes[part] = Node(namespace, f"{subnet}.{index}")
        logger.warning(
            "separate nodes %s on %s.0/24 through %s, links shaped with %s",
            {p: n.address for p, n in network.nodes.items()},
            subnet,
            bridge,
            network.shaping,
        )
        yield network
    finally:
        for undo in reversed(network._made):
            subprocess.run(["ip", *undo], capture_output=True, timeout=30)
