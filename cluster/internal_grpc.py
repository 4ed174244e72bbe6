"""The internal plane's gRPC, secured one way everywhere: the servers instances run and
every channel to an instance (the gateway's, and D's to P for leases) come from an
:class:`InternalPlane`, which adds a call credential made with the cluster secret to every
call (``cluster/auth.py``) and TLS (``cluster/tls.py``) when they are configured.

Flags (every instance and the gateway take them; the environment variables are the
defaults, so that ``splitserve up`` and compose pass secrets without putting them on a
command line other local users can read):

- ``--cluster-secret`` (``SPLITSERVE_CLUSTER_SECRET``) or ``--cluster-secret-file``
  (``SPLITSERVE_CLUSTER_SECRET_FILE``, e.g. a compose secret under /run/secrets);
- ``--tls-cert``, ``--tls-key``, ``--tls-ca`` (``SPLITSERVE_TLS_CERT``, ``_KEY``, ``_CA``);
- ``--require-cluster-secret`` (``SPLITSERVE_REQUIRE_CLUSTER_SECRET=1``): refuse to start
  without a secret; ``--insecure-internal-plane``: start without one although this process
  listens beyond loopback.

A secret given but empty (an empty file, an empty variable) is an error at start. Without a
secret the plane is open: anyone who reaches an instance's port may release or abort any
request's KV, or hand D a KV handle of their own. That is allowed only on loopback (one host:
``splitserve up``, the tests), or when ``--insecure-internal-plane`` says so; the process then
logs a warning at start (:meth:`InternalPlane.warn_if_open`).
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import os
import socket
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import grpc

from cluster.auth import WILDCARD_HOSTS, ClusterCallCheck, ClusterSecret, cluster_call_interceptors, load_cluster_secret
from cluster.call_counts import CallCounts
from cluster.tls import TLSFiles

logger = logging.getLogger(__name__)


def add_internal_plane_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument(
        "--cluster-secret",
        # Set but empty is not the same as unset: an error at start (cluster.auth.load_cluster_secret).
        default=env("SPLITSERVE_CLUSTER_SECRET"),
        help="shared secret every internal gRPC call carries and KV handles are signed with; the same on "
        "gateway, prefill and decode (env SPLITSERVE_CLUSTER_SECRET; prefer it, or the file, to this flag)",
    )
    parser.add_argument(
        "--cluster-secret-file",
        default=env("SPLITSERVE_CLUSTER_SECRET_FILE"),  # set but empty: an error at start, as above
        help="read the cluster secret from this file, e.g. /run/secrets/cluster_secret (env "
        "SPLITSERVE_CLUSTER_SECRET_FILE)",
    )
    parser.add_argument(
        "--tls-cert",
        default=env("SPLITSERVE_TLS_CERT") or None,
        help="PEM certificate for internal gRPC: served by instances, presented as client certificate by all (env "
        "SPLITSERVE_TLS_CERT)",
    )
    parser.add_argument(
        "--tls-key",
        default=env("SPLITSERVE_TLS_KEY") or None,
        help="PEM private key of --tls-cert (env SPLITSERVE_TLS_KEY)",
    )
    parser.add_argument(
        "--tls-ca",
        default=env("SPLITSERVE_TLS_CA") or None,
        help="PEM CA certificates peers are checked against; on an instance it also requires client "
        "certificates (mutual TLS) (env SPLITSERVE_TLS_CA)",
    )
    parser.add_argument(
        "--require-cluster-secret",
        action="store_true",
        default=env("SPLITSERVE_REQUIRE_CLUSTER_SECRET", "") not in ("", "0"),
        help="refuse to start without a cluster secret, even on loopback (env SPLITSERVE_REQUIRE_CLUSTER_SECRET=1)",
    )
    parser.add_argument(
        "--insecure-internal-plane",
        action="store_true",
        help="start without a cluster secret although --host is not a loopback address: anyone who reaches "
        "the internal ports can then abort, release or poison KV (trusted private networks only)",
    )


@dataclass(frozen=True, slots=True)
class InternalPlane:
    """How this process's internal gRPC is secured. The default is open (no secret, no TLS)."""

    secret: ClusterSecret | None = None
    tls: TLSFiles | None = None
    # What this plane's server received, by method (its instance's /metrics exports them).
    call_counts: CallCounts = field(default_factory=CallCounts, compare=False, repr=False)
    # Each server's credential check, told by add_port which addresses its server answers to.
    _call_checks: weakref.WeakKeyDictionary[grpc.aio.Server, ClusterCallCheck] = field(
        default_factory=weakref.WeakKeyDictionary, compare=False, repr=False
    )

    @classmethod
    def from_args(cls, args: argparse.Namespace, listen_host: str) -> InternalPlane:
        """``listen_host``: the address this process binds to (its ``--host``). Raises ValueError
        (naming the flag) for a secret that is empty, too short or in a file it cannot read, and
        for a missing one where it is required: by ``--require-cluster-secret``, or by a
        ``listen_host`` beyond loopback without ``--insecure-internal-plane``."""
        plane = cls(
            secret=load_cluster_secret(args.cluster_secret, args.cluster_secret_file),
            tls=TLSFiles.load(args.tls_cert, args.tls_key, args.tls_ca),
        )
        if plane.secret is None:
            if args.require_cluster_secret:
                raise ValueError(
                    "--require-cluster-secret is set but no cluster secret is given: set SPLITSERVE_CLUSTER_SECRET "
                    "or --cluster-secret-file (the same secret on gateway, prefill and decode)"
                )
            if not args.insecure_internal_plane and not is_loopback(listen_host):
                raise ValueError(
                    f"--host {listen_host} listens beyond loopback, but no cluster secret is given: anyone who "
                    "reaches this process could drive the internal plane. Set SPLITSERVE_CLUSTER_SECRET or "
                    "--cluster-secret-file (the same secret on gateway, prefill and decode; see docs/security.md), "
                    "or pass --insecure-internal-plane on a network only the cluster reaches"
                )
        return plane

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """A channel to the instance at ``address`` (``host:port``, as it advertises itself): TLS
        when configured, a fresh call credential, bound to ``address`` and the request, on every call."""
        interceptors = cluster_call_interceptors(self.secret, address) if self.secret is not None else None
        if self.tls is not None:
            return grpc.aio.secure_channel(
                address, self.tls.channel_credentials(), options=list(options), interceptors=interceptors
            )
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)

    def server(self, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Server:
        """An instance's server: calls without a valid call credential are refused (health checks
        excepted). Give it its ports with :meth:`add_port`, which tells the check its addresses."""
        interceptors: list[grpc.aio.ServerInterceptor] = [self.call_counts]
        server_check = ClusterCallCheck(self.secret) if self.secret is not None else None
        if server_check is not None:
            interceptors.append(server_check)
        server = grpc.aio.server(interceptors=interceptors, options=list(options))
        if server_check is not None:
            self._call_checks[server] = server_check
        return server

    def add_port(self, server: grpc.aio.Server, address: str, advertise_host: str | None = None) -> int:
        """Bind ``server`` to ``address`` (``host:port``; port 0: any free one) and return the port.
        Call credentials are accepted when made for ``host:port`` or, given ``advertise_host``
        (``--advertise-host``), for ``advertise_host:port``: the address peers dial."""
        if self.tls is not None:
            port = server.add_secure_port(address, self.tls.server_credentials())
        else:
            port = server.add_insecure_port(address)
        server_check = self._call_checks.get(server)
        if server_check is not None:
            host = address.rpartition(":")[0]
            hosts = [host, *([advertise_host] if advertise_host else [])]
            if host in WILDCARD_HOSTS and advertise_host in (None, "", host):
                hosts += this_hosts_names()  # bound everywhere, advertised nowhere: dialled by the host's names
            server_check.answer_to(
                *(f"[{h}]:{port}" if ":" in h and not h.startswith("[") else f"{h}:{port}" for h in hosts)
            )
        return port

    def credential_check_counts(self) -> tuple[int, int] | None:
        """Over this plane's servers' credential checks: calls refused since start, and nonces
        of accepted calls remembered now (a replay cache bounded by the calls of one window,
        which a flood of valid calls fills first); None without a cluster secret (nothing is
        checked). Read by the instance's Prometheus endpoint, from its thread."""
        if self.secret is None:
            return None
        checks = list(self._call_checks.values())
        return sum(check.num_refused for check in checks), sum(check.num_remembered for check in checks)

    def warn_if_open(self, who: str) -> None:
        """Say loudly, at start, what an unsecured plane lets others do."""
        if self.secret is None:
            logger.warning(
                "%s: NO CLUSTER SECRET: the internal plane is open. Anyone who reaches this process's ports can "
                "release "
                "or abort any request's KV, and hand decode instances KV of their own. Set SPLITSERVE_CLUSTER_SECRET "
                "(the same on gateway, prefill and decode) everywhere but on a single trusted host; see "
                "docs/security.md",
                who,
            )
        if self.tls is None:
            logger.info("%s: internal gRPC is not encrypted (no --tls-cert / --tls-ca)", who)


def this_hosts_names() -> list[str]:
    """This host's name, its fully qualified name and the addresses they resolve to: what peers
    dial an instance by that binds every interface without an ``--advertise-host``."""
    names = {socket.gethostname(), socket.getfqdn()}
    for name in list(names):
        with contextlib.suppress(OSError, UnicodeError):
            names |= {str(info[4][0]) for info in socket.getaddrinfo(name, None)}
    return sorted(name for name in names if name)


def is_loopback(host: str) -> bool:
    """Whether binding to ``host`` keeps a port on this machine: a loopback address, or a name
    every address of which is one (``localhost``). A name that does not resolve is not."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


async def abort_call(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    """End the servicer's call with ``code``: ``context.abort``, typed as the raise it is."""
    await context.abort(code, details)
    raise RuntimeError("bug: grpc's context.abort returned instead of raising")
