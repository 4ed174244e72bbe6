"""``splitserve bench plot``: PNG figures from result JSON files, several runs overlaid.

- ``ttft_cdf.png``, ``itl_cdf.png``: the distributions, one curve per run;
- ``itl_over_time.png``: every inter-token gap at the moment it ended, with a
  rolling median, to show stalls (e.g. a decode step waiting behind a long prefill);
- ``ttft_phases.png``: where TTFT went at its median and tail percentiles, phase by phase
  (runs against splitserve, whose gateway reports each request's phases);
- ``throughput_vs_rate.png``, ``latency_vs_rate.png``: when runs of one label span
  several request rates (a sweep), one line per label.

Runs are named by ``--label`` (one per file), else the file's ``label``, else the
file name. Figures are drawn on bare ``Figure`` objects with the Agg canvas, never
through pyplot, so nothing global changes and no display is needed.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

_ROLLING_BINS = 60


@dataclass(slots=True)
class Run:
    label: str
    result: dict[str, Any]

    @property
    def rate(self) -> float:
        rate = self.result.get("request_rate", "inf")
        return math.inf if rate in ("inf", None) else float(rate)

    def ok(self) -> list[int]:
        """Indices of the successful requests (vLLM's files say so in ``errors``)."""
        errors = self.result.get("errors") or [""] * len(self.result.get("ttfts") or [])
        return [i for i, error in enumerate(errors) if not error]


def load_runs(paths: list[str | Path], labels: list[str] | None = None) -> list[Run]:
    if labels and len(labels) != len(paths):
        raise ValueError(f"give one --label per result file: {len(labels)} labels for {len(paths)} files")
    runs = []
    for i, path in enumerate(paths):
        try:
            result = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"cannot read benchmark result {path}: {error}") from error
        if not isinstance(result, dict) or "completed" not in result:
            raise ValueError(f"{path} is not a bench serve result (no 'completed' key)")
        runs.append(Run(labels[i] if labels else result.get("label") or Path(path).stem, result))
    return runs


def plot_runs(runs: list[Run], output_dir: str | Path) -> list[Path]:
    """Write the figures that the runs have data for; returns their paths."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ValueError("bench plot needs matplotlib: pip install 'splitserve[bench]'") from error
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    names = _curve_names(runs)
    written = []

    def save(figure: Figure, name: str) -> None:
        FigureCanvasAgg(figure)
        figure.tight_layout()
        path = output_dir / name
        figure.savefig(path, dpi=120)
        written.append(path)

    for metric, title in (("ttfts", "Time to first token"), ("itls", "Inter-token latency")):
        figure = Figure(figsize=(7, 4.5))
        axes = figure.add_subplot()
        for run, name in zip(runs, names):
            values = _values_ms(run, metric)
            values = values[values > 0]  # log axis; chunks read together have zero gaps
            if values.size:
                fractions = np.arange(1, values.size + 1) / values.size
                axes.plot(np.sort(values), fractions, drawstyle="steps-post", label=name)
        # Log scale: medians and tails differ by orders of magnitude, and the tail is the point.
        axes.set_xscale("log")
        _finish(
            axes,
            title + " (CDF)",
            f"{title} (ms, log scale)",
            "fraction of " + ("requests" if metric == "ttfts" else "gaps"),
        )
        save(figure, f"{metric[:-1]}_cdf.png")

    figure = Figure(figsize=(9, 4.5))
    axes = figure.add_subplot()
    for run, name in zip(runs, names):
        times, gaps = _itl_timeline(run)
        if times.size:
            points = axes.scatter(times, gaps, s=6, alpha=0.4, linewidths=0)
            centers, medians = _rolling_median(times, gaps)
            axes.plot(centers, medians, color=points.get_facecolor()[0][:3], label=f"{name} (median)")
    axes.set_yscale("symlog", linthresh=10.0)  # stalls of seconds beside gaps of milliseconds
    _finish(
        axes, "Inter-token latency over the run", "time since the first request (s)", "ITL (ms, log scale above 10)"
    )
    save(figure, "itl_over_time.png")

    with_phases = [(run, name) for run, name in zip(runs, names) if run.result.get("ttft_phase_breakdown_ms")]
    if with_phases:
        save(_ttft_phases(Figure(figsize=(4 + 3 * len(with_phases), 4.5)), with_phases), "ttft_phases.png")

    series = _sweep_series(runs)
    if series:
        save(_throughput_vs_rate(Figure(figsize=(10, 4.5)), series), "throughput_vs_rate.png")
        save(_latency_vs_rate(Figure(figsize=(13, 4.5)), series), "latency_vs_rate.png")
    return written


def _curve_names(runs: list[Run]) -> list[str]:
    """The label, with the rate where one label covers several runs."""
    counts: dict[str, int] = {}
    for run in runs:
        counts[run.label] = counts.get(run.label, 0) + 1
    return [f"{r.label} @ {r.result.get('request_rate')} req/s" if counts[r.label] > 1 else r.label for r in runs]


def _values_ms(run: Run, metric: str) -> np.ndarray:
    column = run.result.get(metric) or []
    if not column:
        logger.warning("run %r has no per-request %s (a vLLM result saved without --save-detailed?)", run.label, metric)
        return np.empty(0)
    ok = run.ok()
    values = [column[i] for i in ok] if metric == "ttfts" else [gap for i in ok for gap in column[i]]
    return np.asarray(values, dtype=np.float64) * 1000.0


def _itl_timeline(run: Run) -> tuple[np.ndarray, np.ndarray]:
    """(when each gap ended, in s from the first send; the gap in ms) for the successful requests."""
    result = run.result
    start_times, ttfts, itls = result.get("start_times"), result.get("ttfts"), result.get("itls")
    if not (start_times and ttfts and itls):
        return np.empty(0), np.empty(0)
    origin = min(start_times)  # vLLM writes absolute perf_counter values, splitserve offsets
    times, gaps = [], []
    for i in run.ok():
        at = start_times[i] - origin + ttfts[i]
        for gap in itls[i]:
            at += gap
            times.append(at)
            gaps.append(gap * 1000.0)
    return np.asarray(times), np.asarray(gaps)


def _rolling_median(times: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    edges = np.linspace(times.min(), times.max(), _ROLLING_BINS + 1)
    bins = np.clip(np.digitize(times, edges) - 1, 0, _ROLLING_BINS - 1)
    centers, medians = [], []
    for b in range(_ROLLING_BINS):
        in_bin = values[bins == b]
        if in_bin.size:
            centers.append((edges[b] + edges[b + 1]) / 2)
            medians.append(float(np.median(in_bin)))
    return np.asarray(centers), np.asarray(medians)


def _sweep_series(runs: list[Run]) -> dict[str, list[Run]]:
    """Label -> its runs by rate, for labels run at two or more rates."""
    by_label: dict[str, list[Run]] = {}
    for run in runs:
        by_label.setdefault(run.label, []).append(run)
    return {
        label: sorted(group, key=lambda r: r.rate)
        for label, group in by_label.items()
        if len({r.rate for r in group}) >= 2
    }


def _rate_axis(series: dict[str, list[Run]]) -> dict[float, int]:
    """Rates as evenly spaced categories (inf has no place on a numeric axis)."""
    rates = sorted({run.rate for group in series.values() for run in group})
    return {rate: i for i, rate in enumerate(rates)}


def _set_rate_ticks(axes: Any, positions: dict[float, int]) -> None:
    axes.set_xticks(list(positions.values()))
    axes.set_xticklabels(["inf" if math.isinf(r) else f"{r:g}" for r in positions])
    axes.set_xlabel("request rate (req/s)")


def _throughput_vs_rate(figure: Any, series: dict[str, list[Run]]) -> Any:
    positions = _rate_axis(series)
    for axes, key, title in zip(
        figure.subplots(1, 2),
        ("request_throughput", "output_throughput"),
        ("Request throughput (req/s)", "Output token throughput (tok/s)"),
    ):
        for label, group in series.items():
            values = [r.result.get(key) or 0.0 for r in group]
            axes.plot([positions[r.rate] for r in group], values, marker="o", label=label)
        _set_rate_ticks(axes, positions)
        _finish(axes, title, None, title.split(" (")[-1].rstrip(")"))
    return figure


def _latency_vs_rate(figure: Any, series: dict[str, list[Run]]) -> Any:
    positions = _rate_axis(series)
    for axes, metric in zip(figure.subplots(1, 3), ("ttft", "itl", "tpot")):
        for label, group in series.items():
            xs = [positions[r.rate] for r in group]
            line = axes.plot(
                xs, [_or_nan(r.result.get(f"median_{metric}_ms")) for r in group], marker="o", label=f"{label} median"
            )[0]
            p99 = [_or_nan(r.result.get(f"p99_{metric}_ms")) for r in group]
            if not all(math.isnan(v) for v in p99):
                axes.plot(xs, p99, marker="x", linestyle="--", color=line.get_color(), label=f"{label} p99")
        _set_rate_ticks(axes, positions)
        axes.set_yscale("log")
        _finish(axes, f"{metric.upper()} vs request rate", None, f"{metric.upper()} (ms, log scale)")
    return figure


def _ttft_phases(figure: Any, runs: list[tuple[Run, str]]) -> Any:
    """Where TTFT went by TTFT percentile: one stacked bar per percentile, its phases the mean
    of the requests near it (bench.metrics.phase_breakdown), one panel per run."""
    panels = figure.subplots(1, len(runs), squeeze=False)[0]
    for axes, (run, name) in zip(panels, runs):
        breakdown: dict[str, dict[str, float]] = run.result["ttft_phase_breakdown_ms"]
        percentiles = list(breakdown)
        phases = [phase for phase in breakdown[percentiles[0]] if phase != "ttft"]
        bottoms = np.zeros(len(percentiles))
        for phase in phases:
            heights = np.array([breakdown[p].get(phase, 0.0) for p in percentiles])
            axes.bar(percentiles, heights, bottom=bottoms, label=phase)
            bottoms += heights
        _finish(axes, f"Where TTFT went: {name}", "TTFT percentile", "ms (stacked)")
    return figure


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


def _finish(axes: Any, title: str, xlabel: str | None, ylabel: str) -> None:
    axes.set_title(title)
    if xlabel:
        axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(True, alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize="small")
