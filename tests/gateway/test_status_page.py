"""The gateway's live status page (``GET /status``) in headless Chromium, over real prefill
and decode processes (tiny random model, UCX on loopback): it renders with no external
asset, lists both instances with their role, health, the counters cluster/instance_counters.py
puts on the page (queue, KV use) and fingerprint, draws the requests' TTFT and ITL, and marks
the decode instance down once that stops, without a reload.

``SPLITSERVE_STATUS_SCREENSHOT=PATH`` keeps the screenshot it takes (docs/images/status-page.png
comes from the compose test's, tests/compose/test_compose_up.py, with the real model)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from cluster.instance_counters import STATUS_PAGE_COUNTERS
from tests.browser import headless_chromium
from tests.checkpoints import make_checkpoint
from tests.gateway.processes import running_gateway
from tests.services.processes import running

pytest.importorskip("ucxx")

ROWS = (
    "return [...document.querySelectorAll('#instances tr')].map(r => [r.dataset.role, r.dataset.healthy, r.innerText]);"
)


def test_status_page_lists_instances_draws_latency_and_follows_a_stopped_decode(tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path / "model")
    with (
        running("prefill", model) as prefill,
        running("decode", model) as decode,
        running_gateway(
            model, "--prefill", prefill.address, "--decode", decode.address, "--stale-after", "2"
        ) as gateway,
    ):
        for _ in range(3):
            reply = httpx.post(
                f"{gateway.url}/v1/completions",
                json={"prompt": "The capital of France is", "max_tokens": 8, "ignore_eos": True, "temperature": 0},
                timeout=120,
            )
            assert reply.status_code == 200, reply.text
        page = httpx.get(f"{gateway.url}/status", timeout=10)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "http://" not in page.text.replace('"http://www.w3.org/2000/svg"', ""), (
            "the page loads nothing from elsewhere"
        )

        with headless_chromium() as browser:
            browser.open(f"{gateway.url}/status")
            rows = browser.wait_for(
                f"const rows = (() => {{ {ROWS} }})(); return rows.length === 2 && rows.every(r => r[1] === 'true') "
                "&& rows;"
            )
            by_role = {role: text for role, _, text in rows}
            assert set(by_role) == {"prefill", "decode"}
            assert prefill.address in by_role["prefill"] and decode.address in by_role["decode"]
            assert all("healthy" in text and "block 16" in text and "%" in text for text in by_role.values()), by_role
            headers = browser.run("return [...document.querySelectorAll('#columns th')].map(th => th.textContent);")
            labels = [counter.status_label for counter in STATUS_PAGE_COUNTERS]
            assert headers == ["role", "instance", "address", "health", *labels, "fingerprint"], headers
            # three requests: three TTFT points and three ITL points drawn
            points = browser.run(
                "return ['ttft-chart', 'itl-chart'].map(id => document.getElementById(id).dataset.points);"
            )
            assert points == ["3", "3"], points
            # where their TTFT went: one row per phase, over the three requests
            phases = browser.run(
                "return [document.getElementById('phases').dataset.requests, "
                "[...document.querySelectorAll('#phase-rows tr')].map(r => r.dataset.phase)];"
            )
            assert phases == ["3", ["gateway_queue", "prefill_queue", "prefill_compute", "kv_publish", "transport"]]
            assert browser.run("return document.getElementById('ready').textContent;") == "ready"
            shot = Path(os.environ.get("SPLITSERVE_STATUS_SCREENSHOT") or tmp_path / "status.png")
            browser.screenshot(shot)
            assert shot.stat().st_size > 10_000, "a blank screenshot"

            decode.stop()
            rows = browser.wait_for(
                f"const rows = (() => {{ {ROWS} }})(); return rows.some(r => r[0] === 'decode' && r[1] === 'false') "
                "&& rows;"
            )
            by_role = {role: (healthy, text) for role, healthy, text in rows}
            assert by_role["decode"][0] == "false" and "unreachable" in by_role["decode"][1]
            assert by_role["prefill"][0] == "true"
            assert browser.run("return document.getElementById('ready').textContent;") == "not ready"
