"""Workloads: the prompts a benchmark sends, with their token lengths.

- ``random``: random word prompts of ``--input-len`` tokens (spread by
  ``--range-ratio``) asking for ``--output-len`` tokens;
- ``mixed``: classes of requests in fixed proportions, ``--mix
  1024-2048:32:0.5,128:256:0.5`` (input tokens, output tokens, weight; a length is
  ``N`` or an inclusive range ``LO-HI`` drawn uniformly);
- ``shared-prefix``: ``--num-prefixes`` groups whose requests share a
  ``--prefix-len``-token system prompt, each followed by its own ``--suffix-len``
  tokens;
- ``sharegpt``: the first human turn of ShareGPT conversations (a local JSON file),
  asking for as many tokens as the recorded answer has (or ``--output-len``).

Every builder is deterministic in its seed, so two servers get the same prompts.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from bench.prompt_text import PromptSynthesizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

DatasetName = Literal["random", "mixed", "shared-prefix", "sharegpt"]

# ShareGPT pruning, the same as vLLM's so results compare: drop conversations whose
# prompt or answer is under 4 tokens, whose prompt is over 1024, or whose total is over 2048.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass(slots=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens of system_prompt + prompt with the bench tokenizer, no special tokens
    output_len: int  # max_tokens to ask for
    system_prompt: str | None = None  # shared prefix: a system message on chat, prepended on completions
    workload: str = ""  # the class it was drawn from, e.g. "1024-2048:32"


@dataclass(frozen=True, slots=True)
class TokenRange:
    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> TokenRange:
        low_text, _, high_text = text.strip().partition("-")
        try:
            low = int(low_text)
            high = int(high_text) if high_text else low
        except ValueError:
            raise ValueError(f"a token length is N or LO-HI, got {text!r}") from None
        if low < 0 or high < low:
            raise ValueError(f"a token range needs 0 <= LO <= HI, got {text!r}")
        return cls(low, high)

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"


@dataclass(frozen=True, slots=True)
class WorkloadClass:
    input_len: TokenRange
    output_len: TokenRange
    weight: float = 1.0

    @property
    def name(self) -> str:
        return f"{self.input_len}:{self.output_len}"


@dataclass(slots=True)
class WorkloadSpec:
    """What ``--dataset`` and its options ask for."""

    dataset: DatasetName
    classes: list[WorkloadClass]  # random and mixed
    num_prefixes: int = 0
    prefix_len: int = 0
    suffix_len: int = 0
    output_len: int | None = None  # shared-prefix, and a fixed answer length for sharegpt
    dataset_path: Path | None = None


def parse_mix(spec: str) -> list[WorkloadClass]:
    """``"1024-2048:32:0.5,128:256:0.5"`` -> classes; the weight defaults to 1, weights are relative."""
    classes = []
    for part in filter(None, (item.strip() for item in spec.split(","))):
        fields = part.split(":")
        if len(fields) not in (2, 3):
            raise ValueError(f"a --mix class is INPUT:OUTPUT[:WEIGHT], e.g. 1024-2048:32:0.5; got {part!r}")
        weight = float(fields[2]) if len(fields) == 3 else 1.0
        if not weight > 0:
            raise ValueError(f"a --mix weight must be > 0, got {part!r}")
        output_len = TokenRange.parse(fields[1])
        if output_len.low < 1:
            raise ValueError(f"a --mix class must ask for at least 1 output token, got {part!r}")
        classes.append(WorkloadClass(TokenRange.parse(fields[0]), output_len, weight))
    if not classes:
        raise ValueError("--mix needs at least one class, e.g. --mix 1024-2048:32:0.5,128:256:0.5")
    return classes


def random_class(input_len: int, output_len: int, range_ratio: float) -> WorkloadClass:
    """The one class of ``--dataset random``: lengths uniform in [L*(1-r), L*(1+r)], as in vLLM."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError("--input-len and --output-len must be >= 1")

    def spread(length: int) -> TokenRange:
        return TokenRange(max(1, math.floor(length * (1 - range_ratio))), math.ceil(length * (1 + range_ratio)))

    return WorkloadClass(spread(input_len), spread(output_len))


def class_counts(classes: list[WorkloadClass], num_requests: int) -> list[int]:
    """Requests per class in exact proportion to the weights (largest remainder), so a
    50/50 mix of 10 requests is 5 and 5, not whatever a coin gives."""
    total = sum(c.weight for c in classes)
    shares = [c.weight / total * num_requests for c in classes]
    counts = [math.floor(share) for share in shares]
    by_remainder = sorted(range(len(classes)), key=lambda i: shares[i] - counts[i], reverse=True)
    for i in by_remainder[: num_requests - sum(counts)]:
        counts[i] += 1
    return counts


def sample_classes(
    synth: PromptSynthesizer, classes: list[WorkloadClass], num_requests: int, rng: random.Random
) -> list[SampleRequest]:
    labels = [c for c, count in zip(classes, class_counts(classes, num_requests)) for _ in range(count)]
    rng.shuffle(labels)
    requests = []
    for workload in labels:
        prompt, prompt_len = synth.text(rng, workload.input_len.sample(rng))
        requests.append(SampleRequest(prompt, prompt_len, workload.output_len.sample(rng), workload=workload.name))
    return requests


def sample_shared_prefix(
    synth: PromptSynthesizer,
    num_requests: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    rng: random.Random,
) -> list[SampleRequest]:
    if num_prefixes < 1 or prefix_len < 1 or output_len < 1:
        raise ValueError("shared-prefix needs --num-prefixes, --prefix-len and --output-len >= 1")
    prefixes = [synth.text(rng, prefix_len)[0] for _ in range(num_prefixes)]
    groups = [i % num_prefixes for i in range(num_requests)]
    rng.shuffle(groups)
    requests = []
    for group in groups:
        suffix, prompt_len = synth.text(rng, suffix_len, head=prefixes[group])
        requests.append(
            SampleRequest(suffix, prompt_len, output_len, system_prompt=prefixes[group], workload=f"prefix{group}")
        )
    return requests


def sample_sharegpt(
    tokenizer: PreTrainedTokenizerFast, path: Path, num_requests: int, rng: random.Random, output_len: int | None = None
) -> list[SampleRequest]:
    try:
        conversations = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read ShareGPT JSON from {path}: {error}") from error
    if not isinstance(conversations, list):
        raise ValueError(f"{path} is not a ShareGPT file: expected a JSON list of conversations")
    pairs = [pair for entry in conversations if (pair := _first_exchange(entry)) is not None]
    rng.shuffle(pairs)
    requests = []
    for prompt, answer in pairs:  # tokenize only as many as needed: ShareGPT files are large
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        answer_len = output_len or len(tokenizer.encode(answer, add_special_tokens=False))
        if prompt_len < SHAREGPT_MIN_LEN or (output_len is None and answer_len < SHAREGPT_MIN_LEN):
            continue
        if prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + answer_len > SHAREGPT_MAX_TOTAL_LEN:
            continue
        requests.append(SampleRequest(prompt, prompt_len, answer_len, workload="sharegpt"))
        if len(requests) == num_requests:
            return requests
    raise ValueError(
        f"{path} has only {len(requests)} usable conversations for {num_requests} requests; "
        "lower --num-prompts (and --num-warmups)"
    )


def _first_exchange(entry: object) -> tuple[str, str] | None:
    """The first (human, assistant) turns of a conversation; ``from/value`` or ``role/content`` keys."""
    if not isinstance(entry, dict):
        return None
    turns = entry.get("conversations") or entry.get("messages")
    if not isinstance(turns, list) or len(turns) < 2 or not all(isinstance(t, dict) for t in turns[:2]):
        return None
    roles = [t.get("from", t.get("role")) for t in turns[:2]]
    texts = [t.get("value", t.get("content")) for t in turns[:2]]
    if roles[0] not in ("human", "user") or roles[1] not in ("gpt", "assistant", "chatgpt"):
        return None
    if not all(isinstance(text, str) for text in texts):
        return None
    return texts[0], texts[1]


def sample_workload(
    spec: WorkloadSpec, tokenizer: PreTrainedTokenizerFast, num_requests: int, num_warmups: int, seed: int
) -> tuple[list[SampleRequest], list[SampleRequest]]:
    """(warm-up requests, measured requests). The measured ones depend only on the seed,
    not on the number of warm-ups; warm-ups are drawn apart so they never pre-cache a
    measured prompt (except the shared prefixes, which warm-ups share by design)."""
    rng = random.Random(seed)
    warmup_rng = random.Random(f"warmup-{seed}")
    if spec.dataset == "sharegpt":
        if spec.dataset_path is None:
            raise ValueError("--dataset sharegpt needs --dataset-path FILE.json (no downloads)")
        both = sample_sharegpt(tokenizer, spec.dataset_path, num_requests + num_warmups, rng, spec.output_len)
        return both[num_requests:], both[:num_requests]
    synth = PromptSynthesizer(tokenizer)
    if spec.dataset == "shared-prefix":
        requests = sample_shared_prefix(
            synth, num_requests, spec.num_prefixes, spec.prefix_len, spec.suffix_len, spec.output_len or 0, rng
        )
        # Warm-ups reuse the groups' prefixes: a steady-state server has them cached.
        prefixes = list(dict.fromkeys(r.system_prompt or "" for r in requests))
        warmups = []
        for i in range(num_warmups):
            suffix, prompt_len = synth.text(warmup_rng, spec.suffix_len, head=prefixes[i % len(prefixes)])
            warmups.append(SampleRequest(suffix, prompt_len, spec.output_len or 1, prefixes[i % len(prefixes)]))
        return warmups, requests
    requests = sample_classes(synth, spec.classes, num_requests, rng)
    return sample_classes(synth, spec.classes, num_warmups, warmup_rng), requests
