"""EAGLE drafts end to end on tiny checkpoints: greedy output equals the output without
speculation and transformers' own, token for token, for several draft lengths; a draft trained on
the target is accepted where an untrained one is not; the draft's KV, cut back after rejections,
is the KV of the tokens kept; both checkpoint layouts load the same draft; pickles are refused;
preemption and abort leave no block (and no draft KV) behind."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.request import Request
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.eagle import _Extension, _Held
from engine.spec_decode.eagle_checkpoint import load_eagle_draft, read_eagle_config
from engine.spec_decode.eagle_draft import DraftEntries, new_draft_kv
from tests.checkpoints import VOCAB_SIZE, make_checkpoint
from tests.engine.spec_decode.eagle_drafts import MAX_POSITIONS, make_cycle_drafts, make_eagle_draft
from tests.engine.spec_decode.eagle_scenarios import (
    assert_decode_speculates_after_a_pulled_prompt,
    assert_greedy_equals_transformers,
    assert_int8_target_greedy_equals_plain,
    assert_preemption_and_abort_leave_no_block_or_draft_kv_behind,
    cycle_prompts,
    recorded_chains,
)
from tests.engine.spec_decode.medusa_heads import HIDDEN_SIZE, cycle_snippet
from tests.engine.spec_decode.test_engine_spec import (
    GREEDY,
    GREEDY_PROCESSED,
    assert_sampling_keeps_the_plain_distribution,
    generate,
    make_engine,
    repetitive_prompts,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def cycle_drafts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int], Path, Path]:
    return make_cycle_drafts(tmp_path_factory.mktemp("cycle"))


def eagle(draft: Path, num_speculative_tokens: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(method="eagle", model=str(draft), num_speculative_tokens=num_speculative_tokens)


@pytest.mark.parametrize("num_speculative_tokens", [1, 3, 5])
def test_eagle_greedy_equals_plain_greedy(
    cycle_drafts: tuple[Path, list[int], Path, Path], num_speculative_tokens: int
) -> None:
    """The trained draft is accepted often but not always, so accepted, rejected and cut-back
    drafts all happen."""
    target, cycle, trained, _ = cycle_drafts
    prompts = cycle_prompts(cycle)
    expected = generate(make_engine(target), prompts, [GREEDY] * len(prompts))
    spec = make_engine(target, eagle(trained, num_speculative_tokens))
    assert generate(spec, prompts, [GREEDY] * len(prompts)) == expected  # and every block came back
    stats = spec.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_eagle_with_penalties_and_logprobs_equals_plain(cycle_drafts: tuple[Path, list[int], Path, Path]) -> None:
    target, cycle, trained, _ = cycle_drafts
    prompts = cycle_prompts(cycle)
    expected = generate(make_engine(target), prompts, [GREEDY_PROCESSED] * len(prompts))
    assert generate(make_engine(target, eagle(trained, 2)), prompts, [GREEDY_PROCESSED] * len(prompts)) == expected


def test_eagle_greedy_equals_transformers(target: Path, tmp_path: Path) -> None:
    assert_greedy_equals_transformers(target, eagle(make_eagle_draft(tmp_path / "draft", "eagle"), 4))


@pytest.mark.parametrize("split", [12, 5, 1], ids=["one-pass", "two-passes", "one-by-one"])
def test_the_draft_is_transformers_llama_layer_over_fc(split: int) -> None:
    """The draft as the speculators package builds it (transformers' LlamaDecoderLayer, its
    input norm replaced by the identity, after fc): the same outputs, whether its entries go
    through the draft KV in one pass or in several."""
    from torch import nn
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from tests.checkpoints import tiny_config
    from tests.engine.spec_decode.eagle_drafts import random_draft

    draft = random_draft(seed=3).eval()
    config = tiny_config("LlamaForCausalLM", num_hidden_layers=1)
    config._attn_implementation = "eager"
    layer = LlamaDecoderLayer(config, layer_idx=0).eval()
    layer.input_layernorm = nn.Identity()
    weights = {k.removeprefix("layers.0."): v for k, v in draft.state_dict().items() if k.startswith("layers.0.")}
    layer.load_state_dict(weights)
    num_entries = 12
    generator = torch.Generator().manual_seed(0)
    embeds, features = torch.randn(2, num_entries, HIDDEN_SIZE, generator=generator)
    with torch.no_grad():
        fused = draft.fc(torch.cat([embeds, features], -1))[None]
        positions = torch.arange(num_entries)[None]
        causal = torch.full((num_entries, num_entries), float("-inf")).triu(1)[None, None]
        position_embeddings = LlamaRotaryEmbedding(config)(fused, positions)
        expected = layer(fused, attention_mask=causal, position_ids=positions, position_embeddings=position_embeddings)
        kv = new_draft_kv(draft, 0)
        chunks = [slice(i, min(i + split, num_entries)) for i in range(0, num_entries, split)]
        ours = torch.cat([draft(embeds[c], features[c], DraftEntries.after(kv, c.stop - c.start)) for c in chunks])
    assert kv.length == num_entries
    torch.testing.assert_close(ours, expected[0], rtol=1e-4, atol=1e-4)


def test_eagle_over_an_int8_target_equals_its_plain_greedy(target: Path, tmp_path: Path) -> None:
    assert_int8_target_greedy_equals_plain(target, eagle(make_eagle_draft(tmp_path / "draft", "speculators")))


def test_a_trained_draft_is_accepted_more_than_an_untrained_one(
    cycle_drafts: tuple[Path, list[int], Path, Path],
) -> None:
    target, cycle, trained, untrained = cycle_drafts
    prompts = [cycle_snippet(cycle, start, 6) for start in (1, 8, 15)]  # on the cycle, as trained
    rates = {}
    for name, draft in (("trained", trained), ("untrained", untrained)):
        core = make_engine(target, eagle(draft, 3))
        generate(core, prompts, [GREEDY] * len(prompts))
        stats = core.scheduler.spec_stats
        rates[name] = stats.num_accepted_tokens / stats.num_draft_tokens
    assert rates["trained"] > 0.5 and rates["trained"] > 2 * rates["untrained"], rates


def test_the_draft_kv_after_rejections_is_the_kv_of_the_tokens_kept(
    cycle_drafts: tuple[Path, list[int], Path, Path],
) -> None:
    """Before each chain, the draft's KV and last output equal a fresh run of the draft over the
    request's kept entries (every (token i + 1, feature i) it was given, later ones in place of
    earlier at the same position), and the chain from that fresh run drafts the same tokens."""
    target, cycle, trained, _ = cycle_drafts
    core = make_engine(target, eagle(trained, 4), long_prefill_token_threshold=16)
    proposer = core.runner.eagle
    assert proposer is not None
    entries: dict[str, dict[int, tuple[int, torch.Tensor]]] = {}
    extend, chains = proposer._extend, proposer._chains
    num_checked = [0]

    def recording_extend(extensions: list[_Extension]) -> None:
        for extension in extensions:
            given = entries.setdefault(extension.held.request.request_id, {})
            for j, token_id in enumerate(extension.token_ids):
                given[extension.start + j] = (token_id, extension.features[j].clone())
        extend(extensions)

    def checked_chains(helds: list[_Held]) -> list[list[int]]:
        fresh_helds = []
        for held in helds:
            kv = held.kv
            given = entries[held.request.request_id]
            token_ids = torch.tensor([given[i][0] for i in range(kv.start, kv.end)])
            features = torch.stack([given[i][1] for i in range(kv.start, kv.end)])
            fresh = new_draft_kv(proposer.draft, kv.start)
            outputs = proposer.draft(proposer.embed(token_ids), features, DraftEntries.after(fresh, kv.length))
            assert fresh.length == kv.length
            torch.testing.assert_close(fresh.keys[0][: kv.length], kv.keys[0][: kv.length], atol=1e-5, rtol=1e-5)
            assert held.last_output is not None
            torch.testing.assert_close(outputs[-1:], held.last_output, atol=1e-5, rtol=1e-5)
            fresh_helds.append(_Held(held.request, fresh, outputs[-1:]))
        drafts = chains(helds)
        assert chains(fresh_helds) == drafts
        num_checked[0] += len(helds)
        return drafts

    proposer._extend = recording_extend  # type: ignore[method-assign]
    proposer._chains = checked_chains  # type: ignore[method-assign]
    prompts = cycle_prompts(cycle)
    with torch.inference_mode():
        generate(core, prompts, [GREEDY] * len(prompts))
    stats = core.scheduler.spec_stats
    assert num_checked[0] > len(prompts) and 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize(
    "options",
    [{}, {"own_embedding": True, "own_lm_head": True, "fc_bias": False}, {"layernorms": True, "own_lm_head": True}],
    ids=["eagle-1", "own-embedding-and-head", "hass-layernorms"],
)
def test_both_layouts_load_the_same_draft(target: Path, tmp_path: Path, options: dict[str, bool]) -> None:
    """The same random draft written in EAGLE's reference layout and the speculators package's
    loads to the same tensors, and drafts the same tokens in the engine."""
    layouts = ["speculators"] if options.get("layernorms") else ["eagle", "speculators"]
    folders = [make_eagle_draft(tmp_path / layout, layout, **options) for layout in layouts]  # type: ignore[arg-type]
    drafts = [load_eagle_draft(f, HIDDEN_SIZE, VOCAB_SIZE, MAX_POSITIONS, torch.float32, CPU) for f in folders]
    assert [read_eagle_config(f).layout for f in folders] == layouts
    for draft in drafts[1:]:
        assert draft.shape == drafts[0].shape
        assert draft.state_dict().keys() == drafts[0].state_dict().keys()
        for name, tensor in drafts[0].state_dict().items():
            assert torch.equal(tensor, draft.state_dict()[name]), name
    prompts = repetitive_prompts()
    drafted = []
    for folder in folders:
        core = make_engine(target, eagle(folder, 3))
        assert core.runner.eagle is not None
        proposals = recorded_chains(core.runner.eagle)
        generate(core, prompts, [GREEDY] * len(prompts))
        drafted.append(proposals)
    assert drafted[0] and all(d == drafted[0] for d in drafted)


def test_a_pickle_is_refused_with_the_way_to_convert_it(tmp_path: Path) -> None:
    draft = make_eagle_draft(tmp_path / "draft", "eagle")
    (draft / "model.safetensors").rename(draft / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pickle \(pytorch_model\.bin\).*weights_only=True"):
        load_eagle_draft(draft, HIDDEN_SIZE, VOCAB_SIZE, MAX_POSITIONS, torch.float32, CPU)


def test_a_draft_for_another_model_is_refused(tmp_path: Path) -> None:
    draft = make_eagle_draft(tmp_path / "draft", "speculators")
    with pytest.raises(ValueError, match="features of 64, the target's hidden states are 32"):
        load_eagle_draft(draft, 32, VOCAB_SIZE, MAX_POSITIONS, torch.float32, CPU)
    with pytest.raises(ValueError, match="vocabulary of 512 tokens, the target's has 1000"):
        load_eagle_draft(draft, HIDDEN_SIZE, 1000, MAX_POSITIONS, torch.float32, CPU)


def test_eagle_needs_a_folder_and_a_whole_model(target: Path) -> None:
    with pytest.raises(ValueError, match="EAGLE speculation needs the draft's folder"):
        SpeculativeConfig(method="eagle")
    for parallel in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        with pytest.raises(ValueError, match="eagle speculation is not supported with --(tensor|pipeline)-parallel"):
            EngineConfig(model=str(target), speculative=eagle(target), **parallel)  # type: ignore[arg-type]


def test_preemption_and_abort_leave_no_block_or_draft_kv_behind(
    cycle_drafts: tuple[Path, list[int], Path, Path],
) -> None:
    target, cycle, trained, _ = cycle_drafts
    assert_preemption_and_abort_leave_no_block_or_draft_kv_behind(target, cycle, eagle(trained), block_bytes=8192)


@pytest.mark.parametrize("with_prompt_draft_kv", [True, False])
def test_decode_instance_speculates_with_eagle_after_a_pulled_prompt(
    cycle_drafts: tuple[Path, list[int], Path, Path], with_prompt_draft_kv: bool
) -> None:
    target, cycle, trained, _ = cycle_drafts
    assert_decode_speculates_after_a_pulled_prompt(target, cycle, eagle(trained), with_prompt_draft_kv)


def test_sampled_output_with_eagle_has_the_plain_distribution(cycle_drafts: tuple[Path, list[int], Path, Path]) -> None:
    """Many seeded samples of the first four tokens, with and without EAGLE: a chi-square test on
    the joint outcome (top-k 3 keeps the outcomes few). The trained draft guesses the target's
    likeliest token, which a temperature-1 sample sometimes is and sometimes not, so both
    acceptance and rejection run."""

    target, cycle, trained, _ = cycle_drafts
    prompt = cycle_snippet(cycle, 3, 6)
    assert_sampling_keeps_the_plain_distribution(target, eagle(trained, 2), prompt)


def test_a_prefix_cache_hit_starts_the_draft_kv_after_the_hit(cycle_drafts: tuple[Path, list[int], Path, Path]) -> None:
    """The second of two requests with one prompt finds its full blocks cached: the target never
    computes them again, so the draft's KV for it starts after them; its output is still the
    plain one and its drafts are still accepted."""
    target, cycle, trained, _ = cycle_drafts
    prompt = cycle_snippet(cycle, 4, 40)  # two full blocks of 16 and some
    expected = generate(make_engine(target), [prompt], [GREEDY])[0]
    core = make_engine(target, eagle(trained))
    proposer = core.runner.eagle
    assert proposer is not None
    starts: dict[str, int] = {}
    cut_back = proposer._cut_back

    def recording(request: Request, start: int, num_entries: int) -> _Held | None:
        held = cut_back(request, start, num_entries)
        if held is not None:
            starts.setdefault(request.request_id, held.kv.start)
        return held

    proposer._cut_back = recording  # type: ignore[method-assign]
    outputs = []
    for request_id in ("first", "second"):
        accepted_before = core.scheduler.spec_stats.num_accepted_tokens
        core.add_request(prompt, GREEDY, request_id=request_id)
        tokens: list[int] = []
        while core.has_unfinished_requests():
            for output in core.step():
                tokens.extend(output.new_token_ids)
        outputs.append(tokens)
        assert core.scheduler.spec_stats.num_accepted_tokens > accepted_before
    assert outputs == [expected, expected]
    assert starts == {"first": 0, "second": 32}


def test_an_interrupted_draft_training_resumes_to_the_same_draft(tmp_path: Path) -> None:
    import dataclasses

    from engine.spec_decode.eagle_training import DraftTraining, train_draft
    from tests.engine.spec_decode.eagle_drafts import random_draft

    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(3, VOCAB_SIZE, (n,), generator=generator).tolist() for n in (9, 14, 6)]
    features = [torch.randn(len(s), HIDDEN_SIZE, generator=generator) for s in sequences]
    embed, lm_head = torch.randn(2, VOCAB_SIZE, HIDDEN_SIZE, generator=generator)
    settings = DraftTraining(num_steps=6, checkpoint_every=3, sequences_per_step=2)
    whole, halves = random_draft(seed=1), random_draft(seed=1)
    train_draft(whole, sequences, features, embed, lm_head, settings, tmp_path / "whole.pt")
    first_half = dataclasses.replace(settings, num_steps=3)
    train_draft(halves, sequences, features, embed, lm_head, first_half, tmp_path / "halves.pt")
    resumed = random_draft(seed=1)
    train_draft(resumed, sequences, features, embed, lm_head, settings, tmp_path / "halves.pt")
    for name, tensor in whole.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[name]), name
    assert not torch.equal(whole.fc.weight, random_draft(seed=1).fc.weight)  # it trained
