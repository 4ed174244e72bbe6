"""Medusa heads end to end on the tiny random checkpoint: greedy output equals the output without
speculation and transformers' own greedy output, token for token, for each checkpoint layout;
a decode instance speculates after a pulled prompt; pickles are refused; every block comes back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.flat_batch import FlatBatch
from engine.sampling_params import SamplingParams
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.medusa_checkpoint import load_medusa_heads, read_medusa_config
from tests.checkpoints import VOCAB_SIZE, make_checkpoint
from tests.engine.kv_loaders import InProcessKVLoader
from tests.engine.spec_decode.medusa_heads import HIDDEN_SIZE, make_medusa_heads
from tests.engine.spec_decode.test_engine_spec import (
    GREEDY,
    GREEDY_PROCESSED,
    assert_sampling_keeps_the_plain_distribution,
    generate,
    make_engine,
    repetitive_prompts,
)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def plain_greedy(target: Path) -> list[list[int]]:
    prompts = repetitive_prompts()
    return generate(make_engine(target), prompts, [GREEDY] * len(prompts))


HEADS = {
    "medusa-1": {"layout": "medusa-1", "num_layers": 1},
    "vllm-own-projections": {"layout": "vllm", "num_layers": 2},
    "vllm-target-lm-head": {"layout": "vllm", "num_layers": 1, "own_projections": False},
}


def medusa(heads: Path, num_speculative_tokens: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(method="medusa", model=str(heads), num_speculative_tokens=num_speculative_tokens)


@pytest.mark.parametrize("kind", sorted(HEADS))
def test_medusa_greedy_equals_plain_greedy(
    target: Path, plain_greedy: list[list[int]], tmp_path: Path, kind: str
) -> None:
    heads = make_medusa_heads(tmp_path / kind, **HEADS[kind])  # type: ignore[arg-type]
    prompts = repetitive_prompts()
    spec = make_engine(target, medusa(heads))
    assert generate(spec, prompts, [GREEDY] * len(prompts)) == plain_greedy  # and every block came back
    stats = spec.scheduler.spec_stats
    assert stats.num_draft_tokens > 0  # the heads drafted, every step after a request's first


def test_medusa_with_penalties_and_logprobs_equals_plain(target: Path, tmp_path: Path) -> None:
    heads = make_medusa_heads(tmp_path / "heads", "vllm", own_projections=False)
    prompts = repetitive_prompts()
    expected = generate(make_engine(target), prompts, [GREEDY_PROCESSED] * len(prompts))
    assert generate(make_engine(target, medusa(heads, 2)), prompts, [GREEDY_PROCESSED] * len(prompts)) == expected


def test_medusa_greedy_equals_transformers(target: Path, tmp_path: Path) -> None:
    heads = make_medusa_heads(tmp_path / "heads", "medusa-1")
    prompts = repetitive_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ours = generate(make_engine(target, medusa(heads)), prompts, [params] * len(prompts))
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, ours):
        with torch.no_grad():
            reference = model.generate(
                torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24, pad_token_id=0
            )
        assert tokens == reference[0, len(prompt) :].tolist()


@pytest.mark.parametrize("handed_drafts", [True, False], ids=["with-p-drafts", "without"])
def test_decode_instance_speculates_with_medusa_after_a_pulled_prompt(
    target: Path, plain_greedy: list[list[int]], tmp_path: Path, handed_drafts: bool
) -> None:
    """P runs the heads once, on the prompt's last hidden state, and hands their drafts over
    with the KV: D verifies drafts from its first step. Without them (a P that sent none) D's
    first step is plain, which gives it the hidden state its heads draft from."""
    heads = make_medusa_heads(tmp_path / "heads", "vllm")
    prompts = repetitive_prompts()
    p = make_engine(target, medusa(heads), role="prefill")
    d = make_engine(target, medusa(heads), role="decode")
    loader = InProcessKVLoader(p.runner.kv_cache, d.runner.kv_cache)
    d.use_kv_loader(loader)
    for index, prompt in enumerate(prompts):
        p.add_request(prompt, GREEDY, request_id="r")
        (handoff,) = [o for o in p.step() if o.request_id == "r"]
        first, drafts = handoff.new_token_ids[0], handoff.kv_handoff.draft_token_ids
        assert len(drafts) == 3  # one per head
        loader.expect("r", handoff.kv_handoff.block_ids)
        d.add_request(
            prompt, GREEDY, request_id="r", first_token_id=first, draft_token_ids=drafts if handed_drafts else None
        )
        d.step()  # the load starts (and ends: an in-process copy)
        assert p.release_kv("r")
        drafted_before = d.scheduler.spec_stats.num_draft_tokens
        tokens = [first]
        for output in d.step():  # D's first decode step
            tokens.extend(output.new_token_ids)
        assert (d.scheduler.spec_stats.num_draft_tokens > drafted_before) == handed_drafts
        while d.has_unfinished_requests():
            for output in d.step():
                tokens.extend(output.new_token_ids)
        assert tokens == plain_greedy[index]
    assert p.scheduler.spec_stats.num_draft_tokens == 0  # P proposes, never verifies
    assert d.kv_cache_manager.num_free_blocks == d.kv_cache_manager.num_total_blocks
    assert p.kv_cache_manager.num_free_blocks == p.kv_cache_manager.num_total_blocks


def test_both_layouts_load_the_same_heads(tmp_path: Path) -> None:
    """The same random heads written in Medusa-1's layout and vLLM's load to the same tensors."""
    one = load_medusa_heads(
        make_medusa_heads(tmp_path / "one", "medusa-1", num_layers=2),
        HIDDEN_SIZE,
        VOCAB_SIZE,
        torch.float32,
        torch.device("cpu"),
    )
    other = load_medusa_heads(
        make_medusa_heads(tmp_path / "other", "vllm", num_layers=2),
        HIDDEN_SIZE,
        VOCAB_SIZE,
        torch.float32,
        torch.device("cpu"),
    )
    assert one.state_dict().keys() == other.state_dict().keys()
    for name, tensor in one.state_dict().items():
        assert torch.equal(tensor, other.state_dict()[name]), name


def test_a_pickle_is_refused_with_the_way_to_convert_it(tmp_path: Path) -> None:
    heads = make_medusa_heads(tmp_path / "heads", "medusa-1")
    (heads / "medusa_lm_head.safetensors").rename(heads / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match=r"pickle \(medusa_lm_head\.pt\).*weights_only=True"):
        load_medusa_heads(heads, HIDDEN_SIZE, VOCAB_SIZE, torch.float32, torch.device("cpu"))


def test_heads_for_another_model_are_refused(tmp_path: Path) -> None:
    heads = make_medusa_heads(tmp_path / "heads", "vllm")
    with pytest.raises(ValueError, match="vocabulary of 512 tokens, the target's has 1000"):
        load_medusa_heads(heads, HIDDEN_SIZE, 1000, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="hidden states of 64, the target's are 32"):
        load_medusa_heads(heads, 32, VOCAB_SIZE, torch.float32, torch.device("cpu"))


def test_more_drafts_than_heads_is_refused(target: Path, tmp_path: Path) -> None:
    heads = make_medusa_heads(tmp_path / "heads", "vllm", num_heads=2)
    assert read_medusa_config(heads).num_heads == 2
    with pytest.raises(ValueError, match="2 heads, fewer than the 3 speculative tokens"):
        make_engine(target, medusa(heads, 3))


def test_the_native_decode_step_hands_the_heads_the_modules_hidden_states(
    target: Path, plain_greedy: list[list[int]], tmp_path: Path
) -> None:
    """CPU decode and verification steps run in one native call (engine/models/native_decode.py);
    with Medusa it also writes the final hidden states, bit for bit the modules' own."""
    core = make_engine(target, medusa(make_medusa_heads(tmp_path / "heads", "vllm")))
    runner = core.runner
    native = runner.native_decode
    if native is None:
        pytest.skip("no native CPU kernels here (no C compiler)")
    num_rows_checked: list[int] = []

    def checked(batch: FlatBatch, final_hidden_out: torch.Tensor | None = None) -> torch.Tensor | None:
        logits = native(batch, final_hidden_out)
        if logits is None:
            return None
        assert final_hidden_out is not None  # Medusa asks for them at every step
        expected_hidden = torch.empty_like(final_hidden_out)
        expected = runner.model(
            batch.input_ids, batch.positions, runner.layer_caches, batch.metadata, batch.logits_indices, expected_hidden
        )
        assert torch.equal(logits, expected) and torch.equal(final_hidden_out, expected_hidden)
        num_rows_checked.append(batch.input_ids.shape[0])
        return logits

    runner.native_decode = checked  # type: ignore[assignment]
    prompts = repetitive_prompts()
    assert generate(core, prompts, [GREEDY] * len(prompts)) == plain_greedy
    assert max(num_rows_checked) > len(prompts)  # verification steps (1 + drafts rows a request) went native


def test_preemption_and_abort_leave_no_block_behind(
    target: Path, plain_greedy: list[list[int]], tmp_path: Path
) -> None:
    """A KV cache too small for every request at once: requests are preempted (their drafts
    dropped with them) and recomputed, and their output is still the plain one; an aborted
    request gives its blocks back."""
    heads = make_medusa_heads(tmp_path / "heads", "vllm")
    prompts = repetitive_prompts()
    small = make_engine(target, medusa(heads), kv_cache_memory=12 * 8192)  # 12 blocks of the tiny model
    assert small.kv_cache_manager.num_total_blocks == 12
    assert generate(small, prompts, [GREEDY] * len(prompts)) == plain_greedy  # and every block came back
    assert small.scheduler.num_preemptions > 0 and small.scheduler.spec_stats.num_draft_tokens > 0

    core = make_engine(target, medusa(heads))
    for index, prompt in enumerate(prompts):
        core.add_request(prompt, GREEDY, request_id=f"r{index}")
    for _ in range(4):
        core.step()
    assert core.scheduler.spec_stats.num_draft_tokens > 0  # drafts were in flight
    core.abort(["r0", "r2"])
    while core.has_unfinished_requests():
        core.step()
    manager = core.kv_cache_manager
    assert manager.num_free_blocks == manager.num_total_blocks


def test_sampled_output_with_medusa_has_the_plain_distribution(target: Path, tmp_path: Path) -> None:
    """Many seeded samples of the first four tokens, with and without Medusa: a chi-square test
    on the joint outcome (top-k 3 keeps the outcomes few). The heads are untrained (each guesses
    the target's own next token again), which the target sometimes samples and sometimes not, so
    both acceptance and rejection run."""
    from engine.spec_decode.medusa_checkpoint import save_medusa_heads
    from engine.spec_decode.medusa_training import HeadTraining, new_heads

    heads = tmp_path / "heads"
    save_medusa_heads(new_heads(HeadTraining(num_heads=2), HIDDEN_SIZE, VOCAB_SIZE), heads, VOCAB_SIZE, {})
    prompt = repetitive_prompts()[1]
    assert_sampling_keeps_the_plain_distribution(target, medusa(heads, 2), prompt)
