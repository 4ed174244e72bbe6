"""GGUF files as models: ``--model path/to/file.gguf`` wherever a Hugging Face folder goes.

The weights load from the file itself (engine/models/gguf_loader.py). What the rest of the
stack reads from a model folder (config.json, generation_config.json, the tokenizer files
for the gateway, the offline LLM, structured outputs and the EOS ids) is derived once from
the file's metadata, by transformers' own GGUF support, into a folder under the cache dir
keyed by the file's digest: :func:`metadata_folder`. Deriving it parses the file's vocabulary
(some seconds); every later use reads the folder. No torch import here, for the gateway;
the first derivation goes through transformers' GGUF reader, which imports it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

from engine.default_model import cache_dir

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
# What the digest reads: the start of the file (the header: metadata, vocabulary, tensor
# table, then the first weights) and its end (the last weights).
_HEAD_BYTES = 8 << 20
_TAIL_BYTES = 1 << 20
# llama.cpp's architecture names -> the Hugging Face class splitserve runs them as.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == GGUF_SUFFIX and path.is_file()


def gguf_digest(path: Path) -> str:
    """16 hex digits over the file's size, its first 8 MiB (the header and the first weights)
    and its last 1 MiB: two files share it only if they share their metadata, tensor table
    and those weight bytes."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    digest.update(size.to_bytes(8, "little"))
    with path.open("rb") as handle:
        digest.update(handle.read(_HEAD_BYTES))
        if size > _HEAD_BYTES:
            handle.seek(max(_HEAD_BYTES, size - _TAIL_BYTES))
            digest.update(handle.read(_TAIL_BYTES))
    return digest.hexdigest()[:16]


def metadata_folder(model_path: Path) -> Path:
    """Where config.json and the tokenizer files of ``model_path`` are: the folder itself, or
    for a GGUF file the folder derived from its metadata (written on first use)."""
    if not is_gguf(model_path):
        return model_path
    target = cache_dir() / "gguf" / f"{model_path.stem}-{gguf_digest(model_path)}"
    if (target / "config.json").is_file():
        return target
    _derive(model_path, target)
    return target


def _derive(gguf_path: Path, target: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    logger.info("reading the config and tokenizer of %s into %s (once)", gguf_path.name, target)
    folder, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    architecture = GGUF_ARCHITECTURES.get(config.model_type)
    if architecture is None:
        raise ValueError(
            f"{gguf_path} holds a {config.model_type!r} model; splitserve runs GGUF files of "
            f"{', '.join(GGUF_ARCHITECTURES)}"
        )
    config.architectures = [architecture]
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # Beside the target, then renamed: a crash never leaves half a folder, and of two
    # processes deriving it at once one keeps its own.
    staging = target.with_name(f"{target.name}.tmp{os.getpid()}")
    config.save_pretrained(staging)
    GenerationConfig.from_model_config(config).save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
