"""A drafter's linear layers take its target's form (engine/spec_decode/draft_linears.py): INT8
rows through the quantized kernels beside a target whose weights are kept quantized, the target's
float path beside a float one. The draft then computes what its float layers compute, within
INT8's rounding or exactly up to summation order; an engine serving it loads it so, and its
greedy output is still the plain engine's (the EAGLE scenarios check the same beside each
int8 target: eagle_scenarios.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from engine import cpu_kernels
from engine.models.cpu_linear import linear_path
from engine.models.int8_quantize import quantize_int8
from engine.models.quantized_linear import QuantizedLinear
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.draft_linears import prepare_draft_linears
from engine.spec_decode.eagle3_draft import Eagle3Draft
from engine.spec_decode.eagle_draft import DraftEntries, new_draft_kv
from tests.checkpoints import make_checkpoint
from tests.engine.spec_decode.eagle3_drafts import random_eagle3_draft
from tests.engine.spec_decode.eagle_scenarios import drafter_linears
from tests.engine.spec_decode.medusa_heads import HIDDEN_SIZE, make_medusa_heads
from tests.engine.spec_decode.test_engine_spec import GREEDY, generate, make_engine, repetitive_prompts

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: nothing stays quantized")

CPU = torch.device("cpu")
NUM_ENTRIES = 12
# fc, q/k/v/o, gate/up/down and the draft vocabulary's LM head.
NUM_EAGLE3_LINEARS = 9


def draft_outputs(draft: Eagle3Draft) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's outputs over ``NUM_ENTRIES`` entries in two passes (the second reads the first's
    KV), and its logits after them."""
    generator = torch.Generator().manual_seed(0)
    embeds = torch.randn(NUM_ENTRIES, HIDDEN_SIZE, generator=generator)
    features = torch.randn(NUM_ENTRIES, 3 * HIDDEN_SIZE, generator=generator)
    kv = new_draft_kv(draft, 0)
    with torch.inference_mode():
        halves = [slice(0, NUM_ENTRIES // 2), slice(NUM_ENTRIES // 2, NUM_ENTRIES)]
        outputs = torch.cat(
            [draft(embeds[h], draft.fuse(features[h]), DraftEntries.after(kv, h.stop - h.start)) for h in halves]
        )
        return outputs, draft.logits(outputs)


def rounded_to_int8_rows(draft: Eagle3Draft) -> Eagle3Draft:
    """The float draft of the weights its INT8 rows hold (each linear weight quantized and back)."""
    with torch.no_grad():
        for module in draft.modules():
            if type(module) is nn.Linear:
                module.weight.copy_(quantize_int8(module.weight).dequantize(torch.float32))
    return draft


def test_beside_a_quantized_target_the_draft_runs_int8_rows() -> None:
    """The draft computes the float model of its INT8 weights (up to summation order), which is
    not the float draft's."""
    float_outputs, _ = draft_outputs(random_eagle3_draft(seed=3))
    reference_outputs, reference_logits = draft_outputs(rounded_to_int8_rows(random_eagle3_draft(seed=3)))
    draft = random_eagle3_draft(seed=3)
    assert prepare_draft_linears(draft, CPU, torch.float32, target_quantized=True) == "int8"
    linears = drafter_linears(draft)
    assert len(linears) == NUM_EAGLE3_LINEARS
    assert all(isinstance(m, QuantizedLinear) and m.qweight.format.name == "INT8" for m in linears), linears
    # Norms, the KV and the activations keep the draft's dtype.
    assert draft.dtype == torch.float32 and new_draft_kv(draft, 0).keys[0].dtype == torch.float32
    outputs, logits = draft_outputs(draft)
    torch.testing.assert_close(outputs, reference_outputs, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, reference_logits, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(outputs, float_outputs, rtol=1e-4, atol=1e-4)


def test_beside_a_float_target_the_draft_takes_the_targets_float_path() -> None:
    reference_outputs, reference_logits = draft_outputs(random_eagle3_draft(seed=3))
    draft = random_eagle3_draft(seed=3)
    path = linear_path(CPU, torch.float32)
    assert prepare_draft_linears(draft, CPU, torch.float32, target_quantized=False) == path
    linears = drafter_linears(draft)
    assert len(linears) == NUM_EAGLE3_LINEARS
    assert all(type(m) is not nn.Linear for m in linears) or path == "torch", linears
    outputs, logits = draft_outputs(draft)
    torch.testing.assert_close(outputs, reference_outputs, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, reference_logits, rtol=1e-4, atol=1e-4)


def test_medusa_heads_over_an_int8_target_run_int8_rows_and_keep_its_greedy_output(tmp_path: Path) -> None:
    target = make_checkpoint(tmp_path / "target")
    heads = make_medusa_heads(tmp_path / "heads", "vllm", num_heads=2, own_projections=True)
    spec = SpeculativeConfig(method="medusa", model=str(heads), num_speculative_tokens=2)
    prompts = repetitive_prompts()
    expected = generate(make_engine(target, quantization="int8"), prompts, [GREEDY] * len(prompts))
    core = make_engine(target, spec, quantization="int8")
    assert core.runner.medusa is not None
    linears = drafter_linears(core.runner.medusa.heads)
    assert linears and all(isinstance(m, QuantizedLinear) for m in linears), linears
    assert generate(core, prompts, [GREEDY] * len(prompts)) == expected
    assert core.scheduler.spec_stats.num_draft_tokens > 0
