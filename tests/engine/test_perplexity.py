"""Perplexity by llama-perplexity's method (engine/perplexity.py): the chunking and scoring on
cases worked by hand, the engine's figure against one computed from transformers' own logits on
the same chunks, and the numerics the engine offers (8-bit KV caches, int8 and bf16 weights, a
GGUF file kept quantized) each giving a figure of their own close to float32's."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import processors
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import cpu_kernels
from engine.llm import LLM
from engine.models.quantized_linear import QuantizedLinear
from engine.perplexity import ChunkPlan, NLLTotals, measure, open_engine, split_chunks, tokenize_text
from splitserve.perplexity import default_text
from tests.engine.gguf_checkpoints import Q, make_gguf, uniform
from tests.engine.test_parity import assert_no_leaks

# The shipped text, cut short: the tiny byte-level tokenizer spends about a token per 2 characters.
TEXT = default_text()[:6000]
PLAN = ChunkPlan(ctx_size=64, batch_size=256, max_chunks=6)  # 4 chunks a forward pass, then 2


def reference_nlls(model: Path, chunks: list[list[int]], ctx_size: int) -> torch.Tensor:
    """Each chunk scored as llama-perplexity scores it, from transformers' float32 logits: the
    logits at positions ctx/2 .. ctx-2 against the tokens after them."""
    hf_model = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    first = ctx_size // 2
    nlls = []
    with torch.no_grad():
        for chunk in chunks:
            logits = hf_model(torch.tensor([chunk])).logits[0].double()
            logprobs = torch.log_softmax(logits[first : ctx_size - 1], dim=-1)
            targets = torch.tensor(chunk[first + 1 : ctx_size])
            nlls.append(-logprobs.gather(1, targets[:, None]).squeeze(1))
    return torch.cat(nlls)


def llama_standard_error(nlls: torch.Tensor) -> float:
    mean = float(nlls.mean())
    variance = float((nlls * nlls).mean()) - mean * mean
    return math.exp(mean) * math.sqrt(variance / (len(nlls) - 1))


@pytest.fixture(scope="module")
def float32(model: Path) -> LLM:
    return open_engine(str(model), PLAN, dtype="float32")


@pytest.fixture(scope="module")
def bos_model(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a tokenizer that puts BOS first, as Llama's do."""
    folder = tmp_path_factory.mktemp("bos") / "model"
    shutil.copytree(model, folder)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)]
    )
    tokenizer.save_pretrained(str(folder))
    return folder


# ----------------------------------------------------------------------------- by hand


def test_chunks_are_whole_non_overlapping_and_start_with_bos_in_place_of_their_first_token() -> None:
    tokens = list(range(100, 121))  # 21 tokens: two chunks of 8, five left over
    plan = ChunkPlan(ctx_size=8)
    assert split_chunks(tokens, plan, bos_token_id=None) == [list(range(100, 108)), list(range(108, 116))]
    assert split_chunks(tokens, plan, bos_token_id=1) == [[1, *range(101, 108)], [1, *range(109, 116)]]
    # Positions 4, 5, 6 score the tokens at 5, 6, 7: ctx - 1 - ctx/2 of them a chunk.
    assert (plan.first_scored, plan.num_scored_per_chunk) == (4, 3)
    assert len(split_chunks(list(range(100)), ChunkPlan(ctx_size=8, max_chunks=3), None)) == 3
    assert (ChunkPlan(ctx_size=9).first_scored, ChunkPlan(ctx_size=9).num_scored_per_chunk) == (4, 4)


def test_fewer_tokens_than_two_chunks_is_refused_naming_the_need() -> None:
    with pytest.raises(ValueError, match="the text has 15 tokens; chunks of --ctx-size 8 need at least 16"):
        split_chunks(list(range(15)), ChunkPlan(ctx_size=8), None)
    assert len(split_chunks(list(range(16)), ChunkPlan(ctx_size=8), None)) == 2


def test_perplexity_and_its_standard_error_on_two_hand_worked_tokens() -> None:
    # p = 1/2 and 1/4: NLLs ln 2 and 2 ln 2, mean 1.5 ln 2, population variance 0.25 ln^2 2.
    totals = NLLTotals()
    totals.add(torch.tensor([[0.5, 0.25, 0.25], [0.25, 0.5, 0.25]]).log(), torch.tensor([0, 2]))
    assert totals.count == 2
    assert totals.perplexity == pytest.approx(2**1.5, rel=1e-6)  # float32 log-softmax
    assert totals.standard_error == pytest.approx(2**1.5 * 0.5 * math.log(2), rel=1e-5)
    uniform_logits = NLLTotals()
    uniform_logits.add(torch.zeros(5, 7), torch.arange(5))
    assert uniform_logits.perplexity == pytest.approx(7.0, rel=1e-6) and uniform_logits.standard_error == 0.0


def test_bos_is_added_only_where_the_tokenizer_adds_it(model: Path, bos_model: Path) -> None:
    plain = AutoTokenizer.from_pretrained(str(model))
    ids, bos = tokenize_text(plain, "Paris is the capital")
    assert bos is None and ids == plain("Paris is the capital", add_special_tokens=False)["input_ids"]
    with_bos = AutoTokenizer.from_pretrained(str(bos_model))
    assert with_bos("x")["input_ids"][0] == with_bos.bos_token_id == 1
    assert tokenize_text(with_bos, "Paris is the capital") == ([1, *ids], 1)


@pytest.mark.parametrize(
    "plan",
    [
        ChunkPlan(ctx_size=64, batch_size=256, max_chunks=6),  # 4 chunks a pass, then 2
        ChunkPlan(ctx_size=64, batch_size=24, max_chunks=3),  # pieces 0-23 (context only), 24-47, 48-63
        ChunkPlan(ctx_size=63, batch_size=63, max_chunks=3),  # an odd context: 31 scored a chunk
    ],
    ids=["batched-chunks", "chunks-in-pieces", "odd-ctx"],
)
def test_the_engines_perplexity_is_transformers_on_the_same_chunks(model: Path, plan: ChunkPlan) -> None:
    with open_engine(str(model), plan, dtype="float32") as llm:
        result = measure(llm, TEXT, plan)
        assert_no_leaks(llm)
    token_ids = AutoTokenizer.from_pretrained(str(model))(TEXT, add_special_tokens=False)["input_ids"]
    chunks = [token_ids[i * plan.ctx_size : (i + 1) * plan.ctx_size] for i in range(plan.max_chunks or 0)]
    nlls = reference_nlls(model, chunks, plan.ctx_size)
    assert result.num_chunks == len(chunks) and result.num_scored == len(nlls) == len(chunks) * (
        plan.ctx_size - 1 - plan.ctx_size // 2
    )
    assert result.perplexity == pytest.approx(math.exp(float(nlls.mean())), rel=1e-5)
    assert result.standard_error == pytest.approx(llama_standard_error(nlls), rel=1e-4)
    per_chunk = nlls.view(len(chunks), -1)
    running = [math.exp(float(per_chunk[: i + 1].mean())) for i in range(len(chunks))]
    assert result.running_perplexity == pytest.approx(running, rel=1e-5)
    assert result.bos_token_id is None and result.num_text_tokens == len(token_ids)


def test_with_a_bos_tokenizer_every_chunk_starts_with_bos(bos_model: Path) -> None:
    plan = ChunkPlan(ctx_size=64, batch_size=128, max_chunks=3)
    with open_engine(str(bos_model), plan, dtype="float32") as llm:
        result = measure(llm, TEXT, plan)
    token_ids = AutoTokenizer.from_pretrained(str(bos_model))(TEXT)["input_ids"]
    assert token_ids[0] == 1 and result.bos_token_id == 1 and result.num_text_tokens == len(token_ids)
    chunks = [[1, *token_ids[i * 64 + 1 : (i + 1) * 64]] for i in range(3)]
    assert result.perplexity == pytest.approx(math.exp(float(reference_nlls(bos_model, chunks, 64).mean())), rel=1e-5)


# ------------------------------------------------------------------- the engine's numerics


@pytest.mark.parametrize(
    ("config", "rel"),
    [
        ({"kv_cache_dtype": "int8"}, 0.02),
        ({"kv_cache_dtype": "fp8_e4m3"}, 0.05),
        ({"quantization": "int8"}, 0.05),
        ({"dtype": "bfloat16"}, 0.1),
    ],
    ids=["kv-int8", "kv-fp8", "weights-int8", "bf16"],
)
def test_quantized_numerics_give_their_own_finite_figure_close_to_float32s(
    model: Path, float32: LLM, config: dict[str, str], rel: float
) -> None:
    reference = measure(float32, TEXT, PLAN)
    with open_engine(str(model), PLAN, **{"dtype": "float32", **config}) as llm:
        if "kv_cache_dtype" in config:
            assert llm.engine.runner.kv_format.fingerprint_dtype.startswith(config["kv_cache_dtype"])
        result = measure(llm, TEXT, PLAN)
        assert_no_leaks(llm)
    assert math.isfinite(result.perplexity) and result.num_scored == reference.num_scored
    assert result.perplexity == pytest.approx(reference.perplexity, rel=rel)
    assert result.perplexity != reference.perplexity  # the rounding reached the logits: the path ran


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: nothing stays quantized")
def test_a_gguf_file_runs_kept_quantized_and_scores_as_its_dequantized_weights(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    checkpoint = make_gguf(tmp_path_factory.mktemp("q4_1"), uniform(Q.Q4_1, Q.Q8_0), tie_word_embeddings=True)
    with open_engine(str(checkpoint.path), PLAN, dtype="float32") as llm:
        assert isinstance(llm.engine.runner.model.layers[0].qkv_proj, QuantizedLinear)
        quantized = measure(llm, TEXT, PLAN)
    with open_engine(str(checkpoint.dequantized), PLAN, dtype="float32") as llm:
        dequantized = measure(llm, TEXT, PLAN)
    assert quantized.num_text_tokens == dequantized.num_text_tokens  # the file's own tokenizer, the same ids
    # Float activations: the dequantized model's arithmetic up to summation order.
    assert quantized.perplexity == pytest.approx(dequantized.perplexity, rel=1e-4)


# ---------------------------------------------------------------------------- bad input


def test_a_context_beyond_the_models_is_refused_before_loading(model: Path) -> None:
    with pytest.raises(ValueError, match=r"--ctx-size 2048 exceeds the model's context \(1024 tokens\)"):
        open_engine(str(model), ChunkPlan(ctx_size=2048))


@pytest.mark.parametrize(
    ("fields", "message"),
    [({"ctx_size": 2}, "--ctx-size must be at least 3"), ({"max_chunks": 1}, "--chunks must be at least 2")],
)
def test_plans_that_cannot_give_a_figure_are_refused(fields: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ChunkPlan(**fields)


def test_a_short_text_is_refused_and_leaves_the_engine_as_it_was(float32: LLM) -> None:
    with pytest.raises(ValueError, match="chunks of --ctx-size 64 need at least 128"):
        measure(float32, "Too short to score.", PLAN)
    assert_no_leaks(float32)
