"""Workload builders: exact prompt token lengths, class proportions, shared prefixes, ShareGPT."""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from bench.datasets import (
    TokenRange,
    WorkloadClass,
    WorkloadSpec,
    class_counts,
    parse_mix,
    random_class,
    sample_classes,
    sample_shared_prefix,
    sample_sharegpt,
    sample_workload,
)
from bench.prompt_text import PromptSynthesizer, load_tokenizer


def _len(tokenizer: PreTrainedTokenizerFast, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_random_prompts_have_exact_token_lengths_and_differ(tokenizer: PreTrainedTokenizerFast) -> None:
    synth = PromptSynthesizer(tokenizer)
    workload = random_class(input_len=100, output_len=16, range_ratio=0.5)
    assert (workload.input_len, workload.output_len) == (TokenRange(50, 150), TokenRange(8, 24))
    requests = sample_classes(synth, [workload], 40, random.Random(0))
    for request in requests:
        assert _len(tokenizer, request.prompt) == request.prompt_len
        assert 50 <= request.prompt_len <= 150 and 8 <= request.output_len <= 24
    assert len({r.prompt_len for r in requests}) > 10
    assert len({r.prompt.split()[0] + r.prompt.split()[1] for r in requests}) == 40  # no shared beginnings


def test_the_seed_fixes_the_prompts(tokenizer: PreTrainedTokenizerFast) -> None:
    synth = PromptSynthesizer(tokenizer)
    classes = [random_class(64, 8, 0.25)]

    def prompts(seed: int) -> list[str]:
        return [r.prompt for r in sample_classes(synth, classes, 5, random.Random(seed))]

    assert prompts(3) == prompts(3) and prompts(3) != prompts(4)


def test_mixed_classes_come_in_exact_proportions(tokenizer: PreTrainedTokenizerFast) -> None:
    classes = parse_mix("1024-2048:32:0.5, 128:256:0.5")
    assert classes == [
        WorkloadClass(TokenRange(1024, 2048), TokenRange(32, 32), 0.5),
        WorkloadClass(TokenRange(128, 128), TokenRange(256, 256), 0.5),
    ]
    requests = sample_classes(PromptSynthesizer(tokenizer), classes, 10, random.Random(0))
    assert Counter(r.workload for r in requests) == {"1024-2048:32": 5, "128:256": 5}
    for request in requests:
        assert _len(tokenizer, request.prompt) == request.prompt_len
        if request.workload == "128:256":
            assert (request.prompt_len, request.output_len) == (128, 256)
        else:
            assert 1024 <= request.prompt_len <= 2048 and request.output_len == 32
    assert [r.workload for r in requests] != sorted(r.workload for r in requests)  # interleaved


def test_class_counts_use_largest_remainders() -> None:
    one, two = (
        WorkloadClass(TokenRange(1, 1), TokenRange(1, 1), 1),
        WorkloadClass(TokenRange(1, 1), TokenRange(1, 1), 2),
    )
    assert class_counts([one, two], 7) == [2, 5]
    assert class_counts([one, two], 3) == [1, 2]
    assert class_counts([one], 4) == [4]


@pytest.mark.parametrize("spec", ["", "100", "100:0:1", "100:10:0", "a:10", "20-10:5", "1:2:3:4"])
def test_bad_mix_specs_are_user_errors(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_mix(spec)


def test_shared_prefix_groups_share_an_exact_length_system_prompt(tokenizer: PreTrainedTokenizerFast) -> None:
    requests = sample_shared_prefix(
        PromptSynthesizer(tokenizer),
        num_requests=12,
        num_prefixes=3,
        prefix_len=200,
        suffix_len=30,
        output_len=8,
        rng=random.Random(0),
    )
    prefixes = Counter(r.system_prompt for r in requests)
    assert len(prefixes) == 3 and set(prefixes.values()) == {4}
    for prefix in prefixes:
        assert _len(tokenizer, prefix) == 200
    for request in requests:
        assert request.prompt_len == 230 == _len(tokenizer, request.system_prompt + request.prompt)
        assert request.output_len == 8
    assert len({r.prompt for r in requests}) == 12


def _write_sharegpt(path: Path) -> Path:
    conversations = [
        {
            "id": "ok1",
            "conversations": [
                {"from": "human", "value": "tell me about " + "kalo " * 10},
                {"from": "gpt", "value": "sure " + "tive " * 20},
            ],
        },
        {
            "id": "ok2",
            "messages": [
                {"role": "user", "content": "pusi teru puro tive refe"},
                {"role": "assistant", "content": "lovo lode loda rege repe pufi"},
            ],
        },
        {
            "id": "short",
            "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there you"}],
        },
        {
            "id": "gpt-first",
            "conversations": [{"from": "gpt", "value": "kalo " * 9}, {"from": "human", "value": "x " * 9}],
        },
        {"id": "one-turn", "conversations": [{"from": "human", "value": "kalo " * 9}]},
        {
            "id": "too-long",
            "conversations": [{"from": "human", "value": "kalo " * 1100}, {"from": "gpt", "value": "ok " * 9}],
        },
    ]
    path.write_text(json.dumps(conversations), encoding="utf-8")
    return path


def test_sharegpt_takes_first_exchanges_and_prunes_like_vllm(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    path = _write_sharegpt(tmp_path / "sharegpt.json")
    requests = sample_sharegpt(tokenizer, path, 2, random.Random(0))
    assert sorted(r.prompt[:4] for r in requests) == ["pusi", "tell"]
    for request in requests:
        assert request.prompt_len == _len(tokenizer, request.prompt)
    answers = {"tell": "sure " + "tive " * 20, "pusi": "lovo lode loda rege repe pufi"}
    assert {r.prompt[:4]: r.output_len for r in requests} == {k: _len(tokenizer, v) for k, v in answers.items()}
    fixed = sample_sharegpt(tokenizer, path, 2, random.Random(0), output_len=7)
    assert [r.output_len for r in fixed] == [7, 7]
    with pytest.raises(ValueError, match="only 2 usable"):
        sample_sharegpt(tokenizer, path, 3, random.Random(0))


def test_measured_requests_do_not_depend_on_warmups(tokenizer: PreTrainedTokenizerFast) -> None:
    spec = WorkloadSpec("random", [random_class(40, 4, 0.0)])
    no_warmup, measured = sample_workload(spec, tokenizer, 6, 0, seed=1)
    warmups, measured_again = sample_workload(spec, tokenizer, 6, 3, seed=1)
    assert no_warmup == [] and len(warmups) == 3
    assert [r.prompt for r in measured] == [r.prompt for r in measured_again]
    assert not {r.prompt for r in warmups} & {r.prompt for r in measured}


class _CrossWordMergingTokenizer:
    """Two-letter words are one token each, except that two consecutive words from the
    first half of the vocabulary encode as one: a tokenizer that merges across words,
    which the synthesizer has to correct for."""

    vocab = [" " + a + b for a in "abcdefghij" for b in "klmnopqrstuvwxyz"]
    all_special_ids: list[int] = []

    def __len__(self) -> int:
        return len(self.vocab)

    def batch_decode(self, batch: list[list[int]]) -> list[str]:
        return [self.vocab[ids[0]] for ids in batch]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        merged_last = False
        for word in re.findall(r" [a-z]+", text):
            index = self.vocab.index(word)
            if ids and not merged_last and ids[-1] < 80 and index < 80:
                merged_last = True
                continue
            ids.append(index)
            merged_last = False
        return ids

    def __call__(self, texts: list[str], add_special_tokens: bool = False) -> dict[str, list[list[int]]]:
        return {"input_ids": [self.encode(text) for text in texts]}


@pytest.mark.parametrize("num_tokens", [1, 2, 9, 60, 400])
def test_synthesizer_corrects_for_merges_across_words(num_tokens: int) -> None:
    synth = PromptSynthesizer(_CrossWordMergingTokenizer())
    rng = random.Random(0)
    for _ in range(10):
        text, measured = synth.text(rng, num_tokens)
        assert measured == num_tokens == synth.num_tokens(text)
        head, _ = synth.text(rng, 7)
        text, measured = synth.text(rng, num_tokens, head=head)
        assert measured == num_tokens + 7 == synth.num_tokens(head + text)


def test_embedded_model_tokenizer_gives_exact_lengths() -> None:
    from engine.default_model import find_gguf

    # The tokenizer inside the GGUF the package ships: the same one the converted folder saves,
    # there whether or not any earlier test or command converted the model.
    tokenizer = load_tokenizer(find_gguf())
    requests = sample_classes(PromptSynthesizer(tokenizer), parse_mix("1024-2048:32,128:256"), 6, random.Random(0))
    for request in requests:
        assert _len(tokenizer, request.prompt) == request.prompt_len
    assert sorted(r.prompt_len for r in requests)[:3] == [128, 128, 128]
