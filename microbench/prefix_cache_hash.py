"""What the prefix-cache hash costs: xxh3 beside sha256, plain and keyed (HMAC-SHA256), on
the CPU at hand (``--prefix-cache-hash``, engine/kv_cache_utils.py)::

    python -m microbench.prefix_cache_hash --output-json prefix_cache_hash.json

Three figures per hash:

- ``block_us``: one chained block of ``--block-size`` tokens hashed (median over
  ``--repeats`` loops of ``--calls`` calls);
- ``lookup_us`` per prompt length: ``KVCacheManager.get_computed_blocks`` for a new request
  whose every full block is cached: hash each block, find it, check its tokens. Each new
  request pays it once at admission; the gateway hashes each prompt the same way for kv
  routing (median over ``--repeats`` lookups, each of a fresh request);
- ``step_ms`` and ``step_hash_us``: the engine's decode steps at ``--batch`` running
  requests (the embedded model unless ``--model``), mean wall time per step, and the part of
  it spent hashing blocks (timed by a wrapper around the hash, so it includes the wrapper's
  own cost). One engine serves every hash, its hash swapped between rounds, in an order that
  rotates by round, so that a second engine's different speed (docs/benchmarks.md,
  "Speculative decoding") is not measured as the hash's; the median over ``--rounds``.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.kv_cache_manager import KVCacheManager
from engine.kv_cache_utils import XXH3, BlockHash, BlockHasher
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine_args.flags import add_dtype_argument

logger = logging.getLogger(__name__)

HASHERS = {
    "xxh3": XXH3,
    "sha256": BlockHasher("sha256"),
    "hmac-sha256": BlockHasher("sha256", bytes(range(32))),  # any 32-byte key costs the same
}
_TOKEN_ID_MARGIN = 100  # random ids keep clear of the special tokens at both ends of the vocabulary


@dataclass(slots=True)
class HashResult:
    name: str
    block_us: float = 0.0
    lookup_us: dict[int, float] = field(default_factory=dict)  # by prompt tokens
    step_ms: float = 0.0
    step_hash_us: float = 0.0


class TimedHasher:
    """Wraps a hasher and adds up the time its calls take."""

    def __init__(self, hasher: BlockHasher) -> None:
        self.hasher = hasher
        self.seconds = 0.0

    def __call__(self, parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes = b"") -> BlockHash:
        started = time.perf_counter()
        try:
            return self.hasher(parent_hash, token_ids, extra_keys)
        finally:
            self.seconds += time.perf_counter() - started


def median_us(function: Callable[[], object], calls: int, repeats: int) -> float:
    """Median microseconds per call over ``repeats`` loops of ``calls`` calls, after a warm-up loop."""
    for _ in range(calls):
        function()
    loops = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            function()
        loops.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(loops)


def block_us(hasher: BlockHasher, block_size: int, calls: int, repeats: int) -> float:
    tokens = list(range(1000, 1000 + block_size))
    parent = hasher(None, tokens)
    return median_us(lambda: hasher(parent, tokens), calls, repeats)


def lookup_us(hasher: BlockHasher, num_tokens: int, block_size: int, repeats: int) -> float:
    """One cached prompt of ``num_tokens``; then ``repeats`` fresh requests for it, each looked up once."""
    num_blocks = num_tokens // block_size + 2
    manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True, block_hasher=hasher)
    prompt = [random.Random(num_tokens).randrange(1000, 40000) for _ in range(num_tokens)]

    def request(request_id: str) -> Request:
        return Request(request_id, prompt, SamplingParams(max_tokens=1), max_tokens=1, eos_token_ids=frozenset())

    first = request("first")
    manager.allocate_slots(first, num_tokens)  # registers every full block in the prefix cache
    manager.free(first)
    timings = []
    for index in range(repeats + 1):  # the first one warms up
        fresh = request(f"r{index}")
        started = time.perf_counter()
        hits, num_hit_tokens = manager.get_computed_blocks(fresh)
        timings.append((time.perf_counter() - started) * 1e6)
        if num_hit_tokens != (num_tokens - 1) // block_size * block_size:
            raise RuntimeError(f"{num_hit_tokens} of {num_tokens} tokens hit: the lookup missed its own prompt (bug)")
    return statistics.median(timings[1:])


def decode_steps(
    core: EngineCore, hasher: BlockHasher, batch: int, prompt_len: int, num_steps: int, seed: int
) -> tuple[float, float]:
    """``batch`` requests prefilled, then ``num_steps`` decode steps: (mean step ms, hashing µs per step)."""
    timed = TimedHasher(hasher)
    core.kv_cache_manager.block_hasher = timed  # type: ignore[assignment]  # duck-typed: a hasher that times itself
    rng = random.Random(seed)
    vocab = range(_TOKEN_ID_MARGIN, core.vocab_size - _TOKEN_ID_MARGIN)
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 1, ignore_eos=True)
    for index in range(batch):
        core.add_request([rng.choice(vocab) for _ in range(prompt_len)], params, request_id=f"s{seed}-{index}")
    while core.scheduler.waiting or any(r.num_output_tokens == 0 for r in core.scheduler.running):
        core.step()  # the prefills, untimed
    timed.seconds = 0.0
    elapsed, steps = 0.0, 0
    while core.has_unfinished_requests():
        started = time.perf_counter()
        core.step()
        elapsed += time.perf_counter() - started
        steps += 1
    core.kv_cache_manager.block_hasher = hasher
    return elapsed / steps * 1e3, timed.seconds / steps * 1e6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m microbench.prefix_cache_hash", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="local Hugging Face folder (default: embedded SmolLM2-135M)")
    add_dtype_argument(parser, default="float32")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--calls", type=int, default=20000, help="block hashes per timed loop")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--prompt-tokens", default="1024,8192", help="comma-separated prompt lengths to look up")
    parser.add_argument("--batch", type=int, default=32, help="requests decoding at once")
    parser.add_argument("--decode-steps", type=int, default=64, help="timed decode steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    parser.add_argument("--output-json", type=Path, default=None)
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> list[HashResult]:
    results = {name: HashResult(name) for name in HASHERS}
    lengths = [int(length) for length in args.prompt_tokens.split(",")]
    for name, hasher in HASHERS.items():
        results[name].block_us = block_us(hasher, args.block_size, args.calls, args.repeats)
        for length in lengths:
            results[name].lookup_us[length] = lookup_us(hasher, length, args.block_size, args.repeats)
    if args.decode_steps:
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        config = EngineConfig(
            model=args.model, dtype=args.dtype, block_size=args.block_size, max_num_seqs=args.batch, seed=0
        )
        core = EngineCore(config)
        decode_steps(core, XXH3, args.batch, 64, 8, seed=-1)  # warm-up, untimed
        names = list(HASHERS)
        steps: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
        for round_index in range(args.rounds):
            order = names[round_index % len(names) :] + names[: round_index % len(names)]
            for name in order:
                steps[name].append(
                    decode_steps(core, HASHERS[name], args.batch, 64, args.decode_steps, seed=round_index)
                )
        core.close()
        for name, timings in steps.items():
            results[name].step_ms = statistics.median(ms for ms, _ in timings)
            results[name].step_hash_us = statistics.median(us for _, us in timings)
    return list(results.values())


def report(results: list[HashResult], args: argparse.Namespace) -> str:
    lengths = sorted(results[0].lookup_us)
    header = (
        f"| hash | block of {args.block_size} (µs) | "
        + " | ".join(f"lookup, {n} tokens (µs)" for n in lengths)
        + f" | decode step, batch {args.batch} (ms) | hashing in it (µs/step) |"
    )
    lines = [header, "|" + "---|" * (4 + len(lengths))]
    for result in results:
        lookups = " | ".join(f"{result.lookup_us[n]:,.0f}" for n in lengths)
        lines.append(
            f"| {result.name} | {result.block_us:.2f} | {lookups} | {result.step_ms:.2f} | {result.step_hash_us:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    args = parse_args(argv)
    results = run(args)
    print(report(results, args))
    if args.output_json is not None:
        args.output_json.write_text(json.dumps([asdict(result) for result in results], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
