"""Per-call time of the CPU ops one decode token runs, and of one whole decode token.

On small batches a CPU op's fixed cost (ctypes, waking an OpenMP team, allocating
the output) can outweigh its arithmetic; this measures it on the CPU at hand, at
SmolLM2-135M's shapes (hidden 576, 9 query / 3 KV heads of 64, intermediate 1536)::

    python -m microbench.cpu_ops --threads 1,2 --rows 1,64 --output-json cpu_ops.json

Each figure is the median over ``--repeats`` timed loops of ``--calls`` calls
(microseconds per call); ``decode ms/token`` is one sequence's inter-token time
through the whole engine (``LLM.generate`` of 65 tokens minus 1, over 64), beside its
floor: the bytes of every linear layer's weight (read once per token) over the read
bandwidth of this machine at that thread count (one pass over a 1 GiB tensor, read in each
round just before its decode run; the ratio is the median of the rounds' ratios). The
linear-layer figures reuse one weight, so it sits in cache; ``decode ms/token`` is the
one that streams weights from memory as serving does.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.models.ops import select_ops

logger = logging.getLogger(__name__)

HIDDEN, INTERMEDIATE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64
BLOCK_SIZE, CONTEXT_LEN = 16, 256
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def time_call(function: Callable[[], object], calls: int, repeats: int) -> float:
    """Median microseconds per call over ``repeats`` loops of ``calls`` calls, after a warm-up loop."""
    for _ in range(calls):
        function()
    loops = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            function()
        loops.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(loops)


def op_calls(llm: LLM, dtype: torch.dtype, num_rows: int) -> dict[str, Callable[[], object]]:
    """One closure per op, on random inputs of ``num_rows`` tokens (decodes, for attention);
    the linear layers are the first decoder layer's of ``llm``, as the engine prepared them."""
    generator = torch.Generator().manual_seed(0)
    ops = select_ops(torch.device("cpu"), dtype)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    x, residual, weight = randn(num_rows, HIDDEN), randn(num_rows, HIDDEN), randn(HIDDEN)
    qkv = randn(num_rows, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM)
    q = qkv[:, : NUM_HEADS * HEAD_DIM].view(num_rows, NUM_HEADS, HEAD_DIM)
    k = qkv[:, NUM_HEADS * HEAD_DIM : (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM].view(num_rows, NUM_KV_HEADS, HEAD_DIM)
    cos, sin = randn(4096, HEAD_DIM // 2), randn(4096, HEAD_DIM // 2)
    positions = torch.full((num_rows,), CONTEXT_LEN - 1)
    gate_up = randn(num_rows, 2 * INTERMEDIATE)

    blocks_per_seq = CONTEXT_LEN // BLOCK_SIZE
    cache = randn(2, num_rows * blocks_per_seq, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    block_tables = torch.randperm(num_rows * blocks_per_seq, generator=generator).view(num_rows, -1).to(torch.int32)
    seq_lens = torch.full((num_rows,), CONTEXT_LEN, dtype=torch.int32)
    slots = block_tables[:, -1].long() * BLOCK_SIZE + BLOCK_SIZE - 1
    metadata = AttentionMetadata(
        num_decodes=num_rows,
        slot_mapping=slots,
        query_start_loc=torch.arange(num_rows + 1, dtype=torch.int32),
        seq_lens=seq_lens,
        block_tables=block_tables,
        max_query_len=1,
        max_seq_len=CONTEXT_LEN,
        query_start_loc_cpu=list(range(num_rows + 1)),
        seq_lens_cpu=[CONTEXT_LEN] * num_rows,
    )
    backend = TorchAttentionBackend()
    q_attn, k_new, v_new = (
        randn(num_rows, NUM_HEADS, HEAD_DIM),
        randn(num_rows, NUM_KV_HEADS, HEAD_DIM),
        randn(num_rows, NUM_KV_HEADS, HEAD_DIM),
    )

    layer = llm.engine.runner.model.layers[0]
    qkv_proj, gate_up_proj, down_proj = layer.qkv_proj, layer.gate_up_proj, layer.down_proj
    hidden_in, intermediate_in = randn(num_rows, HIDDEN), randn(num_rows, INTERMEDIATE)

    return {
        "add_rms_norm": lambda: ops.add_rms_norm(x, residual, weight, 1e-5),
        "rotary (q and k)": lambda: ops.rotary(q, k, cos, sin, positions),
        "silu_and_mul": lambda: ops.silu_and_mul(gate_up),
        f"decode attention ({CONTEXT_LEN} ctx)": lambda: backend.forward(q_attn, k_new, v_new, cache, metadata, 0.125),
        "qkv_proj 576->960": lambda: qkv_proj(hidden_in),
        "gate_up_proj 576->3072": lambda: gate_up_proj(hidden_in),
        "down_proj 1536->576": lambda: down_proj(intermediate_in),
    }


def read_seconds(data: torch.Tensor) -> float:
    """One pass over ``data`` (the floor's 1 GiB float32 tensor), at torch's current thread count."""
    return time_call(data.sum, 1, 1) / 1e6


def weight_bytes_per_token(llm: LLM) -> int:
    """Bytes of every linear layer's weight: what one decode step reads at least once."""
    element_size = llm.engine.runner.dtype.itemsize
    modules = llm.engine.runner.model.modules()
    return sum(m.in_features * m.out_features * element_size for m in modules if hasattr(m, "in_features"))


@dataclass(frozen=True, slots=True)
class DecodeAgainstFloor:
    decode_ms: float  # median inter-token time
    floor_ms: float  # median floor of the same rounds
    ratio: float  # median of each round's decode time over that round's floor


def decode_against_floor(llm: LLM, repeats: int) -> DecodeAgainstFloor:
    """One sequence's inter-token time through the engine, in milliseconds, each round beside
    the floor read in that round: this VM's read bandwidth swings within minutes
    (docs/benchmarks.md, "Prompt chunks capped on the prefill instance"), so a floor taken at
    another moment, let alone the best of several, says little about a given decode run."""
    weight_bytes = weight_bytes_per_token(llm)
    data = torch.ones(1 << 28)
    bytes_per_pass = data.numel() * data.element_size()
    prompt = list(range(1000, 1064))
    short = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True)
    llm.generate([prompt], long)  # warm-up, of the floor's pass too
    read_seconds(data)
    gaps, floors = [], []
    for run in range(repeats):
        floors.append(read_seconds(data) * weight_bytes / bytes_per_pass * 1e3)
        # A new first token per run: no prefix-cache hits.
        prompt = [1000 + run + 1] + prompt[1:]
        start = time.perf_counter()
        llm.generate([prompt], short)
        one = time.perf_counter() - start
        prompt = [2000 + run + 1] + prompt[1:]
        start = time.perf_counter()
        llm.generate([prompt], long)
        gaps.append((time.perf_counter() - start - one) / 64 * 1e3)
    ratios = [gap / floor for gap, floor in zip(gaps, floors)]
    return DecodeAgainstFloor(statistics.median(gaps), statistics.median(floors), statistics.median(ratios))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m microbench.cpu_ops", description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--rows", default="1,64", help="comma-separated token (decode) counts per call")
    parser.add_argument("--calls", type=int, default=200, help="calls per timed loop")
    parser.add_argument("--repeats", type=int, default=7, help="timed loops per figure (the median is reported)")
    parser.add_argument("--skip-decode", action="store_true", help="do not time whole decode tokens")
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        args.dtypes = [_DTYPES[name] for name in args.dtypes.split(",")]
        args.threads = [int(n) for n in args.threads.split(",")]
        args.rows = [int(n) for n in args.rows.split(",")]
    except (KeyError, ValueError) as error:
        parser.error(f"bad list: {error}")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    rows: list[dict[str, object]] = []
    for dtype in args.dtypes:
        dtype_name = str(dtype).removeprefix("torch.")
        # The float folder: the float linear paths are what this measures (a CPU in float32 would get the file).
        llm = LLM(model=None, load_format="safetensors", dtype=dtype_name, kv_cache_memory=1 << 26)
        for num_threads in args.threads:
            torch.set_num_threads(num_threads)
            for num_rows in args.rows:
                for name, call in op_calls(llm, dtype, num_rows).items():
                    us = time_call(call, args.calls, args.repeats)
                    rows.append(
                        {"dtype": dtype_name, "threads": num_threads, "rows": num_rows, "op": name, "us_per_call": us}
                    )
                    sys.stdout.write(
                        f"{dtype_name:<9} threads={num_threads} rows={num_rows:<4} {name:<28} {us:9.1f} us\n"
                    )
            if not args.skip_decode:
                measured = decode_against_floor(llm, args.repeats)
                rows.append(
                    {
                        "dtype": dtype_name,
                        "threads": num_threads,
                        "rows": 1,
                        "op": "decode ms/token",
                        "ms": measured.decode_ms,
                        "floor_ms": measured.floor_ms,
                        "ratio_to_floor": measured.ratio,
                    }
                )
                sys.stdout.write(
                    f"{dtype_name:<9} threads={num_threads} decode ms/token {measured.decode_ms:.2f} (weight-read "
                    f"floor {measured.floor_ms:.2f}; ratio {measured.ratio:.2f}x, median of the rounds)\n"
                )
    if args.output_json is not None:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
