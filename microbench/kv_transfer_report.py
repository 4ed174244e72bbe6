"""What ``microbench.kv_transfer`` measured, and how it shows it: the records of one run (every
timing of every prompt length, the UCX settings in force, the engine's prefill beside
them), the text table it prints and the JSON it writes."""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from kv_connector.ucx import WINDOW
from microbench.kv_transfer_peer import BLOCK_LAYOUTS, BlockLayout, PeerSpec

_GIB = 1 << 30
_MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class EnvSetting:
    name: str
    value: str | None  # None: unset, UCX picks its own default
    source: Literal["flag", "environment", "bench default"]

    def describe(self) -> str:
        return f"{self.name}={self.value if self.value is not None else '(unset: UCX default)'} ({self.source})"


@dataclass(slots=True)
class Samples:
    """Seconds of the timed runs of one measurement (the warm-up is not among them)."""

    seconds: list[float]

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def best_s(self) -> float:
        return min(self.seconds)

    def summary(self, num_bytes: int | None = None) -> dict[str, float]:
        figures = {"median_ms": self.median_s * 1e3, "best_ms": self.best_s * 1e3}
        if num_bytes:
            figures |= {
                "median_gib_per_s": num_bytes / _GIB / self.median_s,
                "best_gib_per_s": num_bytes / _GIB / self.best_s,
            }
        return figures


@dataclass(slots=True)
class LengthResult:
    """Every measurement for one prompt length."""

    num_tokens: int
    num_blocks: int
    num_bytes: int
    connector: dict[BlockLayout, Samples]
    num_messages: dict[BlockLayout, int]  # per pull, as the connector plans it
    raw_ucx: Samples
    memcpy: Samples
    # Parts of a pull, each measured on its own (see measure_breakdown).
    breakdown: dict[str, Samples] = field(default_factory=dict)
    # CPU milliseconds per transfer, by path (path_name) and process ("decode", "prefill").
    cpu_ms: dict[str, dict[str, float]] = field(default_factory=dict)

    def overhead_vs_raw(self, layout: BlockLayout) -> float:
        """The connector's median time over raw UCX's, minus one (0.2 = 20% slower)."""
        return self.connector[layout].median_s / self.raw_ucx.median_s - 1.0


def path_name(layout: BlockLayout) -> str:
    return f"connector, {layout} blocks"


@dataclass(slots=True)
class PrefillResult:
    num_tokens: int
    samples: Samples


def format_report(
    env: list[EnvSetting], spec: PeerSpec, repeats: int, results: list[LengthResult], prefill: PrefillResult | None
) -> str:
    lines = [
        "UCX: " + "  ".join(setting.describe() for setting in env),
        f"KV: {spec.model_id}, {spec.dtype}, {spec.num_layers} layers x {spec.num_kv_heads} KV heads x "
        f"{spec.head_dim} head_dim, "
        f"{spec.block_size}-token blocks = {spec.bytes_per_block:,} bytes/block; "
        f"median and best of {repeats} runs after 1 warm-up",
        "",
        f"{'tokens':>6} {'blocks':>6} {'MiB':>8}  {'path':<29} {'messages':>8} {'median ms':>10} {'best ms':>9} "
        f"{'med GiB/s':>10} {'best GiB/s':>11} {'vs raw UCX':>11}",
    ]
    for r in results:
        rows = [(path_name(layout), r.connector[layout], str(r.num_messages[layout])) for layout in BLOCK_LAYOUTS]
        rows += [("raw UCX", r.raw_ucx, "1"), ("memcpy", r.memcpy, "")]
        for index, (name, samples, num_messages) in enumerate(rows):
            figures = samples.summary(r.num_bytes)
            versus = f"{samples.median_s / r.raw_ucx.median_s - 1:+.1%}" if samples is not r.raw_ucx else ""
            head = f"{r.num_tokens:>6} {r.num_blocks:>6} {r.num_bytes / _MIB:>8.2f}" if index == 0 else " " * 22
            lines.append(
                f"{head}  {name:<29} {num_messages:>8} {figures['median_ms']:>10.2f} {figures['best_ms']:>9.2f} "
                f"{figures['median_gib_per_s']:>10.2f} {figures['best_gib_per_s']:>11.2f} {versus:>11}"
            )
    lines += [
        "",
        "breakdown, median ms, parts timed on their own: connect = a new connection (made once per prefill instance,",
        "then kept); headers = the pull's request and reply headers over raw UCX; raw = raw UCX in one message; raw in",
        "scattered / consecutive messages = raw UCX of the same bytes cut as the connector cuts that pull, at most",
        f"{WINDOW} in flight (its wire pattern with no connector logic); pull = the connector's pull, from the table "
        "above.",
        f"{'tokens':>6} {'connect':>8} {'headers':>8} {'raw':>8} {'raw in scattered':>17} {'pull scattered':>15} "
        f"{'raw in consecutive':>19} {'pull consecutive':>17}",
    ]
    for r in results:
        b = {name: samples.median_s * 1e3 for name, samples in r.breakdown.items()}
        lines.append(
            f"{r.num_tokens:>6} {b['connect']:>8.2f} {b['header_round_trip']:>8.2f} {r.raw_ucx.median_s * 1e3:>8.2f} "
            f"{b['raw_scattered_messages']:>17.2f} {r.connector['scattered'].median_s * 1e3:>15.2f} "
            f"{b['raw_consecutive_messages']:>19.2f} {r.connector['consecutive'].median_s * 1e3:>17.2f}"
        )
    paths = [path_name(layout) for layout in BLOCK_LAYOUTS] + ["raw UCX"]
    lines += [
        "",
        "CPU ms per transfer, decode process + prefill process, all threads:",
        f"{'tokens':>6} " + " ".join(f"{path:>30}" for path in paths),
    ]
    for r in results:
        cells = (f"{r.cpu_ms[path]['decode']:.1f} + {r.cpu_ms[path]['prefill']:.1f}" for path in paths)
        lines.append(f"{r.num_tokens:>6} " + " ".join(f"{cell:>30}" for cell in cells))
    if prefill is not None:
        transfer = next(r for r in results if r.num_tokens == prefill.num_tokens)
        prefill_ms = prefill.samples.median_s * 1e3
        ratios = ", ".join(
            f"{layout} {transfer.connector[layout].median_s * 1e3:.2f} ms = "
            f"{transfer.connector[layout].median_s / prefill.samples.median_s:.1%}"
            for layout in BLOCK_LAYOUTS
        )
        lines += [
            "",
            f"prefill of {prefill.num_tokens} tokens: median {prefill_ms:.1f} ms, best "
            f"{prefill.samples.best_s * 1e3:.1f} ms "
            f"({len(prefill.samples.seconds)} runs after 1 warm-up)",
            f"connector pull / prefill: {ratios} (target < 10%)",
        ]
    return "\n".join(lines)


def report_json(
    args: argparse.Namespace,
    env: list[EnvSetting],
    spec: PeerSpec,
    results: list[LengthResult],
    prefill: PrefillResult | None,
) -> dict[str, object]:
    report: dict[str, object] = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "ucx_env": [asdict(setting) for setting in env],
        "kv": {**asdict(spec), "bytes_per_block": spec.bytes_per_block},
        "lengths": [
            {
                "num_tokens": r.num_tokens,
                "num_blocks": r.num_blocks,
                "num_bytes": r.num_bytes,
                "connector": {
                    layout: {
                        **r.connector[layout].summary(r.num_bytes),
                        "seconds": r.connector[layout].seconds,
                        "num_messages": r.num_messages[layout],
                        "overhead_vs_raw_pct": r.overhead_vs_raw(layout) * 100,
                    }
                    for layout in BLOCK_LAYOUTS
                },
                "raw_ucx": {**r.raw_ucx.summary(r.num_bytes), "seconds": r.raw_ucx.seconds},
                "memcpy": {**r.memcpy.summary(r.num_bytes), "seconds": r.memcpy.seconds},
                "breakdown": {name: {**s.summary(), "seconds": s.seconds} for name, s in r.breakdown.items()},
                "cpu_ms_per_transfer": r.cpu_ms,
            }
            for r in results
        ],
    }
    if prefill is not None:
        transfer = next(r for r in results if r.num_tokens == prefill.num_tokens)
        report["prefill"] = {
            "num_tokens": prefill.num_tokens,
            **prefill.samples.summary(),
            "seconds": prefill.samples.seconds,
            "transfer_over_prefill": {
                layout: transfer.connector[layout].median_s / prefill.samples.median_s for layout in BLOCK_LAYOUTS
            },
        }
    return report
