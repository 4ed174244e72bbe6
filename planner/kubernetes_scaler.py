"""``splitserve planner --actuator kubernetes``: the planner sets each role's Deployment replicas
itself, through the ``scale`` subresource of the Kubernetes API, instead of publishing the count
for KEDA (``deploy/kubernetes-autoscaling/``; docs/planner.md says why KEDA is the default).

Two calls, over urllib (no client library for two calls): ``GET`` the scale of a Deployment
(its replicas, the pool before the planner's first decision) and a JSON merge ``PATCH`` of its
``spec.replicas``. In a pod it uses the ServiceAccount's token, the cluster's CA and namespace
under :data:`SERVICE_ACCOUNT_DIR`, and the API server Kubernetes names in the environment; the
Role it needs allows ``get`` and ``patch`` on ``deployments/scale`` of the two Deployments and
nothing else. Removing a pod is Kubernetes': its preStop hook drains it (``planner/drain.py``).
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.decision import Role

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class KubernetesScaler:
    api_url: str  # https://HOST:PORT of the API server (or a kubectl proxy's http://127.0.0.1:8001)
    namespace: str
    deployments: dict[Role, str]  # each role's Deployment
    token: str | None = None
    ssl_context: ssl.SSLContext | None = None

    @classmethod
    def from_environment(
        cls,
        deployments: dict[Role, str],
        api_url: str | None = None,
        namespace: str | None = None,
        token_file: str | None = None,
    ) -> KubernetesScaler:
        """In a pod: the API server from ``KUBERNETES_SERVICE_HOST``/``_PORT``, the ServiceAccount's
        token, CA and namespace; each of them overridden where given."""
        if api_url is None:
            host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise ValueError(
                    "--actuator kubernetes outside a pod: pass --kubernetes-api-url (e.g. a `kubectl proxy`)"
                )
            api_url = f"https://{host}:{port}"
        token_path = Path(token_file) if token_file else SERVICE_ACCOUNT_DIR / "token"
        token = token_path.read_text().strip() if token_path.is_file() else None
        if namespace is None:
            namespace_path = SERVICE_ACCOUNT_DIR / "namespace"
            if not namespace_path.is_file():
                raise ValueError("--actuator kubernetes outside a pod: pass --kubernetes-namespace")
            namespace = namespace_path.read_text().strip()
        ca_path = SERVICE_ACCOUNT_DIR / "ca.crt"
        context = ssl.create_default_context(cafile=str(ca_path)) if ca_path.is_file() else None
        return cls(api_url.rstrip("/"), namespace, deployments, token, context)

    def replicas(self, role: Role) -> int:
        """The role's Deployment's replicas as its scale says now."""
        return int(self._call("GET", role)["spec"].get("replicas", 0))

    def scale(self, role: Role, replicas: int) -> None:
        """Set the role's Deployment's replicas; raises OSError when the API refuses or does not answer."""
        self._call("PATCH", role, {"spec": {"replicas": replicas}})

    def _call(self, method: str, role: Role, body: dict[str, Any] | None = None) -> dict[str, Any]:
        url = f"{self.api_url}/apis/apps/v1/namespaces/{self.namespace}/deployments/{self.deployments[role]}/scale"
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None
        if body is not None:
            headers["Content-Type"] = "application/merge-patch+json"
            data = json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=self.ssl_context) as response:
            answer: dict[str, Any] = json.load(response)
            return answer
