"""Tiny GGUF files written on the spot with the ``gguf`` package, as llama.cpp's converter
writes them: llama.cpp tensor names, Q and K rows permuted for its rotary layout (llama
architecture), the config and a gpt2-style tokenizer in the metadata, weights quantized with
``gguf.quants.quantize`` (the K-quants, which it cannot quantize, by tests/engine/kquants.py).

Beside each file, the same model as a Hugging Face folder whose weights are the GGUF's
dequantized by ``gguf.quants.dequantize``: the float model the quantized one must equal.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.checkpoints import make_checkpoint, tiny_config
from tests.engine.kquants import quantize

Q = gguf.GGMLQuantizationType
# Hugging Face tensor name -> the type it is written in (2-D weights only; the rest is F32).
Scheme = Callable[[str], Q]
# A tiny model the K-quants fit: every weight's input features whole 256-element super-blocks.
K_QUANT_MODEL = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)

_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def uniform(qtype: Q, embedding: Q | None = None) -> Scheme:
    """Every 2-D weight in ``qtype``, the embedding in ``embedding`` when given."""
    return lambda name: embedding if embedding is not None and "embed_tokens" in name else qtype


def mixed_qkv(name: str) -> Q:
    """Q in Q4_0, K and V in Q8_0 (a fused group of two formats), the rest Q4_1."""
    if "q_proj" in name:
        return Q.Q4_0
    return Q.Q8_0 if "k_proj" in name or "v_proj" in name else Q.Q4_1


def q4_k_m(name: str) -> Q:
    """llama.cpp's Q4_K_M mix, as it writes it for most layers: V, the down projection, the
    embedding and the head in Q6_K, the rest in Q4_K (so q/k/v mixes two formats)."""
    if any(part in name for part in ("v_proj", "down_proj", "embed_tokens", "lm_head")):
        return Q.Q6_K
    return Q.Q4_K


@dataclass(frozen=True, slots=True)
class GGUFCheckpoint:
    path: Path  # the .gguf file
    dequantized: Path  # the Hugging Face folder of its dequantized weights


def gguf_name(hf_name: str) -> str:
    name = hf_name.removeprefix("model.")
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        module, _, suffix = rest.rpartition(".")
        return f"blk.{index}.{_LAYER_NAMES[module]}.{suffix}"
    return {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}.get(
        name, "output.weight" if name == "lm_head.weight" else name
    )


def permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter's permutation of Q/K rows (``LlamaModel.permute``)."""
    return (
        rows.reshape(num_heads, 2, rows.shape[0] // num_heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
    )


def make_gguf(
    directory: Path,
    scheme: Scheme,
    architecture: str = "LlamaForCausalLM",
    seed: int = 0,
    **overrides: object,
) -> GGUFCheckpoint:
    folder = make_checkpoint(directory / "float", architecture, seed=seed, **overrides)
    dequantized = write_gguf(folder, directory / "model.gguf", scheme, architecture, **overrides)
    target = directory / "dequantized"
    shutil.copytree(folder, target)
    save_file(dequantized, str(target / "model.safetensors"))
    return GGUFCheckpoint(directory / "model.gguf", target)


def write_gguf(
    folder: Path, path: Path, scheme: Scheme, architecture: str = "LlamaForCausalLM", **overrides: object
) -> dict[str, torch.Tensor]:
    """Write the weights of ``folder`` (a tests/checkpoints.py checkpoint made with ``overrides``)
    to GGUF file ``path`` as ``scheme`` says. Returns them dequantized by gguf, under their
    Hugging Face names."""
    config = tiny_config(architecture, **overrides)
    arch = _GGUF_ARCHITECTURES[architecture]
    weights = load_file(str(folder / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, config, folder, arch)
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        values = tensor.float().numpy()
        if values.ndim == 1:
            writer.add_tensor(gguf_name(name), values)
            dequantized[name] = tensor
            continue
        qtype = scheme(name)
        data = quantize(values, qtype)
        dequantized[name] = torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32))
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            data = permute(data, heads)  # rows quantize one by one: permuting them commutes with it
        writer.add_tensor(gguf_name(name), data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dequantized


def _write_metadata(writer: gguf.GGUFWriter, config: object, folder: Path, arch: str) -> None:
    writer.add_name("tiny")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)  # the model's; the tokenizer's is smaller, as in tests/checkpoints.py
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    specials = {added["content"] for added in tokenizer["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in specials else 1 for token in tokens])
    writer.add_token_merges(
        [merge if isinstance(merge, str) else " ".join(merge) for merge in tokenizer["model"]["merges"]]
    )
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
