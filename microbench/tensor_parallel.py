"""Tensor and pipeline parallelism on one CPU host: TP=1 with every core against TP=N and/or
PP=M with a core share per rank, single-stream decode and offline throughput, with the
collectives' share of the time (rank 0's: its stage's all-reduces and gather; a pipeline
stage's wait for the one before it is not counted there).

Each size runs in a fresh process of its own (``torch.set_num_threads`` is process-wide, and a
TP=N engine sets rank 0's share), the sizes alternating round by round so that load from
elsewhere on the machine lands on every size alike. Per size and round:

- **single stream**: one random-token prompt of ``--input-len`` tokens, ``--output-len``
  tokens greedily (EOS ignored), ms per output token after the first (the inter-token
  latency), and rank 0's time inside all-reduce/all-gather as a share of it;
- **offline**: ``--num-prompts`` such prompts at once through ``LLM.generate``, output
  tokens per second, and the collectives' share.

The model is the embedded SmolLM2-135M only where every size divides its 3 KV heads; by default
it is a random-weight Llama of SmolLM2's size with heads every size here divides (8 query and
4 KV heads of 64, 30 layers, MLP 1536, vocabulary 49152: 135M parameters)::

    python -m microbench.tensor_parallel --sizes 1,2 --rounds 3
    python -m microbench.tensor_parallel --sizes 1,1x2,2 --rounds 3   # PP 2 beside TP 2

A size is ``N`` (tensor parallel N) or ``NxM`` (tensor parallel N in each of M pipeline stages).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from engine_args.flags import add_dtype_argument

logger = logging.getLogger(__name__)

_TOKEN_ID_MARGIN = 100  # random ids keep clear of the special tokens at both ends of the vocabulary
_SMOLLM2_SIZED = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}


def write_model(directory: Path) -> Path:
    """The default model: random weights of SmolLM2's size, heads that split 1, 2 or 4 ways."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from engine.default_model import default_model_path

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**_SMOLLM2_SIZED))
    model.save_pretrained(directory, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(default_model_path())).save_pretrained(directory)  # its vocabulary size
    return directory


def parse_size(size: str) -> tuple[int, int]:
    """``"2"`` -> (2, 1); ``"2x3"`` -> tensor parallel 2 in each of 3 pipeline stages."""
    tensor, _, pipeline = size.partition("x")
    return int(tensor), int(pipeline or 1)


def measure(args: argparse.Namespace, size: str) -> dict[str, Any]:
    """In this process: one engine at ``size``, the single stream and the offline batch."""
    from engine import LLM, SamplingParams

    tensor_parallel_size, pipeline_parallel_size = parse_size(size)
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=False,
    )
    core = llm.engine
    runner = core.runner
    group = runner.tensor_parallel.group if runner.tensor_parallel is not None else None
    collective_s = (lambda: group.collective_seconds) if group is not None else (lambda: 0.0)
    vocab = runner.shape.vocab_size
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(_TOKEN_ID_MARGIN, vocab - _TOKEN_ID_MARGIN) for _ in range(args.input_len)]
        for _ in range(args.num_prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up

    # Single stream, step by step: the steps after the first token are the decode.
    core.add_request(prompts[0], params, request_id=uuid.uuid4().hex)
    num_tokens, decode_s, decode_collective_s = 0, 0.0, 0.0
    while core.has_unfinished_requests():
        wall, collective = time.perf_counter(), collective_s()
        num_new = sum(len(output.new_token_ids) for output in core.step())
        if num_tokens:
            decode_s += time.perf_counter() - wall
            decode_collective_s += collective_s() - collective
        num_tokens += num_new
    if num_tokens != args.output_len:
        raise RuntimeError(f"{num_tokens} tokens, expected {args.output_len} with ignore_eos: a bug")

    started, collective = time.perf_counter(), collective_s()
    outputs = llm.generate(prompts, params)
    offline_s, offline_collective_s = time.perf_counter() - started, collective_s() - collective
    num_output = sum(len(output.outputs[0].token_ids) for output in outputs)
    llm.close()
    return {
        "size": size,
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "single_stream_ms_per_token": 1000 * decode_s / (args.output_len - 1),
        "single_stream_collective_share": decode_collective_s / decode_s,
        "offline_output_tokens_per_s": num_output / offline_s,
        "offline_collective_share": offline_collective_s / offline_s,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m microbench.tensor_parallel", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="local checkpoint (default: a SmolLM2-sized random Llama)")
    parser.add_argument(
        "--sizes", default="1,2", help="comma-separated sizes: N, tensor parallel N; NxM, N in each of M stages"
    )
    add_dtype_argument(parser, default="float32")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=16, help="the offline batch")
    parser.add_argument("--rounds", type=int, default=3, help="runs per size, the sizes alternating")
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 28, help="bytes, all ranks together")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", type=Path, default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: measure this size
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    if args.output_len < 2:
        raise ValueError("--output-len must be >= 2: ms per token is measured between tokens")
    if args.one is not None:
        print(json.dumps(measure(args, args.one)), flush=True)
        return 0
    sizes = args.sizes.split(",")
    for size in sizes:
        parse_size(size)  # a ValueError for a size that is not one, before any run
    with tempfile.TemporaryDirectory(prefix="tp-bench-") as scratch:
        model = args.model or str(write_model(Path(scratch)))
        results: list[dict[str, Any]] = []
        for round_index in range(args.rounds):
            for size in sizes if round_index % 2 == 0 else sizes[::-1]:
                child = [sys.executable, "-m", "microbench.tensor_parallel", *(argv or sys.argv[1:])]
                child += ["--model", model, "--one", size]
                done = subprocess.run(child, check=True, capture_output=True, text=True, env=dict(os.environ))
                result = json.loads(done.stdout.strip().splitlines()[-1])
                result["round"] = round_index
                results.append(result)
                print(json.dumps(result), flush=True)
    summary = []
    for size in sizes:
        runs = [r for r in results if r["size"] == size]
        medians = {key: statistics.median(r[key] for r in runs) for key in runs[0] if key not in ("round", "size")}
        summary.append({"size": size, **medians})
    print(f"{'TPxPP':>5} {'ms/token (1 stream)':>20} {'collectives':>12} {'offline tok/s':>14} {'collectives':>12}")
    for row in summary:
        shape = f"{row['tensor_parallel_size']:.0f}x{row['pipeline_parallel_size']:.0f}"
        print(
            f"{shape:>5} {row['single_stream_ms_per_token']:>20.1f} "
            f"{100 * row['single_stream_collective_share']:>11.1f}% {row['offline_output_tokens_per_s']:>14.1f} "
            f"{100 * row['offline_collective_share']:>11.1f}%"
        )
    if args.output_json is not None:
        args.output_json.write_text(json.dumps({"runs": results, "median": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
