"""Offline throughput: splitserve's ``LLM.generate`` against transformers' ``generate``
and, with ``--vllm-python``, vLLM's ``LLM.generate`` (run in that Python's environment).

Every engine gets the same N random-token prompts, decodes greedily and ignores EOS,
so every request yields exactly ``--output-len`` tokens. Model loading and the
optional warm-up are outside the timed region::

    python -m microbench.throughput --num-prompts 64 --input-len 128 --output-len 64
    python -m microbench.throughput --dtype float32 --warmup --vllm-python /tmp/vllm-venv/bin/python
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.engine_core import resolve_model_path
from engine.model_runner import resolve_device
from engine_args.flags import add_device_argument, add_dtype_argument

logger = logging.getLogger(__name__)

# Token ids are drawn from [margin, vocab_size - margin) to stay clear of the
# special tokens, which sit at both ends of the vocabulary in common tokenizers.
_TOKEN_ID_MARGIN = 100
_WARMUP_NUM_PROMPTS = 4
_WARMUP_OUTPUT_LEN = 4


@dataclass(slots=True)
class RunResult:
    engine: str
    elapsed_s: float
    num_requests: int
    num_input_tokens: int
    num_output_tokens: int

    def rates(self) -> dict[str, float]:
        return {
            "requests_per_s": self.num_requests / self.elapsed_s,
            "output_tokens_per_s": self.num_output_tokens / self.elapsed_s,
            "total_tokens_per_s": (self.num_input_tokens + self.num_output_tokens) / self.elapsed_s,
        }


def random_prompts(rng: random.Random, num_prompts: int, input_len: int, vocab_size: int) -> list[list[int]]:
    low, high = _TOKEN_ID_MARGIN, vocab_size - _TOKEN_ID_MARGIN
    if high <= low:
        raise ValueError(f"vocab_size {vocab_size} is too small to leave {_TOKEN_ID_MARGIN} ids at each end")
    return [[rng.randrange(low, high) for _ in range(input_len)] for _ in range(num_prompts)]


def make_result(
    engine: str, elapsed_s: float, prompts: list[list[int]], num_output_tokens: int, output_len: int
) -> RunResult:
    """Check that every request produced exactly ``output_len`` tokens, then package the figures."""
    expected = len(prompts) * output_len
    if num_output_tokens != expected:
        raise RuntimeError(
            f"{engine} produced {num_output_tokens} output tokens, expected {expected}; "
            "with ignore_eos and a fixed length this is a bug"
        )
    return RunResult(engine, elapsed_s, len(prompts), sum(len(p) for p in prompts), num_output_tokens)


def run_splitserve(
    args: argparse.Namespace, model_path: Path, prompts: list[list[int]], warmup_prompts: list[list[int]]
) -> tuple[float, int]:
    """Returns (elapsed seconds, output tokens) of the timed run."""
    overrides = {
        k: v
        for k in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory")
        if (v := getattr(args, k)) is not None
    }
    llm = LLM(model=str(model_path), dtype=args.dtype, device=args.device, **overrides)
    if warmup_prompts:
        llm.generate(warmup_prompts, SamplingParams(temperature=0.0, max_tokens=_WARMUP_OUTPUT_LEN, ignore_eos=True))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def left_pad(batch: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-align the prompts, as decoder-only generation needs; returns (input_ids, attention_mask)."""
    max_len = max(len(p) for p in batch)
    input_ids = torch.full((len(batch), max_len), pad_token_id, dtype=torch.long)  # [batch, max_len]
    attention_mask = torch.zeros((len(batch), max_len), dtype=torch.long)
    for row, prompt in enumerate(batch):
        input_ids[row, max_len - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, max_len - len(prompt) :] = 1
    return input_ids, attention_mask


def count_generated(new_tokens: torch.Tensor, eos_token_ids: list[int]) -> int:
    """Tokens per row up to and including the first EOS; later positions are padding."""
    # new_tokens: [batch, num_new]
    is_eos = torch.isin(new_tokens, torch.tensor(eos_token_ids, dtype=new_tokens.dtype))
    first_eos = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, new_tokens.shape[1])
    return int(first_eos.sum())


def run_transformers(
    args: argparse.Namespace, model_path: Path, prompts: list[list[int]], warmup_prompts: list[list[int]]
) -> tuple[float, int]:
    """Returns (elapsed seconds, output tokens) of the timed run."""
    device = resolve_device(args.device)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=args.dtype).to(device).eval()
    eos = model.generation_config.eos_token_id
    eos_token_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    pad_token_id = model.generation_config.pad_token_id
    if pad_token_id is None:
        pad_token_id = eos_token_ids[0] if eos_token_ids else 0
    batch_size = args.baseline_batch_size or len(prompts)

    @torch.inference_mode()
    def generate_all(batch_prompts: list[list[int]], output_len: int) -> int:
        num_generated = 0
        for start in range(0, len(batch_prompts), batch_size):
            input_ids, attention_mask = left_pad(batch_prompts[start : start + batch_size], pad_token_id)
            output_ids = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                do_sample=False,
                max_new_tokens=output_len,
                min_new_tokens=output_len,  # masks EOS until output_len: the ignore_eos equivalent
                pad_token_id=pad_token_id,
            )
            num_generated += count_generated(output_ids[:, input_ids.shape[1] :].cpu(), eos_token_ids)
        return num_generated

    if warmup_prompts:
        generate_all(warmup_prompts, _WARMUP_OUTPUT_LEN)
    start = time.perf_counter()
    num_output_tokens = generate_all(prompts, args.output_len)  # .cpu() above syncs a CUDA device
    elapsed = time.perf_counter() - start
    return elapsed, num_output_tokens


def run_vllm(
    args: argparse.Namespace, model_path: Path, prompts: list[list[int]], warmup_prompts: list[list[int]]
) -> tuple[float, int]:
    """Returns (elapsed seconds, output tokens) of vLLM's timed run, from its own process
    (``microbench/vllm_offline.py`` under ``--vllm-python``), bound to ``--vllm-cpus``."""
    request = {
        "model": str(model_path),
        "dtype": args.dtype,
        "max_model_len": args.input_len + args.output_len,
        "prompts": prompts,
        "warmup_prompts": warmup_prompts,
        "output_len": args.output_len,
        "warmup_output_len": _WARMUP_OUTPUT_LEN,
    }
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": args.vllm_cpus}
    with tempfile.TemporaryDirectory(prefix="vllm-offline-") as scratch:
        request_path, result_path = Path(scratch, "request.json"), Path(scratch, "result.json")
        request_path.write_text(json.dumps(request))
        script = Path(__file__).with_name("vllm_offline.py")
        subprocess.run([args.vllm_python, str(script), str(request_path), str(result_path)], env=env, check=True)
        result = json.loads(result_path.read_text())
    return float(result["elapsed_s"]), int(result["num_output_tokens"])


def format_table(results: list[RunResult]) -> str:
    header = f"{'engine':<14}{'elapsed s':>11}{'req/s':>10}{'output tok/s':>14}{'total tok/s':>13}"
    rows = []
    for r in results:
        rates = r.rates()
        rows.append(
            f"{r.engine:<14}{r.elapsed_s:>11.2f}{rates['requests_per_s']:>10.2f}"
            f"{rates['output_tokens_per_s']:>14.1f}{rates['total_tokens_per_s']:>13.1f}"
        )
    return "\n".join([header, *rows])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m microbench.throughput", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="local Hugging Face folder (default: embedded SmolLM2-135M-Instruct)"
    )
    add_dtype_argument(parser, default="bfloat16")
    add_device_argument(parser)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--output-len", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="engine default when omitted")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="engine default when omitted")
    parser.add_argument(
        "--kv-cache-memory", type=int, default=None, help="KV cache bytes on CPU; engine default when omitted"
    )
    parser.add_argument("--skip-baseline", action="store_true", help="do not run transformers")
    parser.add_argument(
        "--baseline-batch-size", type=int, default=None, help="transformers batch (default: all prompts)"
    )
    parser.add_argument("--warmup", action="store_true", help="run a small untimed warm-up through each engine first")
    parser.add_argument(
        "--vllm-python", default=None, help="also run vLLM, with the Python of an environment that has it"
    )
    parser.add_argument("--vllm-cpus", default="0-1", help="vLLM's VLLM_CPU_OMP_THREADS_BIND")
    parser.add_argument("--output-json", type=Path, default=None, help="write the figures to this file")
    args = parser.parse_args(argv)
    for name in ("num_prompts", "input_len", "output_len", "baseline_batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    # The embedded model as its folder: the weights transformers and vLLM run too.
    model_path = resolve_model_path(args.model, "safetensors" if args.model is None else "auto")
    vocab_size = AutoConfig.from_pretrained(model_path).vocab_size
    rng = random.Random(args.seed)
    prompts = random_prompts(rng, args.num_prompts, args.input_len, vocab_size)
    # Drawn after the timed prompts (which stay the same with or without warm-up) and
    # distinct from them, so the warm-up seeds no prefix-cache hits.
    warmup_prompts = random_prompts(rng, _WARMUP_NUM_PROMPTS, args.input_len, vocab_size) if args.warmup else []

    logger.info(
        "splitserve: %d prompts x %d in / %d out, %s", args.num_prompts, args.input_len, args.output_len, args.dtype
    )
    elapsed, num_output_tokens = run_splitserve(args, model_path, prompts, warmup_prompts)
    results = [make_result("splitserve", elapsed, prompts, num_output_tokens, args.output_len)]
    gc.collect()  # free the engine's weights and KV cache before loading the baseline
    if not args.skip_baseline:
        logger.info("transformers: batch size %d", args.baseline_batch_size or args.num_prompts)
        elapsed, num_output_tokens = run_transformers(args, model_path, prompts, warmup_prompts)
        results.append(make_result("transformers", elapsed, prompts, num_output_tokens, args.output_len))
    if args.vllm_python is not None:
        logger.info("vLLM: %s", args.vllm_python)
        elapsed, num_output_tokens = run_vllm(args, model_path, prompts, warmup_prompts)
        results.append(make_result("vllm", elapsed, prompts, num_output_tokens, args.output_len))

    report: dict[str, object] = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    report.update({r.engine: {**asdict(r), **r.rates()} for r in results})
    table = format_table(results)
    ours = results[0].rates()["output_tokens_per_s"]
    for baseline in results[1:]:
        ratio = ours / baseline.rates()["output_tokens_per_s"]
        report[
            "output_tokens_per_s_ratio"
            if baseline.engine == "transformers"
            else f"output_tokens_per_s_ratio_{baseline.engine}"
        ] = ratio
        table += f"\nsplitserve / {baseline.engine} output tok/s: {ratio:.2f}x"
    sys.stdout.write(table + "\n")
    if args.output_json is not None:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
        logger.info("wrote %s", args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
