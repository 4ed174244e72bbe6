"""Routing and conditional disaggregation, side by side in one run: two ``splitserve up``
clusters that differ in one gateway flag stay up together, and ``splitserve bench serve``
sends the same workload to each in turn, round after round (the order alternating), so
both see the same machine load over time. Round 0 warms the caches and is not reported.

Presets:

- ``routing``: ``--num-prefill 2 --num-decode 1`` with small KV budgets, each prefill
  instance pinned to half of the CPUs (``--prefill-cpus 'A|B'``: two instances sharing
  cores stall each other's thread teams, which no router can see), ``--routing load``
  against ``--routing kv``, on ``--dataset shared-prefix`` (8 system prompts of 1,024
  tokens): prefix-cache hit rate (the gateway's cached / prompt tokens over the measured
  requests) and TTFT p50 / p99;
- ``conditional``: ``--num-prefill 1 --num-decode 1``, ``--disagg-min-prompt-tokens 0``
  against ``128``, on a mix of 64- and 1,024-token prompts: TTFT of each class.

Prints a markdown table with the CPU model and flags (``lscpu``) for docs/benchmarks.md::

    python -m bench.routing --preset routing --output-dir /tmp/routing

Bound: the hit rate a round can reach at best, every request but the first of each prefix
hitting its whole prefix (each round draws prefixes of its own). Expected cached tokens
missed: of the prompt tokens kv routing expected cached on the prefill instance it chose,
those that instance computed after all (evicted, or not there yet). Passed over: cached
tokens another instance held beyond the chosen one's (given up to balance load).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.splitserve_up import start_up, wait_ready
from engine_args.flags import add_dtype_argument
from launcher.processes import free_port, splitserve_command


@dataclass(frozen=True, slots=True)
class Preset:
    up: tuple[str, ...]  # splitserve up flags both clusters share
    modes: dict[str, tuple[str, ...]]  # mode name -> the up flags that make it
    workload: tuple[str, ...]  # bench serve flags
    pin_prefill: bool = False  # each prefill instance on CPUs of its own, where there are enough


def prefill_cpu_lists(count: int, cpus: set[int]) -> str | None:
    """``--prefill-cpus`` giving each of ``count`` instances an equal share of ``cpus`` of its
    own ('0|1' for two on two cores); None with fewer CPUs than instances."""
    ordered = sorted(cpus)
    share = len(ordered) // count
    if share == 0:
        return None
    return "|".join(
        ",".join(str(cpu) for cpu in ordered[index * share : (index + 1) * share]) for index in range(count)
    )


PRESETS = {
    "routing": Preset(
        up=("--num-prefill", "2", "--num-decode", "1", "--kv-cache-memory", str(256 << 20)),
        modes={"load": ("--routing", "load"), "kv": ("--routing", "kv")},
        workload=(
            "--dataset",
            "shared-prefix",
            "--num-prefixes",
            "8",
            "--prefix-len",
            "1024",
            "--suffix-len",
            "64",
            "--output-len",
            "16",
        ),
        pin_prefill=True,
    ),
    "conditional": Preset(
        up=("--num-prefill", "1", "--num-decode", "1"),
        modes={"always": ("--disagg-min-prompt-tokens", "0"), "conditional": ("--disagg-min-prompt-tokens", "128")},
        workload=("--dataset", "mixed", "--mix", "64:16:1,1024:16:1"),
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds per mode (after the warm-up round)")
    parser.add_argument("--num-prompts", type=int, default=24, help="requests per round")
    parser.add_argument("--request-rate", type=float, default=0.5)
    parser.add_argument("--modes", default=None, help="comma-separated, of the preset's (default: all of them)")
    parser.add_argument(
        "--log-level", default="WARNING", help="the clusters' (DEBUG: the gateway logs each prefix kv routing missed)"
    )
    add_dtype_argument(parser, default="float32")
    return parser.parse_args(argv)


def start_cluster(mode: str, preset: Preset, args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    log = open(args.output_dir / f"{mode}-server.log", "w")  # noqa: SIM115 - the child holds it until it exits
    flags = [*preset.up, *preset.modes[mode]]
    if preset.pin_prefill:
        lists = prefill_cpu_lists(int(preset.up[preset.up.index("--num-prefill") + 1]), os.sched_getaffinity(0))
        flags += ["--prefill-cpus", lists] if lists else []
    print(f"[{mode}] splitserve up --dtype {args.dtype} {shlex.join(flags)}", flush=True)
    return start_up(port, args.dtype, flags, log, log_level=args.log_level), f"http://127.0.0.1:{port}"


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {}
    for name in ("splitserve_prompt_tokens_total", "splitserve_cached_prompt_tokens_total"):
        found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        values[name] = float(found[1]) if found else 0.0
    for found in re.finditer(r'^splitserve_routed_prefix_tokens_total\{outcome="(\w+)"\} (\S+)$', text, re.MULTILINE):
        values[f"routed:{found[1]}"] = float(found[2])
    for found in re.finditer(
        r'^splitserve_pd_decision_total\{path="(\w+)",reason="(\w+)"\} (\S+)$', text, re.MULTILINE
    ):
        values[f"pd:{found[1]}:{found[2]}"] = float(found[3])
    return values


def run_round(mode: str, url: str, round_index: int, preset: Preset, args: argparse.Namespace) -> Path:
    result_dir = args.output_dir / mode
    filename = f"round{round_index}.json"
    command = splitserve_command(
        "bench",
        "serve",
        "--base-url",
        url,
        *preset.workload,
        "--num-prompts",
        str(args.num_prompts),
        "--request-rate",
        str(args.request_rate),
        "--seed",
        str(round_index),
        "--metric-percentiles",
        "50,99",
        "--label",
        mode,
        "--save-result",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        filename,
        "--disable-tqdm",
    )
    print(f"[{mode}] round {round_index}: {' '.join(command[2:])}", flush=True)
    before = scrape(url)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    after = scrape(url)
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    (result_dir / f"round{round_index}.gateway.json").write_text(json.dumps(delta))
    return result_dir / filename


def selected_modes(args: argparse.Namespace, preset: Preset) -> list[str]:
    modes = args.modes.split(",") if args.modes else list(preset.modes)
    unknown = set(modes) - set(preset.modes)
    if unknown:
        raise SystemExit(f"--modes: {', '.join(sorted(unknown))} not in the preset's {', '.join(preset.modes)}")
    return modes


def num_reusable_prefix_tokens(result: dict, workload: tuple[str, ...]) -> int:
    """Shared-prefix tokens a round could serve from prefix caches at best: every request but
    the first of each prefix (each round has prefixes of its own, from its seed)."""
    if "--prefix-len" not in workload:
        return 0
    prefix_len = int(workload[workload.index("--prefix-len") + 1])
    groups = [w for w, error in zip(result["workloads"], result["errors"], strict=True) if not error]
    return prefix_len * (len(groups) - len(set(groups)))


def summary(args: argparse.Namespace, preset: Preset) -> str:
    rows = []
    for mode in selected_modes(args, preset):
        ttfts: dict[str, list[float]] = {}
        prompt = cached = reusable = 0.0
        decisions: dict[str, float] = {}
        routed = {"served": 0.0, "missed": 0.0, "passed_over": 0.0}
        failed = 0
        for round_index in range(1, args.rounds + 1):
            result = json.loads((args.output_dir / mode / f"round{round_index}.json").read_text())
            gateway = json.loads((args.output_dir / mode / f"round{round_index}.gateway.json").read_text())
            failed += result["failed"]
            for ttft, workload, error in zip(result["ttfts"], result["workloads"], result["errors"], strict=True):
                if not error:
                    ttfts.setdefault("all", []).append(ttft * 1000)
                    if preset is PRESETS["conditional"]:
                        ttfts.setdefault(workload.split(":")[0] + "-token prompts", []).append(ttft * 1000)
            prompt += gateway["splitserve_prompt_tokens_total"]
            cached += gateway["splitserve_cached_prompt_tokens_total"]
            reusable += num_reusable_prefix_tokens(result, preset.workload)
            for outcome in routed:
                routed[outcome] += gateway.get(f"routed:{outcome}", 0.0)
            for key, value in gateway.items():
                if key.startswith("pd:"):
                    decisions[key[3:]] = decisions.get(key[3:], 0.0) + value
        for name, values in ttfts.items():
            rows.append(
                f"| {mode} | {name} | {len(values)} | {np.percentile(values, 50):.0f} / "
                f"{np.percentile(values, 99):.0f} "
                f"| {cached / prompt if prompt else 0:.1%} | {reusable / prompt if prompt else 0:.1%} "
                f"| {routed['missed']:.0f} / {routed['served'] + routed['missed']:.0f} | {routed['passed_over']:.0f} "
                f"| {failed} | " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(decisions.items())) + " |"
            )
    header = [
        "| mode | requests | n | TTFT p50 / p99 (ms) | prefix-cache hit rate | bound | expected cached tokens missed "
        "| cached tokens passed over | failed | P/D decisions |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join([*header, *rows])


def cpu_line() -> str:
    text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    model = fields.get("Model name", "?").strip()
    flags = [f for f in fields.get("Flags", "").split() if f.startswith(("avx", "amx", "fma", "f16c"))]
    return f"CPU: {model}, {os.cpu_count()} cores visible; flags: {' '.join(flags)}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    preset = PRESETS[args.preset]
    args.output_dir.mkdir(parents=True, exist_ok=True)
    modes = selected_modes(args, preset)
    clusters = {mode: start_cluster(mode, preset, args) for mode in modes}
    try:
        for server, url in clusters.values():
            wait_ready(url, server)
        for round_index in range(args.rounds + 1):
            for mode in modes if round_index % 2 == 0 else reversed(modes):
                run_round(mode, clusters[mode][1], round_index, preset, args)
    finally:
        for server, _ in clusters.values():
            server.send_signal(signal.SIGTERM)
        for server, _ in clusters.values():
            server.wait(timeout=120)
    table = summary(args, preset)
    (args.output_dir / "summary.md").write_text(f"{cpu_line()}\n\n{table}\n")
    print(cpu_line())
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
