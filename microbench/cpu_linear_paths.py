"""The linear paths of engine/models/cpu_linear.py against each other, on the CPU at hand.

Loads the embedded SmolLM2 once per variant and measures, round-robin so that every
variant sees the same load on a shared machine: the time of one decode step of N
sequences for each N of ``--decode-rows`` (``LLM.generate`` of N fresh prompts, 33 tokens
minus 1, over 32) and the output tokens/s of 32 sequences (64 prompt tokens, 16 out each)::

    python -m microbench.cpu_linear_paths --dtype float32 --threads 2 --decode-rows 1,4,16,32 --rounds 5

Variants: ``torch`` (``F.linear``: MKL in float32, oneDNN reordering the weight on every
call in bf16), ``onednn-packed`` without and with the panel kernel for its decode
steps, the latter also ``per module`` (its decode steps one kernel call at a time
rather than in one native call, engine/models/native_decode.py), and ``bf16-weights``
(bf16 only). Run it under ``ONEDNN_MAX_CPU_ISA=AVX2 SPLITSERVE_CPU_ISA=avx2`` to see an
AVX2-only CPU's choices. ``--prefetch-bytes 0,2048`` loads each variant once per distance
the panel kernel reads ahead (``SPLITSERVE_PANEL_PREFETCH_BYTES``, each its own build of the
kernels), measured round-robin with the rest.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from unittest import mock

import torch

import engine.models.loader as loader
from engine import LLM, SamplingParams, cpu_kernels
from engine.models.cpu_linear import LinearPath, PackedLinear, linear_path
from engine_args.flags import add_dtype_argument

logger = logging.getLogger(__name__)

# name -> (path, panel kernel beside packed weights, decode steps in one native call where they can be)
_VARIANTS: dict[str, tuple[LinearPath, bool, bool]] = {
    "torch": ("torch", False, True),
    "onednn-packed": ("onednn-packed", False, True),
    "onednn-packed + panel kernel": ("onednn-packed", True, True),
    "onednn-packed + panel kernel per module": ("onednn-packed", True, False),
    "bf16-weights": ("bf16-weights", True, True),
}


def load_variant(dtype: str, path: LinearPath, panel_kernel: bool, native_step: bool) -> LLM:
    """The engine with every linear layer on ``path``, whatever this CPU would pick."""
    chosen = loader.linear_path
    loader.linear_path = lambda device, dtype_, features=None: path
    try:
        llm = LLM(model=None, load_format="safetensors", dtype=dtype, kv_cache_memory=1 << 27)  # the float layers
    finally:
        loader.linear_path = chosen
    if not panel_kernel:
        for module in llm.engine.runner.model.modules():
            if isinstance(module, PackedLinear):
                module.panels = None
    if not (panel_kernel and native_step):
        # The runner built its native step over the panels: none without them, or when not asked for.
        llm.engine.runner.native_decode = None
    return llm


def load_named_variant(dtype: str, name: str) -> LLM:
    """A variant of _VARIANTS, or one suffixed ``@ prefetch N``: its kernels built to read N bytes ahead."""
    variant, _, distance = name.partition(" @ prefetch ")
    if not distance:
        return load_variant(dtype, *_VARIANTS[variant])
    with mock.patch.dict(os.environ, {"SPLITSERVE_PANEL_PREFETCH_BYTES": distance}):
        cpu_kernels.clear_cache()  # the next load builds (or finds) the library of that distance
        try:
            return load_variant(dtype, *_VARIANTS[variant])
        finally:
            cpu_kernels.clear_cache()


def decode_step_ms(llm: LLM, num_rows: int, seed: int) -> float:
    """One decode step of ``num_rows`` sequences: 33 tokens minus the first, over 32."""

    def generate(max_tokens: int, first_token: int) -> float:
        # A new first token per prompt and run: no prefix-cache hits.
        prompts = [[first_token + i] + list(range(1001, 1064)) for i in range(num_rows)]
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        return time.perf_counter() - start

    base = 10_000 + seed * 2 * num_rows
    return (generate(33, base) - generate(1, base + num_rows)) / 32 * 1e3


def batch_tokens_per_s(llm: LLM, seed: int) -> float:
    prompts = [[5000 + seed * 64 + i] + list(range(2000, 2063)) for i in range(32)]
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    return 32 * 16 / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m microbench.cpu_linear_paths", description=__doc__.splitlines()[0])
    add_dtype_argument(parser, default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--decode-rows", default="1", help="comma-separated decode batch sizes to time a step of")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--variants", default=None, help=f"comma-separated, of: {', '.join(_VARIANTS)}")
    parser.add_argument(
        "--prefetch-bytes", default=None, help="comma-separated panel prefetch distances (default: the build's)"
    )
    args = parser.parse_args(argv)
    if args.dtype not in ("float32", "bfloat16"):
        parser.error(f"--dtype {args.dtype}: the CPU linear paths compared here are float32's and bfloat16's")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    names = (
        args.variants.split(",")
        if args.variants
        else [name for name, (path, _, _) in _VARIANTS.items() if path != "bf16-weights" or dtype == torch.bfloat16]
    )
    unknown = set(names) - set(_VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}")
    sys.stdout.write(f"this CPU's choice for {args.dtype}: {linear_path(torch.device('cpu'), dtype)}\n")
    if args.prefetch_bytes:
        names = [f"{name} @ prefetch {distance}" for name in names for distance in args.prefetch_bytes.split(",")]
    engines = {name: load_named_variant(args.dtype, name) for name in names}
    measures: dict[str, Callable[[LLM, int], float]] = {
        f"{rows} rows": functools.partial(decode_step_ms, num_rows=int(rows)) for rows in args.decode_rows.split(",")
    }
    measures["batch tok/s"] = batch_tokens_per_s
    results: dict[tuple[str, str], list[float]] = {(name, measure): [] for name in names for measure in measures}
    for seed in range(args.rounds):
        for name, llm in engines.items():
            for measure, function in measures.items():
                results[name, measure].append(function(llm, seed=seed))
    for name in names:
        steps = ", ".join(
            f"{measure} {statistics.median(results[name, measure]):.1f}"
            for measure in measures
            if measure.endswith("rows")
        )
        tps = results[name, "batch tok/s"]
        sys.stdout.write(
            f"{args.dtype} threads={args.threads} {name:<46} decode step ms: {steps}; "
            f"batch of 32 {statistics.median(tps):6.1f} tok/s (max {max(tps):.1f})\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
