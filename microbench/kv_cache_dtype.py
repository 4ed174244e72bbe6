"""What --kv-cache-dtype buys and costs: the bytes and time of a prefill -> decode hand-off per
KV dtype, and how often greedy decoding over the quantized KV picks the token float32 KV picks.

**Pulls** (``--part pull``): for each ``COMPUTE:KV`` pair of ``--configs`` a real ``splitserve
prefill`` and ``splitserve decode`` process on loopback over UCX (``UCX_TLS=tcp,sm,self``), the
embedded SmolLM2-135M-Instruct unless ``--model``. Each repeat prefills a fresh random
``--input-len``-token prompt (no prefix-cache hit on D) and decodes two tokens from its handle;
the figures are D's own account of the pull (``microbench.pd_pulls``), median and best of
``--repeats`` after one untimed warm-up. The KV's bytes do not depend on the compute
dtype but for ``auto``, so the quantized rows run with float32 compute (faster to prefill on CPUs
without bf16 dot products) and bf16 KV with bf16 compute.

**Agreement** (``--part agreement``): SmolLM2 in float32, once per KV dtype, in this process.
The float32-KV engine writes a greedy continuation of ``--gen-tokens`` tokens for each of a few
chat prompts; then every engine is teacher-forced through the same tokens (the prompts in one
prefill, then one batched decode step per position, each engine's own KV), and at each position
the bench counts whether its argmax is the float32-KV engine's token (top-1 agreement) and the
KL divergence of its next-token distribution from float32-KV's. ``auto`` is checked against
itself along the way: its agreement is the noise floor (the teacher-forced steps take the
modules' path, the continuation came from batched native steps). Free-running greedy
generation is compared too (tokens until the first divergence).

**Attention** (``--part attention``): one native paged decode attention call over each KV dtype's
cache, SmolLM2's heads, a few batch x context sizes: what reading 8-bit rows and widening them
in registers costs or saves against float32 and bf16 rows::

    python -m microbench.kv_cache_dtype --output-json kv_cache_dtype.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine.kv_cache_dtype import KV_CACHE_DTYPES, KVCacheDType
from microbench.pd_pulls import measure_pulls

# The attention part's (compute dtype, KV dtype) pairs: the model's own rows, then 8-bit ones.
ATTENTION_CONFIGS: tuple[tuple[torch.dtype, KVCacheDType], ...] = (
    (torch.float32, "auto"),
    (torch.bfloat16, "auto"),
    (torch.float32, "int8"),
    (torch.float32, "fp8_e4m3"),
)
DEFAULT_CONFIGS = "bfloat16:auto,float32:auto,float32:int8,float32:fp8_e4m3"
PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, step by step.",
    "What are the main differences between Python lists and tuples?",
    "Give me a recipe for a simple tomato soup.",
    "Summarize the causes of the French Revolution in a few paragraphs.",
    "Describe the water cycle to a ten-year-old.",
    "List some tips for staying focused while studying.",
    "Why is the sky blue? Answer in detail.",
]


# --------------------------------------------------------------------------------------- pulls


def measure_pull(args: argparse.Namespace, dtype: str, kv_cache_dtype: str, log_dir: Path) -> dict[str, Any]:
    flags = ["--dtype", dtype, "--kv-cache-dtype", kv_cache_dtype, "--kv-cache-memory", str(1 << 28),
             *(["--model", args.model] if args.model else [])]  # fmt: skip
    prefill_flags = [*flags, "--lease-seconds", "600"]
    figures = measure_pulls(prefill_flags, flags, args.input_len, args.repeats, args.seed, log_dir)
    return {
        "compute_dtype": dtype,
        "kv_cache_dtype": kv_cache_dtype,
        "fingerprint_dtype": figures.fingerprint_dtype,
        "num_blocks": figures.num_blocks,
        "num_bytes": figures.num_bytes,
        "pull_ms_median": figures.pull_ms_median,
        "pull_ms_min": figures.pull_ms_min,
    }


def run_pulls(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kv-dtype-pulls-") as scratch:
        for config in args.configs.split(","):
            dtype, kv_cache_dtype = config.split(":")
            rows.append(measure_pull(args, dtype, kv_cache_dtype, Path(scratch)))
            print(json.dumps(rows[-1]), flush=True)
    base = next((row for row in rows if row["fingerprint_dtype"] == "bfloat16"), rows[0])
    print(f"\n| KV dtype (fingerprint) | blocks | MiB pulled | vs {base['fingerprint_dtype']} | pull ms median | min |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['fingerprint_dtype']} | {row['num_blocks']} | {row['num_bytes'] / 2**20:.2f} | "
            f"{row['num_bytes'] / base['num_bytes']:.3f}x bytes, {row['pull_ms_median'] / base['pull_ms_median']:.2f}x "
            f"time | {row['pull_ms_median']:.1f} | {row['pull_ms_min']:.1f} |"
        )
    return rows


# ----------------------------------------------------------------------------------- agreement


def chat_prompts(llm: Any) -> list[list[int]]:
    texts = [
        llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in PROMPTS
    ]
    return [llm.tokenizer.encode(text, add_special_tokens=False) for text in texts]


def run_agreement(args: argparse.Namespace) -> dict[str, Any]:
    from engine import LLM, SamplingParams
    from engine.teacher_forcing import teacher_forced_logits

    engines = {
        kv: LLM(
            model=args.model, dtype="float32", kv_cache_dtype=kv, kv_cache_memory=1 << 27, enable_prefix_caching=False
        )
        for kv in KV_CACHE_DTYPES
    }
    prompts = chat_prompts(engines["auto"])
    greedy = SamplingParams(temperature=0.0, max_tokens=args.gen_tokens, ignore_eos=True)
    generated = {kv: [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] for kv, llm in engines.items()}
    reference = generated["auto"]
    results: dict[str, Any] = {"num_prompts": len(prompts), "gen_tokens": args.gen_tokens, "kv_dtypes": {}}
    streams = {kv: teacher_forced_logits(llm.engine, prompts, reference) for kv, llm in engines.items()}
    agree = {kv: 0 for kv in KV_CACHE_DTYPES}
    kl_sum = {kv: 0.0 for kv in KV_CACHE_DTYPES}
    kl_max = {kv: 0.0 for kv in KV_CACHE_DTYPES}
    expected = torch.tensor(reference)  # [num_prompts, gen_tokens]
    for position in range(args.gen_tokens):
        logits = {kv: next(stream).float() for kv, stream in streams.items()}
        reference_logprobs = torch.log_softmax(logits["auto"], dim=-1)
        for kv in KV_CACHE_DTYPES:
            agree[kv] += int((logits[kv].argmax(dim=-1) == expected[:, position]).sum())
            logprobs = torch.log_softmax(logits[kv], dim=-1)
            kl = (reference_logprobs.exp() * (reference_logprobs - logprobs)).sum(dim=-1)
            kl_sum[kv] += float(kl.sum())
            kl_max[kv] = max(kl_max[kv], float(kl.max()))
    for stream in streams.values():
        stream.close()  # gives the borrowed blocks back
    num_positions = len(prompts) * args.gen_tokens
    for kv in KV_CACHE_DTYPES:
        matching = [_common_prefix(a, b) for a, b in zip(generated[kv], reference, strict=True)]
        results["kv_dtypes"][kv] = {
            "fingerprint_dtype": engines[kv].engine.runner.kv_format.fingerprint_dtype,
            "bytes_per_block": engines[kv].engine.runner.bytes_per_block,
            "top1_agreement": agree[kv] / num_positions,
            "mean_kl": kl_sum[kv] / num_positions,
            "max_kl": kl_max[kv],
            "free_running_identical": sum(m == args.gen_tokens for m in matching),
            "free_running_tokens_until_divergence_median": statistics.median(matching),
        }
    print(f"\nSmolLM2 float32 compute, {len(prompts)} chat prompts x {args.gen_tokens} teacher-forced positions")
    print("| KV dtype | bytes/block | top-1 agreement vs float32 KV | mean KL | max KL | free-running: identical, "
          "median tokens to first divergence |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for row in results["kv_dtypes"].values():
        print(
            f"| {row['fingerprint_dtype']} | {row['bytes_per_block']} | {100 * row['top1_agreement']:.2f}% | "
            f"{row['mean_kl']:.2e} | {row['max_kl']:.2e} | {row['free_running_identical']}/{len(prompts)}, "
            f"{row['free_running_tokens_until_divergence_median']} |"
        )
    return results


def run_attention(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One native paged-decode-attention call (one layer) of SmolLM2's heads (9 query heads, 3 KV
    heads of 64) over each KV dtype's cache, float32 queries: the median of ``--attention-repeats``
    calls after a warm-up, for a few batch x context sizes, with the bytes of K and V it reads."""
    from engine import cpu_kernels
    from engine.kv_cache_dtype import VALUE_DTYPES, KVCacheFormat, quantize
    from engine.kv_cache_layout import layer_view

    kernels = cpu_kernels.load()
    if kernels is None:
        raise RuntimeError("no native CPU kernels here (no C compiler?)")
    num_heads, num_kv_heads, head_dim, block_size, num_layers = 9, 3, 64, 16, 30
    rows: list[dict[str, Any]] = []
    for num_seqs, context in ((1, 512), (1, 2048), (8, 2048)):
        num_blocks = num_seqs * context // block_size
        generator = torch.Generator().manual_seed(num_seqs + context)
        values = torch.randn((2, num_blocks, block_size, num_kv_heads, head_dim), generator=generator)
        query = torch.randn((num_seqs, num_heads, head_dim), generator=generator)
        block_tables = torch.randperm(num_blocks, generator=generator).view(num_seqs, -1).to(torch.int32)
        seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)
        for dtype, kv_cache_dtype in ATTENTION_CONFIGS:
            kv_format = KVCacheFormat(kv_cache_dtype, dtype, head_dim)
            # A block-major cache of a model's depth, so that blocks lie a whole cross-layer block apart.
            shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, kv_format.row_elements)
            cache = torch.zeros(shape, dtype=kv_format.cache_dtype)
            stored = quantize(values, VALUE_DTYPES[kv_cache_dtype]) if kv_format.quantized else values.to(cache.dtype)
            layer = layer_view(cache, num_layers // 2)
            layer.copy_(stored)
            layer = layer_view(cache, num_layers // 2, kv_cache_dtype)
            q = query.to(kv_format.model_dtype)
            kernels.paged_decode_attention(q, layer, block_tables, seq_lens, 0.125)
            timings = []
            for _ in range(args.attention_repeats):
                started = time.perf_counter()
                kernels.paged_decode_attention(q, layer, block_tables, seq_lens, 0.125)
                timings.append(time.perf_counter() - started)
            rows.append(
                {
                    "num_seqs": num_seqs,
                    "context": context,
                    "kv": kv_format.fingerprint_dtype,
                    "kv_bytes_read": num_seqs * context * 2 * num_kv_heads * kv_format.bytes_per_row,
                    "us_median": 1e6 * statistics.median(timings),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    print(f"\nnative decode attention, one layer of SmolLM2's heads ({kernels.isa} build), median of calls")
    print("| sequences x context | KV dtype | K+V bytes read | us per call |\n|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['num_seqs']} x {row['context']} | {row['kv']} | {row['kv_bytes_read'] / 2**20:.2f} MiB | "
            f"{row['us_median']:.0f} |"
        )
    return rows


def _common_prefix(a: list[int], b: list[int]) -> int:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m microbench.kv_cache_dtype", description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["pull", "agreement", "attention", "all"], default="all")
    parser.add_argument("--model", default=None, help="local checkpoint (default: the embedded SmolLM2)")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="pulls: comma-separated COMPUTE_DTYPE:KV_DTYPE")
    parser.add_argument("--input-len", type=int, default=2048, help="pulls: prompt tokens")
    parser.add_argument("--repeats", type=int, default=5, help="pulls: timed pulls per config, after one warm-up")
    parser.add_argument("--gen-tokens", type=int, default=128, help="agreement: continuation tokens per prompt")
    parser.add_argument("--attention-repeats", type=int, default=50, help="attention: timed calls per case")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {}
    if args.part in ("pull", "all"):
        report["pulls"] = run_pulls(args)
    if args.part in ("agreement", "all"):
        report["agreement"] = run_agreement(args)
    if args.part in ("attention", "all"):
        report["attention"] = run_attention(args)
    if args.output_json is not None:
        args.output_json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
