"""Prometheus's config for the simulated stack (docker-compose.simulate.yml), written from the
pieces it shares with the real stack's (prometheus.yml: its global settings and the gateway's
job, taken as they are) and the simulated instances' metrics ports: instance ``i`` of the
prefill container serves ``/metrics`` on ``SIMULATE_PREFILL_METRICS_PORT + i``, for each of
``SIMULATE_PREFILL_INSTANCES`` (decode's likewise). Prometheus lists static targets only, so
the file names each; the variables' values come from the environment, else from the
simulate file's defaults, so that one command serves both:

    python compose/prometheus/simulated.py > compose/prometheus/prometheus.simulate.yml
    SIMULATE_PREFILL_INSTANCES=16 SIMULATE_DECODE_INSTANCES=16 \\
        python compose/prometheus/simulated.py > compose/prometheus/prometheus.simulate.yml

tests/compose/test_observability.py checks that the committed file is what this writes with
the defaults, and that its targets are the ports the simulate file's commands serve.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

PROMETHEUS_DIR = Path(__file__).resolve().parent
SHARED = PROMETHEUS_DIR / "prometheus.yml"
SIMULATE_FILE = PROMETHEUS_DIR.parent / "docker-compose.simulate.yml"
GATEWAY_JOB = "splitserve-gateway"
VARIABLES = {  # role -> (its instance count, its first metrics port)
    "prefill": ("SIMULATE_PREFILL_INSTANCES", "SIMULATE_PREFILL_METRICS_PORT"),
    "decode": ("SIMULATE_DECODE_INSTANCES", "SIMULATE_DECODE_METRICS_PORT"),
}
HEADER = """\
# Prometheus for the simulated stack (docker-compose.simulate.yml): written by
# prometheus/simulated.py from prometheus.yml (global settings, the gateway's job) and the
# simulated instances' metrics ports: regenerate it after changing SIMULATE_*_INSTANCES or
# SIMULATE_*_METRICS_PORT (its docstring says how), rather than editing it.
"""


def compose_defaults(text: str) -> dict[str, str]:
    """``${NAME:-default}`` of a compose file, by name."""
    return dict(re.findall(r"\$\{([A-Z][A-Z0-9_]*):-([^}]*)\}", text))


def instance_targets(environ: Mapping[str, str]) -> dict[str, list[str]]:
    """``service:port`` of every simulated instance's ``/metrics``, by role, in instance order."""
    defaults = compose_defaults(SIMULATE_FILE.read_text())
    targets = {}
    for role, (count_name, port_name) in VARIABLES.items():
        num_instances = int(environ.get(count_name) or defaults[count_name])
        first_port = int(environ.get(port_name) or defaults[port_name])
        targets[role] = [f"{role}:{first_port + index}" for index in range(num_instances)]
    return targets


def config(environ: Mapping[str, str]) -> dict[str, Any]:
    shared = yaml.safe_load(SHARED.read_text())
    (gateway,) = [job for job in shared["scrape_configs"] if job["job_name"] == GATEWAY_JOB]
    instances = {
        "job_name": "splitserve-simulated-instances",
        "static_configs": [
            {"targets": targets, "labels": {"component": role}} for role, targets in instance_targets(environ).items()
        ],
    }
    return {"global": shared["global"], "scrape_configs": [gateway, instances]}


def config_text(environ: Mapping[str, str]) -> str:
    return HEADER + yaml.safe_dump(config(environ), sort_keys=False)


if __name__ == "__main__":
    sys.stdout.write(config_text(os.environ))
