"""Tiny random-weight Hugging Face checkpoints, built on the spot (no downloads).

Each is saved as a real HF folder (config.json, safetensors, tokenizer files) so the
engine loads it the way users' models load. The tokenizer is a byte-level BPE over
a few hundred merges: enough for text round trips; vocab sizes are padded to match.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

VOCAB_SIZE = 512

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# Large enough that prefilling a 2048-token prompt takes a second or more on one CPU core
# (the overload tests hold instances busy with it).
LONG_MODEL = dict(
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
# What the overload tests run on LONG_MODEL: a small KV cache, and prompts that nearly fill it.
LONG_MODEL_KV_MEMORY = ["--kv-cache-memory", str(1 << 26)]
LONG_PROMPT_TOKENS = 2040


def random_prompts(lengths: list[int], seed: int, vocab_size: int = VOCAB_SIZE) -> list[list[int]]:
    """Prompts of random token ids (3 and up: past pad, bos and eos), reproducible by seed."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def tiny_config(architecture: str, **overrides: object):
    kwargs = {**_COMMON, **overrides}
    if architecture == "LlamaForCausalLM":
        kwargs.setdefault("tie_word_embeddings", False)
        return LlamaConfig(architectures=[architecture], **kwargs)
    if architecture == "Qwen2ForCausalLM":
        kwargs.setdefault("tie_word_embeddings", True)
        return Qwen2Config(architectures=[architecture], **kwargs)
    if architecture == "MistralForCausalLM":
        kwargs.setdefault("sliding_window", None)
        return MistralConfig(architectures=[architecture], **kwargs)
    raise ValueError(architecture)


def build_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["The quick brown fox jumps over the lazy dog. Paris is the capital of France."] * 20
    tokenizer.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def make_checkpoint(
    directory: Path,
    architecture: str = "LlamaForCausalLM",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **overrides: object,
) -> Path:
    """Write a random-weight model of ``architecture`` into ``directory`` and return it."""
    torch.manual_seed(seed)
    config = tiny_config(architecture, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Larger-than-default init spreads the logits, so greedy argmax has clear winners
    # and float rounding differences between implementations cannot flip a token.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.25)
            elif "bias" in name:
                param.normal_(0.0, 0.1)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return directory
