"""``bench serve`` reports the server's speculative decoding over its measured requests: the
acceptance rate by draft position and the accepted-length counts, from a splitserve gateway's
/metrics scraped before and after them (bench/spec_decode_metrics.py).

The /metrics text is the real gateway's (``GatewayMetrics`` over load reports carrying the
counts), served by the FAKE OpenAI server beside its fake generations: a name that drifts on
either side fails here."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from bench.spec_decode_metrics import SpecDecodeCounts, over_run
from gateway.instances import InstancePool
from gateway.metrics import GatewayMetrics
from splitserve.cli import main
from splitserve.v1 import disaggregation_pb2
from tests.bench.fake_openai_server import FakeOpenAIServer, FakeServerConfig


def report(instance_id: str, drafts: list[int], accepted: list[int], by_accepted: list[int]) -> object:
    counters = disaggregation_pb2.InstanceCounters(
        num_spec_draft_tokens=sum(drafts),
        num_spec_accepted_tokens=sum(accepted),
        num_spec_draft_tokens_per_pos=drafts,
        num_spec_accepted_tokens_per_pos=accepted,
        num_spec_verifications_by_accepted=by_accepted,
    )
    return disaggregation_pb2.LoadReport(instance_id=instance_id, role="colocated", counters=counters)


async def gateway_metrics(reports: dict[str, object]) -> str:
    """What a gateway's /metrics says with these instances' latest reports."""
    pool = InstancePool(stale_after_s=30.0)
    try:
        for address, load_report in reports.items():
            pool.add(address, "colocated")
            pool.record_report(address, load_report, serving=True)  # type: ignore[arg-type]
        return GatewayMetrics(pool).render().decode()
    finally:
        await pool.close()


async def cluster_after(num_requests: int) -> str:
    """Two instances: one whose counts grow with each request (two draft positions, each
    verification accepting 0, 1 or 2 drafts), one whose counts stay as they were."""
    n = num_requests
    return await gateway_metrics(
        {
            "host-a:1": report("a", [10 * n, 8 * n], [6 * n, 3 * n], [4 * n, 3 * n, 3 * n]),
            "host-b:1": report("b", [5, 5, 5], [5, 2, 1], [0, 3, 1, 1]),
        }
    )


def bench_serve_spec_decode(
    metrics: Callable[[int], Awaitable[str]], tokenizer_dir: Path, tmp_path: Path
) -> dict[str, Any] | None:
    """``spec_decode`` of a bench serve run of two warm-ups and four measured requests against a
    fake server whose /metrics renders ``metrics``."""
    with FakeOpenAIServer(FakeServerConfig(ttft_s=0.0, itl_s=0.0, metrics=metrics)) as server:
        args = ["bench", "serve", "--base-url", server.base_url, "--tokenizer", str(tokenizer_dir)]
        args += ["--num-prompts", "4", "--num-warmups", "2", "--input-len", "8", "--output-len", "2"]
        args += ["--disable-tqdm", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"]
        assert main(args) == 0
    return json.loads((tmp_path / "r.json").read_text())["spec_decode"]


def test_bench_serve_reports_acceptance_over_its_measured_requests_only(
    tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    spec = bench_serve_spec_decode(cluster_after, tokenizer_dir, tmp_path)
    # Four measured requests (the two warm-ups were before the first scrape); b did nothing.
    assert spec == {
        "num_draft_tokens": 72,
        "num_accepted_tokens": 36,
        "acceptance_rate": 0.5,
        "acceptance_rate_per_position": [24 / 40, 12 / 32],
        "mean_accepted_length": 36 / 40,
        "verifications_by_accepted": [16, 12, 12],
    }
    printed = capsys.readouterr().out
    assert "Speculative Decoding (server)" in printed and "acceptance by position: 0.60 0.38" in printed


def test_bench_serve_reads_counts_once_the_gateway_has_learnt_every_step(tokenizer_dir: Path, tmp_path: Path) -> None:
    """A gateway learns its instances' counts from the load reports it polls, so a scrape as the
    last response ends can lack that request's steps: here each scrape answers what the one before
    it saw. Read as they settle, the run's counts are still the four measured requests'."""
    arrived_at_last_scrape = [0]

    async def one_scrape_late(num_requests: int) -> str:
        known, arrived_at_last_scrape[0] = arrived_at_last_scrape[0], num_requests
        return await cluster_after(known)

    spec = bench_serve_spec_decode(one_scrape_late, tokenizer_dir, tmp_path)
    assert (spec["num_draft_tokens"], spec["num_accepted_tokens"]) == (72, 36)


def test_no_figures_without_drafts_without_series_or_when_counts_went_back() -> None:
    async def texts() -> tuple[str, str, str]:
        idle = await gateway_metrics({"host-a:1": report("a", [], [], [])})
        busy = await gateway_metrics({"host-a:1": report("a", [4], [2], [2, 2])})
        restarted = await gateway_metrics({"host-a:1": report("a", [1], [1], [0, 1])})
        return idle, busy, restarted

    idle, busy, restarted = (SpecDecodeCounts.parse(text) for text in asyncio.run(texts()))
    assert over_run(idle, idle) is None  # speculation off, or nothing drafted in the run
    assert over_run(None, busy) is None  # no /metrics, or no series, at either scrape
    assert over_run(busy, restarted) is None  # the instance restarted: its counts went backwards
    assert over_run(idle, busy) == {
        "num_draft_tokens": 4,
        "num_accepted_tokens": 2,
        "acceptance_rate": 0.5,
        "acceptance_rate_per_position": [0.5],
        "mean_accepted_length": 0.5,
        "verifications_by_accepted": [2, 2],
    }
