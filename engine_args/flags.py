"""The engine's flags, declared once for every command that takes them: the engine instances
(``splitserve prefill|decode|colocated``), ``splitserve up``, which passes them on to the
instances it starts (:func:`engine_argv`), ``splitserve generate``, ``splitserve perplexity``
(the numerics alone), the benchmarks that start a server and the in-process benchmarks.

Torch-free and engine-free: the launcher and the client benchmarks parse these flags without
loading the engine. The choice lists are spelled here for that reason; tests/splitserve/test_flags.py
holds each equal to the engine's. The parsed values become an ``EngineConfig`` in one place,
engine_args/config.py.
"""

from __future__ import annotations

import argparse
from typing import Literal

# The engine's choice lists, spelled here so that this module loads no part of the engine
# (tests/splitserve/test_flags.py holds each equal to the engine's).
DTypeChoice = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES: tuple[DTypeChoice, ...] = ("auto", "float32", "bfloat16", "float16")  # engine.config.DTypeName
QUANTIZATIONS: tuple[str, ...] = ("int8",)  # engine.config.QuantizationName
LOAD_FORMATS: tuple[str, ...] = ("auto", "gguf", "safetensors")  # engine.default_model.LOAD_FORMATS
QUANT_ACTIVATIONS: tuple[str, ...] = ("float", "q8")  # engine.config.QUANT_ACTIVATIONS
KVCacheDTypeChoice = Literal["auto", "int8", "fp8_e4m3"]
KV_CACHE_DTYPES: tuple[KVCacheDTypeChoice, ...] = ("auto", "int8", "fp8_e4m3")  # engine.kv_cache_dtype
PrefixCacheHashChoice = Literal["xxh3", "sha256"]
PREFIX_CACHE_HASHES: tuple[PrefixCacheHashChoice, ...] = ("xxh3", "sha256")  # engine.kv_cache_utils

DTYPE_HELP = (
    "auto: bfloat16 for a bfloat16 checkpoint (such as the embedded model) or a .gguf file where the CPU computes it "
    "natively "
    "(AVX512_BF16 or AMX), float32 on other CPUs (exact, and faster in batches there), the checkpoint's own "
    "dtype on a GPU"
)


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="local Hugging Face folder, or a .gguf file (its Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K weights kept "
        "quantized on the CPU; other types dequantized at load) (default: embedded SmolLM2-135M-Instruct)",
    )


def add_dtype_argument(parser: argparse.ArgumentParser, default: DTypeChoice = "auto") -> None:
    """``default``: a benchmark pins the dtype its figures in docs/benchmarks.md were measured
    in, whatever the CPU; every serving command keeps auto."""
    parser.add_argument("--dtype", default=default, choices=DTYPES, help=f"{DTYPE_HELP} (default: {default})")


def add_load_format_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--load-format",
        default="auto",
        choices=LOAD_FORMATS,
        help="which form of the embedded model to serve: gguf, the Q4_1 file as shipped, kept quantized; safetensors, "
        "its dequantized bfloat16 folder; auto: with --dtype auto on a CPU, the file (in bf16 where the CPU has bf16 "
        "dot products, else in float32); the folder on a GPU and for a --dtype named outright. With --model, the form "
        "the path is (default: auto)",
    )


def add_quant_activations_argument(parser: argparse.ArgumentParser, default: str | None = "float") -> None:
    """``default``: None for a benchmark that passes the flag on only when given (the server's
    default, float, otherwise)."""
    default_help = default or "the server's, float"
    parser.add_argument(
        "--quant-activations",
        default=default,
        choices=QUANT_ACTIVATIONS,
        help="how quantized weights (a GGUF file's, --quantization int8) take their inputs: float, as they come (the "
        "float model of the dequantized weights); q8, rounded to 8-bit blocks on the fly for integer dot products, "
        "as llama.cpp computes: a faster decode whose greedy output can part from the float model's (default: "
        f"{default_help})",
    )


def add_kv_cache_dtype_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="how the KV cache stores K and V: auto, the compute dtype (--dtype); int8 or fp8_e4m3, 8-bit values "
        "with a float32 scale per token and KV head, about half of bf16's bytes in memory and in every prefill -> "
        "decode hand-off (prefill and decode instances must agree: it is in the KV fingerprint) (default: auto)",
    )


def add_numerics_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that decide the model's numbers: the weights (``--model``, ``--quantization``),
    the compute dtype, how quantized weights take their inputs and the KV cache's dtype.
    ``splitserve perplexity`` takes these alone."""
    add_model_argument(parser)
    add_load_format_argument(parser)
    add_dtype_argument(parser)
    parser.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=QUANTIZATIONS,
        help="quantize a Hugging Face folder's weights at load: int8, per output channel, symmetric, weight-only "
        "(kept int8 in memory on the CPU; --dtype stays the compute dtype) (default: the checkpoint's own weights)",
    )
    add_quant_activations_argument(parser)
    add_kv_cache_dtype_argument(parser)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's flags ``splitserve up`` passes on to its instances (:func:`engine_argv`)
    and ``splitserve generate`` takes as well; instances take more of their own."""
    add_numerics_arguments(parser)
    parser.add_argument(
        "--kv-cache-memory",
        type=int,
        default=None,
        help="KV cache bytes: the size on CPU (default: 1 GiB), a cap on GPU (default: none)",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="longest prompt + output (default: the model's)"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        metavar="N",
        help="tokens one engine step computes at most, prompt chunks included (default: 2048)",
    )
    parser.add_argument(
        "--long-prefill-token-threshold",
        type=_chunk_cap,
        default=None,
        metavar="N|auto",
        help="prompt tokens of one request in one step at most: a long prompt goes in chunks of N, so prompts "
        "that arrive meanwhile share its steps; auto: chunks of about half a second at the measured prefill "
        "rate; 0: no cap (default: auto on prefill instances, no cap elsewhere)",
    )
    parser.add_argument(
        "--prefix-cache-hash",
        default="auto",
        choices=("auto", *PREFIX_CACHE_HASHES),
        help="the prefix cache's block hash: xxh3, the fastest, or sha256, collision resistant (a crafted prompt "
        "cannot reuse KV computed for another), keyed by the cluster secret where there is one; auto: sha256 keyed "
        "by the cluster secret where there is one, xxh3 without; the gateway follows each instance's choice "
        "(default: auto)",
    )
    add_tensor_parallel_argument(parser)
    add_pipeline_parallel_arguments(parser)
    add_speculative_arguments(parser)


TENSOR_PARALLEL_HELP = (
    "ranks the model is split over, one process each (on CPU each with its share of the CPUs, on GPUs each with "
    "its own GPU): its attention heads, KV heads, MLP and vocabulary"
)


def add_tensor_parallel_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1, metavar="N", help=f"{TENSOR_PARALLEL_HELP} (default: 1)"
    )


def add_pipeline_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        metavar="N",
        help="stages the model's layers are split into, one process each (per tensor-parallel rank): contiguous "
        "layers, the first stage embedding the tokens, the last computing the logits; prefill and decode "
        "instances move their KV with --kv-connector ucx only, so far (default: 1)",
    )
    parser.add_argument(
        "--pipeline-stage-layers",
        type=_stage_layers,
        default=None,
        metavar="N,N,...",
        help="each pipeline stage's layer count, in order, adding up to the model's layers (default: as equal as "
        "the layer count allows, the extra layers on the stages before the last)",
    )


def parse_stage_layers(text: str) -> tuple[int, ...]:
    """``--pipeline-stage-layers`` as counts: ``"10,10,10"`` -> (10, 10, 10)."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"expected comma-separated layer counts such as 10,10,10; got {text!r}") from None
    if min(counts) < 1:
        raise ValueError(f"every pipeline stage needs at least one layer; got {text!r}")
    return counts


def _stage_layers(value: str) -> str:
    """--pipeline-stage-layers: checked here, kept as its text (so that :func:`engine_argv` passes
    it on as given); engine_args/config.py reads the counts with :func:`parse_stage_layers`."""
    try:
        parse_stage_layers(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return value


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """Instances and ``splitserve generate``; ``splitserve up`` gives each instance a GPU of its own instead."""
    parser.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default: auto, cuda when available)")


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of every command that runs a decoding engine. ``--speculative-config`` is kept as
    given (its JSON text) and parsed in engine_args/config.py. Unset n-gram bounds keep
    ``SpeculativeConfig``'s defaults, which the help repeats (a test holds them equal)."""
    group = parser.add_argument_group("speculative decoding (off unless one of the first three is given)")
    group.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='as vLLM spells it: {"method": "ngram"|"draft_model"|"medusa"|"eagle"|"eagle3", "model": FOLDER, '
        '"num_speculative_tokens": N, "prompt_lookup_min": N, "prompt_lookup_max": N, "disable_by_batch_size": N}; '
        "disable_by_batch_size: batches of N requests or more do not speculate; medusa: a folder of Medusa "
        "heads (splitserve train-heads makes one), drafting as many tokens as it has heads unless N says fewer; "
        "eagle, eagle3: an EAGLE-1/2 or EAGLE-3 draft's folder (EAGLE's reference layout or the speculators "
        "package's). Instead of the flags below, not beside them",
    )
    group.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="drafts verified per step; alone, turns on n-gram (prompt lookup) drafting (try 4)",
    )
    group.add_argument(
        "--speculative-model",
        default=None,
        help="draft model: a local Hugging Face folder with the target's vocabulary (default: n-gram)",
    )
    group.add_argument(
        "--speculative-ngram-min", type=int, default=None, help="shortest suffix n-gram looked up (default: 2)"
    )
    group.add_argument(
        "--speculative-ngram-max", type=int, default=None, help="longest suffix n-gram looked up (default: 4)"
    )


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The flags of :func:`add_engine_arguments` as parsed, for an instance to parse the same:
    read off the declaration, so a new engine flag is passed on without a line here.
    ``--model`` aside (the launcher passes the folder it resolved), and the speculative flags,
    left to :func:`speculative_argv`: only decoding instances take them. A flag that is unset
    (None) is left out, so the instance keeps its own default."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(parser)
    speculative = _speculative_dests()
    return _argv(args, [a for a in parser._actions if a.dest != "model" and a.dest not in speculative])


def speculative_argv(args: argparse.Namespace) -> list[str]:
    """The speculative flags as given, for a launcher passing them on to its decoding instances."""
    parser = argparse.ArgumentParser(add_help=False)
    add_speculative_arguments(parser)
    return _argv(args, [a for a in parser._actions if a.dest in _speculative_dests()])


def _speculative_dests() -> set[str]:
    parser = argparse.ArgumentParser(add_help=False)
    add_speculative_arguments(parser)
    return {action.dest for action in parser._actions}


def _argv(args: argparse.Namespace, actions: list[argparse.Action]) -> list[str]:
    argv: list[str] = []
    for action in actions:
        value = getattr(args, action.dest)
        if value is not None:
            argv += [action.option_strings[0], str(value)]
    return argv


def _chunk_cap(value: str) -> int | Literal["auto"]:
    """--long-prefill-token-threshold: "auto", or a token count (0: no cap)."""
    if value == "auto":
        return "auto"
    try:
        num_tokens = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count or 'auto', got {value!r}") from None
    if num_tokens < 0 or num_tokens == 1:
        raise argparse.ArgumentTypeError(f"expected 0 (no cap), at least 2 tokens, or 'auto'; got {num_tokens}")
    return num_tokens
