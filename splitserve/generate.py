"""``splitserve generate "prompt"``: one-shot offline generation, chat-templated when the model has a template.

It lives with the product's command rather than in ``engine/``: it takes the flags the
serving commands share (engine_args/), and the engine imports nothing above it."""

from __future__ import annotations

import argparse
import sys

from engine.sampling_params import SamplingParams
from engine_args.config import engine_fields
from engine_args.flags import add_device_argument, add_engine_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="+", help="one or more prompts")
    add_engine_arguments(parser)
    add_device_argument(parser)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")


def run(args: argparse.Namespace) -> int:
    from engine.llm import LLM

    llm = LLM(**engine_fields(args))
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
