"""Each instance's own Prometheus endpoint (``--metrics-port``, serving/metrics.py), scraped
from real prefill and decode processes (tiny random model, UCX on loopback) around one
hand-off: step counts and time, KV moved as D counts it, P's lease released, no failures."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from tests.checkpoints import make_checkpoint
from tests.services.client import assert_all_free, run_decode, run_prefill
from tests.services.processes import running
from tests.stores import free_port

pytest.importorskip("ucxx")


def scrape(port: int) -> dict[str, float]:
    """{name: value} of the splitserve_engine_* samples (one instance: one sample per name)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        m["name"]: float(m["value"])
        for m in re.finditer(r"^(?P<name>splitserve_engine_\w+)\{[^}]*\} (?P<value>\S+)$", text, re.MULTILINE)
    }


def test_prefill_and_decode_serve_their_own_metrics(tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path)
    prefill_port, decode_port = free_port(), free_port()
    with (
        running("prefill", model, "--metrics-port", str(prefill_port)) as prefill,
        running("decode", model, "--metrics-port", str(decode_port)) as decode,
    ):
        before = scrape(prefill_port), scrape(decode_port)
        assert before[0]["splitserve_engine_up"] == before[1]["splitserve_engine_up"] == 1
        assert before[1]["splitserve_engine_kv_transfer_bytes_total"] == 0
        prompt = list(range(1, 41))  # 40 tokens: two full blocks and a partial one
        prefilled = run_prefill(prefill, "metrics-1", prompt)
        held = scrape(prefill_port)
        assert held["splitserve_engine_kv_usage"] > 0, "P holds the prompt's KV until D pulls it"
        run_decode(decode, "metrics-1", prompt, prefilled)
        assert_all_free(prefill, decode)
        after_prefill, after_decode = scrape(prefill_port), scrape(decode_port)

    assert after_prefill["splitserve_engine_steps_total"] > before[0]["splitserve_engine_steps_total"]
    assert after_prefill["splitserve_engine_step_seconds_total"] > before[0]["splitserve_engine_step_seconds_total"]
    assert after_prefill["splitserve_engine_kv_usage"] == 0
    assert after_decode["splitserve_engine_kv_transfers_total"] == 1
    assert after_decode["splitserve_engine_kv_transfer_bytes_total"] > 0
    assert after_decode["splitserve_engine_kv_transfer_seconds_total"] > 0
    assert after_decode["splitserve_engine_steps_total"] >= 7, "D decoded the remaining tokens, a step each"
    for name in ("kv_pull_failures", "kv_recomputes", "kv_handbacks", "kv_handles_refused", "local_prefills"):
        assert after_decode[f"splitserve_engine_{name}_total"] == 0, name
    assert after_prefill["splitserve_engine_lease_expiries_total"] == 0
