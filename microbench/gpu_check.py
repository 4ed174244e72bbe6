"""One script for a GPU session: checks the GPU path and measures it, in one run.

Machines with a GPU are lent to this project rarely and briefly, so everything worth
knowing about the GPU path comes from one prepared command (``bench/gpu_check.py`` runs this
module under that name, which the team knows it by)::

    python -m bench.gpu_check --output-json gpu_check.json

1. **Kernels**: the Triton attention kernels (KV store, paged attention over decodes,
   prefills behind a cached prefix and mixed batches) against the torch reference, on
   one layer of a block-major cache whose other layers hold NaN, for SmolLM2's and a
   Llama-8B-like head layout in bf16, fp16 and fp32, and in bf16 over int8 and fp8 e4m3 KV
   caches (``--kv-cache-dtype``: the quantized store's bytes must equal the torch
   reference's); the largest error per case, and the time of one decode-attention call of
   each backend.
2. **Parity**: greedy tokens of the engine on the device against transformers on the
   same device, float32, the embedded SmolLM2.
3. **Throughput**: ``microbench.throughput`` on the device (engine against transformers).

On a machine without a GPU, ``--device cpu`` runs the same steps small (kernels under
the Triton interpreter), which is how the script itself is tested.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.kv_cache_dtype import KVCacheDType
from engine.kv_cache_utils import cdiv

logger = logging.getLogger(__name__)

# (num_heads, num_kv_heads, head_dim): SmolLM2-135M's, and Llama-3-8B's.
HEAD_LAYOUTS = [(9, 3, 64), (32, 8, 128)]
BLOCK_SIZE = 16
# Relative to the reference's own rounding in the same dtype (both run in `dtype`).
TOLERANCES = {torch.float32: 1e-4, torch.bfloat16: 4e-2, torch.float16: 4e-3}
# KV cache dtypes checked beside the compute dtype's own (engine/kv_cache_dtype.py), in bf16.
QUANTIZED_KV_CACHE_DTYPES: tuple[KVCacheDType, ...] = ("int8", "fp8_e4m3")


@dataclass(frozen=True, slots=True)
class KernelCase:
    dtype: str
    heads: str  # "num_heads/num_kv_heads x head_dim"
    batch: str
    max_abs_error: float
    tolerance: float
    store_exact: bool  # the kernel's KV store wrote exactly what the reference's did
    triton_ms: float
    torch_ms: float
    kv_cache_dtype: str = "auto"

    @property
    def ok(self) -> bool:
        return self.store_exact and self.max_abs_error <= self.tolerance


def batch_shapes(quick: bool) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (query lens, context lens), decodes first as the scheduler lays them out."""
    if quick:
        return {"decodes": ([1, 1, 1], [17, 40, 5]), "mixed": ([1, 1, 9, 7], [33, 16, 9, 25])}
    rng = random.Random(0)
    decodes = [rng.randint(100, 2000) for _ in range(64)]
    return {
        "decodes": ([1] * 64, decodes),
        "prefills behind a prefix": ([512, 512], [768, 1024]),
        "mixed": ([1] * 32 + [1024, 256], decodes[:32] + [1024, 1280]),
    }


def make_step(query_lens: list[int], seq_lens: list[int], device: torch.device, seed: int):
    """A step over sequences with shuffled blocks (never block 0, the padding id), and the cache size it needs."""
    from engine.attention.metadata import AttentionMetadata

    blocks_per_seq = [cdiv(n, BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    free = (torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    slots: list[int] = []
    for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        blocks = [free.pop() for _ in range(blocks_per_seq[i])]
        block_tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots += [
            blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE for pos in range(seq_len - query_len, seq_len)
        ]
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    metadata = AttentionMetadata(
        num_decodes=sum(1 for n in query_lens if n == 1),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
    )
    return metadata, num_blocks


def layer_of_block_major_cache(
    num_blocks: int,
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_dtype: KVCacheDType = "auto",
) -> torch.Tensor:
    """Random K/V as layer 1 of a 3-layer block-major cache whose other layers hold NaN (a
    quantized cache's other bytes are 0xFF: NaN as fp8 values and as float32 scales)."""
    from engine.kv_cache_dtype import VALUE_DTYPES, quantize
    from engine.kv_cache_layout import allocate_kv_cache, layer_view

    cache = allocate_kv_cache(num_blocks, 3, BLOCK_SIZE, heads, head_dim, dtype, device, kv_cache_dtype)
    if kv_cache_dtype == "auto":
        cache.fill_(float("nan"))
        layer = layer_view(cache, 1)
        layer.copy_(torch.randn(layer.shape, device=device).to(dtype))
        return layer
    cache.fill_(0xFF)
    values = torch.randn((2, num_blocks, BLOCK_SIZE, heads, head_dim), device=device)
    layer_view(cache, 1).copy_(quantize(values, VALUE_DTYPES[kv_cache_dtype]))
    return layer_view(cache, 1, kv_cache_dtype)


def same_cache(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal caches: bytes of a quantized one, values (NaN as NaN) of another."""
    if a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a.nan_to_num(), b.nan_to_num())


def timed_ms(run, device: torch.device, repeats: int) -> float:
    run()  # warm-up (compiles the kernel)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats * 1e3


def check_kernels(device: torch.device, quick: bool) -> list[KernelCase]:
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.attention.triton_backend import TritonAttentionBackend

    triton, reference = TritonAttentionBackend(), TorchAttentionBackend(use_cpu_kernels=False)
    cases = []
    dtypes = [torch.float32, torch.bfloat16] if quick else [torch.bfloat16, torch.float16, torch.float32]
    layouts = HEAD_LAYOUTS[:1] if quick else HEAD_LAYOUTS
    configs: list[tuple[torch.dtype, KVCacheDType]] = [(dtype, "auto") for dtype in dtypes]
    configs += [(torch.bfloat16, kv_cache_dtype) for kv_cache_dtype in QUANTIZED_KV_CACHE_DTYPES]
    for dtype, kv_cache_dtype in configs:
        for num_heads, num_kv_heads, head_dim in layouts:
            for name, (query_lens, seq_lens) in batch_shapes(quick).items():
                metadata, num_blocks = make_step(query_lens, seq_lens, device, seed=len(cases))
                cache = layer_of_block_major_cache(num_blocks, num_kv_heads, head_dim, dtype, device, kv_cache_dtype)
                num_tokens = metadata.num_tokens
                query = torch.randn(num_tokens, num_heads, head_dim, device=device).to(dtype)
                key = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
                value = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
                scale = 1 / math.sqrt(head_dim)
                reference_cache = (
                    cache.view(torch.uint8).clone().view(cache.dtype) if cache.element_size() == 1 else cache.clone()
                )
                out = triton.forward(query, key, value, cache, metadata, scale)
                expected = reference.forward(query, key, value, reference_cache, metadata, scale)
                error = (out.float() - expected.float()).abs().max().item()
                repeats = 3 if quick else 20
                cases.append(
                    KernelCase(
                        dtype=str(dtype).removeprefix("torch."),
                        heads=f"{num_heads}/{num_kv_heads} x {head_dim}",
                        batch=name,
                        max_abs_error=error if not math.isnan(error) else math.inf,
                        tolerance=TOLERANCES[dtype],
                        store_exact=same_cache(cache, reference_cache),
                        triton_ms=timed_ms(
                            functools.partial(triton.forward, query, key, value, cache, metadata, scale),
                            device,
                            repeats,
                        ),
                        torch_ms=timed_ms(
                            functools.partial(reference.forward, query, key, value, reference_cache, metadata, scale),
                            device,
                            repeats,
                        ),
                        kv_cache_dtype=kv_cache_dtype,
                    )
                )
                logger.info("%s", cases[-1])
    return cases


def check_parity(device: torch.device, quick: bool) -> dict[str, object]:
    """Greedy tokens of the engine and of transformers, float32, on ``device``."""
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams

    num_tokens = 8 if quick else 32
    rng = random.Random(0)
    # The float folder, which transformers loads too (in float32 on a CPU auto would serve the GGUF file).
    llm = LLM(model=None, load_format="safetensors", dtype="float32", device=device.type, kv_cache_memory=256 << 20)
    prompts = [[rng.randrange(3, 40000) for _ in range(n)] for n in ((5, 40) if quick else (5, 40, 100, 300, 700))]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True))
    model = AutoModelForCausalLM.from_pretrained(str(llm.engine.model_path), dtype=torch.float32).to(device)
    mismatches = []
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.inference_mode():
            expected = model.generate(
                torch.tensor([prompt], device=device),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                do_sample=False,
                max_new_tokens=num_tokens,
                min_new_tokens=num_tokens,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        if output.outputs[0].token_ids != expected:
            mismatches.append(
                {"prompt_len": len(prompt), "engine": output.outputs[0].token_ids, "transformers": expected}
            )
    return {"prompts": len(prompts), "tokens_each": num_tokens, "mismatches": mismatches}


def run_throughput(device: torch.device, quick: bool, output: Path) -> dict[str, object]:
    from microbench import throughput

    workload = (
        ["--num-prompts", "8", "--input-len", "32", "--output-len", "8"]
        if quick
        else ["--num-prompts", "256", "--input-len", "512", "--output-len", "128"]
    )
    throughput.main(["--device", device.type, *workload, "--warmup", "--output-json", str(output)])
    return json.loads(output.read_text())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (the point of the script) or cpu (a small dry run)")
    parser.add_argument("--output-json", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--skip-parity", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device = torch.device(args.device)
    quick = device.type == "cpu"
    if quick:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    elif not torch.cuda.is_available():
        print("no CUDA device here; run with --device cpu for a dry run", file=sys.stderr)
        return 2
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, object] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
    }
    kernels = check_kernels(device, quick)
    report["kernels"] = [{**asdict(case), "ok": case.ok} for case in kernels]
    if not args.skip_parity:
        report["parity"] = check_parity(device, quick)
    if not args.skip_throughput:
        report["throughput"] = run_throughput(
            device, quick, args.output_json.with_name(args.output_json.stem + "_throughput.json")
        )
    args.output_json.write_text(json.dumps(report, indent=2))

    print(f"\n{report['device']}, torch {report['torch']}")
    print(
        f"{'dtype':9} {'KV':9} {'heads':13} {'batch':26} {'max err':>9} {'tol':>7} {'store':>6} {'triton ms':>10} "
        f"{'torch ms':>9}"
    )
    for case in kernels:
        print(
            f"{case.dtype:9} {case.kv_cache_dtype:9} {case.heads:13} {case.batch:26} {case.max_abs_error:9.2e} "
            f"{case.tolerance:7.0e} {'exact' if case.store_exact else 'DIFF':>6} {case.triton_ms:10.3f} "
            f"{case.torch_ms:9.3f}"
        )
    failed = [case for case in kernels if not case.ok]
    parity = report.get("parity")
    if parity is not None:
        print(
            f"parity: {parity['prompts']} prompts x {parity['tokens_each']} greedy tokens, "
            f"{len(parity['mismatches'])} mismatching"
        )
    print(f"written: {args.output_json}")
    return 1 if failed or (parity is not None and parity["mismatches"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
