"""``splitserve planner --actuator metrics`` beside a real gateway and real simulated instances:
it publishes the counts it wants and changes nothing (both decode instances keep serving while
it wants one), and the gateway's status page (``--planner-url``) shows its decision, the same
figures its metrics hold, in the browser too; a planner that stops answering shows as such."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.browser import headless_chromium
from tests.gateway.processes import HTTPProcess
from tests.simulator.cluster import SimulatedInstances, ready_counts, registry_gateway, wait_for, write_profile
from tests.stores import free_port, start_redis, stop


def planner_series(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def planner_status(gateway_url: str) -> dict | None:
    return httpx.get(f"{gateway_url}/status.json", timeout=10).json()["planner"]


def test_a_publishing_planner_changes_nothing_and_the_status_page_shows_its_decision(tmp_path: Path) -> None:
    profile = write_profile(tmp_path)
    redis_process, registry_url = start_redis()
    planner_port = free_port()
    planner_url = f"http://127.0.0.1:{planner_port}"
    started: list[SimulatedInstances | HTTPProcess] = []
    try:
        started.append(SimulatedInstances("prefill", 1, profile, registry_url, "status-prefill"))
        started.append(SimulatedInstances("decode", 2, profile, registry_url, "status-decode"))
        gateway = registry_gateway("gateway-planner-status", registry_url, "--planner-url", planner_url)
        started.append(gateway)
        wait_for(lambda: ready_counts(gateway.url) == {"prefill": 1, "decode": 2, "colocated": 0}, "both roles up")
        # No planner yet: the page says it does not answer, and serves the rest.
        status = planner_status(gateway.url)
        assert status is not None and status["reachable"] is False and status["url"] == planner_url

        planner = HTTPProcess(
            "planner-publishing",
            "planner",
            "--actuator", "metrics",
            "--gateway-url", gateway.url,
            "--metrics-port", str(planner_port),
            "--simulate-profile", str(profile),
            "--plan-interval", "0.5",
            "--down-cooldown", "0",
            "--min-decode", "1",
            port=planner_port,
            ready_path="/metrics",
        )  # fmt: skip
        started.append(planner)
        # No traffic: one decode instance is enough, and the planner says so.
        shown = wait_for(
            lambda: (
                (s := planner_status(gateway.url)) is not None
                and s["reachable"]
                and s["roles"][1]["desired"] == 1
                and s
            ),
            "the status page to show the planner wanting one decode instance",
        )
        decode = {role["role"]: role for role in shown["roles"]}["decode"]
        assert decode["instances"] == {"starting": 0, "ready": 2, "draining": 0}, "both still serve"
        assert ready_counts(gateway.url)["decode"] == 2, "publishing only: nothing was stopped"
        # The page's figures are the planner's own.
        series = planner_series(planner_url)
        assert series[("splitserve_planner_desired_instances", (("role", "decode"),))] == decode["desired"]
        assert series[("splitserve_planner_capacity_requests_per_second", (("role", "decode"),))] == pytest.approx(
            decode["capacity_rps"]
        )

        # The reason may change between two of the planner's decisions (its first ones, the
        # prediction settling): the page shows the planner's latest one, read in one pass each.
        def reason_shown() -> bool:
            reason = planner_role(gateway.url, "decode")["reason"]
            key = ("splitserve_planner_reason", (("reason", reason), ("role", "decode")))
            return planner_series(planner_url).get(key) == 1

        wait_for(reason_shown, "the page's reason to be the planner's latest")
        assert shown["slo_s"] == {"ttft": 1.0, "itl": 0.05}, "the planner's default SLOs"

        with headless_chromium() as browser:
            browser.open(f"{gateway.url}/status")
            rows = browser.wait_for(
                "const section = document.getElementById('planner');"
                "const rows = [...document.querySelectorAll('#planner-roles tr')];"
                "return !section.hidden && rows.length === 2 && "
                "rows.map(r => [r.dataset.role, r.dataset.desired, r.innerText]);"
            )
            by_role = {role: (desired, text) for role, desired, text in rows}
            assert by_role["decode"][0] == "1"
            assert f"{decode['capacity_rps']:.2f}" in by_role["decode"][1], by_role
            metrics = browser.run(
                "return [...document.querySelectorAll('#planner-slos tr')].map(r => r.dataset.metric);"
            )
            assert metrics == ["ttft", "itl"]

        # The planner stops (one SIGTERM: a second one landing while it exits would kill it): the page says so.
        assert planner.stop() == 0
        wait_for(lambda: planner_status(gateway.url)["reachable"] is False, "the page to show the planner gone")
    finally:
        for process in reversed(started):
            process.stop()
        stop(redis_process)


def planner_role(gateway_url: str, role: str) -> dict:
    """The status page's planner row of ``role``."""
    status = planner_status(gateway_url)
    assert status is not None
    return {row["role"]: row for row in status["roles"]}[role]
