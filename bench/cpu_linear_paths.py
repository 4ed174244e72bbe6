"""The linear paths of engine/models/cpu_linear.py against each other, on the CPU at hand.

Loads the embedded SmolLM2 once per variant and measures, round-robin so that every
variant sees the same load on a shared machine: one sequence's inter-token time
(``LLM.generate`` of 33 tokens minus 1, over 32) and the output tokens/s of 32
sequences (64 prompt tokens, 16 out each)::

    python -m bench.cpu_linear_paths --dtype float32 --threads 1 --rounds 7

Variants: ``torch`` (``F.linear``: MKL in float32, oneDNN reordering the weight on every
call in bf16), ``onednn-packed`` without and with the few-row kernel for its few
rows, and ``bf16-weights`` (bf16 only). Run it under ``ONEDNN_MAX_CPU_ISA=AVX2
SPLITSERVE_CPU_ISA=avx2`` to see an AVX2-only CPU's choices.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections.abc import Callable

import torch

import engine.models.loader as loader
from engine import LLM, SamplingParams
from engine.models.cpu_linear import LinearPath, PackedLinear, linear_path

logger = logging.getLogger(__name__)

_VARIANTS: dict[str, tuple[LinearPath, bool]] = {  # name -> (path, few-row kernel beside packed weights)
    "torch": ("torch", False),
    "onednn-packed": ("onednn-packed", False),
    "onednn-packed + few-row kernel": ("onednn-packed", True),
    "bf16-weights": ("bf16-weights", True),
}


def load_variant(dtype: str, path: LinearPath, few_row_kernel: bool) -> LLM:
    """The engine with every linear layer on ``path``, whatever this CPU would pick."""
    chosen = loader.linear_path
    loader.linear_path = lambda device, dtype_, features=None: path
    try:
        llm = LLM(model=None, dtype=dtype, kv_cache_memory=1 << 27)
    finally:
        loader.linear_path = chosen
    if not few_row_kernel:
        for module in llm.engine.runner.model.modules():
            if isinstance(module, PackedLinear):
                module.kernels = None
    return llm


def single_stream_ms(llm: LLM, seed: int) -> float:
    prompt = [1000 + seed] + list(range(1001, 1064))  # a new first token per run: no prefix-cache hits
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    first = time.perf_counter() - start
    prompt = [3000 + seed] + prompt[1:]
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True))
    return (time.perf_counter() - start - first) / 32 * 1e3


def batch_tokens_per_s(llm: LLM, seed: int) -> float:
    prompts = [[5000 + seed * 64 + i] + list(range(2000, 2063)) for i in range(32)]
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    return 32 * 16 / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_linear_paths", description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--variants", default=None, help=f"comma-separated, of: {', '.join(_VARIANTS)}")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    names = (
        args.variants.split(",")
        if args.variants
        else [name for name, (path, _) in _VARIANTS.items() if path != "bf16-weights" or dtype == torch.bfloat16]
    )
    unknown = set(names) - set(_VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}")
    sys.stdout.write(f"this CPU's choice for {args.dtype}: {linear_path(torch.device('cpu'), dtype)}\n")
    engines = {name: load_variant(args.dtype, *_VARIANTS[name]) for name in names}
    measures: dict[str, Callable[[LLM, int], float]] = {"ms/token": single_stream_ms, "batch tok/s": batch_tokens_per_s}
    results = {(name, measure): [] for name in names for measure in measures}
    for seed in range(args.rounds):
        for name, llm in engines.items():
            for measure, function in measures.items():
                results[name, measure].append(function(llm, seed))
    for name in names:
        ms, tps = results[name, "ms/token"], results[name, "batch tok/s"]
        sys.stdout.write(
            f"{args.dtype} threads={args.threads} {name:<32} single stream {statistics.median(ms):6.2f} ms/token "
            f"(min {min(ms):.2f}), batch of 32 {statistics.median(tps):6.1f} tok/s (max {max(tps):.1f})\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
