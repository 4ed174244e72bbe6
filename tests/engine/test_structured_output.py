"""Structured outputs in the engine: with random weights only the grammar makes an output
parse, so every constrained output parsing is the test."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from engine import LLM, SamplingParams
from engine.sampler import Sampler, SamplingMetadata
from engine.structured_output import StructuredOutputSpec
from engine.structured_output.bitmask import BitmaskWorker, apply_token_bitmask, token_bias
from engine.structured_output.compiler import GrammarCompiler
from engine.structured_output.grammar_state import GrammarState

# Bounded strings and numbers: a random model closes a string only by chance.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{3}"
CHOICES = ["red", "green", "blue"]
GRAMMAR = 'root ::= "(" digit+ (("+" | "*") digit+){0,3} ")"\ndigit ::= [0-9]'
GRAMMAR_TEXT = re.compile(r"\([0-9]+([+*][0-9]+){0,3}\)")


def json_spec(schema: dict[str, object] = PERSON) -> StructuredOutputSpec:
    return StructuredOutputSpec.from_json_schema(schema)


def check_output(spec: StructuredOutputSpec | None, text: str) -> None:
    """Raises unless ``text`` is what ``spec`` allows."""
    if spec is None:
        return
    if spec.kind == "json":
        jsonschema.validate(json.loads(text), json.loads(spec.spec))
    elif spec.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif spec.kind == "regex":
        assert re.fullmatch(spec.spec, text), text
    elif spec.kind == "choice":
        assert text in spec.choices, text
    else:
        assert GRAMMAR_TEXT.fullmatch(text), text


@pytest.fixture(scope="module")
def llm(model: Path) -> LLM:
    return LLM(model=str(model), kv_cache_memory=1 << 24)


@pytest.fixture(scope="module")
def compiler(model: Path) -> GrammarCompiler:
    return GrammarCompiler.from_hf_tokenizer(PreTrainedTokenizerFast.from_pretrained(str(model)), [2])


def test_every_output_of_a_mixed_batch_parses_or_matches(llm: LLM) -> None:
    specs = [
        json_spec(),
        StructuredOutputSpec("regex", REGEX),
        StructuredOutputSpec.from_choices(CHOICES),
        StructuredOutputSpec("grammar", GRAMMAR),
        None,
    ]
    params = []
    for index in range(20):
        spec = specs[index % len(specs)]
        # Greedy and sampled rows, seeded so a failure reproduces.
        params.append(
            SamplingParams(
                temperature=0.0 if index % 2 else 1.0,
                seed=index,
                max_tokens=80,
                ignore_eos=spec is None,
                structured=spec,
            )
        )
    prompts = ["The quick brown fox", "Paris is the capital", "lazy dog", "of France."] * 5
    outputs = llm.generate(prompts, params)
    for p, output in zip(params, outputs):
        completion = output.outputs[0]
        if p.structured is not None:
            assert completion.finish_reason == "stop", completion
            check_output(p.structured, completion.text)
    # The unconstrained rows are left alone: they run to their budget, writing no JSON.
    unconstrained = [o.outputs[0] for p, o in zip(params, outputs) if p.structured is None]
    assert all(
        c.finish_reason == "length" and len(c.token_ids) == 80 and not c.text.startswith("{") for c in unconstrained
    )


def test_constrained_rows_do_not_change_unconstrained_ones(llm: LLM) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["The quick brown fox"], plain)[0].outputs[0].token_ids
    mixed = llm.generate(
        ["Paris is", "The quick brown fox", "lazy dog"],
        [
            SamplingParams(temperature=0.0, max_tokens=40, structured=json_spec()),
            plain,
            SamplingParams(temperature=0.0, max_tokens=40, structured=StructuredOutputSpec("regex", REGEX)),
        ],
    )
    assert mixed[1].outputs[0].token_ids == alone


def test_a_grammar_cut_short_by_max_tokens_finishes_with_length(llm: LLM) -> None:
    output = llm.generate(
        ["The quick"], SamplingParams(temperature=0.0, max_tokens=5, structured=StructuredOutputSpec("regex", "a{50}"))
    )[0]
    completion = output.outputs[0]
    assert completion.finish_reason == "length"
    assert completion.text == "a" * len(completion.text) and len(completion.token_ids) == 5


def test_a_complete_grammar_stops_without_waiting_for_eos(llm: LLM) -> None:
    completion = llm.generate(
        ["The quick"],
        SamplingParams(temperature=0.0, max_tokens=30, structured=StructuredOutputSpec.from_choices(["yes"])),
    )[0].outputs[0]
    assert (completion.text, completion.finish_reason, completion.stop_reason) == ("yes", "stop", None)
    assert 2 not in completion.token_ids  # no EOS step was needed


def test_json_object_output_is_an_object_or_cut_by_length(llm: LLM) -> None:
    for seed in range(4):
        completion = llm.generate(
            ["Paris"],
            SamplingParams(temperature=1.0, seed=seed, max_tokens=40, structured=StructuredOutputSpec("json_object")),
        )[0].outputs[0]
        assert completion.text.startswith("{")
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict)


def test_preempted_requests_keep_their_grammar_and_their_tokens(model: Path, llm: LLM) -> None:
    """Too few blocks for every request: some are preempted and recompute; the grammar state
    lives with the tokens, so each output is the one an uncontended run gives."""
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured=json_spec()) for _ in range(6)]
    prompts = [f"The quick brown fox {i}" for i in range(6)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    tight = LLM(model=str(model), num_blocks_override=10, block_size=16)
    outputs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    for output in outputs:
        assert output.outputs[0].finish_reason == "stop", [len(o.outputs[0].token_ids) for o in outputs]
        check_output(json_spec(), output.outputs[0].text)


def test_a_rebuilt_state_allows_what_the_live_one_allows(compiler: GrammarCompiler) -> None:
    """What the decode side does with P's first token, and a retry with all tokens so far."""
    compiled = compiler.compile(json_spec())
    live = GrammarState(compiled.new_matcher(), "live")
    worker = BitmaskWorker(compiler.vocab_size, compiler.vocab_size)
    tokens: list[int] = []
    for _ in range(12):
        allowed = (worker.start([0], [live]).result()[0] == 0).nonzero().flatten().tolist()
        token = allowed[len(tokens) * 7 % len(allowed)]
        tokens.append(token)
        live.accept(token)
        rebuilt = GrammarState(compiled.new_matcher(), "rebuilt")
        rebuilt.sync(tokens)
        assert rebuilt.num_consumed == len(tokens)
        # result() is a view of the worker's buffer, valid until its next start: keep a copy.
        live_bias = worker.start([0, 1], [live, rebuilt]).result()[0].clone()
        assert torch.equal(live_bias, worker.start([0], [rebuilt]).result()[0])
    worker.close()


def test_compiled_grammars_are_cached_by_kind_and_spec(model: Path) -> None:
    compiler = GrammarCompiler.from_hf_tokenizer(PreTrainedTokenizerFast.from_pretrained(str(model)), cache_size=2)
    regex, choice = StructuredOutputSpec("regex", REGEX), StructuredOutputSpec.from_choices(CHOICES)
    first = compiler.compile(regex)
    assert compiler.compile(StructuredOutputSpec("regex", REGEX)) is first
    # The same text as another kind is another grammar; two more specs evict the first regex.
    as_grammar = compiler.compile(StructuredOutputSpec("grammar", 'root ::= "x"'))
    as_regex = compiler.compile(StructuredOutputSpec("regex", "x"))
    assert as_regex is not as_grammar
    assert compiler.compile(StructuredOutputSpec("grammar", 'root ::= "x"')) is as_grammar  # now the most recent
    compiler.compile(choice)  # evicts the least recently used: the regex "x"
    assert compiler.compile(StructuredOutputSpec("grammar", 'root ::= "x"')) is as_grammar
    assert compiler.compile(StructuredOutputSpec("regex", "x")) is not as_regex
    assert compiler.compile(regex) is not first


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutputSpec("json", "{not json"), "the JSON schema is not valid JSON"),
        (StructuredOutputSpec("json", '{"type": "strin"}'), r"(?s)the JSON schema does not compile: .*strin"),
        (StructuredOutputSpec("json", '{"type": "object", "properties": 3}'), "properties must be an object"),
        (StructuredOutputSpec("json", "[1, 2]"), "a JSON schema must be an object"),
        (StructuredOutputSpec("regex", "a(b"), r"(?s)the regex does not compile: .*unclosed group"),
        (StructuredOutputSpec("grammar", 'root ::= "a" undefined_rule'), r"(?s)the grammar .*undefined_rule"),
    ],
)
def test_a_spec_that_does_not_compile_names_the_problem(
    compiler: GrammarCompiler, spec: StructuredOutputSpec, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        compiler.compile(spec)


def test_bad_specs_are_refused_before_any_work(llm: LLM) -> None:
    with pytest.raises(ValueError, match="does not compile"):
        llm.generate(["Paris"], SamplingParams(structured=StructuredOutputSpec("regex", "(")))
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputSpec.from_choices([])
    with pytest.raises(ValueError, match="the structured output regex is empty"):
        StructuredOutputSpec("regex", " ")
    assert (
        llm.generate(["Paris"], SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0].finish_reason == "length"
    )


def test_the_bitmask_masks_only_its_rows_and_ids_beyond_the_grammar_vocabulary() -> None:
    bitmask = np.zeros((2, 2), dtype=np.int32)  # a 64-token grammar vocabulary
    bitmask[0, 0] = 1 << 5
    bitmask[0, 1] = (1 << 3) - (1 << 31)  # tokens 35 and 63 (bit 31 is the sign bit)
    bitmask[1, 0] = -1  # tokens 0..31
    wide = token_bias(bitmask, 70)  # the model's embedding is padded past the tokenizer
    assert set(wide.flatten().tolist()) == {0.0, float("-inf")}
    assert (wide[0] == 0).nonzero().flatten().tolist() == [5, 35, 63]
    assert (wide[1] == 0).nonzero().flatten().tolist() == list(range(32))
    assert (token_bias(bitmask, 40)[0] == 0).nonzero().flatten().tolist() == [5, 35]  # a narrower model

    logits = torch.zeros(3, 70)
    apply_token_bitmask(logits, [1], wide[:1])
    assert torch.equal(logits[0], torch.zeros(70)) and torch.equal(logits[2], torch.zeros(70))
    assert (logits[1] == 0).nonzero().flatten().tolist() == [5, 35, 63]
    every_row = torch.zeros(2, 70)
    apply_token_bitmask(every_row, [0, 1], wide)
    assert torch.equal(every_row, wide)


def test_the_sampler_picks_only_allowed_tokens_greedy_or_sampled() -> None:
    logits = torch.randn(4, 64) * 5
    bitmask = np.zeros((2, 2), dtype=np.int32)
    bitmask[0, 1] = 1 << 7  # row 1: only token 39
    bitmask[1, 0] = 0b1010  # row 3: tokens 1 or 3
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0),
    ]
    metadata = SamplingMetadata(
        params=params,
        prompt_token_ids=[[]] * 4,
        output_token_ids=[[]] * 4,
        generators=[None] * 4,
        eos_token_ids=frozenset(),
        grammar_rows=[1, 3],
        grammar_bias=token_bias(bitmask, 64),
    )
    tokens = Sampler(seed=0)(logits, metadata).token_ids
    assert tokens[0] == int(logits[0].argmax()) and tokens[1] == 39 and tokens[3] in (1, 3)
