"""``splitserve gateway --api-server-count N``: N gateway processes serving one REST port (and
one gRPC port), for the cores one Python process cannot use (one uvicorn loop detokenizes and
frames every token of every stream).

Each child is a whole gateway: its own discovery, load reports, KV events, prefix index and
routing. They share nothing but the ports, and see each other's work as any two gateways do,
through the instances' reports; each breaks routing ties in an order of its own, its index
among them (``gateway.tie_break``), so that they do not herd.

One port, several processes: each child binds its own listening socket with SO_REUSEPORT and
the kernel spreads new connections over them by a hash of the connection's addresses, rather
than every child accepting from one socket its parent shares. On a shared socket every idle
child is woken for each connection and one wins the race (a thundering herd on every accept,
and which one wins is up to the scheduler); with SO_REUSEPORT exactly one is woken, and each
child's accept queue is its own. gRPC's server binds with SO_REUSEPORT by default, so the gRPC
front is shared alike. The kernel shares a port only between sockets of one user.

Supervision, step by step:

1. The parent binds the ports the children will share, where they are 0 (any free port), and
   holds them bound but not listening for as long as the children run: a port the kernel
   picked stays this gateway's, and the children are told its number.
2. It starts the children (this command line, plus ``--api-server-index i`` and the ports),
   each dying with it (PR_SET_PDEATHSIG).
3. A child that exits takes the gateway down: the parent stops the others and exits 1, for
   whatever runs it (``splitserve up``, Kubernetes, systemd) to restart it whole. A restart in
   place would hide a crash loop behind a port that still answers.
4. SIGTERM or SIGINT: the parent passes SIGTERM to every child, each drains its requests as a
   lone gateway would, and the parent waits for them all (killing one that overstays) before
   it exits 0.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from launcher.processes import Child, splitserve_command
from launcher.stop_signals import StopSignal

logger = logging.getLogger(__name__)

# A child drains for up to 30 s over REST and another 30 s over gRPC (gateway.server).
STOP_TIMEOUT_S = 70.0


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with SO_REUSEPORT, not yet listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def run_api_servers(args: argparse.Namespace) -> int:
    """Run ``args.api_server_count`` gateway processes on one port until SIGTERM/SIGINT or until one exits."""
    stop = StopSignal().install()
    held: list[socket.socket] = []
    children: list[Child] = []
    try:
        ports = ["--port", str(_held_port(args.host, args.port, held))]
        if args.grpc_port >= 0:
            ports += ["--grpc-port", str(_held_port(args.host, args.grpc_port, held))]
        for index in range(args.api_server_count):
            # This process's own command line, spelt again: later flags win in argparse.
            argv = splitserve_command(*sys.argv[1:], *ports, "--api-server-index", str(index))
            children.append(Child(f"gateway-{index}", argv))
        logger.info("%d gateway processes on %s:%s", args.api_server_count, args.host, ports[1])
        while not stop.wait(0.5):
            dead = next((child for child in children if child.exited), None)
            if dead is not None:
                logger.error("%s exited with %s; stopping the gateway", dead.name, dead.process.returncode)
                return 1
        return 0
    finally:
        for child in children:
            child.terminate()
        for child in children:
            child.wait(STOP_TIMEOUT_S)
        for sock in held:
            sock.close()


def _held_port(host: str, port: int, held: list[socket.socket]) -> int:
    """``port``, or the one the kernel picks for 0, bound here (and kept in ``held``) so that it
    stays free for the children's SO_REUSEPORT sockets."""
    try:
        sock = reuse_port_socket(host, port)
    except OSError as error:
        raise ValueError(f"cannot bind {host}:{port} for the gateway processes: {error}") from None
    held.append(sock)
    return sock.getsockname()[1]
