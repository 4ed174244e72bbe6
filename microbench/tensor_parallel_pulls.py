"""KV pulls between prefill and decode instances of different tensor-parallel sizes: the time
and bytes of a ``--input-len``-token prompt's pull for each (P size, D size) pair, beside 1 -> 1.

Each pair runs as real ``splitserve prefill`` and ``splitserve decode`` processes on loopback
over UCX, started fresh per pair (``microbench.pd_pulls`` says how a pull is timed). The model
is the SmolLM2-sized random Llama of ``microbench.tensor_parallel`` (4 KV heads)::

    python -m microbench.tensor_parallel_pulls --pairs 1:1,2:1,1:2,2:2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from microbench.pd_pulls import measure_pulls
from microbench.tensor_parallel import write_model


def measure_pair(args: argparse.Namespace, model: str, prefill_size: int, decode_size: int, log_dir: Path) -> dict:
    def flags(size: int) -> list[str]:
        return ["--model", model, "--dtype", "float32", "--tensor-parallel-size", str(size),
                "--kv-cache-memory", str(args.kv_cache_memory)]  # fmt: skip

    figures = measure_pulls(flags(prefill_size), flags(decode_size), args.input_len, args.repeats, args.seed, log_dir)
    return {
        "prefill_tp": prefill_size,
        "decode_tp": decode_size,
        "pull_ms_median": figures.pull_ms_median,
        "pull_ms_min": figures.pull_ms_min,
        "num_bytes": figures.num_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m microbench.tensor_parallel_pulls", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default=None, help="local checkpoint (default: a SmolLM2-sized random Llama)")
    parser.add_argument("--pairs", default="1:1,2:1,1:2,2:2", help="comma-separated PREFILL_TP:DECODE_TP")
    parser.add_argument("--input-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5, help="timed pulls per pair, after one warm-up")
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 29, help="bytes per instance, all ranks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args(argv)
    pairs = [tuple(int(size) for size in pair.split(":")) for pair in args.pairs.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tp-pulls-") as scratch:
        model = args.model or str(write_model(Path(scratch) / "model"))
        for prefill_size, decode_size in pairs:
            rows.append(measure_pair(args, model, prefill_size, decode_size, Path(scratch)))
            print(json.dumps(rows[-1]), flush=True)
    base = next((row for row in rows if (row["prefill_tp"], row["decode_tp"]) == (1, 1)), None)
    print(f"{'P->D':>6} {'pull ms (median)':>17} {'min':>8} {'MiB':>8} {'vs 1->1':>8}")
    for row in rows:
        ratio = row["pull_ms_median"] / base["pull_ms_median"] if base else float("nan")
        pair = f"{row['prefill_tp']}->{row['decode_tp']}"
        print(
            f"{pair:>6} {row['pull_ms_median']:>17.1f} {row['pull_ms_min']:>8.1f} "
            f"{row['num_bytes'] / 2**20:>8.1f} {ratio:>7.2f}x"
        )
    if args.output_json is not None:
        args.output_json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
