"""Small builders for the benchmark tests: a tiny tokenizer, request records."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from bench.client import RequestRecord


def make_tokenizer(directory: Path) -> Path:
    """A byte-level BPE tokenizer (1000 tokens) trained on made-up two-syllable words,
    saved as a Hugging Face folder. Hundreds of its tokens are whole words (" kalo")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words = ["".join(pair) for pair in itertools.product(syllables, repeat=2)]
    random.Random(0).shuffle(words)
    corpus = [" ".join(words[i : i + 50]) for i in range(0, len(words), 50)] * 3
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(directory)
    return directory


def make_record(
    ttft: float = 0.1,
    itl: list[float] | None = None,
    output_tokens: int | None = None,
    prompt_len: int = 10,
    start_time: float = 0.0,
    error: str | None = None,
    workload: str = "",
    server_itl: list[float] | None = None,
) -> RequestRecord:
    """A finished request: content chunks at ``ttft`` then ``itl`` gaps; latency is their sum;
    ``server_itl``: the server's gaps between the same chunks, when it sent its chunk times."""
    itl = list(itl or [])
    chunks = 1 + len(itl)
    return RequestRecord(
        prompt_len=prompt_len,
        output_len=output_tokens or chunks,
        workload=workload,
        start_time=start_time,
        ttft=ttft,
        itl=itl,
        latency=ttft + sum(itl),
        output_tokens=output_tokens,
        num_content_chunks=chunks,
        generated_text="x" * chunks,
        error=error,
        server_itl=server_itl,
    )
