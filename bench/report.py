"""The tables printed at the end of ``bench serve`` and ``bench sweep``."""

from __future__ import annotations

from typing import Any

from bench.metrics import LATENCY_METRICS, LatencyStats

_WIDTH = 60
_TITLES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def format_result(result: dict[str, Any]) -> str:
    lines = [" Serving Benchmark Result ".center(_WIDTH, "=")]
    row = lines.append
    row(_line("Successful requests:", result["completed"]))
    row(_line("Failed requests:", result["failed"]))
    row(_line("Request rate configured (RPS):", result["request_rate"]))
    row(_line("Burstiness:", result["burstiness"]))
    row(_line("Maximum request concurrency:", result["max_concurrency"]))
    row(_line("Benchmark duration (s):", result["duration"]))
    row(_line("Total input tokens:", result["total_input_tokens"]))
    row(_line("Total generated tokens:", result["total_output_tokens"]))
    row(_line("Request throughput (req/s):", result["request_throughput"]))
    if result["request_goodput"] is not None:
        slos = " ".join(f"{name}:{ms:g}" for name, ms in result["goodput_slos_ms"].items())
        row(_line("Goodput SLOs (ms):", slos))
        row(_line("Request goodput (req/s):", result["request_goodput"]))
    row(_line("Output token throughput (tok/s):", result["output_throughput"]))
    row(_line("Peak output chunks per second:", result["max_output_tokens_per_s"]))
    row(_line("Peak concurrent requests:", result["max_concurrent_requests"]))
    row(_line("Total token throughput (tok/s):", result["total_token_throughput"]))
    for name in LATENCY_METRICS:
        short, title = _TITLES[name]
        row(f" {title} ".center(_WIDTH, "-"))
        for stat, key in _stat_keys(result, name):
            row(_line(f"{stat} {short} (ms):", result[key]))
    lines += _token_gaps(result)
    lines += _server_phases(result)
    lines += _spec_decode(result)
    lines += _per_workload(result)
    if result["failed"]:
        first = next(error for error in result["errors"] if error)
        row(" Errors ".center(_WIDTH, "-"))
        row(f"first of {result['failed']}: {first[:300]}")
    row("=" * _WIDTH)
    return "\n".join(lines)


def format_sweep(results: list[dict[str, Any]]) -> str:
    """One row per request rate: throughput and the latency figures a sweep is run for."""
    header = (
        f"{'rate':>6} {'done':>5} {'fail':>5} {'req/s':>8} {'goodput':>8} {'out tok/s':>10} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'TPOT p50':>9}"
    )
    rows = [" Request Rate Sweep (latencies in ms) ".center(len(header), "="), header]
    for r in results:
        rows.append(
            f"{r['request_rate']!s:>6} {r['completed']:>5} {r['failed']:>5} {r['request_throughput']:>8.2f} "
            f"{_num(r['request_goodput'], 8)} {r['output_throughput']:>10.1f} "
            f"{_num(r['median_ttft_ms'], 9)} {_num(r.get('p99_ttft_ms'), 9)} {_num(r['median_itl_ms'], 8)} "
            f"{_num(r.get('p99_itl_ms'), 8)} {_num(r['median_tpot_ms'], 9)}"
        )
    rows.append("=" * len(header))
    return "\n".join(rows)


def _stat_keys(result: dict[str, Any], name: str) -> list[tuple[str, str]]:
    keys = [("Mean", f"mean_{name}_ms"), ("Median", f"median_{name}_ms")]
    suffix = f"_{name}_ms"
    for key in result:
        head = key[: -len(suffix)]
        if key.endswith(suffix) and head.startswith("p") and head[1:].replace(".", "", 1).isdigit():
            keys.append((head.upper(), key))
    return keys + [("Max", f"max_{name}_ms")]


def _per_workload(result: dict[str, Any]) -> list[str]:
    """TTFT and ITL of each request class of a ``mixed`` run (e.g. long prompts and chat)."""
    if result.get("dataset") != "mixed":
        return []
    names = sorted({w for w, e in zip(result["workloads"], result["errors"]) if not e})
    lines = [" Per Workload Class ".center(_WIDTH, "-")]
    for name in names:
        ok = [i for i, (w, e) in enumerate(zip(result["workloads"], result["errors"])) if w == name and not e]
        ttft = LatencyStats.of([result["ttfts"][i] for i in ok], (99.0,))
        itl = LatencyStats.of([gap for i in ok for gap in result["itls"][i]], (99.0,))
        lines.append(
            f"{name} ({len(ok)} req): TTFT p50 {_num(ttft.median)} p99 {_num(ttft.percentiles[99.0])}"
            f" | ITL p50 {_num(itl.median)} p99 {_num(itl.percentiles[99.0])} ms"
        )
    return lines


def _spec_decode(result: dict[str, Any]) -> list[str]:
    """The server's speculative decoding over the run (bench/spec_decode_metrics.py)."""
    spec: dict[str, Any] | None = result.get("spec_decode")
    if not spec:
        return []
    rates = " ".join("-" if rate is None else f"{rate:.2f}" for rate in spec["acceptance_rate_per_position"])
    return [
        " Speculative Decoding (server) ".center(_WIDTH, "-"),
        _line("Draft tokens verified:", spec["num_draft_tokens"]),
        _line("Draft tokens accepted:", spec["num_accepted_tokens"]),
        _line("Acceptance rate:", spec["acceptance_rate"]),
        _line("Mean accepted length:", spec["mean_accepted_length"]),
        f"acceptance by position: {rates}",
        f"verifications by drafts accepted (0, 1, ...): {spec['verifications_by_accepted']}",
    ]


def _token_gaps(result: dict[str, Any]) -> list[str]:
    """The client's token gaps beside the server's (bench/token_gaps.py), and which side the ITL
    figures measure."""
    gaps: dict[str, Any] | None = result.get("token_gaps")
    if not gaps:
        return []
    lines = [" Token Gaps: Client vs Server (ms) ".center(_WIDTH, "-")]
    lines.append(f"{'':<10} {'client':>9} {'server':>9}   ({gaps['num_gaps']} gaps, {gaps['num_requests']} requests)")
    for name, client in gaps["client_ms"].items():
        lines.append(f"{name.upper() if name != 'max' else 'Max':<10} {client:>9.2f} {gaps['server_ms'][name]:>9.2f}")
    if gaps["client_lagged"]:
        lines.append(f"CLIENT LAGGED at {', '.join(gaps['lagged_at'])}: the client's ITL there measures the client")
    else:
        lines.append("client kept up: the ITL figures measure the server")
    lines.append(f"(lagged: {gaps['client_lag_rule']})")
    return lines


def _server_phases(result: dict[str, Any]) -> list[str]:
    """The server's TTFT phases (splitserve's x-splitserve-timing): each phase's median and tail,
    and what the requests at the median and tail TTFT spent in each."""
    breakdown: dict[str, dict[str, float]] = result.get("ttft_phase_breakdown_ms") or {}
    if not breakdown:
        return []
    tails = sorted(
        {key.split("_phase_")[0] for key in result if key.startswith("p") and "_phase_" in key},
        key=lambda key: float(key[1:]),
    )
    names = [name for name in next(iter(breakdown.values())) if name != "ttft"]
    lines = [" TTFT by Phase (server, ms) ".center(_WIDTH, "-")]
    header = f"{'phase':<18} {'median':>8}" + "".join(f" {tail.upper():>8}" for tail in tails)
    lines.append(header)
    for name in names:
        values = [result.get(f"median_phase_{name}_ms")] + [result.get(f"{tail}_phase_{name}_ms") for tail in tails]
        lines.append(f"{name:<18}" + "".join(f" {_num(value, 8)}" for value in values))
    lines.append("at TTFT percentile: " + " | ".join(f"{key} {row['ttft']:.1f}" for key, row in breakdown.items()))
    for name in names:
        lines.append(f"  {name:<16}" + "".join(f" {key}:{row.get(name, 0.0):>8.1f}" for key, row in breakdown.items()))
    return lines


def _line(label: str, value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<44} {'n/a' if value is None else value}"


def _num(value: float | None, width: int = 0) -> str:
    return f"{'n/a':>{width}}" if value is None else f"{value:>{width}.2f}"
