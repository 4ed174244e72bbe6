"""``splitserve perplexity``: the perplexity of a model as the engine serves it (its weights as
loaded, ``--dtype``, ``--quantization``, ``--quant-activations``, ``--kv-cache-dtype``) over a text, by llama.cpp's
``llama-perplexity`` method, so that the two compare on the same GGUF and text
(engine/perplexity.py says how).

The default text ships with the package: the first five chapters of a public-domain novel
(splitserve/data/README.md says which, and how the file was made from its source).
``--text-file`` scores any other UTF-8 file.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from importlib import resources
from pathlib import Path

from engine_args.config import numerics_fields
from engine_args.flags import add_device_argument, add_numerics_arguments

DEFAULT_TEXT = "pride_and_prejudice_chapters_1-5.txt"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_numerics_arguments(parser)
    add_device_argument(parser)
    parser.add_argument(
        "--text-file",
        type=Path,
        default=None,
        help=f"the UTF-8 text to score (default: splitserve/data/{DEFAULT_TEXT}, shipped with the package)",
    )
    parser.add_argument(
        "--ctx-size",
        "-c",
        type=int,
        default=512,
        help="tokens a chunk; the first half of each is context, the second half scored (llama-perplexity's -c) "
        "(default: 512)",
    )
    parser.add_argument(
        "--chunks", type=int, default=None, help="score at most this many chunks (default: all the text holds)"
    )
    parser.add_argument(
        "--batch-size",
        "-b",
        type=int,
        default=2048,
        help="tokens one forward pass computes at most: batch-size / ctx-size chunks at once, or a longer chunk in "
        "pieces through the KV cache (llama-perplexity's -b) (default: 2048)",
    )
    parser.add_argument("--output-json", type=Path, default=None, help="write the figures and the setup here")


def default_text() -> str:
    return (resources.files("splitserve") / "data" / DEFAULT_TEXT).read_text(encoding="utf-8")


def run(args: argparse.Namespace) -> int:
    from engine.perplexity import ChunkPlan, measure, open_engine

    text = args.text_file.read_text(encoding="utf-8") if args.text_file is not None else default_text()
    plan = ChunkPlan(ctx_size=args.ctx_size, batch_size=args.batch_size, max_chunks=args.chunks)
    with open_engine(plan=plan, **numerics_fields(args)) as llm:
        runner = llm.engine.runner

        def on_chunk(index: int, running: float) -> None:
            sys.stdout.write(f"{',' if index > 1 else ''}[{index}]{running:.4f}")
            sys.stdout.flush()

        result = measure(llm, text, plan, on_chunk)
        setup = {
            "model": str(llm.engine.model_path),
            "quantization": args.quantization,
            "quant_activations": args.quant_activations,
            "dtype": str(runner.dtype).removeprefix("torch."),
            "kv_cache_dtype": args.kv_cache_dtype,
            "kv_cache_storage": runner.kv_format.fingerprint_dtype,
            "device": str(runner.device),
            "text_file": str(args.text_file) if args.text_file is not None else f"splitserve/data/{DEFAULT_TEXT}",
            "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
        }
    model = Path(setup["model"])
    weights = args.quantization or ("GGUF blocks" if model.suffix == ".gguf" else "checkpoint weights")
    if args.quant_activations != "float":
        weights += f", {args.quant_activations} activations"
    sys.stdout.write(
        f"\nPPL = {result.perplexity:.4f} +/- {result.standard_error:.5f} ({model.name}, {weights}, "
        f"{setup['dtype']} compute, {setup['kv_cache_storage']} KV; "
        f"{result.num_chunks} chunks of {result.ctx_size} tokens, {result.num_scored} scored, {result.seconds:.1f} s)\n"
    )
    if args.output_json is not None:
        args.output_json.write_text(json.dumps({**setup, **dataclasses.asdict(result)}, indent=2) + "\n")
    return 0
