"""Load a Hugging Face folder (config.json + safetensors), or a GGUF file
(engine/models/gguf_loader.py), into one of our model classes; a folder's weights quantized to
int8 at load with ``quantization="int8"`` (engine/models/int8_quantize.py)."""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from engine.attention.backend import AttentionBackend
from engine.cpu_features import CPUFeatures, cpu_features
from engine.gguf_files import is_gguf, metadata_folder
from engine.models.cpu_linear import linear_path, prepare_linears
from engine.models.gguf_loader import load_gguf
from engine.models.int8_quantize import int8_weights
from engine.models.llama import LlamaFamilyForCausalLM, ModelShape, TensorParallel
from engine.models.ops import NativeCPUOps, select_ops
from engine.models.quantized_model import load_quantized
from engine.pipeline_parallel.stages import PipelineStage
from engine.tensor_parallel.group import TensorParallelGroup
from engine.tensor_parallel.layout import TensorParallelLayout

if TYPE_CHECKING:
    from engine.config import QuantActivations, QuantizationName

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    model: LlamaFamilyForCausalLM
    config: PretrainedConfig
    architecture: str
    dtype: torch.dtype
    max_model_len: int


def resolve_dtype(
    name: str,
    config: PretrainedConfig,
    device: torch.device,
    features: CPUFeatures | None = None,
    gguf: bool = False,
) -> torch.dtype:
    """The dtype to run in. ``auto`` is the checkpoint's own dtype (float32 if it names none),
    except on CPU, where it is what is fast there and exact:

    - a bfloat16 checkpoint runs in bfloat16 where the CPU has bf16 dot products
      (AVX512_BF16 or AMX): there bf16 is faster than float32 both decoding one stream and
      in batches. Elsewhere it runs in float32, which holds its weights exactly: on an
      AVX2-only CPU bf16 (engine/models/cpu_linear.py's bf16-weights path) decodes one
      stream faster but runs batches slower than float32 (docs/benchmarks.md, "Runtime CPU
      dispatch and the default dtype"), and on aarch64 no bf16 path has been measured.
      ``dtype="bfloat16"`` runs on any CPU.
    - a float16 checkpoint runs in float32 (exact: CPUs without AVX512-FP16 have no
      fast float16 matmul, and bfloat16 would round its weights);
    - a float32 checkpoint runs in float32;
    - a GGUF file (``gguf``) names no dtype (its weights are blocks): it runs as a bfloat16
      checkpoint does, as vLLM runs GGUF files in half precision. Where bf16 is native the
      Q4_1 SmolLM2 file held a mix of chatty streams and long prompts far better in bf16 than
      in float32, its prompts' GEMMs running in bf16 too (docs/benchmarks.md, "The step
      thread's OpenMP team").
    """
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
        return _DTYPES[name]
    configured = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(configured, str):
        configured = _DTYPES.get(configured)
    checkpoint_dtype = configured if configured in _DTYPES.values() else torch.float32
    if gguf:
        checkpoint_dtype = torch.bfloat16
    if device.type != "cpu":
        return checkpoint_dtype
    features = features or cpu_features()
    if checkpoint_dtype == torch.bfloat16 and features.native_bf16:
        return torch.bfloat16
    return torch.float32


def model_max_len(config: PretrainedConfig) -> int:
    """Longest context the checkpoint supports; a sliding window caps it, since a
    window is not implemented and tokens past it would be attended wrongly."""
    max_len = config.max_position_embeddings
    window = getattr(config, "sliding_window", None)
    return min(max_len, window) if window else max_len


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: those its shard index names, else the single file, else all."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}; convert the checkpoint to safetensors first")
    return files


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = safetensors_files(path)
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safetensors handles have keys(), not __iter__
                yield name, handle.get_tensor(name)


def load_model(
    path: Path,
    dtype_name: str,
    device: torch.device,
    backend: AttentionBackend,
    max_model_len: int | None,
    group: TensorParallelGroup | None = None,
    quantization: QuantizationName | None = None,
    activations: QuantActivations = "float",
    stage: PipelineStage | None = None,
) -> LoadedModel:
    """``path``: a Hugging Face folder or a GGUF file. ``group``: load this rank's shard of the
    model, whose collectives run in ``group`` (None: the whole model). ``quantization``: None,
    or ``int8`` to quantize a folder's weights at load. ``activations``: how the quantized
    weights' kernels take their inputs (engine.config.QuantActivations). ``stage``: load this
    pipeline stage's layers only (None: all of them)."""
    if quantization is not None and is_gguf(path):
        raise ValueError(
            f"--quantization {quantization} quantizes a float checkpoint at load; {path.name} is a GGUF file whose "
            "weights are quantized already: drop --quantization, or give a Hugging Face folder"
        )
    config = AutoConfig.from_pretrained(str(metadata_folder(path)))
    architectures = getattr(config, "architectures", None) or []
    architecture = next((arch for arch in architectures if arch in SUPPORTED_ARCHITECTURES), None)
    if architecture is None:
        raise ValueError(
            f"model at {path} has architectures {architectures}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    dtype = resolve_dtype(dtype_name, config, device, gguf=is_gguf(path))
    supported_len = model_max_len(config)
    if max_model_len is None:
        max_model_len = supported_len
    elif max_model_len > supported_len:
        raise ValueError(f"max_model_len {max_model_len} exceeds what the model supports ({supported_len})")
    parallel = None
    if group is not None:
        shape = ModelShape.from_config(config, architecture)
        layout = TensorParallelLayout(
            group.rank, group.world_size, shape.num_heads, shape.num_kv_heads, shape.intermediate_size, shape.vocab_size
        )
        parallel = TensorParallel(layout, group)
    ops = select_ops(device, dtype)
    if is_gguf(path):
        model = load_gguf(
            path, config, architecture, supported_len, dtype, device, backend, ops, parallel, activations, stage
        )
    elif quantization == "int8":
        tied = bool(getattr(config, "tie_word_embeddings", False))
        weights = int8_weights(iter_safetensors(path), tied)
        name = f"{path.name} (int8)"
        model = load_quantized(
            name,
            weights,
            config,
            architecture,
            supported_len,
            dtype,
            device,
            backend,
            ops,
            parallel,
            activations,
            stage,
        )
    else:
        if activations != "float":
            logger.warning("%s keeps no weight quantized: activations %s change nothing", path.name, activations)
        with torch.device(device), warnings.catch_warnings():
            # A pipeline stage's absent embedding or LM head has no rows: nothing to initialize.
            warnings.filterwarnings("ignore", "Initializing zero-element tensors is a no-op")
            model = LlamaFamilyForCausalLM(config, architecture, supported_len, dtype, backend, ops, parallel, stage)
            model = model.to(dtype)
        model.load_weights(iter_safetensors(path))
    model.eval()
    path_name = linear_path(device, dtype)
    prepare_linears(model, path_name)
    shard = f", rank {group.rank} of {group.world_size}" if group is not None else ""
    if stage is not None and not stage.is_whole:
        layers = f"layers {stage.layers.start}-{stage.layers.stop - 1}"
        shard += f", pipeline stage {stage.index} of {stage.num_stages} ({layers})"
    logger.info("loaded %s (%s) from %s in %s on %s%s", architecture, config.model_type, path, dtype, device, shard)
    if device.type == "cpu":
        kernel_isa = ops.kernels.isa if isinstance(ops, NativeCPUOps) else "none (pure PyTorch)"
        logger.info("CPU %s: linear path %s, kernel ISA %s", cpu_features().describe(), path_name, kernel_isa)
    return LoadedModel(model, config, architecture, dtype, max_model_len)
