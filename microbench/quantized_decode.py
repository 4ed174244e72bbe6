"""Single-stream decode, ms per token, for each quantized weight format, on the CPU at hand.

Two models:

- the embedded SmolLM2-135M-Instruct: its dequantized folder in float32, the Q4_1 GGUF it ships
  as, and the folder with ``--quantization int8``. Its width (576) is not a multiple of 256, so
  no K-quant fits most of its weights (llama.cpp falls back to other types for those too);
- hence a random Llama of about its size whose every width is whole 256-element super-blocks
  (``--hidden 512 --intermediate 1536 --layers 30``, 8 heads of 64, 2 KV heads, a tied
  49,152-token vocabulary: 115M weights), written once under ``--work-dir`` as a float folder and
  as GGUF files of Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K and llama.cpp's Q4_K_M mix, the K-quant
  blocks built by tests/engine/kquants.py (gguf cannot quantize them), and served in float32,
  from each GGUF, and from the folder with ``--quantization int8``.

Every variant is loaded once and measured round-robin, so that each sees the same load on a
shared machine: a round times each of ``--tokens`` decode steps of one sequence (engine steps,
sampling included, outside the detokenizer) and keeps their median; the figures are the median
and the best of the rounds' medians. Where the model takes the native decode step (one C call
a step, engine/models/native_decode.py: every variant, with the kernels built), the same steps
are timed again through the model's modules, the native step set aside ("modules' step"), so
the two paths stand side by side in one run. Beside it, the linear layers alone: one token's row through
every linear layer (the LM head's included) once, in PyTorch calls, timed as a sweep: what the
weight formats change, without the step's attention, sampling and per-layer Python.
``--activations q8`` runs the quantized variants with their inputs rounded to Q8_0 / Q8_K as
well (``--quant-activations q8``)::

    python -m microbench.quantized_decode --threads 2 --rounds 7 --tokens 64 --activations float,q8

``--dtype bfloat16`` computes in bf16 instead (a float folder's weights then bf16, as served in
bf16; a quantized format's blocks stay as they are)::

    python -m microbench.quantized_decode --threads 1 --dtype bfloat16 --variants "folder,Q4_1 (shipped"
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine import LLM, SamplingParams
from engine.models.cpu_linear import BF16WeightLinear, PackedLinear
from engine.models.quantized_linear import QuantizedLinear
from engine_args.flags import add_dtype_argument

logger = logging.getLogger(__name__)

ALIGNED_FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M")


def aligned_model(work_dir: Path, hidden: int, intermediate: int, layers: int) -> tuple[Path, dict[str, Path]]:
    """The random 256-aligned model's float folder and its GGUF file per format (written once)."""
    from gguf import GGMLQuantizationType

    from tests.checkpoints import make_checkpoint
    from tests.engine.gguf_checkpoints import q4_k_m, uniform, write_gguf

    overrides: dict[str, Any] = dict(
        vocab_size=49152,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    name = f"llama-{hidden}-{intermediate}-{layers}"
    folder = work_dir / name / "float"
    if not (folder / "model.safetensors").is_file():
        logger.warning("writing %s (once)", folder)
        make_checkpoint(folder, "LlamaForCausalLM", **overrides)
    files = {}
    for format_name in ALIGNED_FORMATS:
        path = work_dir / name / f"{format_name}.gguf"
        if not path.is_file():
            logger.warning("writing %s (once)", path)
            scheme = q4_k_m if format_name == "Q4_K_M" else uniform(GGMLQuantizationType[format_name])
            write_gguf(folder, path.with_suffix(".tmp"), scheme, "LlamaForCausalLM", **overrides)
            path.with_suffix(".tmp").rename(path)
        files[format_name] = path
    return folder, files


def decode_ms(llm: LLM, num_tokens: int, seed: int) -> float:
    """One sequence's decode step, ms: the median of ``num_tokens`` engine steps, each timed alone
    (a median shrugs off the spikes other work on a shared machine puts into some steps)."""
    core = llm.engine
    prompt = [10_000 + seed] + list(range(1001, 1064))  # a new first token a round: no prefix-cache hit
    core.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=num_tokens + 1, ignore_eos=True))
    core.step()  # the prefill, and the first token
    steps = []
    while core.has_unfinished_requests():
        start = time.perf_counter()
        core.step()
        steps.append(time.perf_counter() - start)
    return statistics.median(steps) * 1e3


@contextlib.contextmanager
def modules_path(llm: LLM) -> Iterator[None]:
    """Decode steps through the model's modules, one kernel call at a time, the native step set aside."""
    runner = llm.engine.runner
    native, runner.native_decode = runner.native_decode, None
    try:
        yield
    finally:
        runner.native_decode = native


LinearLayer = QuantizedLinear | nn.Linear | PackedLinear | BF16WeightLinear


def linear_layers(llm: LLM) -> list[LinearLayer]:
    """The model's linear layers, the LM head's included, as served (a mixed group's parts apart)."""
    return [module for module in llm.engine.runner.model.modules() if isinstance(module, LinearLayer)]


@torch.inference_mode()
def linear_sweep_ms(llm: LLM, sweeps: int = 9) -> float:
    """One token through every linear layer once, each on its own random row (the weights
    streamed from memory, as in a decode step, since together they outgrow the caches): the
    median of ``sweeps``, ms."""
    layers = linear_layers(llm)
    inputs = [torch.randn(1, layer.in_features, dtype=llm.engine.runner.dtype) for layer in layers]
    times = []
    for _ in range(sweeps):
        start = time.perf_counter()
        for layer, x in zip(layers, inputs, strict=True):
            layer(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def linear_mib(llm: LLM) -> float:
    """What one decode token reads of the weights: the linear layers' (the LM head's included) in
    the format they are held in (a float layer counted once, though the panel kernel holds a copy
    of its own)."""
    total = 0
    for module in linear_layers(llm):
        if isinstance(module, QuantizedLinear):
            total += module.qweight.nbytes
        else:
            total += module.in_features * module.out_features * llm.engine.runner.dtype.itemsize
    return total / 2**20


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m microbench.quantized_decode", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=64, help="decode steps timed a round")
    parser.add_argument("--activations", default="float", help="comma-separated: float, q8")
    add_dtype_argument(parser, default="float32")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/splitserve-quantized-decode"))
    parser.add_argument("--no-smollm2", action="store_true", help="the random 256-aligned model only")
    parser.add_argument("--variants", default=None, help="comma-separated substrings: only variants naming one")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    modes = args.activations.split(",")

    # name -> (model path, quantization, quantized: whether activation modes apply)
    variants: dict[str, tuple[Path, str | None, bool]] = {}
    if not args.no_smollm2:
        from engine.default_model import default_model_path, find_gguf

        folder = default_model_path()
        variants[f"SmolLM2 {args.dtype} folder"] = (folder, None, False)
        variants["SmolLM2 Q4_1 (shipped GGUF)"] = (find_gguf(), None, True)
        variants["SmolLM2 int8"] = (folder, "int8", True)
    aligned_folder, files = aligned_model(args.work_dir, args.hidden, args.intermediate, args.layers)
    label = f"aligned {args.hidden}/{args.intermediate}x{args.layers}"
    variants[f"{label} {args.dtype}"] = (aligned_folder, None, False)
    for format_name, path in files.items():
        variants[f"{label} {format_name}"] = (path, None, True)
    variants[f"{label} int8"] = (aligned_folder, "int8", True)
    if args.variants:
        wanted = args.variants.split(",")
        variants = {name: spec for name, spec in variants.items() if any(part in name for part in wanted)}

    engines: dict[str, LLM] = {}
    for name, (path, quantization, quantized) in variants.items():
        for mode in modes if quantized else ["float"]:
            key = f"{name} [{mode} activations]" if quantized else name
            engines[key] = LLM(
                model=str(path),
                dtype=args.dtype,
                quantization=quantization,
                quant_activations=mode,
                kv_cache_memory=1 << 26,
            )
    results: dict[str, list[float]] = {name: [] for name in engines}
    modules: dict[str, list[float]] = {
        name: [] for name, llm in engines.items() if llm.engine.runner.native_decode is not None
    }
    sweeps: dict[str, list[float]] = {name: [] for name in engines}
    for seed in range(args.rounds):
        for name, llm in engines.items():
            results[name].append(decode_ms(llm, args.tokens, seed))
            if name in modules:
                with modules_path(llm):
                    modules[name].append(decode_ms(llm, args.tokens, args.rounds + seed))
            sweeps[name].append(linear_sweep_ms(llm))
    sys.stdout.write(
        f"threads={args.threads} rounds={args.rounds} dtype={args.dtype}: single-stream decode, ms per token\n"
    )
    for name, llm in engines.items():
        times, linear = results[name], sweeps[name]
        sys.stdout.write(
            f"{name:<56} linear layers {linear_mib(llm):6.1f} MiB  step median {statistics.median(times):6.2f}  "
            f"best {min(times):6.2f}  linear layers alone median {statistics.median(linear):6.2f}  "
            f"best {min(linear):6.2f}"
        )
        if name in modules:
            sys.stdout.write(
                f"  (native step)  modules' step median {statistics.median(modules[name]):6.2f}  "
                f"best {min(modules[name]):6.2f}\n"
            )
        else:
            sys.stdout.write("  (the modules' path: no native step)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
