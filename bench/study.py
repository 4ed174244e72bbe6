"""The disaggregated-vs-colocated study on one machine: the same model, the same
cores, the same workload and request rates, served two ways by ``splitserve up``:

- colocated: one engine doing both phases on every core (``up --colocated``);
- disaggregated: prefill pinned to some cores, decode to the others
  (``up --prefill-cpus A --decode-cpus B``), KV over UCX.

For each, ``splitserve bench sweep`` runs the rates; then ``bench plot`` overlays
both, and a markdown table of the figures is printed for docs/benchmarks.md::

    python -m bench.study --output-dir docs/study

Run it on a quiet machine: the figures are latencies.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from bench.splitserve_up import start_up, wait_ready
from engine_args.flags import add_dtype_argument
from launcher.processes import free_port, splitserve_command


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--request-rates", default="0.15,0.25,0.35,0.5,0.7,1.0")
    parser.add_argument("--num-prompts", type=int, default=32, help="measured requests per rate")
    parser.add_argument(
        "--mix", default="1024-2048:32:1,128:256:1", help="bench serve --mix: long prompts and chatty requests"
    )
    parser.add_argument(
        "--goodput", default="ttft:5000 tpot:100", help="SLOs in ms, as bench serve --goodput takes them"
    )
    parser.add_argument("--prefill-cpus", default="0")
    parser.add_argument("--decode-cpus", default="1")
    add_dtype_argument(parser)
    parser.add_argument("--modes", default="colocated,disaggregated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--report-only", action="store_true", help="plot and tabulate the results already in --output-dir"
    )
    return parser.parse_args(argv)


def up_flags(mode: str, args: argparse.Namespace) -> list[str]:
    if mode == "colocated":
        return ["--colocated"]
    return ["--prefill-cpus", args.prefill_cpus, "--decode-cpus", args.decode_cpus]


def run_mode(mode: str, args: argparse.Namespace) -> None:
    port = free_port()
    log = open(args.output_dir / f"{mode}-server.log", "w")  # noqa: SIM115 - closed below
    flags = up_flags(mode, args)
    print(f"[{mode}] splitserve up --dtype {args.dtype} {' '.join(flags)}", flush=True)
    server = start_up(port, args.dtype, flags, log)
    try:
        wait_ready(f"http://127.0.0.1:{port}", server)
        sweep = splitserve_command(
            "bench",
            "sweep",
            "--base-url",
            f"http://127.0.0.1:{port}",
            "--dataset",
            "mixed",
            "--mix",
            args.mix,
            "--num-prompts",
            str(args.num_prompts),
            "--request-rates",
            args.request_rates,
            "--num-warmups",
            "6",
            "--seed",
            str(args.seed),
            "--goodput",
            *args.goodput.split(),
            "--metric-percentiles",
            "50,90,99",
            "--label",
            mode,
            "--result-dir",
            str(args.output_dir / mode),
            "--disable-tqdm",
        )
        print(f"[{mode}] {' '.join(sweep[2:])}", flush=True)
        subprocess.run(sweep, check=True)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
        log.close()


def summary(args: argparse.Namespace, modes: list[str]) -> str:
    """One markdown row per run. "met" is the share of requests meeting every SLO
    (goodput / request throughput); p99.9 and max ITL come from the per-request gaps."""
    rows = [
        "| mode | rate (req/s) | achieved (req/s) | TTFT p50 / p99 (ms) | ITL p50 / p99 / p99.9 / max (ms) | TPOT "
        "mean (ms) "
        "| output tok/s | goodput (req/s) | met SLOs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in modes:
        results = [json.loads(p.read_text()) for p in sorted((args.output_dir / mode).glob("*.json"))]
        for r in sorted(results, key=lambda r: float(r["request_rate"])):
            gaps_ms = np.array([gap for gaps in r["itls"] for gap in gaps]) * 1000
            met = r["request_goodput"] / r["request_throughput"] if r["request_throughput"] else 0.0
            rows.append(
                f"| {mode} | {r['request_rate']} | {r['request_throughput']:.3f} | {r['median_ttft_ms']:.0f} / "
                f"{r['p99_ttft_ms']:.0f} "
                f"| {r['median_itl_ms']:.0f} / {r['p99_itl_ms']:.0f} / {np.percentile(gaps_ms, 99.9):.0f} / "
                f"{gaps_ms.max():.0f} "
                f"| {r['mean_tpot_ms']:.0f} | {r['output_throughput']:.1f} | {r['request_goodput']:.3f} | {met:.0%} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    modes = args.modes.split(",")
    if not args.report_only:
        for mode in modes:
            run_mode(mode, args)
    files = [str(p) for mode in modes for p in sorted((args.output_dir / mode).glob("*.json"))]
    plot = splitserve_command("bench", "plot")
    subprocess.run([*plot, *files, "--output-dir", str(args.output_dir / "plots")], check=True)
    # The CDFs and ITL timelines compare best two at a time: both modes at the highest rate.
    top = max(float(rate) for rate in args.request_rates.split(","))
    at_top = [p for p in files if float(json.loads(Path(p).read_text())["request_rate"]) == top]
    subprocess.run([*plot, *at_top, "--output-dir", str(args.output_dir / f"plots-at-{top:g}")], check=True)
    print(summary(args, modes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
