"""Bytes a group of processes moved over TCP, by whom they talked to, from the kernel's own
per-connection counters (``ss -tinp``: ``bytes_sent`` and ``bytes_received`` of each
established socket, with the pid that holds it).

Per process, not per interface: loopback carries every other process of the host too.
/proc/PID/io is no substitute: its rchar and wchar count read() and write(), which gRPC's
recvmsg/sendmsg and asyncio's recv/send never call. Connections that close within a window are
missed (their counters go with them): the cluster's gRPC channels, Redis clients and the load
client's keep-alive connections stay open for the whole run; one opened within it counts whole.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

_OWNER = re.compile(r"pid=(\d+),fd=(\d+)")
_SENT = re.compile(r"\bbytes_sent:(\d+)")
_RECEIVED = re.compile(r"\bbytes_received:(\d+)")

SocketKey = tuple[int, int, str, str]  # pid, fd, local address, peer address


@dataclass(frozen=True, slots=True)
class SocketBytes:
    local_port: int
    peer_port: int
    bytes_sent: int
    bytes_received: int


def parse_ss(text: str, pids: set[int]) -> dict[SocketKey, SocketBytes]:
    """The sockets of ``pids`` in ``ss -tinpH state established`` output: a line naming the
    socket and its owners, then an indented line of its TCP counters."""
    sockets: dict[SocketKey, SocketBytes] = {}
    owner: tuple[SocketKey, int, int] | None = None
    for line in text.splitlines():
        if line and not line[0].isspace():
            owner = None
            columns = line.split()
            if len(columns) < 5:
                continue
            local, peer = columns[2], columns[3]
            for pid, fd in _OWNER.findall(line):
                if int(pid) in pids:
                    local_port, peer_port = int(local.rsplit(":", 1)[1]), int(peer.rsplit(":", 1)[1])
                    owner = ((int(pid), int(fd), local, peer), local_port, peer_port)
                    break
        elif owner is not None:
            sent, received = _SENT.search(line), _RECEIVED.search(line)
            key, local_port, peer_port = owner
            sockets[key] = SocketBytes(
                local_port, peer_port, int(sent.group(1)) if sent else 0, int(received.group(1)) if received else 0
            )
            owner = None
    return sockets


def established_sockets(pids: set[int]) -> dict[SocketKey, SocketBytes]:
    """Every established TCP socket the processes ``pids`` hold now, with its counters."""
    output = subprocess.run(
        ["ss", "-tinpH", "state", "established"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return parse_ss(output, pids)


def bytes_by_peer(
    before: dict[SocketKey, SocketBytes],
    after: dict[SocketKey, SocketBytes],
    pids: set[int],
    peer_of: Callable[[SocketBytes], str],
) -> dict[str, dict[str, int]]:
    """Bytes ``pids``' sockets sent and received between two readings, by ``peer_of`` each socket."""
    totals: dict[str, dict[str, int]] = {}
    for key, now in after.items():
        if key[0] not in pids:
            continue
        then = before.get(key)
        entry = totals.setdefault(peer_of(now), {"sent": 0, "received": 0})
        entry["sent"] += now.bytes_sent - (then.bytes_sent if then else 0)
        entry["received"] += now.bytes_received - (then.bytes_received if then else 0)
    return totals
