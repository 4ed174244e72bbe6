"""Speculative decoding end to end on tiny random-weight checkpoints: greedy output equals the
non-speculative output token for token (colocated and on a decode instance, n-gram and draft
model), sampled output has the non-speculative distribution (chi-square), and every block
comes back."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from engine.spec_decode.config import SpeculativeConfig
from tests.checkpoints import VOCAB_SIZE, make_checkpoint
from tests.engine.kv_loaders import InProcessKVLoader
from tests.engine.spec_decode.chi_square import two_sample

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another checkpoint with the target's vocabulary: one layer, other weights."""
    return make_checkpoint(tmp_path_factory.mktemp("draft"), seed=1, num_hidden_layers=1)


def make_engine(model: Path, speculative: SpeculativeConfig | None = None, **config: object) -> EngineCore:
    config.setdefault("kv_cache_memory", 1 << 22)
    return EngineCore(EngineConfig(model=str(model), dtype="float32", speculative=speculative, **config))  # type: ignore[arg-type]


def generate(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    ids = [core.add_request(prompt, p, request_id=f"r{i}") for i, (prompt, p) in enumerate(zip(prompts, params))]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    manager = core.kv_cache_manager
    while core.has_unfinished_requests():
        for output in core.step():
            tokens[output.request_id].extend(output.new_token_ids)
        # No request ever holds a block beyond its computed tokens (and the next one) after a step.
        for request in core.scheduler.running:
            held = len(manager.get_block_ids(request.request_id))
            assert held <= -(-request.num_tokens // manager.block_size)
    assert manager.num_free_blocks == manager.num_total_blocks
    return [tokens[i] for i in ids]


def repetitive_prompts() -> list[list[int]]:
    """Prompts whose lookups hit: repeated phrases, and the model's own loops."""
    rng = random.Random(5)
    phrase = [rng.randrange(3, VOCAB_SIZE) for _ in range(7)]
    return [phrase * 5, [9, 8, 7, 6] * 6 + [9, 8], [rng.randrange(3, VOCAB_SIZE) for _ in range(40)], phrase[:3] * 3]


GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
# Every per-position input of the sampler: penalties and min_tokens see the drafts as output.
GREEDY_PROCESSED = SamplingParams(
    temperature=0.0, max_tokens=48, repetition_penalty=1.05, frequency_penalty=0.05, min_tokens=6, logprobs=2
)


@pytest.mark.parametrize("params", [GREEDY, GREEDY_PROCESSED], ids=["greedy", "greedy-penalties-logprobs"])
def test_ngram_greedy_equals_plain_greedy(target: Path, params: SamplingParams) -> None:
    prompts = repetitive_prompts()
    plain = make_engine(target)
    spec = make_engine(target, NGRAM)
    expected = generate(plain, prompts, [params] * len(prompts))
    assert generate(spec, prompts, [params] * len(prompts)) == expected
    stats = spec.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    report = spec.load_report()
    assert (report.num_spec_draft_tokens, report.num_spec_accepted_tokens) == (
        stats.num_draft_tokens,
        stats.num_accepted_tokens,
    )
    # By position and by accepted length, adding up to the totals.
    assert sum(report.num_spec_draft_tokens_per_pos) == stats.num_draft_tokens
    assert sum(report.num_spec_accepted_tokens_per_pos) == stats.num_accepted_tokens
    by_length = report.num_spec_verifications_by_accepted
    assert sum(n * count for n, count in enumerate(by_length)) == stats.num_accepted_tokens
    assert len(by_length) == len(report.num_spec_draft_tokens_per_pos) + 1 > 1


def test_ngram_logprobs_equal_plain_logprobs(target: Path) -> None:
    prompt = repetitive_prompts()[0]
    outputs = {}
    for name, core in (("plain", make_engine(target)), ("spec", make_engine(target, NGRAM))):
        core.add_request(prompt, GREEDY_PROCESSED, request_id="r")
        logprobs = []
        while core.has_unfinished_requests():
            for output in core.step():
                logprobs.extend(output.new_logprobs)
        outputs[name] = [(lp.token_id, lp.rank, [t for t, _ in lp.top_logprobs]) for lp in logprobs]
        values = [lp.logprob for lp in logprobs]
        outputs[name + "_values"] = values
    assert outputs["spec"] == outputs["plain"]
    assert outputs["spec_values"] == pytest.approx(outputs["plain_values"], abs=1e-4)


@pytest.mark.parametrize("draft", ["target", "small"])
def test_draft_model_greedy_equals_plain_greedy(target: Path, small_draft: Path, draft: str) -> None:
    prompts = repetitive_prompts()
    draft_path = target if draft == "target" else small_draft
    spec = make_engine(target, SpeculativeConfig(method="draft_model", num_speculative_tokens=3, model=str(draft_path)))
    expected = generate(make_engine(target), prompts, [GREEDY] * len(prompts))
    assert generate(spec, prompts, [GREEDY] * len(prompts)) == expected
    stats = spec.scheduler.spec_stats
    if draft == "target":  # the target drafting for itself is always right
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    else:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_decode_instance_speculates_after_a_pulled_prompt(target: Path, small_draft: Path, method: str) -> None:
    """P prefills, the KV is copied to D (the connector's job, by hand), D speculates; the draft
    model computes its own KV for the prompt on D."""
    draft = SpeculativeConfig(method="draft_model", num_speculative_tokens=3, model=str(small_draft))
    spec = NGRAM if method == "ngram" else draft
    prompts = repetitive_prompts()
    expected = generate(make_engine(target), prompts, [GREEDY] * len(prompts))
    p = make_engine(target, spec, role="prefill")
    d = make_engine(target, spec, role="decode")
    loader = InProcessKVLoader(p.runner.kv_cache, d.runner.kv_cache)
    d.use_kv_loader(loader)
    assert p.speculative is None and p.runner.draft_model is None  # P samples one token, never drafts
    for index, prompt in enumerate(prompts):
        p.add_request(prompt, GREEDY, request_id="r")
        (handoff,) = [o for o in p.step() if o.request_id == "r"]
        first = handoff.new_token_ids[0]
        loader.expect("r", handoff.kv_handoff.block_ids)
        d.add_request(prompt, GREEDY, request_id="r", first_token_id=first)
        d.step()  # the load starts (and ends: an in-process copy)
        assert p.release_kv("r")
        tokens = [first]
        while d.has_unfinished_requests():
            for output in d.step():
                tokens.extend(output.new_token_ids)
        assert tokens == expected[index]
    assert d.scheduler.spec_stats.num_accepted_tokens > 0
    assert d.kv_cache_manager.num_free_blocks == d.kv_cache_manager.num_total_blocks


NUM_SAMPLES = 1500


def assert_sampling_keeps_the_plain_distribution(
    target: Path, spec: SpeculativeConfig, prompt: list[int], **config: object
) -> None:
    """Many seeded samples of the first four tokens after ``prompt``, speculative against plain,
    are one distribution (a chi-square test on the joint outcome; top-k 3 keeps the outcomes few,
    at most 81, so the test has power), and drafts were both accepted and rejected on the way."""
    samples = {}
    for name, speculative in (("plain", None), ("spec", spec)):
        # No prefix caching: equal prompts without a cached prefix prefill in one batched attention call.
        core = make_engine(
            target,
            speculative,
            max_num_seqs=512,
            max_num_batched_tokens=16384,
            kv_cache_memory=1 << 24,
            enable_prefix_caching=False,
            **config,
        )
        params = [
            SamplingParams(temperature=1.0, top_k=3, max_tokens=4, seed=seed, ignore_eos=True)
            for seed in range(NUM_SAMPLES)
        ]
        samples[name] = [tuple(t) for t in generate(core, [prompt] * NUM_SAMPLES, params)]
        if speculative is not None:
            stats = core.scheduler.spec_stats
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert two_sample(samples["plain"], samples["spec"]) > 1e-3


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_output_has_the_plain_distribution(target: Path, small_draft: Path, method: str) -> None:
    """Speculative sampling keeps the plain distribution (the helper's chi-square test)."""
    plain = make_engine(target)
    if method == "ngram":
        # Random weights copy nothing from their context, but their greedy output loops: a prompt
        # ending in the model's own loop gives lookups the target sometimes accepts.
        prompt = repetitive_prompts()[3]
        prompt = (
            prompt + generate(plain, [prompt], [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)])[0]
        )
        spec = NGRAM
    else:
        prompt = repetitive_prompts()[1]
        spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=2, model=str(small_draft))
    assert_sampling_keeps_the_plain_distribution(target, spec, prompt)


def test_a_request_under_a_grammar_does_not_speculate_beside_ones_that_do(target: Path) -> None:
    """A mixed batch: speculating requests and regex-constrained ones share every step; the
    constrained rows keep their mask (their output matches), nobody's tokens change."""
    from engine.llm import LLM
    from engine.structured_output import StructuredOutputSpec

    regex = StructuredOutputSpec("regex", r"[a-z]{2,5}-[0-9]{3}")
    assert SamplingParams().can_speculate and not SamplingParams(structured=regex).can_speculate
    repetitive = repetitive_prompts()
    prompts = [repetitive[0], "The quick", repetitive[1], "Paris is"]
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=20, structured=regex)] * 2
    outputs = {}
    for name, spec in (("plain", None), ("spec", NGRAM)):
        llm = LLM(model=str(target), dtype="float32", kv_cache_memory=1 << 22, speculative=spec)
        outputs[name] = [o.outputs[0] for o in llm.generate(prompts, params)]
        if spec is not None:
            assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert [o.token_ids for o in outputs["spec"]] == [o.token_ids for o in outputs["plain"]]
    for output in outputs["spec"][1::2]:
        assert re.fullmatch(regex.spec, output.text), output.text
