"""``splitserve generate "prompt"``: one-shot offline generation, chat-templated when the model has a template."""

from __future__ import annotations

import argparse
import sys

from engine.config import DEFAULT_KV_CACHE_MEMORY
from engine.sampling_params import SamplingParams
from engine.spec_decode.config import add_speculative_arguments, speculative_config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="+", help="one or more prompts")
    parser.add_argument(
        "--model", default=None, help="local Hugging Face folder (default: embedded SmolLM2-135M-Instruct)"
    )
    # float32 by default: one prompt costs little, and on a 135M model bfloat16 rounding can
    # flip near-tied first tokens (SmolLM2 puts "The" and "L" 0.1 apart for the README's question).
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--kv-cache-memory",
        type=int,
        default=None,
        help=f"KV cache bytes: the size on CPU (default {DEFAULT_KV_CACHE_MEMORY}), a cap on GPU (default: none)",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_speculative_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from engine.llm import LLM

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        kv_cache_memory=args.kv_cache_memory,
        speculative=speculative_config_from_args(args),
    )
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, max_tokens=args.max_tokens
    )
    use_template = not args.raw and llm.tokenizer.chat_template is not None
    for prompt in args.prompt:
        if use_template:
            output = llm.chat([{"role": "user", "content": prompt}], params)
        else:
            output = llm.generate([prompt], params)[0]
        sys.stdout.write(output.outputs[0].text.strip() + "\n")
    return 0
