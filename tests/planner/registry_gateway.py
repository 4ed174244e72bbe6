"""The gateway the planner tests run beside simulated instances: it finds them in the Redis
registry, polls them often, and carries the simulated cluster's secret."""

from __future__ import annotations

from launcher.processes import free_port
from tests.gateway.processes import HTTPProcess
from tests.simulator.cluster import SECRET


def registry_gateway(name: str, registry_url: str, *extra: str) -> HTTPProcess:
    """A gateway on a free port, HTTP only, routing to what ``registry_url`` lists."""
    port = free_port()
    return HTTPProcess(
        name,
        "gateway",
        "--port", str(port),
        "--grpc-port", "-1",
        "--registry-url", registry_url,
        "--poll-interval", "0.5",
        *extra,
        port=port,
        env={"SPLITSERVE_CLUSTER_SECRET": SECRET},
        ready_path="/health",
    )  # fmt: skip
