"""EAGLE-3 drafts end to end on tiny checkpoints: greedy output equals the output without
speculation and transformers' own, token for token; the target's captured layers are transformers'
hidden states and the draft layer is EAGLE-3's as the speculators package builds it; a draft
vocabulary smaller than the target's drafts the target's tokens through d2t; both checkpoint
layouts load the same draft; sampling keeps the target's distribution; preemption and abort leave
no block (and no draft KV) behind; P's chain and draft KV cross the hand-off to D as EAGLE's do
(the scenarios both methods run: eagle_scenarios.py); what cannot be served is refused, saying why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine.sampling_params import SamplingParams
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.eagle3_checkpoint import load_eagle3_draft, read_eagle3_config
from engine.spec_decode.eagle_checkpoint import load_eagle_draft
from engine.spec_decode.eagle_draft import DraftEntries, new_draft_kv
from tests.checkpoints import VOCAB_SIZE, make_checkpoint, tiny_config
from tests.engine.spec_decode.eagle3_drafts import (
    DEFAULT_LAYER_IDS,
    MAX_POSITIONS,
    NUM_TARGET_LAYERS,
    make_cycle_eagle3_drafts,
    make_eagle3_draft,
    random_eagle3_draft,
    random_vocabulary,
)
from tests.engine.spec_decode.eagle_drafts import make_eagle_draft
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
    assert_sampling_keeps_the_plain_distribution,
    generate,
    make_engine,
    repetitive_prompts,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("target"), num_hidden_layers=NUM_TARGET_LAYERS)


@pytest.fixture(scope="module")
def cycle_drafts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int], Path, Path]:
    return make_cycle_eagle3_drafts(tmp_path_factory.mktemp("cycle"))


def eagle3(draft: Path, num_speculative_tokens: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(method="eagle3", model=str(draft), num_speculative_tokens=num_speculative_tokens)


def test_eagle3_greedy_equals_plain_greedy_and_transformers(target: Path, tmp_path: Path) -> None:
    """A random draft (its drafts nearly all rejected) over EAGLE-3's default layers of the target."""
    draft = make_eagle3_draft(tmp_path / "draft", "eagle", name_layers=False)
    core = assert_greedy_equals_transformers(target, eagle3(draft, 4))
    assert core.runner.eagle is not None and core.runner.eagle.draft.feature_layer_ids == DEFAULT_LAYER_IDS


def test_eagle3_over_an_int8_target_equals_its_plain_greedy(target: Path, tmp_path: Path) -> None:
    draft = make_eagle3_draft(tmp_path / "draft", "speculators", vocabulary=random_vocabulary(128, seed=2))
    assert_int8_target_greedy_equals_plain(target, eagle3(draft))


def test_the_captured_features_are_transformers_hidden_states(target: Path, tmp_path: Path) -> None:
    """The target forward of a prompt hands the draft the residual streams entering layers 2, 4
    and 5, side by side: transformers' ``hidden_states[2]``, ``[4]`` and ``[5]``."""
    draft = make_eagle3_draft(tmp_path / "draft", "speculators")
    core = make_engine(target, eagle3(draft))
    proposer = core.runner.eagle
    assert proposer is not None
    recorded: list[torch.Tensor] = []
    target_forward = proposer.target_forward

    def recording(*args):  # type: ignore[no-untyped-def]
        logits, features = target_forward(*args)
        recorded.append(features.clone())
        return logits, features

    proposer.target_forward = recording  # type: ignore[method-assign]
    prompt = repetitive_prompts()[0]
    generate(core, [prompt], [SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)])
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden_states = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    expected = torch.cat([hidden_states[i][0] for i in DEFAULT_LAYER_IDS], dim=-1)
    assert recorded[0].shape == (len(prompt), 3 * HIDDEN_SIZE)
    torch.testing.assert_close(recorded[0], expected, rtol=1e-4, atol=1e-4)


def test_verify_steps_run_natively_capturing_the_drafts_layers(target: Path, tmp_path: Path) -> None:
    """An EAGLE-3 engine's decode steps, verify rows included, run in the one native call, which
    captures the layers the draft fuses (without it they ran the modules, 23% slower a step on
    the embedded model); the greedy output is still the plain engine's."""
    draft = make_eagle3_draft(tmp_path / "draft", "speculators")
    core = make_engine(target, eagle3(draft))
    native, proposer = core.runner.native_decode, core.runner.eagle
    assert native is not None and proposer is not None and proposer.native is native
    rows_taken: list[int] = []

    def spy(batch, final_hidden_out=None, capture=None):  # type: ignore[no-untyped-def]
        logits = native(batch, final_hidden_out, capture)
        if logits is not None:
            assert capture is not None and capture.layer_ids.tolist() == list(DEFAULT_LAYER_IDS)
            rows_taken.append(batch.input_ids.shape[0])
        return logits

    spy.hidden_dtype = native.hidden_dtype  # type: ignore[attr-defined]
    core.runner.native_decode = proposer.native = spy
    prompt = repetitive_prompts()[0]
    ours = generate(core, [prompt], [GREEDY])
    assert ours == generate(make_engine(target), [prompt], [GREEDY])
    # One request: a step of more than one row is a verification of drafts.
    assert core.scheduler.spec_stats.num_draft_tokens > 0 and max(rows_taken) > 1, rows_taken


@pytest.mark.parametrize("norm_before_residual", [False, True])
@pytest.mark.parametrize("split", [12, 5, 1], ids=["one-pass", "two-passes", "one-by-one"])
def test_the_draft_is_eagle3s_layer_over_fc(norm_before_residual: bool, split: int) -> None:
    """The draft as the speculators package builds it (transformers' Llama attention reading
    ``2 * hidden``, its norms and MLP, after fc): the same outputs and logits, whether its entries
    go through the draft KV in one pass or in several."""
    from torch import nn
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

    draft = random_eagle3_draft(seed=3, norm_before_residual=norm_before_residual).eval()
    config = tiny_config("LlamaForCausalLM", num_hidden_layers=1)
    config._attn_implementation = "eager"
    attention = LlamaAttention(config, layer_idx=0).eval()
    head_dim = HIDDEN_SIZE // config.num_attention_heads
    attention.q_proj = nn.Linear(2 * HIDDEN_SIZE, config.num_attention_heads * head_dim, bias=False)
    attention.k_proj = nn.Linear(2 * HIDDEN_SIZE, config.num_key_value_heads * head_dim, bias=False)
    attention.v_proj = nn.Linear(2 * HIDDEN_SIZE, config.num_key_value_heads * head_dim, bias=False)
    layer = nn.ModuleDict(
        {
            "self_attn": attention,
            "mlp": LlamaMLP(config),
            "input_layernorm": LlamaRMSNorm(HIDDEN_SIZE, config.rms_norm_eps),
            "hidden_norm": LlamaRMSNorm(HIDDEN_SIZE, config.rms_norm_eps),
            "post_attention_layernorm": LlamaRMSNorm(HIDDEN_SIZE, config.rms_norm_eps),
        }
    )
    weights = {k.removeprefix("layers.0."): v for k, v in draft.state_dict().items() if k.startswith("layers.0.")}
    layer.load_state_dict(weights)
    num_entries = 12
    generator = torch.Generator().manual_seed(0)
    embeds = torch.randn(num_entries, HIDDEN_SIZE, generator=generator)
    features = torch.randn(num_entries, 3 * HIDDEN_SIZE, generator=generator)
    with torch.no_grad():
        hidden = draft.fc(features)[None]
        normed = layer["hidden_norm"](hidden)
        attn_in = torch.cat([layer["input_layernorm"](embeds[None]), normed], -1)
        positions = torch.arange(num_entries)[None]
        causal = torch.full((num_entries, num_entries), float("-inf")).triu(1)[None, None]
        attn, _ = attention(attn_in, LlamaRotaryEmbedding(config)(attn_in, positions), causal)
        residual = (normed if norm_before_residual else hidden) + attn
        expected = (residual + layer["mlp"](layer["post_attention_layernorm"](residual)))[0]
        kv = new_draft_kv(draft, 0)
        chunks = [slice(i, min(i + split, num_entries)) for i in range(0, num_entries, split)]
        ours = torch.cat(
            [draft(embeds[c], draft.fuse(features[c]), DraftEntries.after(kv, c.stop - c.start)) for c in chunks]
        )
    assert kv.length == num_entries
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(draft.logits(ours), draft.lm_head(draft.norm(expected)), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_speculative_tokens", [1, 3])
def test_a_smaller_draft_vocabulary_drafts_the_targets_tokens_through_d2t(
    cycle_drafts: tuple[Path, list[int], Path, Path], num_speculative_tokens: int
) -> None:
    """The trained draft names 64 tokens, the target 512: with its d2t its first drafts are
    accepted often and every draft is a token of its vocabulary; the same draft with
    d2t zeroed (its draft ids read as the target's) is nearly never accepted. Greedy output equals
    the plain output either way."""
    target, cycle, trained, unmapped = cycle_drafts
    vocabulary = set(random_vocabulary(64, seed=1, keep=cycle))
    prompts = cycle_prompts(cycle)
    expected = generate(make_engine(target), prompts, [GREEDY] * len(prompts))
    rates = {}
    for name, draft in (("trained", trained), ("unmapped", unmapped)):
        core = make_engine(target, eagle3(draft, num_speculative_tokens))
        assert core.runner.eagle is not None
        chains = recorded_chains(core.runner.eagle)
        assert generate(core, prompts, [GREEDY] * len(prompts)) == expected  # and every block came back
        stats = core.scheduler.spec_stats
        rates[name] = stats.num_accepted_at[0] / stats.num_drafts_at[0]
        if name == "trained":
            assert chains and {t for chain in chains for t in chain} <= vocabulary
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert rates["trained"] > 0.4 and rates["unmapped"] < 0.1, rates


@pytest.mark.parametrize("options", [{}, {"own_embedding": True}], ids=["targets-embedding", "own-embedding"])
def test_both_layouts_load_the_same_draft(target: Path, tmp_path: Path, options: dict[str, bool]) -> None:
    """The same random draft (a vocabulary of 128 of the target's 512) in EAGLE's reference layout
    (``midlayer.*``, no layers named: EAGLE-3's defaults) and the speculators package's (its layers
    named) loads to the same tensors and target layers, and drafts the same tokens in the engine."""
    vocabulary = random_vocabulary(128, seed=5)
    folders = [
        make_eagle3_draft(tmp_path / "eagle", "eagle", name_layers=False, vocabulary=vocabulary, **options),
        make_eagle3_draft(tmp_path / "speculators", "speculators", vocabulary=vocabulary, **options),
    ]
    assert any(k.startswith("midlayer.") for k in load_file(str(folders[0] / "model.safetensors")))
    assert [read_eagle3_config(f).layout for f in folders] == ["eagle", "speculators"]
    drafts = [
        load_eagle3_draft(f, HIDDEN_SIZE, VOCAB_SIZE, NUM_TARGET_LAYERS, MAX_POSITIONS, torch.float32, CPU)
        for f in folders
    ]
    assert drafts[0].eagle3 == drafts[1].eagle3 and drafts[0].shape == drafts[1].shape
    assert drafts[0].state_dict().keys() == drafts[1].state_dict().keys()
    for name, tensor in drafts[0].state_dict().items():
        assert torch.equal(tensor, drafts[1].state_dict()[name]), name
    prompts = repetitive_prompts()
    drafted = []
    for folder in folders:
        core = make_engine(target, eagle3(folder, 3))
        assert core.runner.eagle is not None
        proposals = recorded_chains(core.runner.eagle)
        generate(core, prompts, [GREEDY] * len(prompts))
        drafted.append(proposals)
    assert drafted[0] and drafted[0] == drafted[1]
    assert {t for chain in drafted[0] for t in chain} <= set(vocabulary)


def test_sampled_output_with_eagle3_has_the_plain_distribution(
    cycle_drafts: tuple[Path, list[int], Path, Path],
) -> None:
    """The shared chi-square test: the trained draft guesses the target's likeliest token, which a
    temperature-1 sample sometimes is and sometimes not, so both acceptance and rejection run."""
    target, cycle, trained, _ = cycle_drafts
    assert_sampling_keeps_the_plain_distribution(target, eagle3(trained, 2), cycle_snippet(cycle, 3, 6))


def test_preemption_and_abort_leave_no_block_or_draft_kv_behind(
    cycle_drafts: tuple[Path, list[int], Path, Path],
) -> None:
    target, cycle, trained, _ = cycle_drafts
    block_bytes = 2 * 16 * 2 * 16 * 4 * 4  # K and V, 16 tokens, 2 heads of 16, float32, 4 layers
    assert_preemption_and_abort_leave_no_block_or_draft_kv_behind(target, cycle, eagle3(trained), block_bytes)


@pytest.mark.parametrize("with_prompt_draft_kv", [True, False])
def test_decode_instance_speculates_with_eagle3_after_a_pulled_prompt(
    cycle_drafts: tuple[Path, list[int], Path, Path], with_prompt_draft_kv: bool
) -> None:
    """As EAGLE's (eagle_scenarios.py): P's EAGLE-3 draft chains after the first token and its KV
    over the prompt crosses with the target's; D's chains are the colocated engine's with it."""
    target, cycle, trained, _ = cycle_drafts
    assert_decode_speculates_after_a_pulled_prompt(target, cycle, eagle3(trained), with_prompt_draft_kv)


def _edit(
    folder: Path, config: dict[str, object] | None = None, tensors: dict[str, torch.Tensor] | None = None
) -> Path:
    if config is not None:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensors is not None:
        path = folder / "model.safetensors"
        save_file({**load_file(str(path)), **tensors}, str(path))
    return folder


def _load(folder: Path, num_target_layers: int = NUM_TARGET_LAYERS) -> None:
    load_eagle3_draft(folder, HIDDEN_SIZE, VOCAB_SIZE, num_target_layers, MAX_POSITIONS, torch.float32, CPU)


def test_what_cannot_be_served_is_refused_saying_why(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="EAGLE-3 speculation needs the draft's folder"):
        SpeculativeConfig(method="eagle3")
    pickle = make_eagle3_draft(tmp_path / "pickle", "eagle")
    (pickle / "model.safetensors").rename(pickle / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pickle \(pytorch_model\.bin\).*weights_only=True"):
        _load(pickle)
    # Each method names the other for the other's drafts.
    for layout in ("eagle", "speculators"):
        folder = make_eagle3_draft(tmp_path / f"eagle3-{layout}", layout)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match='an EAGLE-3 draft.*"method": "eagle3"'):
            load_eagle_draft(folder, HIDDEN_SIZE, VOCAB_SIZE, MAX_POSITIONS, torch.float32, CPU)
    with pytest.raises(ValueError, match='not an EAGLE-3 draft.*"method": "eagle"'):
        _load(make_eagle_draft(tmp_path / "eagle1", "eagle"))
    # EAGLE-3's default layers of a 4-layer target are (2, 2, 1): not three distinct ones.
    defaults = make_eagle3_draft(tmp_path / "defaults", "eagle", name_layers=False)
    with pytest.raises(ValueError, match=r"target layers \[2, 2, 1\] \(EAGLE-3's default layers\)"):
        _load(defaults, num_target_layers=4)
    named = make_eagle3_draft(tmp_path / "named", "speculators", feature_layer_ids=(0, 1))
    with pytest.raises(ValueError, match=r"fuses 128 features, but reads target layers \[1, 2, 3\]"):
        _load(_edit(named, {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}))
    small = random_vocabulary(32, seed=0)
    out_of_range = make_eagle3_draft(tmp_path / "d2t", "speculators", vocabulary=small)
    with pytest.raises(ValueError, match="d2t maps draft tokens outside the target's vocabulary"):
        _load(_edit(out_of_range, tensors={"d2t": torch.full((32,), VOCAB_SIZE, dtype=torch.int64)}))
    disagreeing = make_eagle3_draft(tmp_path / "t2d", "eagle", vocabulary=small)
    with pytest.raises(ValueError, match="its d2t and t2d disagree"):
        _load(_edit(disagreeing, tensors={"t2d": torch.zeros(VOCAB_SIZE, dtype=torch.bool)}))
    with pytest.raises(ValueError, match="EAGLE-3 drafts of one decoder layer are served here, not 2"):
        _load(_edit(make_eagle3_draft(tmp_path / "two-layers", "eagle"), {"num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="hidden states of 64, the target's are 32"):
        load_eagle3_draft(named, 32, VOCAB_SIZE, NUM_TARGET_LAYERS, MAX_POSITIONS, torch.float32, CPU)
