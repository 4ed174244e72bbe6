"""Whether EAGLE tree drafts would pay on this CPU: the verify step's cost by rows, the accepted
length of each draft shape on held-out prompts, and the ms per output token each shape predicts.

1. **Verify cost by rows.** One request at ``--context`` tokens verifies ``n - 1`` drafts (``n``
   query rows) in a step the engine's own scheduler plans and its model runner executes
   (``Scheduler.schedule`` then ``ModelRunner.execute``, with the speculative config's target path:
   an EAGLE-3 draft makes every step capture three layers' inputs); the time the runner spends in
   the drafter's ``propose`` within that step is taken off, as the draft's cost is counted apart.
   The plain step is a second engine's, with no speculation: one row. Median ms over ``--repeats``.

   This measures a *chain's* rows as the proxy of a tree's of the same count: the two steps differ
   only in the attention mask over the new rows (a tree's row sees its ancestors, a chain's every
   row before it). At this model size the step is weight reads and matmuls over the rows plus
   attention over the cached context, which are the same either way; the mask changes which of at
   most a few dozen new keys each row reads. What the proxy assumes: the engine verifies a chain's
   rows as decode rows over the paged cache, each attending up to itself; a tree's rows read
   context plus ancestors, not a contiguous run, so a tree needs an attention kernel that takes a
   mask (or per-row key lists) at the decode kernel's cost, and a copy of the accepted path's KV
   into place after the step. Neither is measured here.

2. **Accepted length by draft shape.** For each prompt, the speculating engine's greedy
   continuation (``--output-len`` tokens; greedy output does not depend on the drafts) is fed back
   through the draft proposer's own ``target_forward`` (prompt as a prefill row, continuation as
   decode rows, as the engine's steps run them) for the target's features, and the trained draft is
   extended over them as the engine's drafter extends it. At every position the draft is then run
   down the continuation's own path: at depth ``d`` the rank of the continuation's token among the
   draft's logits (argmax's tie order), and while that rank is within some shape's branching, the
   next depth is fed that token, the draft's own choice there. A tree's accepted length is the
   longest path of its nodes that matches the continuation; as a node's children are distinct
   tokens, only the matching path can go on, so a shape ``b_1, ..., b_D`` accepts ``m`` tokens
   where the ranks at depths ``1..m`` are below ``b_1..b_m`` and the next one is not. A shape's
   top-``b`` children at every node: ``2,1`` is the root's two best, each with its best child.

   Reported per shape: nodes (drafts verified), mean accepted length over every position (the
   positions whose continuation reaches the deepest shape's depth, the same for every shape), the
   acceptance at each depth (of the positions that reach it) and that of the top-1 child there.
   ``served_mean_accepted`` walks the positions an engine serving the shape would visit (it skips
   the tokens it accepted); for a chain it is what the engine's own stats count, the cross-check
   logged for the configured chain.

3. **Predicted ms per output token**: (the draft's cost of the shape + the verify step at
   ``nodes + 1`` rows) / (mean accepted + 1), beside the plain step, and the speedup over it. The
   draft's cost is timed at ``--context`` too: per depth, one pass of the draft over the nodes of
   the depth above (the root: the entry of the last known token), each node its own draft KV as a
   batch of requests is in the engine, then the LM head and top-k. A tree drafter would read one KV
   under a mask; the per-node attention here costs more, so wide trees' draft costs are an upper
   bound.

Figures go to docs/benchmarks.md, measured alone::

    python -m microbench.tree_drafts --speculative-config \\
        '{"method": "eagle3", "model": "/tmp/heads/smollm2-eagle3", "num_speculative_tokens": 3}' \\
        --output tree_drafts.json
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.flat_batch import build_flat_batch
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ModelOutput, SchedulerOutput
from engine.spec_decode.config import EAGLE_METHODS, SpeculativeConfig
from engine.spec_decode.eagle import EagleProposer
from engine.spec_decode.eagle3_draft import Eagle3Draft
from engine.spec_decode.eagle_draft import DraftEntries, DraftKV, EagleDraft, new_draft_kv
from engine.spec_decode.stats import SpecDecodeStats
from engine.teacher_forcing import borrowed_block_rows
from engine_args.config import speculative_config_from_json
from engine_args.flags import add_dtype_argument

logger = logging.getLogger(__name__)

# Held out: none of splitserve/data/chat_questions.txt (the questions drafts are trained on).
HELD_OUT_QUESTIONS = (
    "Explain what a B-tree is and why databases use them for indexes.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "What happens, step by step, when I type a URL into a browser and press enter?",
    "Describe the difference between TCP and UDP, with one use case for each.",
)
DEFAULT_SHAPES = ("1", "1,1", "1,1,1", "1,1,1,1", "2", "3", "2,1", "2,2", "3,1,1", "4,2,1", "2,2,1,1")
DEFAULT_ROWS = (1, 2, 3, 4, 5, 7, 9, 13, 17)


@dataclass(frozen=True, slots=True)
class DraftShape:
    """A draft tree: every node kept at depth ``d - 1`` gets its ``branching[d - 1]`` best children
    (the root is the last known token); all ones is a chain."""

    branching: tuple[int, ...]

    @property
    def name(self) -> str:
        if all(b == 1 for b in self.branching):
            return f"chain-{len(self.branching)}"
        return ",".join(map(str, self.branching))

    @property
    def depth(self) -> int:
        return len(self.branching)

    @property
    def nodes_at_depth(self) -> list[int]:
        """Nodes at depths 0 (the root) .. D."""
        counts = [1]
        for branching in self.branching:
            counts.append(counts[-1] * branching)
        return counts

    @property
    def num_nodes(self) -> int:
        """Drafts verified: every node but the root."""
        return sum(self.nodes_at_depth[1:])


def parse_shape(text: str) -> DraftShape:
    """``"2,1"`` (branching per depth) or ``"chain-3"``."""
    if text.startswith("chain-") and text[6:].isdigit() and int(text[6:]) > 0:
        return DraftShape((1,) * int(text[6:]))
    try:
        branching = tuple(int(part) for part in text.split(","))
    except ValueError:
        branching = ()
    if not branching or min(branching) < 1:
        raise ValueError(f"a draft shape is branching factors per depth, each >= 1 (e.g. 2,1) or chain-K; got {text!r}")
    return DraftShape(branching)


def accepted_length(ranks: Sequence[int], branching: Sequence[int]) -> int:
    """Tokens a shape accepts at a position whose continuation's tokens rank ``ranks`` (by depth,
    down the continuation's own path) among the draft's guesses."""
    num_accepted = 0
    while num_accepted < min(len(ranks), len(branching)) and ranks[num_accepted] < branching[num_accepted]:
        num_accepted += 1
    return num_accepted


# ----------------------------------------------------------------- the draft's view of the target


class DraftVocabulary:
    """The draft's logits and which target token each of their columns is (EAGLE-3 drafts in a
    vocabulary of its own)."""

    def __init__(self, proposer: EagleProposer) -> None:
        self.proposer = proposer
        draft = proposer.draft
        if isinstance(draft, Eagle3Draft):
            self.target_ids = torch.arange(draft.d2t.shape[0], device=draft.d2t.device) + draft.d2t
        elif isinstance(draft, EagleDraft):
            self.target_ids = torch.arange(draft.shape.vocab_size, device=draft.device)
        else:
            raise RuntimeError(f"bug: no vocabulary for a {type(draft).__name__} draft")
        self.column_of = {token_id: column for column, token_id in enumerate(self.target_ids.tolist())}

    def logits(self, outputs: torch.Tensor) -> torch.Tensor:
        """outputs: [R, hidden_size] -> [R, the draft's vocabulary]."""
        draft = self.proposer.draft
        if isinstance(draft, Eagle3Draft):
            return draft.logits(outputs)
        if isinstance(draft, EagleDraft):
            return draft.logits(outputs, self.proposer.target.lm_head)
        raise RuntimeError(f"bug: no logits for a {type(draft).__name__} draft")

    def rank(self, logits: torch.Tensor, token_id: int) -> int:
        """Where ``token_id`` stands among one row's guesses (0: argmax's choice, ties to the first
        column as argmax breaks them); the vocabulary's size when the draft cannot guess it."""
        column = self.column_of.get(token_id)
        if column is None:
            return logits.shape[-1]
        score = logits[column]
        return int((logits > score).sum()) + int((logits[:column] == score).sum())


def clone_prefix(kv: DraftKV, num_entries: int, spare: int) -> DraftKV:
    """A copy of ``kv``'s first ``num_entries`` entries, room for ``spare`` more."""
    keys = [k.new_empty(num_entries + spare, *k.shape[1:]) for k in kv.keys]
    values = [v.new_empty(num_entries + spare, *v.shape[1:]) for v in kv.values]
    for copy, source in zip([*keys, *values], [*kv.keys, *kv.values]):
        copy[:num_entries] = source[:num_entries]
    return DraftKV(kv.start, keys, values, num_entries)


# ----------------------------------------------------------------- 2. accepted length by shape


def greedy_continuation(core: EngineCore, prompt: list[int], output_len: int) -> list[int]:
    """The engine's greedy output (``output_len`` tokens, EOS ignored)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    core.add_request(prompt, params, request_id=uuid.uuid4().hex)
    token_ids: list[int] = []
    while core.has_unfinished_requests():
        for output in core.step():
            token_ids.extend(output.new_token_ids)
    return token_ids


@torch.inference_mode()
def target_features(core: EngineCore, token_ids: list[int], num_prompt_tokens: int) -> tuple[torch.Tensor, int]:
    """The target's features of positions ``0 .. len(token_ids) - 2`` through the proposer's own
    ``target_forward``, the prompt as one prefill row and the rest as decode rows (as a verify step
    lays them out); and how many of the continuation's tokens the target's argmax here disagrees
    with (0 unless float rounding differs between this pass and the served steps)."""
    runner = core.runner
    proposer = _proposer(core)
    num_rows = len(token_ids) - 1 - num_prompt_tokens
    with borrowed_block_rows(core, 1, len(token_ids)) as (block_ids,):
        prefill = build_flat_batch(
            token_ids[:num_prompt_tokens],
            np.array([num_prompt_tokens]),
            np.array([0]),
            [block_ids],
            np.array([True]),
            0,
            runner.block_size,
            runner.to_device,
        )
        _, prompt_features = proposer.target_forward(prefill, runner._forward, runner.layer_caches)
        decodes = build_flat_batch(
            token_ids[num_prompt_tokens:-1],
            np.ones(num_rows, dtype=np.int64),
            np.arange(num_prompt_tokens, num_prompt_tokens + num_rows),
            [block_ids] * num_rows,
            np.ones(num_rows, dtype=bool),
            num_rows,
            runner.block_size,
            runner.to_device,
        )
        logits, features = proposer.target_forward(decodes, runner._forward, runner.layer_caches)
    greedy = logits.argmax(-1).tolist()  # row i: the token after position num_prompt_tokens + i
    num_disagreeing = sum(a != b for a, b in zip(greedy, token_ids[num_prompt_tokens + 1 :]))
    return torch.cat([prompt_features, features]), num_disagreeing


@torch.inference_mode()
def path_ranks(
    proposer: EagleProposer,
    token_ids: list[int],
    features: torch.Tensor,
    num_prompt_tokens: int,
    max_branching: Sequence[int],
) -> list[list[int]]:
    """Per position from the prompt's last on (where the engine's first chain starts), the ranks
    down the continuation's path (module docstring), as deep as ``max_branching`` (the widest
    shape's per depth) keeps a path alive and the continuation reaches."""
    draft, vocabulary = proposer.draft, DraftVocabulary(proposer)
    device = features.device
    num_entries = features.shape[0]  # entry i reads token i + 1 and the feature of i
    kv = new_draft_kv(draft, 0)
    next_ids = torch.tensor(token_ids[1 : num_entries + 1], device=device)
    outputs = draft(proposer.embed(next_ids), draft.fuse(features), DraftEntries.after(kv, num_entries))
    last = len(token_ids) - 1
    ranks_by_position = []
    for position in range(num_prompt_tokens - 1, last - 1):
        num_depths = min(len(max_branching), last - 1 - position)  # depth d guesses token position + 1 + d
        output = outputs[position : position + 1]
        path_kv: DraftKV | None = None
        ranks: list[int] = []
        for depth in range(num_depths):
            token_id = token_ids[position + 2 + depth]
            ranks.append(vocabulary.rank(vocabulary.logits(output)[0], token_id))
            if ranks[-1] >= max_branching[depth] or depth + 1 == num_depths:
                break
            if path_kv is None:
                path_kv = clone_prefix(kv, position + 1, num_depths)
            entries = DraftEntries(torch.tensor([path_kv.end], device=device), [path_kv], [1])
            output = draft(proposer.embed(torch.tensor([token_id], device=device)), output, entries)
        ranks_by_position.append(ranks)
    return ranks_by_position


def served_verifications(
    ranks_by_position: list[list[int]], shape: DraftShape, output_len: int
) -> list[tuple[int, int]]:
    """(drafts verified, accepted) per step of an engine serving ``shape`` the same greedy request:
    from the first output token on, each step jumps past what it accepted, and drafts stop short of
    ``max_tokens`` as the scheduler's do (a chain's equals the engine's own stats)."""
    verifications = []
    index = 0  # position num_prompt_tokens - 1 + index: index + 1 tokens out
    while index + 1 < output_len:
        num_drafts = min(shape.depth, output_len - index - 2)
        if num_drafts == 0:
            index += 1  # a plain decode
            continue
        accepted = accepted_length(ranks_by_position[index], shape.branching[:num_drafts])
        verifications.append((sum(shape.nodes_at_depth[1 : num_drafts + 1]), accepted))
        index += accepted + 1
    return verifications


def served_stats(ranks_by_prompt: list[list[list[int]]], shape: DraftShape, output_len: int) -> SpecDecodeStats:
    """The engine's counts (engine/spec_decode/stats.py) for a chain serving these prompts."""
    stats = SpecDecodeStats()
    for ranks_by_position in ranks_by_prompt:
        for num_drafts, accepted in served_verifications(ranks_by_position, shape, output_len):
            stats.add(num_drafts, accepted)
    return stats


@dataclass(slots=True)
class ShapeAcceptance:
    shape: str
    num_nodes: int
    num_positions: int
    mean_accepted: float
    accept_at_depth: list[float]  # of the positions that reach depth d, the share accepting a node there
    top1_accept_at_depth: list[float]  # ... accepting the top-1 child there
    served_mean_accepted: float  # over the positions a serving engine visits (module docstring)


def shape_acceptance(
    ranks_by_prompt: list[list[list[int]]], shape: DraftShape, max_depth: int, output_len: int
) -> ShapeAcceptance:
    """Over the positions whose continuation reaches ``max_depth`` (the same for every shape)."""
    reached, accepted_any, accepted_top1 = [0] * shape.depth, [0] * shape.depth, [0] * shape.depth
    lengths = []
    for ranks_by_position in ranks_by_prompt:
        for ranks in ranks_by_position[: max(0, output_len - max_depth)]:
            length = accepted_length(ranks, shape.branching)
            lengths.append(length)
            for depth in range(min(length + 1, shape.depth)):
                reached[depth] += 1
                accepted_any[depth] += depth < length
                accepted_top1[depth] += ranks[depth] == 0
    served = [a for ranks in ranks_by_prompt for _, a in served_verifications(ranks, shape, output_len)]
    return ShapeAcceptance(
        shape=shape.name,
        num_nodes=shape.num_nodes,
        num_positions=len(lengths),
        mean_accepted=statistics.fmean(lengths) if lengths else 0.0,
        accept_at_depth=[a / r if r else 0.0 for a, r in zip(accepted_any, reached)],
        top1_accept_at_depth=[a / r if r else 0.0 for a, r in zip(accepted_top1, reached)],
        served_mean_accepted=statistics.fmean(served) if served else 0.0,
    )


def measure_ranks(
    core: EngineCore, prompts: list[list[int]], output_len: int, shapes: Sequence[DraftShape]
) -> list[list[list[int]]]:
    """Per prompt, :func:`path_ranks` on the speculating engine ``core``'s greedy continuation."""
    max_depth = max(shape.depth for shape in shapes)
    max_branching = [max((s.branching[d] for s in shapes if s.depth > d), default=1) for d in range(max_depth)]
    ranks_by_prompt = []
    for prompt in prompts:
        token_ids = [*prompt, *greedy_continuation(core, prompt, output_len)]
        features, num_disagreeing = target_features(core, token_ids, len(prompt))
        if num_disagreeing:
            logger.warning(
                "the teacher-forced target disagrees with the served continuation at %d of %d tokens (float "
                "rounding): acceptance there is measured against the served tokens",
                num_disagreeing,
                output_len - 1,
            )
        ranks_by_prompt.append(path_ranks(_proposer(core), token_ids, features, len(prompt), max_branching))
    return ranks_by_prompt


# ----------------------------------------------------------------- 1. verify cost by rows


@contextmanager
def _propose_seconds(proposer: EagleProposer | None) -> Iterator[list[float]]:
    """Seconds the runner spends in the drafter's ``propose`` meanwhile (one entry per call)."""
    spent: list[float] = []
    if proposer is None:
        yield spent
        return
    propose = proposer.propose

    def timed(
        output: SchedulerOutput, model_output: ModelOutput | None, features: torch.Tensor, chain: bool = True
    ) -> list[list[int]]:
        started = time.perf_counter()
        try:
            return propose(output, model_output, features, chain)
        finally:
            spent.append(time.perf_counter() - started)

    proposer.propose = timed  # type: ignore[method-assign]
    try:
        yield spent
    finally:
        del proposer.propose  # the method again


def start_request_at_context(core: EngineCore, context: int, max_rows: int, seed: int) -> Request:
    """One request of ``context`` random prompt tokens, prefilled, its first token sampled."""
    rng = random.Random(seed)
    prompt = [rng.randrange(100, core.vocab_size - 100) for _ in range(context)]
    params = SamplingParams(temperature=0.0, max_tokens=max_rows + 2, ignore_eos=True)
    request_id = core.add_request(prompt, params)
    while not any(output.new_token_ids for output in core.step()):
        pass
    (request,) = [r for r in core.scheduler.running if r.request_id == request_id]
    return request


@torch.inference_mode()
def time_step(core: EngineCore, request: Request, num_rows: int) -> float:
    """Seconds of one step of ``request`` verifying ``num_rows - 1`` drafts, as the scheduler plans
    and the runner executes it, less the drafter's share; the request stays where it was (the step
    is not applied, its KV slots are written again next time)."""
    request.spec_token_ids = [request.all_token_ids[-1]] * (num_rows - 1)  # the tokens do not change the cost
    request.num_spec_tokens = num_rows - 1
    output = core.scheduler.schedule()
    (item,) = output.scheduled
    if item.num_new_tokens != num_rows:
        raise ValueError(f"the scheduler fit {item.num_new_tokens} rows of {num_rows}: raise --kv-cache-memory")
    with _propose_seconds(core.runner.eagle) as propose_seconds:
        started = time.perf_counter()
        core.runner.execute(output, core.eos_token_ids)
        elapsed = time.perf_counter() - started
    return elapsed - sum(propose_seconds)


def time_verify_rows(
    spec_core: EngineCore, plain_core: EngineCore, context: int, rows: Sequence[int], repeats: int, seed: int
) -> tuple[dict[int, float], float]:
    """Median ms of the speculating engine's step at each row count, and of the plain engine's
    one-row step; the two interleaved, the order reversed every other repeat."""
    spec_request = start_request_at_context(spec_core, context, max(rows), seed)
    plain_request = start_request_at_context(plain_core, context, 1, seed)
    runs = [(spec_core, spec_request, n) for n in rows] + [(plain_core, plain_request, 1)]
    samples: list[list[float]] = [[] for _ in runs]
    for repeat in range(repeats + 1):  # the first: warm-up
        order = list(range(len(runs))) if repeat % 2 else list(reversed(range(len(runs))))
        for index in order:
            seconds = time_step(*runs[index])
            if repeat:
                samples[index].append(seconds * 1e3)
    for core, request in ((spec_core, spec_request), (plain_core, plain_request)):
        core.abort([request.request_id])
        core.step()  # reports the abort
    medians = [statistics.median(s) for s in samples]
    return dict(zip(rows, medians[:-1])), medians[-1]


# ----------------------------------------------------------------- 3. the draft's cost by shape


@torch.inference_mode()
def time_draft(
    proposer: EagleProposer, shapes: Sequence[DraftShape], context: int, repeats: int
) -> dict[str, list[float]]:
    """Per shape, the median ms of each depth's draft pass over the nodes above it (then the LM
    head and top-k), every node on a draft KV of ``context`` entries of its own."""
    draft, vocabulary = proposer.draft, DraftVocabulary(proposer)
    device = draft.device
    max_depth = max(shape.depth for shape in shapes)
    width = draft.target_hidden_size * len(draft.feature_layer_ids or (0,))
    generator = torch.Generator().manual_seed(0)
    num_entries = context + max_depth  # what the timed nodes' KVs copy (their values do not change the cost)
    token_ids = torch.randint(100, proposer.target.shape.vocab_size - 100, (num_entries,), generator=generator)
    features = torch.randn(num_entries, width, generator=generator).to(device=device, dtype=draft.dtype)
    base = new_draft_kv(draft, 0)
    draft(proposer.embed(token_ids.to(device)), draft.fuse(features), DraftEntries.after(base, num_entries))
    root_feature = features[:1]
    root_token = token_ids[:1].to(device)
    medians = {}
    for shape in shapes:
        nodes = shape.nodes_at_depth
        samples: list[list[float]] = [[] for _ in range(shape.depth)]
        for repeat in range(repeats + 1):  # the first: warm-up
            kvs = [[clone_prefix(base, context + d, 1) for _ in range(nodes[d])] for d in range(shape.depth)]
            tokens, hidden = root_token, root_feature
            for depth in range(shape.depth):
                started = time.perf_counter()
                parents = draft.fuse(hidden) if depth == 0 else hidden
                positions = torch.full((nodes[depth],), context + depth, device=device)
                outputs = draft(
                    proposer.embed(tokens), parents, DraftEntries(positions, kvs[depth], [1] * nodes[depth])
                )
                columns = vocabulary.logits(outputs).topk(shape.branching[depth], dim=-1).indices
                tokens = vocabulary.target_ids[columns.flatten()]
                hidden = outputs.repeat_interleave(shape.branching[depth], dim=0)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if repeat:
                    samples[depth].append((time.perf_counter() - started) * 1e3)
        medians[shape.name] = [statistics.median(s) for s in samples]
    return medians


# ----------------------------------------------------------------- the report


@dataclass(slots=True)
class ShapeReport:
    acceptance: ShapeAcceptance
    draft_ms_at_depth: list[float]
    draft_ms: float
    verify_ms: float  # the step at num_nodes + 1 rows
    ms_per_token: float
    speedup: float  # the plain step's ms / ms_per_token


def predict(
    acceptance: ShapeAcceptance, draft_ms_at_depth: list[float], verify_ms: float, plain_ms: float
) -> ShapeReport:
    draft_ms = sum(draft_ms_at_depth)
    ms_per_token = (draft_ms + verify_ms) / (acceptance.mean_accepted + 1)
    return ShapeReport(acceptance, draft_ms_at_depth, draft_ms, verify_ms, ms_per_token, plain_ms / ms_per_token)


def format_report(reports: list[ShapeReport], verify_ms: dict[int, float], plain_ms: float) -> str:
    lines = [f"{'rows':>6}{'verify ms':>11}{'x 1 row':>9}"]
    for num_rows, ms in sorted(verify_ms.items()):
        lines.append(f"{num_rows:>6}{ms:>11.2f}{ms / verify_ms.get(1, ms):>9.2f}")
    lines.append(f"plain step (no speculation, 1 row): {plain_ms:.2f} ms")
    lines.append("")
    lines.append(
        f"{'shape':<10}{'nodes':>6}{'accepted':>10}{'served':>8}  {'top-1 accept by depth':<26}"
        f"{'draft ms':>9}{'verify ms':>10}{'ms/token':>10}{'speedup':>9}"
    )
    lines.append(
        f"{'plain':<10}{0:>6}{0:>10.2f}{0:>8.2f}  {'':<26}{0:>9.2f}{plain_ms:>10.2f}{plain_ms:>10.2f}{1:>8.2f}x"
    )
    for r in reports:
        a = r.acceptance
        top1 = " ".join(f"{rate:.0%}" for rate in a.top1_accept_at_depth)
        lines.append(
            f"{a.shape:<10}{a.num_nodes:>6}{a.mean_accepted:>10.2f}{a.served_mean_accepted:>8.2f}  {top1:<26}"
            f"{r.draft_ms:>9.2f}{r.verify_ms:>10.2f}{r.ms_per_token:>10.2f}{r.speedup:>8.2f}x"
        )
    return "\n".join(lines)


def chat_prompts(core: EngineCore, questions: Sequence[str]) -> list[list[int]]:
    """Each question through the model's chat template, as the chat workload of microbench/spec_decode.py."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(core.metadata_path))  # a GGUF file's too
    if tokenizer.chat_template is None:  # a base model's folder: the questions as plain text
        return [list(tokenizer.encode(question)) for question in questions]
    prompts = []
    for question in questions:
        messages = [{"role": "user", "content": question}]
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        prompts.append(list(encoded["input_ids"]))  # type: ignore[index, call-overload]
    return prompts


def _proposer(core: EngineCore) -> EagleProposer:
    if core.runner.eagle is None:
        raise RuntimeError("bug: the speculating engine has no EAGLE proposer")
    return core.runner.eagle


def engine_config(args: argparse.Namespace, speculative: SpeculativeConfig | None) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=False,  # a hit would leave the draft's KV short of the prompt
        speculative=speculative,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m microbench.tree_drafts", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="local Hugging Face folder (default: embedded SmolLM2-135M-Instruct)"
    )
    add_dtype_argument(parser, default="float32")
    parser.add_argument(
        "--speculative-config",
        required=True,
        metavar="JSON",
        help='an EAGLE or EAGLE-3 draft, as the serving commands take it: \'{"method": "eagle3", "model": "DIR"}\'',
    )
    parser.add_argument(
        "--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="branching per depth (2,1) or chain-K"
    )
    parser.add_argument(
        "--rows", default=",".join(map(str, DEFAULT_ROWS)), help="verify rows to time besides the shapes'"
    )
    parser.add_argument("--context", type=int, default=700, help="tokens of context of the timed steps")
    parser.add_argument("--repeats", type=int, default=20, help="timed steps and draft passes per measurement")
    parser.add_argument("--output-len", type=int, default=128, help="greedy tokens per prompt")
    parser.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="another question (repeatable)")
    parser.add_argument("--no-default-prompts", action="store_true", help="only the --prompt questions")
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 28)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    parser.add_argument("--output", type=Path, default=None, help="JSON report")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    spec = speculative_config_from_json(args.speculative_config)
    if spec.method not in EAGLE_METHODS:
        raise ValueError(f"tree drafts are measured for EAGLE drafts: use method eagle or eagle3, not {spec.method!r}")
    shapes = [parse_shape(text) for text in args.shapes]
    questions = [*(() if args.no_default_prompts else HELD_OUT_QUESTIONS), *args.prompt]
    if not questions or args.output_len < 2 + max(s.depth for s in shapes):
        raise ValueError("need a prompt and --output-len of at least the deepest shape's depth + 2")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rows = sorted({*map(int, args.rows.split(",")), 1, *(s.num_nodes + 1 for s in shapes)})
    spec_core = EngineCore(engine_config(args, spec))
    plain_core = EngineCore(engine_config(args, None))
    try:
        ranks_by_prompt = measure_ranks(spec_core, chat_prompts(spec_core, questions), args.output_len, shapes)
        # The engine served the configured chain while it generated: its counts should be the walk's.
        engine_counts = (
            spec_core.scheduler.spec_stats.num_draft_tokens,
            spec_core.scheduler.spec_stats.num_accepted_tokens,
        )
        served = served_stats(ranks_by_prompt, DraftShape((1,) * spec.num_speculative_tokens), args.output_len)
        walked_counts = (served.num_draft_tokens, served.num_accepted_tokens)
        log = logger.info if engine_counts == walked_counts else logger.warning
        log(
            "chain-%d drafts verified, accepted: the engine's own %s, walked from this module's ranks %s",
            spec.num_speculative_tokens,
            engine_counts,
            walked_counts,
        )
        verify_ms, plain_ms = time_verify_rows(spec_core, plain_core, args.context, rows, args.repeats, args.seed)
        draft_ms = time_draft(_proposer(spec_core), shapes, args.context, args.repeats)
    finally:
        spec_core.close()
        plain_core.close()
    max_depth = max(s.depth for s in shapes)
    reports = [
        predict(
            shape_acceptance(ranks_by_prompt, shape, max_depth, args.output_len),
            draft_ms[shape.name],
            verify_ms[shape.num_nodes + 1],
            plain_ms,
        )
        for shape in shapes
    ]
    sys.stdout.write(format_report(reports, verify_ms, plain_ms) + "\n")
    if args.output is not None:
        report = {
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "plain_ms": plain_ms,
            "verify_ms_by_rows": verify_ms,
            "engine_chain": {
                "num_speculative_tokens": spec.num_speculative_tokens,
                "engine_drafts_accepted": engine_counts,
                "walked_drafts_accepted": walked_counts,
            },
            "shapes": [asdict(r) for r in reports],
        }
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")
        logger.info("wrote %s", args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
