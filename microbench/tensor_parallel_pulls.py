"""KV pulls between prefill and decode instances of different shapes (tensor parallel size x
pipeline parallel size, each side its own): the time and bytes of a ``--input-len``-token
prompt's pull for each (P shape, D shape) pair, beside 1 -> 1.

Each pair runs as real ``splitserve prefill`` and ``splitserve decode`` processes on loopback
over UCX, started fresh per pair (``microbench.pd_pulls`` says how a pull is timed). The model
is the SmolLM2-sized random Llama of ``microbench.tensor_parallel`` (4 KV heads, 30 layers).
A shape is ``TP`` or ``TPxPP`` (``microbench.tensor_parallel.parse_size``); pipeline stages
split the layers evenly. Tensor-parallel pairs, then pipeline-parallel ones::

    python -m microbench.tensor_parallel_pulls --pairs 1:1,2:1,1:2,2:2
    python -m microbench.tensor_parallel_pulls --pairs 1:1,1x2:1,1:1x2,2:1x2,2x2:1
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from microbench.pd_pulls import measure_pulls
from microbench.tensor_parallel import parse_size, write_model

Shape = tuple[int, int]  # (tensor parallel size, pipeline parallel size)


def shape_label(shape: Shape) -> str:
    """``(2, 2)`` -> ``TP2xPP2``, ``(1, 2)`` -> ``PP2``, ``(1, 1)`` -> ``1``."""
    tensor, pipeline = shape
    parts = []
    if tensor > 1:
        parts.append(f"TP{tensor}")
    if pipeline > 1:
        parts.append(f"PP{pipeline}")
    return "x".join(parts) or "1"


def parse_pairs(pairs: str) -> list[tuple[Shape, Shape]]:
    """``"1:1,2x2:1"`` -> [((1, 1), (1, 1)), ((2, 2), (1, 1))]: PREFILL_SHAPE:DECODE_SHAPE each."""
    parsed = []
    for pair in pairs.split(","):
        prefill, separator, decode = pair.partition(":")
        if not separator:
            raise ValueError(f"--pairs: {pair!r} is not PREFILL_SHAPE:DECODE_SHAPE (a shape: TP or TPxPP)")
        parsed.append((parse_size(prefill), parse_size(decode)))
    return parsed


def measure_pair(args: argparse.Namespace, model: str, prefill: Shape, decode: Shape, log_dir: Path) -> dict:
    vocab_size = json.loads((Path(model) / "config.json").read_text())["vocab_size"]

    def flags(shape: Shape) -> list[str]:
        return ["--model", model, "--dtype", "float32", "--tensor-parallel-size", str(shape[0]),
                "--pipeline-parallel-size", str(shape[1]),
                "--kv-cache-memory", str(args.kv_cache_memory)]  # fmt: skip

    figures = measure_pulls(
        flags(prefill), flags(decode), args.input_len, args.repeats, args.seed, log_dir, vocab_size=vocab_size
    )
    if figures.prefill_shape != prefill:
        raise RuntimeError(f"asked for a prefill at {prefill}, its KV handle says {figures.prefill_shape} (bug)")
    return {
        "prefill_tp": prefill[0],
        "prefill_pp": prefill[1],
        "decode_tp": decode[0],
        "decode_pp": decode[1],
        "pull_ms_median": figures.pull_ms_median,
        "pull_ms_min": figures.pull_ms_min,
        "num_bytes": figures.num_bytes,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    """The pairs side by side, each against the 1 -> 1 pair's median where it was measured."""
    base = next((row for row in rows if _shapes(row) == ((1, 1), (1, 1))), None)
    print(f"{'P -> D':>16} {'pull ms (median)':>17} {'min':>8} {'MiB':>8} {'vs 1->1':>8}")
    for row in rows:
        ratio = row["pull_ms_median"] / base["pull_ms_median"] if base else float("nan")
        prefill, decode = _shapes(row)
        pair = f"{shape_label(prefill)} -> {shape_label(decode)}"
        print(
            f"{pair:>16} {row['pull_ms_median']:>17.1f} {row['pull_ms_min']:>8.1f} "
            f"{row['num_bytes'] / 2**20:>8.1f} {ratio:>7.2f}x"
        )


def _shapes(row: dict[str, Any]) -> tuple[Shape, Shape]:
    return (row["prefill_tp"], row["prefill_pp"]), (row["decode_tp"], row["decode_pp"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m microbench.tensor_parallel_pulls", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default=None, help="local checkpoint (default: a SmolLM2-sized random Llama)")
    parser.add_argument(
        "--pairs", default="1:1,2:1,1:2,2:2", help="comma-separated PREFILL_SHAPE:DECODE_SHAPE, a shape TP or TPxPP"
    )
    parser.add_argument("--input-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5, help="timed pulls per pair, after one warm-up")
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 29, help="bytes per instance, all ranks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        pairs = parse_pairs(args.pairs)
    except ValueError as error:
        parser.error(str(error))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pd-shape-pulls-") as scratch:
        model = args.model or str(write_model(Path(scratch) / "model"))
        for prefill, decode in pairs:
            rows.append(measure_pair(args, model, prefill, decode, Path(scratch)))
            print(json.dumps(rows[-1]), flush=True)
    print_table(rows)
    if args.output_json is not None:
        args.output_json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
