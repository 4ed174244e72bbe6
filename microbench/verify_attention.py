"""Paged decode attention over one request's verify rows, by build of the native kernels,
interleaved call by call in one process: the ms of a decode step's attention (30 layers of
SmolLM2-135M's heads: 9 query, 3 KV, 64 wide, blocks of 16 tokens, float32) for 1 to 5 rows of one
request (each a token longer than the one before over the same blocks), at several contexts.

The cache is the engine's block-major one (a block spans every layer), so a layer's KV is not in
cache when its turn comes. It measured a kernel that folded a request's verify rows into one walk
of the cache, and why it was not kept (docs/benchmarks.md, "A draft pass in the target's form").
The builds are given as shared libraries: this checkout's, and any other (a baseline
built by importing ``engine.cpu_kernels`` in a worktree at an earlier commit, which prints nothing
but leaves it in ``~/.cache/splitserve/kernels``)::

    python -m microbench.verify_attention --library BASELINE.so --library this

Each figure is the median over ``--repeats`` rounds, the builds' order reversed every other round;
the first library is the one the others are divided by.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from engine import cpu_kernels
from engine.cpu_features import cpu_features
from engine.cpu_kernels import CPUKernels
from engine.kv_cache_layout import allocate_kv_cache, layer_views

NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, NUM_HEADS = 30, 16, 3, 64, 9


def layer_caches(num_blocks: int, generator: torch.Generator) -> list[torch.Tensor]:
    """The engine's own block-major layout, random K and V."""
    cache = allocate_kv_cache(
        num_blocks, NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu")
    )
    views = layer_views(cache)
    for view in views:
        view.copy_(torch.randn(view.shape, generator=generator))
    return views


def time_rows(libraries: dict[str, CPUKernels], context: int, rows: int, repeats: int) -> dict[str, float]:
    """Median ms per build of the 30 layers' attention for ``rows`` verify rows at ``context``."""
    generator = torch.Generator().manual_seed(context + rows)
    num_blocks = -(-(context + rows) // BLOCK_SIZE)
    caches = layer_caches(num_blocks, generator)
    block_tables = torch.arange(num_blocks, dtype=torch.int32)[None].repeat(rows, 1)
    seq_lens = torch.arange(context, context + rows, dtype=torch.int32)
    query = torch.randn(rows, NUM_HEADS, HEAD_DIM, generator=generator)
    order = list(libraries.items())
    samples: dict[str, list[float]] = {name: [] for name in libraries}
    for repeat in range(repeats + 2):  # two warm-up rounds
        for name, kernels in order if repeat % 2 else order[::-1]:
            started = time.perf_counter()
            for cache in caches:
                kernels.paged_decode_attention(query, cache, block_tables, seq_lens, HEAD_DIM**-0.5)
            if repeat >= 2:
                samples[name].append((time.perf_counter() - started) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def load_libraries(paths: list[str]) -> dict[str, CPUKernels]:
    own = cpu_kernels.load()
    if own is None:
        raise SystemExit("no native kernels here (no C compiler)")
    libraries = {}
    for path in paths:
        libraries[path] = own if path == "this" else CPUKernels(ctypes.CDLL(path), own.isa)
    return libraries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m microbench.verify_attention", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--library", action="append", default=None, help="a build's .so, or 'this' (repeatable; default: this)"
    )
    parser.add_argument("--contexts", default="200,700,1500")
    parser.add_argument("--rows", default="1,2,3,5")
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args(argv)
    libraries = load_libraries(args.library or ["this"])
    print(f"CPU: {cpu_features().describe()}; torch threads {torch.get_num_threads()}")
    names = list(libraries)
    for context in map(int, args.contexts.split(",")):
        for rows in map(int, args.rows.split(",")):
            ms = time_rows(libraries, context, rows, args.repeats)
            cells = "  ".join(
                f"{name.rsplit('/', 1)[-1]} {ms[name]:.3f} ms ({ms[name] / ms[names[0]]:.2f}x)" for name in names
            )
            print(f"context {context:5d}, {rows} rows: {cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
