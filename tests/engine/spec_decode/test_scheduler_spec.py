"""The scheduler's side of speculative decoding: slots for drafts, roll-back of rejected ones,
and block-pool accounting that ends exactly where a non-speculative run would."""

from __future__ import annotations

from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from engine.scheduler_output import ModelOutput, SchedulerOutput
from tests.engine.factories import EOS, make_request, make_scheduler, run_step


def want_drafts(request: Request, drafts: list[int]) -> None:
    """What EngineCore's n-gram hook does before scheduling."""
    request.spec_token_ids, request.num_spec_tokens = list(drafts), len(drafts)


def verify(scheduler: Scheduler, output: SchedulerOutput, accepted: list[int], token_id: int) -> None:
    """Update with one speculating request that had ``accepted`` drafts accepted, then ``token_id``."""
    (item,) = output.scheduled
    assert item.num_draft_tokens
    model_output = ModelOutput(
        [token_id], [None], accepted_token_ids=[accepted], accepted_logprobs=[[None] * len(accepted)]
    )
    scheduler.update(output, model_output)


def held_block_ids(scheduler: Scheduler, request_id: str) -> list[int]:
    return list(scheduler.kv_cache_manager.get_block_ids(request_id))


def test_drafts_get_slots_and_rejected_ones_give_their_blocks_back() -> None:
    scheduler = make_scheduler(speculative=True, num_blocks=8, block_size=4, max_model_len=32)
    request = make_request("a", 6, max_tokens=10)
    scheduler.add_request(request)
    run_step(scheduler, token_id=50)  # prefill: 6 tokens in blocks [0, 1], token 50 sampled
    assert request.num_tokens == 7 and held_block_ids(scheduler, "a") == [0, 1]

    want_drafts(request, [51, 52, 53, 54])
    output = scheduler.schedule()
    (item,) = output.scheduled
    # Last token (position 6) plus 4 drafts at positions 7..10: three blocks.
    assert (item.num_new_tokens, item.num_draft_tokens, item.samples) == (5, 4, True)
    assert (output.num_decodes, output.num_spec_decodes, output.num_spec_tokens) == (0, 1, 5)
    assert held_block_ids(scheduler, "a") == [0, 1, 2]
    assert scheduler.kv_cache_manager.num_free_blocks == 5

    verify(scheduler, output, accepted=[], token_id=60)  # every draft rejected
    assert request.all_token_ids[6:] == [50, 60]
    assert request.num_computed_tokens == 7  # positions 0..6; the drafts' KV is not counted
    # Block 2 held only rejected positions: back in the pool, as if no draft was ever made.
    assert held_block_ids(scheduler, "a") == [0, 1]
    assert scheduler.kv_cache_manager.num_free_blocks == 6
    assert scheduler.kv_cache_manager.block_pool.blocks[2].ref_cnt == 0
    assert (request.num_spec_tokens, request.spec_token_ids) == (0, [])

    want_drafts(request, [61, 62, 63])
    output = scheduler.schedule()  # positions 7..10
    verify(scheduler, output, accepted=[61, 62], token_id=70)  # 63 rejected, 70 recovered
    assert request.all_token_ids[6:] == [50, 60, 61, 62, 70]
    assert request.num_computed_tokens == 10
    assert held_block_ids(scheduler, "a") == [0, 1, 3]  # block 2 went to the free queue's tail
    assert scheduler.spec_stats.num_draft_tokens == 7 and scheduler.spec_stats.num_accepted_tokens == 2


def test_block_counts_match_a_non_speculative_run_token_for_token() -> None:
    """Free-block counts after every step, speculative vs plain, over the same token sequence."""
    tokens = [40 + i for i in range(12)]

    def free_blocks_by_length(speculate: bool) -> dict[int, int]:
        scheduler = make_scheduler(speculative=True, num_blocks=10, block_size=4, max_model_len=40)
        request = make_request("a", 5, max_tokens=len(tokens))
        scheduler.add_request(request)
        run_step(scheduler, token_id=tokens[0])
        seen = {request.num_tokens: scheduler.kv_cache_manager.num_free_blocks}
        while not request.status.is_finished:
            produced = request.num_output_tokens
            if speculate:
                # Drafts: two right ones, then a wrong one.
                want_drafts(request, tokens[produced : produced + 2] + [999])
                output = scheduler.schedule()
                num_drafts = output.scheduled[0].num_draft_tokens
                accepted = tokens[produced : produced + min(2, num_drafts)]
                if num_drafts:
                    verify(scheduler, output, accepted, tokens[produced + len(accepted)])
                else:
                    scheduler.update(output, ModelOutput([tokens[produced]], [None]))
            else:
                run_step(scheduler, token_id=tokens[produced])
            if not request.status.is_finished:
                seen[request.num_tokens] = scheduler.kv_cache_manager.num_free_blocks
        assert request.output_token_ids == tokens
        manager = scheduler.kv_cache_manager
        assert manager.num_free_blocks == manager.num_total_blocks
        return seen

    plain, spec = free_blocks_by_length(False), free_blocks_by_length(True)
    assert spec and all(plain[length] == free for length, free in spec.items())
    assert len(spec) < len(plain)  # it did take bigger steps


def test_stop_token_among_accepted_drafts_ends_the_request_there() -> None:
    scheduler = make_scheduler(speculative=True, num_blocks=8, block_size=4)
    request = make_request("a", 3, max_tokens=10)
    scheduler.add_request(request)
    run_step(scheduler, token_id=50)
    want_drafts(request, [51, EOS, 53])
    output = scheduler.schedule()
    verify(scheduler, output, accepted=[51, EOS, 53], token_id=54)
    assert request.output_token_ids == [50, 51, EOS]
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert scheduler.kv_cache_manager.num_free_blocks == 8 and not scheduler.requests


def test_drafts_stop_at_max_tokens_the_context_and_the_budget() -> None:
    scheduler = make_scheduler(
        speculative=True, num_blocks=16, block_size=4, max_model_len=12, max_num_batched_tokens=4
    )
    request = make_request("a", 3, max_tokens=4)
    scheduler.add_request(request)
    run_step(scheduler, token_id=50)
    want_drafts(request, [1, 2, 3, 4, 5])
    # max_tokens 4 with one out: at most 3 more tokens, so 2 drafts (plus the bonus).
    assert scheduler.schedule().scheduled[0].num_draft_tokens == 2

    scheduler = make_scheduler(
        speculative=True, num_blocks=16, block_size=4, max_model_len=9, max_num_batched_tokens=16
    )
    request = make_request("a", 6, max_tokens=3)
    scheduler.add_request(request)
    run_step(scheduler, token_id=50)
    want_drafts(request, [1, 2, 3])
    # 7 tokens known, context 9: two more tokens at most, so one draft.
    assert scheduler.schedule().scheduled[0].num_draft_tokens == 1

    scheduler = make_scheduler(speculative=True, num_blocks=16, block_size=4, max_num_batched_tokens=3)
    request = make_request("a", 2, max_tokens=10)
    scheduler.add_request(request)
    run_step(scheduler, token_id=50)
    want_drafts(request, [1, 2, 3, 4])
    assert scheduler.schedule().scheduled[0].num_draft_tokens == 2  # budget 3: last token + 2


def test_drafts_never_take_the_blocks_another_stream_needs() -> None:
    scheduler = make_scheduler(speculative=True, num_blocks=3, block_size=4, max_model_len=16)
    a, b = make_request("a", 3, max_tokens=8), make_request("b", 4, max_tokens=8)
    scheduler.add_request(a)
    scheduler.add_request(b)
    run_step(scheduler, token_id=50)  # a and b hold one block each, one is free
    want_drafts(a, [1, 2, 3, 4])  # a decodes at position 3 in its block; drafts would need the free one
    want_drafts(b, [1, 2, 3, 4])  # b decodes at position 4: it needs the free block
    output = scheduler.schedule()
    # b's decode gets the block (a's drafts taking it would have preempted b); b's own drafts fill
    # the rest of that block.
    assert [(s.request.request_id, s.num_draft_tokens) for s in output.scheduled] == [("a", 0), ("b", 3)]
    assert not output.preempted_request_ids and scheduler.kv_cache_manager.num_free_blocks == 0


def test_a_scheduler_without_speculation_schedules_no_drafts() -> None:
    scheduler = make_scheduler(num_blocks=8, block_size=4)
    request = make_request("a", 3, max_tokens=10)
    scheduler.add_request(request)
    run_step(scheduler, token_id=50)
    want_drafts(request, [1, 2])
    output = scheduler.schedule()
    assert [(s.num_new_tokens, s.num_draft_tokens) for s in output.scheduled] == [(1, 0)]
    assert (output.num_decodes, output.num_spec_decodes) == (1, 0)
