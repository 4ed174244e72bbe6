"""TLS for the internal gRPC channels (gateway -> P/D, D -> P): each process's
certificate and the CA it checks its peers' certificates against.

- An instance serves TLS with ``--tls-cert`` and ``--tls-key``; with ``--tls-ca`` too it
  requires a client certificate signed by that CA (mutual TLS).
- Every process dials instances with ``--tls-ca`` as the roots it trusts (the system's
  when absent) and, when it has ``--tls-cert`` / ``--tls-key``, presents them as its client
  certificate.

A certificate must name the host its peers dial (the instance's ``--advertise-host``,
or ``--host``) among its subject alternative names. One certificate for the whole
cluster, naming every host, is enough.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import grpc


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """PEM bytes, read once at start."""

    cert: bytes | None = None
    key: bytes | None = field(default=None, repr=False)
    ca: bytes | None = None

    @classmethod
    def load(cls, cert: str | None, key: str | None, ca: str | None, flags: str = "--tls") -> TLSFiles | None:
        """None when no TLS flag is given. Raises ValueError naming the flag to fix: ``flags``
        is their common prefix (``--tls``: the internal plane's; ``--grpc-tls``: the gateway's
        public gRPC front's)."""
        if not (cert or key or ca):
            return None
        if bool(cert) != bool(key):
            raise ValueError(
                f"{flags}-cert and {flags}-key go together: give both (the certificate and its private key) or neither"
            )
        return cls(cert=_read(cert, f"{flags}-cert"), key=_read(key, f"{flags}-key"), ca=_read(ca, f"{flags}-ca"))

    @property
    def mutual(self) -> bool:
        """A server that checks client certificates against ``ca``."""
        return self.ca is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert is None or self.key is None:
            raise ValueError(
                "an instance serving TLS needs its own certificate: give --tls-cert and --tls-key (--tls-ca alone "
                "only checks peers)"
            )
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=self.mutual
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


def _read(path: str | None, flag: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"cannot read {flag} {path}: {error}") from None
