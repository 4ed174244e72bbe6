"""The order in which one gateway breaks ties between equally ranked instances, so that
several gateways sharing the instances do not herd.

Each gateway ranks instances from their load reports plus what it dispatched itself since
(``gateway.instances``); another gateway's dispatches reach it only with the next report
(a poll interval or a registry heartbeat later). Two gateways receiving a burst at the same
moment therefore see the same idle instances, tied, and with one tie order for all (every
gateway lists the instances alike) they send their bursts to the same instances in the same
order: each instance gets two requests while half of them get none.

So each gateway breaks ties in an order of its own: the instances of a role sorted by id (the
same list in every gateway, from the same registry), rotated by ``slot * len / num_slots``.
Gateway ``slot`` of ``num_slots`` starts at its own ``1 / num_slots`` of the list; a burst of
up to ``len / num_slots`` requests to each gateway lands on disjoint instances, whatever the
reports say meanwhile: a gateway's idle instances come first in its own order, and the others
never send there while they have idle ones of their own first. The order decides only among
instances ranked equal; load and prefix-cache hits still come first.

Why a rotation by slot, not a random order (power-of-two choices, or rendezvous hashing keyed
by a random gateway id): those lower the overlap between two gateways' choices, the rotation
removes it for every burst that fits, deterministically, which tests can check and an
operator can reason about. Its price: each gateway must know its slot. The processes of one
gateway (``--api-server-count N``) are numbered by their parent; replicas are numbered by
whoever runs them (``--gateway-index I --num-gateways M``: a StatefulSet's ordinal), process
``i`` of replica ``I`` taking slot ``I * N + i`` of ``M * N``. Replicas left unnumbered share
slot 0 and herd as before.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GatewaySlot:
    """This gateway process's place among all the gateway processes sharing the instances."""

    slot: int = 0
    num_slots: int = 1

    def __post_init__(self) -> None:
        if self.num_slots < 1 or not 0 <= self.slot < self.num_slots:
            raise ValueError(
                f"gateway slot {self.slot} of {self.num_slots}: give --gateway-index below --num-gateways "
                "(and both at least 0 and 1)"
            )

    @classmethod
    def of(cls, gateway_index: int, num_gateways: int, api_server_index: int, api_server_count: int) -> GatewaySlot:
        """Process ``api_server_index`` of ``api_server_count`` of replica ``gateway_index`` of ``num_gateways``."""
        if not 0 <= gateway_index < num_gateways:
            raise ValueError(
                f"--gateway-index {gateway_index} must be at least 0 and below --num-gateways {num_gateways}"
            )
        return cls(gateway_index * api_server_count + api_server_index, num_gateways * api_server_count)

    def tie_order(self, instances: Iterable[tuple[str, str]]) -> dict[str, int]:
        """Each instance's place in this gateway's tie order, by address (lower goes first);
        ``instances``: (instance id, address) of every instance of one role the gateway knows."""
        ordered = sorted(instances)
        offset = self.slot * len(ordered) // self.num_slots
        return {address: (rank - offset) % len(ordered) for rank, (_, address) in enumerate(ordered)}
