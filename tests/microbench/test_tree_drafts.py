"""microbench.tree_drafts on a tiny target and an EAGLE-3 draft trained a few steps on the test
prompt's own continuation: good enough that some drafts are accepted, bad enough that the top-1
guess often is not the target's token (where a tree's second child is)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.llm import LLM
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.draft_training import served_embedding_weight
from engine.spec_decode.eagle import EagleProposer
from engine.spec_decode.eagle3_checkpoint import save_eagle3_draft
from engine.spec_decode.eagle3_draft import Eagle3Layer
from engine.spec_decode.eagle3_training import Eagle3Training, layer_features, new_eagle3_draft, train_eagle3_draft
from engine.spec_decode.eagle_draft import DraftEntries, DraftKV, new_draft_kv
from engine.spec_decode.medusa_training import greedy_sequences
from microbench.tree_drafts import (
    DraftShape,
    DraftVocabulary,
    accepted_length,
    clone_prefix,
    greedy_continuation,
    main,
    measure_ranks,
    parse_shape,
    served_stats,
    target_features,
    time_draft,
    time_verify_rows,
)
from tests.checkpoints import make_checkpoint, random_prompts

OUTPUT_LEN = 24
LAYER_IDS = (0, 2, 3)  # of the 4-layer target
PROMPT = random_prompts([6], seed=99)[0]
SHAPES = [parse_shape(text) for text in ("chain-1", "chain-2", "chain-3", "2", "2,1", "2,2", "1,1,3", "2,2,2", "2,1,5")]


@dataclass(frozen=True, slots=True)
class Setup:
    target: Path
    draft: Path

    def engine(self, num_speculative_tokens: int = 3) -> EngineCore:
        spec = SpeculativeConfig(method="eagle3", model=str(self.draft), num_speculative_tokens=num_speculative_tokens)
        return EngineCore(
            EngineConfig(
                model=str(self.target),
                dtype="float32",
                kv_cache_memory=1 << 22,
                enable_prefix_caching=False,
                speculative=spec,
            )
        )


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    directory = tmp_path_factory.mktemp("tree_drafts")
    target = make_checkpoint(directory / "target", num_hidden_layers=4)
    llm = LLM(model=str(target), dtype="float32", kv_cache_memory=1 << 22)
    sequences = greedy_sequences(llm, [PROMPT], OUTPUT_LEN)
    features = [layer_features(llm, sequence, LAYER_IDS) for sequence in sequences]
    vocabulary = sorted(set(sequences[0]))
    draft = new_eagle3_draft(llm.engine.runner.hf_config, vocabulary, LAYER_IDS, 1024, seed=2)
    # A few steps only: some of its guesses right, many second best.
    train_eagle3_draft(draft, sequences, features, served_embedding_weight(llm), Eagle3Training(num_steps=8))
    llm.close()
    layer = draft.layers[0]
    assert isinstance(layer, Eagle3Layer)
    with torch.no_grad():  # the token fed weighs more, so that feeding a wrong one shows in its guesses
        layer.input_layernorm.weight.mul_(4.0)
    save_eagle3_draft(draft, directory / "draft", "speculators", {})
    return Setup(target, directory / "draft")


def test_chains_accept_what_the_engine_accepts_and_trees_what_their_expansion_does(setup: Setup) -> None:
    ranks = None
    for k in (1, 2, 3):
        core = setup.engine(num_speculative_tokens=k)
        free_blocks = core.kv_cache_manager.block_pool.num_free_blocks
        ranks_k = measure_ranks(core, [PROMPT], OUTPUT_LEN, SHAPES)
        assert core.kv_cache_manager.block_pool.num_free_blocks == free_blocks
        engine = core.scheduler.spec_stats
        walked = served_stats(ranks_k, DraftShape((1,) * k), OUTPUT_LEN)
        assert (walked.num_draft_tokens, walked.num_accepted_tokens) == (
            engine.num_draft_tokens,
            engine.num_accepted_tokens,
        )
        assert walked.accepted_length_counts == engine.accepted_length_counts
        assert walked.num_accepted_at == engine.num_accepted_at
        assert ranks is None or ranks_k == ranks  # the same draft and target whatever the chain served
        ranks = ranks_k
        core.close()
    assert ranks is not None
    (by_position,) = ranks
    # The draft is neither perfect nor useless: chains are rejected where the second child is right.
    assert any(r[0] == 0 for r in by_position) and any(r[0] == 1 for r in by_position)

    core = setup.engine()
    token_ids = [*PROMPT, *greedy_continuation(core, PROMPT, OUTPUT_LEN)]
    features, num_disagreeing = target_features(core, token_ids, len(PROMPT))
    assert num_disagreeing == 0
    proposer = core.runner.eagle
    assert proposer is not None
    trees = _ExpandedTrees(proposer, token_ids, features)
    for index, position_ranks in enumerate(by_position[: OUTPUT_LEN - 3]):
        position = len(PROMPT) - 1 + index
        lengths = {}
        for shape in SHAPES:
            lengths[shape.name] = accepted_length(position_ranks, shape.branching)
            assert 0 <= lengths[shape.name] <= shape.depth
            assert lengths[shape.name] == trees.longest_match(position, shape.branching), (index, shape.name)
        # A superset of a shape's nodes never accepts less.
        assert lengths["chain-1"] <= lengths["chain-2"] <= lengths["chain-3"] <= lengths["1,1,3"]
        assert lengths["chain-2"] <= lengths["2,1"] <= lengths["2,2"] <= lengths["2,2,2"]
        assert lengths["chain-1"] <= lengths["2"] <= lengths["2,1"] <= lengths["2,1,5"]
    core.close()


class _ExpandedTrees:
    """Every node of a shape's tree drafted (each node's top-k children from the draft fed the
    node's own token), then the longest path matching the continuation: what the module's ranks
    stand for, computed the long way."""

    def __init__(self, proposer: EagleProposer, token_ids: list[int], features: torch.Tensor) -> None:
        self.proposer, self.token_ids = proposer, token_ids
        self.vocabulary = DraftVocabulary(proposer)
        draft = proposer.draft
        self.kv = new_draft_kv(draft, 0)
        num_entries = features.shape[0]
        next_ids = torch.tensor(token_ids[1 : num_entries + 1])
        with torch.inference_mode():
            self.outputs = draft(
                proposer.embed(next_ids), draft.fuse(features), DraftEntries.after(self.kv, num_entries)
            )

    @torch.inference_mode()
    def longest_match(self, position: int, branching: tuple[int, ...]) -> int:
        kv = clone_prefix(self.kv, position + 1, 0)
        return self._longest(kv, self.outputs[position : position + 1], position, branching)

    def _longest(self, kv: DraftKV, output: torch.Tensor, position: int, branching: tuple[int, ...]) -> int:
        if not branching:
            return 0
        columns = self.vocabulary.logits(output)[0].topk(branching[0]).indices
        best = 0
        for token_id in self.vocabulary.target_ids[columns].tolist():
            child_kv = clone_prefix(kv, kv.length, 1)
            entries = DraftEntries(torch.tensor([child_kv.end]), [child_kv], [1])
            child = self.proposer.draft(self.proposer.embed(torch.tensor([token_id])), output, entries)
            deeper = self._longest(child_kv, child, position + 1, branching[1:])
            if token_id == self.token_ids[position + 2]:
                best = max(best, 1 + deeper)
        return best


def test_verify_rows_and_draft_passes_are_timed_for_every_count_asked(setup: Setup) -> None:
    spec_core = setup.engine()
    plain_core = EngineCore(EngineConfig(model=str(setup.target), dtype="float32", kv_cache_memory=1 << 22))
    free_blocks = [core.kv_cache_manager.block_pool.num_free_blocks for core in (spec_core, plain_core)]
    verify_ms, plain_ms = time_verify_rows(spec_core, plain_core, context=40, rows=[1, 2, 5, 9], repeats=2, seed=0)
    assert sorted(verify_ms) == [1, 2, 5, 9] and all(ms > 0 for ms in verify_ms.values()) and plain_ms > 0
    assert not spec_core.has_unfinished_requests() and not plain_core.has_unfinished_requests()
    assert [core.kv_cache_manager.block_pool.num_free_blocks for core in (spec_core, plain_core)] == free_blocks
    draft_ms = time_draft(spec_core.runner.eagle, SHAPES, context=40, repeats=1)  # type: ignore[arg-type]
    assert {name: len(ms) for name, ms in draft_ms.items()} == {shape.name: shape.depth for shape in SHAPES}
    spec_core.close()
    plain_core.close()


def test_the_command_reports_every_shape_and_row(setup: Setup, tmp_path: Path) -> None:
    config = json.dumps({"method": "eagle3", "model": str(setup.draft), "num_speculative_tokens": 2})
    output = tmp_path / "report.json"
    argv = ["--model", str(setup.target), "--speculative-config", config, "--no-default-prompts"]
    argv += ["--prompt", "The quick brown fox", "--output-len", "8", "--context", "24", "--repeats", "1"]
    argv += ["--rows", "1,2,3", "--shapes", "chain-2", "2,1", "--kv-cache-memory", str(1 << 22)]
    assert main([*argv, "--output", str(output)]) == 0
    report = json.loads(output.read_text())
    assert sorted(map(int, report["verify_ms_by_rows"])) == [1, 2, 3, 5]  # 2,1's 4 nodes need 5 rows
    assert [s["acceptance"]["shape"] for s in report["shapes"]] == ["chain-2", "2,1"]
    assert report["engine_chain"]["engine_drafts_accepted"] == report["engine_chain"]["walked_drafts_accepted"]


def test_shapes_parse_as_branching_per_depth() -> None:
    assert parse_shape("chain-3") == parse_shape("1,1,1") == DraftShape((1, 1, 1))
    assert (parse_shape("4,2,1").num_nodes, parse_shape("4,2,1").name) == (4 + 8 + 8, "4,2,1")
    with pytest.raises(ValueError, match="branching factors"):
        parse_shape("2,0")
