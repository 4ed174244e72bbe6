"""Aggregate per-request timings into the figures a serving benchmark reports, and
the result JSON, whose keys are those of vLLM's ``vllm bench serve`` so tooling
for one reads the other.

Definitions (successful requests only; failed ones are counted in ``failed`` and
keep their error in ``errors``):
- TTFT: send to first content chunk; E2EL: send to last content chunk;
- ITL: every gap between consecutive content chunks, all requests pooled;
- TPOT: ``(E2EL - TTFT) / (output_tokens - 1)`` per request with more than one
  output token;
- goodput: requests per second that met every SLO given (``ttft``, ``tpot``,
  ``e2el`` in ms; a one-token request has TPOT 0 for this purpose, as in vLLM);
- percentiles interpolate linearly (``numpy.percentile``), std is the population std;
- server phases: the TTFT phases splitserve reports per request (``x-splitserve-timing``,
  seconds, measured by the gateway from the request's arrival there), each phase's
  distribution, and the TTFT breakdown at TTFT percentiles (:func:`phase_breakdown`);
- server token gaps: the server's gaps between the same content chunks, from when it wrote
  them, beside the client's, and whether the client lagged (bench/token_gaps.py).

Per-request lists hold every request in send order; a failed request has 0.0 for
its TTFT and latency and 0 output tokens, as in vLLM (its ``errors`` entry says why).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.client import RequestRecord
from bench.token_gaps import TokenGaps, compare_gaps

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (90.0, 99.0)


@dataclass(slots=True)
class LatencyStats:
    """One metric's distribution in milliseconds; None where no request measured it."""

    mean: float | None
    median: float | None
    std: float | None
    max: float | None
    percentiles: dict[float, float | None]

    @classmethod
    def of(cls, values_s: list[float], percentiles: tuple[float, ...]) -> LatencyStats:
        if not values_s:
            return cls(None, None, None, None, {p: None for p in percentiles})
        ms = np.asarray(values_s, dtype=np.float64) * 1000.0
        return cls(
            float(ms.mean()),
            float(np.median(ms)),
            float(ms.std()),
            float(ms.max()),
            {p: float(np.percentile(ms, p)) for p in percentiles},
        )


@dataclass(slots=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float | None  # None when no SLO was given
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    latency: dict[str, LatencyStats] = field(default_factory=dict)  # LATENCY_METRICS -> stats
    # The server's TTFT phases (x-splitserve-timing), name -> stats, in the header's order; and
    # where TTFT went at TTFT percentiles (:func:`phase_breakdown`). Empty without the header.
    server_phases: dict[str, LatencyStats] = field(default_factory=dict)
    phase_breakdown: dict[float, dict[str, float]] = field(default_factory=dict)
    # Client and server token gaps side by side; None when no response carried the server's times.
    token_gaps: TokenGaps | None = None


@dataclass(slots=True)
class RunInfo:
    """The set-up of a run, written at the head of the result JSON."""

    date: str
    backend: str  # "openai" (completions) or "openai-chat", vLLM's names for the two endpoints
    label: str | None
    model_id: str
    tokenizer_id: str
    num_prompts: int
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    base_url: str
    endpoint: str
    dataset: str
    seed: int
    num_warmups: int
    goodput_slos_ms: dict[str, float]


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, _, value = item.partition(":")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput takes NAME:MS pairs like ttft:500 tpot:50, got {item!r}") from None
        if name not in SLO_METRICS:
            raise ValueError(f"--goodput metric must be one of {', '.join(SLO_METRICS)}, got {name!r}")
        if not slos[name] >= 0:
            raise ValueError(f"--goodput {name} must be >= 0 ms, got {value}")
    return slos


def tpot(record: RequestRecord) -> float | None:
    tokens = output_tokens(record)
    if record.ttft is None or record.latency is None or tokens <= 1:
        return None
    return (record.latency - record.ttft) / (tokens - 1)


def output_tokens(record: RequestRecord) -> int:
    """Tokens generated: the server's usage count, else the number of content chunks."""
    if not record.success:
        return 0
    return record.output_tokens if record.output_tokens is not None else record.num_content_chunks


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    if not record.success:
        return False
    measured_ms = {
        "ttft": (record.ttft or 0.0) * 1000,
        "tpot": (tpot(record) or 0.0) * 1000,
        "e2el": (record.latency or 0.0) * 1000,
    }
    return all(measured_ms[name] <= limit for name, limit in slos_ms.items())


def compute_metrics(
    records: list[RequestRecord],
    duration_s: float,
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
    goodput_slos_ms: dict[str, float] | None = None,
) -> BenchmarkMetrics:
    if not duration_s > 0:
        raise RuntimeError(f"a benchmark run took {duration_s} s; this is a bug")
    done = [r for r in records if r.success]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(output_tokens(r) for r in done)
    values = {
        "ttft": [r.ttft for r in done if r.ttft is not None],
        "tpot": [t for r in done if (t := tpot(r)) is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done if r.latency is not None],
    }
    goodput = None
    if goodput_slos_ms:
        goodput = sum(meets_slos(r, goodput_slos_ms) for r in done) / duration_s
    peak_tokens, peak_concurrency = _peaks(done)
    timings = [r.server_timing for r in done if r.server_timing is not None]
    phase_names = list(dict.fromkeys(name for timing in timings for name in timing))
    return BenchmarkMetrics(
        completed=len(done),
        failed=len(records) - len(done),
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(done) / duration_s,
        request_goodput=goodput,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        max_output_tokens_per_s=peak_tokens,
        max_concurrent_requests=peak_concurrency,
        latency={name: LatencyStats.of(values[name], percentiles) for name in LATENCY_METRICS},
        server_phases={
            name: LatencyStats.of([t[name] for t in timings if name in t], percentiles) for name in phase_names
        },
        phase_breakdown=phase_breakdown(timings, (50.0, *percentiles)),
        token_gaps=compare_gaps([(r.itl, r.server_itl) for r in done if r.server_itl is not None]),
    )


def phase_breakdown(
    timings: list[dict[str, float]], percentiles: tuple[float, ...], band: float = 2.5
) -> dict[float, dict[str, float]]:
    """Where TTFT went at each TTFT percentile, in milliseconds per phase: the mean phases of
    the requests whose server-side TTFT ranks within ``band`` percentile points of it (the one
    nearest it at least), so a tail's phases are those of the tail's requests."""
    ranked = sorted((t for t in timings if "ttft" in t), key=lambda t: t["ttft"])
    if not ranked:
        return {}
    breakdown = {}
    last = len(ranked) - 1
    for p in percentiles:
        low = max(0, math.floor((p - band) / 100 * last))
        high = min(last, math.ceil((p + band) / 100 * last))
        nearest = round(p / 100 * last)
        group = ranked[min(low, nearest) : max(high, nearest) + 1]
        names = [name for name in group[0] if name != "ttft"]
        breakdown[p] = {name: 1000.0 * sum(t.get(name, 0.0) for t in group) / len(group) for name in ["ttft", *names]}
    return breakdown


def _peaks(done: list[RequestRecord]) -> tuple[float, int]:
    """Most content chunks received in one wall-clock second (vLLM's max_output_tokens_per_s,
    which counts chunks too) and most requests in flight at once."""
    if not done:
        return 0.0, 0
    per_second: dict[int, int] = {}
    events: list[tuple[float, int]] = []
    for r in done:
        at = r.start_time + (r.ttft or 0.0)
        for gap in [0.0, *r.itl]:
            at += gap
            per_second[math.floor(at)] = per_second.get(math.floor(at), 0) + 1
        events += [(r.start_time, 1), (r.start_time + (r.latency or 0.0), -1)]
    in_flight = peak = 0
    for _, delta in sorted(events):  # an end (-1) sorts before a start at the same instant
        in_flight += delta
        peak = max(peak, in_flight)
    return float(max(per_second.values())), peak


def percentile_key(p: float) -> str:
    return f"p{int(p) if float(p).is_integer() else p}"


def result_json(
    info: RunInfo, records: list[RequestRecord], metrics: BenchmarkMetrics, duration_s: float
) -> dict[str, Any]:
    """The result in vLLM's key names (plus a few of ours: ``start_times`` as offsets
    from the start of the run, ``max_*_ms``, ``workloads``, and the run's set-up)."""
    result: dict[str, Any] = {
        "date": info.date,
        "endpoint_type": info.backend,
        "backend": info.backend,
        "label": info.label,
        "model_id": info.model_id,
        "tokenizer_id": info.tokenizer_id,
        "num_prompts": info.num_prompts,
        "request_rate": "inf" if math.isinf(info.request_rate) else info.request_rate,
        "burstiness": "inf" if math.isinf(info.burstiness) else info.burstiness,
        "max_concurrency": info.max_concurrency,
        "base_url": info.base_url,
        "endpoint": info.endpoint,
        "dataset": info.dataset,
        "seed": info.seed,
        "num_warmups": info.num_warmups,
        "goodput_slos_ms": dict(info.goodput_slos_ms),
    }
    result.update(
        duration=duration_s,
        completed=metrics.completed,
        failed=metrics.failed,
        total_input_tokens=metrics.total_input,
        total_output_tokens=metrics.total_output,
        request_throughput=metrics.request_throughput,
        request_goodput=metrics.request_goodput,
        output_throughput=metrics.output_throughput,
        total_token_throughput=metrics.total_token_throughput,
        max_output_tokens_per_s=metrics.max_output_tokens_per_s,
        max_concurrent_requests=metrics.max_concurrent_requests,
    )
    for name in LATENCY_METRICS:
        stats = metrics.latency[name]
        result[f"mean_{name}_ms"] = stats.mean
        result[f"median_{name}_ms"] = stats.median
        result[f"std_{name}_ms"] = stats.std
        for p, value in stats.percentiles.items():
            result[f"{percentile_key(p)}_{name}_ms"] = value
        result[f"max_{name}_ms"] = stats.max
    for name, stats in metrics.server_phases.items():
        result[f"mean_phase_{name}_ms"] = stats.mean
        result[f"median_phase_{name}_ms"] = stats.median
        for p, value in stats.percentiles.items():
            result[f"{percentile_key(p)}_phase_{name}_ms"] = value
    if metrics.phase_breakdown:
        result["ttft_phase_breakdown_ms"] = {percentile_key(p): row for p, row in metrics.phase_breakdown.items()}
    result["token_gaps"] = metrics.token_gaps.as_json() if metrics.token_gaps is not None else None
    result.update(
        input_lens=[r.prompt_len for r in records],
        output_lens=[output_tokens(r) for r in records],
        ttfts=[(r.ttft or 0.0) if r.success else 0.0 for r in records],
        itls=[list(r.itl) if r.success else [] for r in records],
        latencies=[(r.latency or 0.0) if r.success else 0.0 for r in records],
        start_times=[r.start_time for r in records],
        generated_texts=[r.generated_text for r in records],
        errors=[r.error or "" for r in records],
        workloads=[r.workload for r in records],
        server_timings=[r.server_timing if r.success else None for r in records],
        server_itls=[r.server_itl if r.success else None for r in records],
    )
    return result
