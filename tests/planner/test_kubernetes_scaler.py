"""``splitserve planner --actuator kubernetes`` beside a real gateway and real simulated
instances, against a stand-in for the Kubernetes API (an API server cannot run here: the
stand-in answers the two calls the planner makes, the scale subresource's GET and merge PATCH,
as the API documents them, and refuses any other call or a missing token). With two decode
replicas idle the planner reads the Deployments' replicas, then patches decode down to one and
leaves prefill alone; the instances themselves are Kubernetes' to remove, so both still serve."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from planner.kubernetes_scaler import KubernetesScaler
from tests.gateway.processes import HTTPProcess
from tests.simulator.cluster import SimulatedInstances, ready_counts, registry_gateway, wait_for, write_profile
from tests.stores import free_port, start_redis, stop

TOKEN = "the-planner-service-account-token"
NAMESPACE = "splitserve"


class ScaleAPI(BaseHTTPRequestHandler):
    """``/apis/apps/v1/namespaces/NS/deployments/NAME/scale``: GET and merge PATCH, bearer token."""

    replicas: dict[str, int]
    calls: list[tuple[str, str, int | None]]

    def _deployment(self) -> str | None:
        prefix = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/"
        if not (self.path.startswith(prefix) and self.path.endswith("/scale")):
            return None
        name = self.path.removeprefix(prefix).removesuffix("/scale")
        return name if name in self.replicas else None

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _checked(self) -> str | None:
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._answer(401, {"kind": "Status", "reason": "Unauthorized"})
            return None
        name = self._deployment()
        if name is None:
            self._answer(403, {"kind": "Status", "reason": "Forbidden"})
        return name

    def _scale(self, name: str) -> dict:
        return {"kind": "Scale", "apiVersion": "autoscaling/v1", "spec": {"replicas": self.replicas[name]}}

    def do_GET(self) -> None:
        name = self._checked()
        if name is not None:
            self.calls.append(("GET", name, None))
            self._answer(200, self._scale(name))

    def do_PATCH(self) -> None:
        name = self._checked()
        if name is None:
            return
        if self.headers.get("Content-Type") != "application/merge-patch+json":
            self._answer(415, {"kind": "Status", "reason": "UnsupportedMediaType"})
            return
        patch = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.replicas[name] = int(patch["spec"]["replicas"])
        self.calls.append(("PATCH", name, self.replicas[name]))
        self._answer(200, self._scale(name))

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def scale_api(replicas: dict[str, int]) -> Iterator[type[ScaleAPI]]:
    handler = type("Handler", (ScaleAPI,), {"replicas": replicas, "calls": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    handler.url = f"http://127.0.0.1:{server.server_address[1]}"  # type: ignore[attr-defined]
    try:
        yield handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_the_planner_patches_the_decode_deployment_down_to_what_it_needs(tmp_path: Path) -> None:
    profile = write_profile(tmp_path)
    (tmp_path / "token").write_text(TOKEN + "\n")
    redis_process, registry_url = start_redis()
    started: list[SimulatedInstances | HTTPProcess] = []
    try:
        started.append(SimulatedInstances("prefill", 1, profile, registry_url, "k8s-prefill"))
        started.append(SimulatedInstances("decode", 2, profile, registry_url, "k8s-decode"))
        gateway = registry_gateway("gateway-k8s-scaler", registry_url)
        started.append(gateway)
        wait_for(lambda: ready_counts(gateway.url) == {"prefill": 1, "decode": 2, "colocated": 0}, "both roles up")
        with scale_api({"prefill": 1, "decode-pool": 2}) as api:
            metrics_port = free_port()
            planner = HTTPProcess(
                "planner-kubernetes",
                "planner",
                "--actuator", "kubernetes",
                "--kubernetes-api-url", api.url,  # type: ignore[attr-defined]
                "--kubernetes-namespace", NAMESPACE,
                "--kubernetes-token-file", str(tmp_path / "token"),
                "--decode-deployment", "decode-pool",
                "--gateway-url", gateway.url,
                "--metrics-port", str(metrics_port),
                "--simulate-profile", str(profile),
                "--plan-interval", "0.5",
                "--down-cooldown", "0",
                port=metrics_port,
                ready_path="/metrics",
            )  # fmt: skip
            started.append(planner)
            wait_for(lambda: api.replicas["decode-pool"] == 1, "the planner to scale decode to one")
            # Read before it decided, and only decode patched, once.
            assert ("GET", "decode-pool", None) in api.calls and ("GET", "prefill", None) in api.calls
            assert [call for call in api.calls if call[0] == "PATCH"] == [("PATCH", "decode-pool", 1)]
            assert api.replicas["prefill"] == 1
            assert ready_counts(gateway.url)["decode"] == 2, "the pods are Kubernetes' to remove, not the planner's"
            planner.stop()
    finally:
        for process in reversed(started):
            process.stop()
        stop(redis_process)


def test_outside_a_pod_without_an_api_url_the_planner_says_what_to_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ValueError, match="--kubernetes-api-url"):
        KubernetesScaler.from_environment({"prefill": "prefill", "decode": "decode"})
