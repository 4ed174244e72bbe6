"""Parsed engine flags (engine_args/flags.py) as the engine's settings, built here alone: the
instances (``serving.instance.engine_config``), ``splitserve generate`` and ``splitserve
perplexity`` read their flags through these functions, so a flag means the same everywhere.

The engine is imported inside the functions: importing this module loads no part of it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from engine_args.flags import parse_stage_layers

if TYPE_CHECKING:  # annotations only: importing these loads torch
    from engine.config import EngineConfig, EngineRole
    from engine.spec_decode.config import SpeculativeConfig


def numerics_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The flags of ``add_numerics_arguments`` and ``--device`` as ``EngineConfig`` fields."""
    return {
        "model": args.model,
        "load_format": args.load_format,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "quant_activations": args.quant_activations,
        "kv_cache_dtype": args.kv_cache_dtype,
        "device": args.device,
    }


def engine_fields(args: argparse.Namespace, role: EngineRole = "colocated") -> dict[str, Any]:
    """The flags of ``add_engine_arguments`` and ``--device`` as ``EngineConfig`` fields for an
    engine in ``role``."""
    return {
        **numerics_fields(args),
        "role": role,
        "kv_cache_memory": args.kv_cache_memory,
        "max_model_len": args.max_model_len,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "long_prefill_token_threshold": long_prefill_token_threshold(args, role),
        "prefix_cache_hash": args.prefix_cache_hash,
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "pipeline_stage_layers": parse_stage_layers(args.pipeline_stage_layers) if args.pipeline_stage_layers else None,
        # The prefill role never speculates (it samples one token); the engine ignores it there.
        "speculative": speculative_config_from_args(args),
    }


def engine_config_from_args(args: argparse.Namespace, role: EngineRole = "colocated", **fields: Any) -> EngineConfig:
    """The engine's settings from its flags; ``fields``: the ``EngineConfig`` fields a command
    sets from flags of its own (an instance's ``--block-size``, its cluster secret's key)."""
    from engine.config import EngineConfig

    return EngineConfig(**engine_fields(args, role), **fields)


def long_prefill_token_threshold(args: argparse.Namespace, role: EngineRole) -> int | Literal["auto"] | None:
    """The flag as given, else the role's default: capped on a prefill instance, whose steps are
    all prompt chunks and whose queue is what a short prompt waits in; not elsewhere, where more
    steps carrying a chunk would lengthen running streams' token gaps (docs/benchmarks.md, "A
    smaller step budget"). 0 is no cap."""
    if args.long_prefill_token_threshold is None:
        return "auto" if role == "prefill" else None
    return args.long_prefill_token_threshold or None


def speculative_config_from_args(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The speculative flags as a config: None (speculation off) unless ``--speculative-config``,
    ``--num-speculative-tokens`` or ``--speculative-model`` was given; a flag not given keeps
    the field's default."""
    from engine.spec_decode.config import SpeculativeConfig

    older = {
        "--num-speculative-tokens": args.num_speculative_tokens,
        "--speculative-model": args.speculative_model,
        "--speculative-ngram-min": args.speculative_ngram_min,
        "--speculative-ngram-max": args.speculative_ngram_max,
    }
    if args.speculative_config is not None:
        given_older = [flag for flag, value in older.items() if value is not None]
        if given_older:
            raise ValueError(
                f"--speculative-config says everything about speculation; drop {', '.join(given_older)} (or put "
                "it in the JSON: num_speculative_tokens, model, prompt_lookup_min, prompt_lookup_max)"
            )
        return speculative_config_from_json(args.speculative_config)
    if args.num_speculative_tokens is None and args.speculative_model is None:
        return None
    given = {
        "num_speculative_tokens": args.num_speculative_tokens,
        "ngram_min": args.speculative_ngram_min,
        "ngram_max": args.speculative_ngram_max,
        "model": args.speculative_model,
    }
    return SpeculativeConfig(
        method="draft_model" if args.speculative_model else "ngram",
        **{name: value for name, value in given.items() if value is not None},
    )


# --speculative-config's keys (vLLM's names) -> SpeculativeConfig's fields.
SPECULATIVE_CONFIG_KEYS = {
    "method": "method",
    "model": "model",
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_min": "ngram_min",
    "prompt_lookup_max": "ngram_max",
    "disable_by_batch_size": "disable_by_batch_size",
}


def speculative_config_from_json(text: str) -> SpeculativeConfig:
    """``--speculative-config`` as vLLM spells it. Medusa without ``num_speculative_tokens``
    drafts one token per head of its checkpoint, as vLLM does."""
    import json

    from engine.spec_decode.config import SpeculativeConfig

    try:
        given = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f'--speculative-config must be a JSON object, e.g. \'{{"method": "ngram"}}\': {error}'
        ) from None
    if not isinstance(given, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {text!r}")
    unknown = sorted(set(given) - set(SPECULATIVE_CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"--speculative-config: unknown keys {unknown}; this engine takes {sorted(SPECULATIVE_CONFIG_KEYS)}"
        )
    if "method" not in given:
        raise ValueError('--speculative-config needs a "method": ngram, draft_model, medusa, eagle or eagle3')
    for key, value in given.items():
        wanted = str if key in ("method", "model") else int
        if not isinstance(value, wanted) or isinstance(value, bool):
            raise ValueError(f"--speculative-config: {key} must be a {wanted.__name__}, got {value!r}")
    fields = {SPECULATIVE_CONFIG_KEYS[key]: value for key, value in given.items()}
    if fields["method"] == "medusa" and "num_speculative_tokens" not in fields and fields.get("model"):
        from engine.spec_decode.medusa_checkpoint import read_medusa_config

        fields["num_speculative_tokens"] = read_medusa_config(Path(fields["model"])).num_heads
    return SpeculativeConfig(**fields)
