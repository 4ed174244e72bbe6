"""Scenarios EAGLE's and EAGLE-3's engine tests both run (test_eagle.py, test_eagle3.py), each
with its own target and trained cycle draft: the same proposer serves both methods
(engine/spec_decode/eagle.py), so the same scenario must hold for both."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from engine.engine_core import EngineCore
from engine.models.cpu_linear import BF16WeightLinear, PackedLinear
from engine.models.quantized_linear import QuantizedLinear
from engine.sampling_params import SamplingParams
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.eagle import EagleProposer, _Held
from tests.engine.kv_loaders import InProcessKVLoader
from tests.engine.spec_decode.medusa_heads import cycle_snippet
from tests.engine.spec_decode.test_engine_spec import GREEDY, generate, make_engine, repetitive_prompts


def cycle_prompts(cycle: list[int]) -> list[list[int]]:
    """On the cycle, off it (the target's own continuation), and short."""
    return [
        cycle_snippet(cycle, 5, 8),
        [7, 9, 11, 13, 15, 17],
        cycle_snippet(cycle, 11, 4),
        cycle_snippet(cycle, 2, 30),
    ]


def recorded_chains(proposer: EagleProposer) -> list[list[int]]:
    """Every chain ``proposer`` drafts from now on, in order."""
    proposals: list[list[int]] = []
    chains = proposer._chains

    def recording(helds: list[_Held]) -> list[list[int]]:
        drafted = chains(helds)
        proposals.extend(drafted)
        return drafted

    proposer._chains = recording  # type: ignore[method-assign]
    return proposals


def recorded_drafts(core: EngineCore) -> list[list[int]]:
    """Every chain ``core``'s EAGLE proposer makes from now on, in order (one request at a time)."""
    proposer = core.runner.eagle
    assert proposer is not None
    chains: list[list[int]] = []
    propose = proposer.propose

    def recording(*args, **kwargs) -> list[list[int]]:  # type: ignore[no-untyped-def]
        drafts = propose(*args, **kwargs)
        chains.extend(chain for chain in drafts if chain)
        return drafts

    proposer.propose = recording  # type: ignore[method-assign]
    return chains


def assert_preemption_and_abort_leave_no_block_or_draft_kv_behind(
    target: Path, cycle: list[int], spec: SpeculativeConfig, block_bytes: int
) -> None:
    """A KV cache of 12 blocks (``block_bytes`` each), too small for every request at once:
    requests are preempted and recomputed (their draft KV dropped and rebuilt), and their output is
    still the plain one; aborted requests give their blocks back, and no finished request's draft
    KV outlives the next step."""
    prompts = cycle_prompts(cycle)
    expected = generate(make_engine(target), prompts, [GREEDY] * len(prompts))
    small = make_engine(target, spec, kv_cache_memory=12 * block_bytes)
    assert small.kv_cache_manager.num_total_blocks == 12
    assert generate(small, prompts, [GREEDY] * len(prompts)) == expected  # and every block came back
    assert small.scheduler.num_preemptions > 0 and small.scheduler.spec_stats.num_accepted_tokens > 0

    core = make_engine(target, spec)
    proposer = core.runner.eagle
    assert proposer is not None
    for index, prompt in enumerate(prompts):
        core.add_request(prompt, GREEDY, request_id=f"r{index}")
    for _ in range(4):
        core.step()
    assert core.scheduler.spec_stats.num_draft_tokens > 0 and {"r0", "r2"} <= set(proposer.held)
    core.abort(["r0", "r2"])
    while core.has_unfinished_requests():
        core.step()
    manager = core.kv_cache_manager
    assert manager.num_free_blocks == manager.num_total_blocks
    core.add_request(prompts[0], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), request_id="last")
    while core.has_unfinished_requests():
        core.step()
    assert set(proposer.held) == {"last"}  # every earlier request's draft KV dropped


def assert_decode_speculates_after_a_pulled_prompt(
    target: Path, cycle: list[int], spec: SpeculativeConfig, with_prompt_draft_kv: bool
) -> None:
    """P's draft chains after the first token and D verifies that chain at its first step. With
    the draft's KV over the prompt handed over too (engine/spec_decode/prompt_draft_kv.py), D's
    draft attends over the whole prompt: every chain P and D make is the colocated engine's, in
    order. Without it, D's draft attends from its first step's position on, and its chains
    differ. Either way the output is the plain one, and no block is left behind."""
    prompts = cycle_prompts(cycle)
    expected = generate(make_engine(target), prompts, [GREEDY] * len(prompts))
    colocated = make_engine(target, spec)
    colocated_chains = recorded_drafts(colocated)
    assert [generate(colocated, [prompt], [GREEDY])[0] for prompt in prompts] == expected  # one at a time, as P and D
    p = make_engine(target, spec, role="prefill")
    d = make_engine(target, spec, role="decode")
    chains = recorded_drafts(p)
    d_chains = recorded_drafts(d)
    loader = InProcessKVLoader(p.runner.kv_cache, d.runner.kv_cache)
    d.use_kv_loader(loader)
    for index, prompt in enumerate(prompts):
        p.add_request(prompt, GREEDY, request_id="r")
        (handoff,) = [o for o in p.step() if o.request_id == "r"]
        prompt_draft_kv = handoff.kv_handoff.prompt_draft_kv
        assert prompt_draft_kv is not None and (prompt_draft_kv.start, prompt_draft_kv.end) == (0, len(prompt))
        loader.expect("r", handoff.kv_handoff.block_ids, prompt_draft_kv if with_prompt_draft_kv else None)
        first = handoff.new_token_ids[0]
        drafts = handoff.kv_handoff.draft_token_ids
        assert drafts == chains[-1] and len(drafts) == spec.num_speculative_tokens
        d.add_request(prompt, GREEDY, request_id="r", first_token_id=first, draft_token_ids=drafts)
        d.step()  # the load starts (and ends: an in-process copy)
        assert p.release_kv("r")
        tokens = [first]
        while d.has_unfinished_requests():
            for output in d.step():
                tokens.extend(output.new_token_ids)
        assert tokens == expected[index]
        chains.extend(d_chains)
        d_chains.clear()
    assert (chains == colocated_chains) is with_prompt_draft_kv
    assert d.scheduler.spec_stats.num_accepted_tokens > 0
    assert d.runner.eagle is not None and set(d.runner.eagle.held) <= {"r"}
    assert d.kv_cache_manager.num_free_blocks == d.kv_cache_manager.num_total_blocks
    assert p.kv_cache_manager.num_free_blocks == p.kv_cache_manager.num_total_blocks


def assert_greedy_equals_transformers(target: Path, spec: SpeculativeConfig) -> EngineCore:
    """Greedy tokens with ``spec`` (some drafted) are transformers' own, token for token, and the
    engine's without speculation; returns the speculating engine."""
    prompts = repetitive_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = generate(make_engine(target), prompts, [params] * len(prompts))
    core = make_engine(target, spec)
    ours = generate(core, prompts, [params] * len(prompts))  # and every block came back
    assert ours == expected
    assert core.scheduler.spec_stats.num_draft_tokens > 0
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, ours):
        with torch.no_grad():
            reference = model.generate(
                torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24, pad_token_id=0
            )
        assert tokens == reference[0, len(prompt) :].tolist()
    return core


def drafter_linears(drafter: nn.Module) -> list[nn.Module]:
    """The drafter's linear layers, in whichever form they were loaded."""
    return [m for m in drafter.modules() if isinstance(m, (nn.Linear, QuantizedLinear, PackedLinear, BF16WeightLinear))]


def assert_int8_target_greedy_equals_plain(target: Path, spec: SpeculativeConfig) -> None:
    """Quantized weights (the embedding and LM head included) serve the draft as they serve the
    target, and the draft's own linear layers run INT8 rows (engine/spec_decode/draft_linears.py):
    greedy tokens with ``spec`` (some drafted) are the int8 engine's without speculation."""
    prompts = repetitive_prompts()
    expected = generate(make_engine(target, quantization="int8"), prompts, [GREEDY] * len(prompts))
    core = make_engine(target, spec, quantization="int8")
    assert core.runner.eagle is not None
    linears = drafter_linears(core.runner.eagle.draft)  # type: ignore[arg-type]
    assert linears and all(isinstance(m, QuantizedLinear) for m in linears), linears
    assert generate(core, prompts, [GREEDY] * len(prompts)) == expected
    assert core.scheduler.spec_stats.num_draft_tokens > 0
