from __future__ import annotations

import threading

import pytest

from engine.request import RequestStatus
from tests.engine.factories import EOS, eviction_order, finish_load, make_request, make_scheduler, run_step, sample


def block_ids(scheduler, request_id: str) -> list[int]:
    return list(scheduler.kv_cache_manager.get_block_ids(request_id))


def assert_all_free(scheduler) -> None:
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_total_blocks
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)
    assert not manager.req_to_blocks and not scheduler.requests


def test_prefill_then_decode_allocates_exact_blocks() -> None:
    scheduler = make_scheduler(num_blocks=8, block_size=4)
    scheduler.add_request(make_request("a", 6, max_tokens=3))
    output = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens, s.samples) for s in output.scheduled] == [("a", 6, True)]
    assert output.num_decodes == 0 and output.num_scheduled_tokens == 6
    assert block_ids(scheduler, "a") == [0, 1]
    scheduler.update(output, sample(output))
    output = run_step(scheduler)  # decode at position 6: still in block 1
    assert output.num_decodes == 1 and block_ids(scheduler, "a") == [0, 1]
    run_step(scheduler)  # third token -> max_tokens reached: finished and freed
    assert scheduler.requests == {}
    assert_all_free(scheduler)
    # Freed tail first: block 1 is evicted before block 0, after the never-used blocks.
    assert eviction_order(scheduler.kv_cache_manager.block_pool) == [2, 3, 4, 5, 6, 7, 1, 0]


def test_decode_crossing_a_block_boundary_gets_a_new_block() -> None:
    scheduler = make_scheduler(num_blocks=8, block_size=4)
    scheduler.add_request(make_request("a", 4, max_tokens=3))
    run_step(scheduler)
    assert block_ids(scheduler, "a") == [0]
    run_step(scheduler)  # token at position 4 needs block 1
    assert block_ids(scheduler, "a") == [0, 1]


def test_chunked_prefill_respects_the_token_budget_and_decodes_go_first() -> None:
    scheduler = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=5)
    scheduler.add_request(make_request("short", 2, max_tokens=5))
    scheduler.add_request(make_request("long", 9, max_tokens=2))
    output = run_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled] == [("short", 2), ("long", 3)]
    output = run_step(scheduler)
    # The decode is placed first, the prefill continues with what the budget leaves.
    assert [(s.request.request_id, s.num_new_tokens, s.samples) for s in output.scheduled] == [
        ("short", 1, True),
        ("long", 4, False),
    ]
    assert output.num_decodes == 1
    output = run_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens, s.samples) for s in output.scheduled] == [
        ("short", 1, True),
        ("long", 2, True),
    ]


def test_max_num_seqs_caps_running_requests() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(make_request(name, 3))
    output = scheduler.schedule()
    assert [s.request.request_id for s in output.scheduled] == ["a", "b"]
    assert scheduler.num_waiting == 1


def test_prefix_cache_hit_shares_blocks_and_counts_refs() -> None:
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    shared = list(range(100, 108))  # two full blocks
    scheduler.add_request(make_request("a", shared + [1, 3], max_tokens=5))
    run_step(scheduler)
    scheduler.add_request(make_request("b", shared + [4], max_tokens=5))
    output = run_step(scheduler)
    item_b = next(s for s in output.scheduled if s.request.request_id == "b")
    assert item_b.request.num_cached_tokens == 8
    assert item_b.num_new_tokens == 1
    assert block_ids(scheduler, "b")[:2] == block_ids(scheduler, "a")[:2] == [0, 1]
    pool = scheduler.kv_cache_manager.block_pool
    assert [pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [2, 2, 1]
    scheduler.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert_all_free(scheduler)
    assert pool.get_cached_block(scheduler_block_hash(shared), shared[4:8]) is pool.blocks[1]


def test_a_prompt_whose_next_block_a_prefill_is_computing_waits_for_it_and_hits() -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=4, long_prefill_token_threshold=8)
    shared = list(range(100, 116))  # four full blocks
    scheduler.add_request(make_request("a", shared + [1, 2], max_tokens=3))
    scheduler.add_request(make_request("b", shared + [3], max_tokens=3))
    scheduler.add_request(make_request("c", list(range(200, 205)), max_tokens=3))
    output = run_step(scheduler)
    # a computes blocks 0-1; b would hit them and compute blocks 2-3 beside a: it waits, and
    # c, behind it, shares nothing and is admitted.
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled] == [("a", 8), ("c", 5)]
    output = run_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled if s.num_new_tokens > 1] == [("a", 8)]
    b = next(s for s in output.scheduled if s.request.request_id == "b")
    assert b.request.num_cached_tokens == 16 and b.num_new_tokens == 1  # the whole shared prefix, once
    assert block_ids(scheduler, "b")[:4] == block_ids(scheduler, "a")[:4]
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert_all_free(scheduler)


def scheduler_block_hash(tokens: list[int]):
    from engine.kv_cache_utils import hash_block_tokens

    return hash_block_tokens(hash_block_tokens(None, tokens[:4]), tokens[4:8])


def test_fully_cached_prompt_still_computes_its_last_token() -> None:
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    prompt = list(range(100, 108))
    scheduler.add_request(make_request("a", prompt, max_tokens=1))
    run_step(scheduler)
    scheduler.add_request(make_request("b", prompt, max_tokens=1))
    output = scheduler.schedule()
    assert output.scheduled[0].request.num_cached_tokens == 4
    assert output.scheduled[0].num_new_tokens == 4


def test_cache_salt_separates_prefixes() -> None:
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    prompt = list(range(100, 109))
    first = make_request("a", prompt, max_tokens=1)
    run_after = make_request("b", prompt, max_tokens=1)
    run_after.cache_salt = b"tenant-2"
    scheduler.add_request(first)
    run_step(scheduler)
    scheduler.add_request(run_after)
    output = scheduler.schedule()
    assert output.scheduled[0].request.num_cached_tokens == 0


def test_preemption_picks_the_latest_arrival_and_loses_no_output() -> None:
    # 4 blocks of 4 tokens; two requests of 7 prompt tokens each need 2 blocks, then a third on decode.
    scheduler = make_scheduler(num_blocks=4, block_size=4, enable_prefix_caching=False)
    scheduler.add_request(make_request("old", 7, max_tokens=4))
    scheduler.add_request(make_request("new", 7, max_tokens=4))
    run_step(scheduler)
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    new = scheduler.requests["new"]
    run_step(scheduler, token_id=8)  # decodes at position 7 still fit in each request's block 1
    output = run_step(scheduler, token_id=9)  # "old" needs a block for position 8 -> "new" preempted
    assert output.preempted_request_ids == ["new"]
    assert [s.request.request_id for s in output.scheduled] == ["old"]
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert new.output_token_ids == [7, 8]  # its sampled tokens survive
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert new.output_token_ids[:2] == [7, 8] and new.num_output_tokens == 4
    assert scheduler.num_preemptions == 1
    assert_all_free(scheduler)


def test_preemption_respects_priority() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, enable_prefix_caching=False)
    scheduler.add_request(make_request("low", 7, max_tokens=4, priority=5))
    scheduler.add_request(make_request("high", 7, max_tokens=4, priority=0))
    output = run_step(scheduler)
    assert [s.request.request_id for s in output.scheduled] == ["high", "low"]
    run_step(scheduler)
    output = run_step(scheduler)
    assert output.preempted_request_ids == ["low"]


def test_stop_conditions() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("eos", 3, max_tokens=5))
    scheduler.add_request(make_request("stop_id", 3, max_tokens=5, stop_token_ids=[9]))
    scheduler.add_request(make_request("ignore", 3, max_tokens=2, ignore_eos=True))
    scheduler.add_request(make_request("min", 3, max_tokens=5, min_tokens=2))
    output = scheduler.schedule()
    statuses = {}
    tokens = {"eos": EOS, "stop_id": 9, "ignore": EOS, "min": EOS}
    from engine.scheduler_output import ModelOutput

    model_output = ModelOutput([tokens[s.request.request_id] for s in output.scheduled], [None] * 4)
    for request, _ in scheduler.update(output, model_output):
        statuses[request.request_id] = (request.status, request.stop_reason)
    assert statuses == {
        "eos": (RequestStatus.FINISHED_STOPPED, None),
        "stop_id": (RequestStatus.FINISHED_STOPPED, 9),
        "ignore": (RequestStatus.RUNNING, None),
        "min": (RequestStatus.RUNNING, None),
    }
    run_step(scheduler)  # "ignore" hits max_tokens=2; "min" gets its second token
    assert scheduler.requests.keys() == {"min"}


def test_abort_frees_blocks_in_every_state() -> None:
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=1)
    scheduler.add_request(make_request("running", 5, max_tokens=10))
    scheduler.add_request(make_request("waiting", 5, max_tokens=10))
    run_step(scheduler)
    assert scheduler.requests["waiting"].status is RequestStatus.WAITING
    ended = scheduler.finish_requests(["running", "waiting", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in ended] == ["running", "waiting"]
    assert all(r.status is RequestStatus.FINISHED_ABORTED for r in ended)
    assert_all_free(scheduler)


def test_prefill_role_pins_blocks_until_released() -> None:
    scheduler = make_scheduler(num_blocks=8, block_size=4, role="prefill")
    scheduler.add_request(make_request("a", 6, max_tokens=10))
    output = run_step(scheduler)
    request = output.scheduled[0].request
    assert request.status is RequestStatus.FINISHED_PREFILLED
    assert request.output_token_ids == [7]
    assert not scheduler.has_unfinished_requests()
    handoff = scheduler.kv_handoff(request)
    assert handoff.block_ids == [0, 1] and handoff.num_tokens == 6
    assert scheduler.kv_cache_manager.num_free_blocks == 6
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_RELEASED)
    assert_all_free(scheduler)


def loads_started(scheduler) -> list[tuple[str, int, int]]:
    """(request id, blocks, local hit blocks) of every load the scheduler started, in order."""
    return [(load.request_id, len(load.block_ids), load.num_local_hit_blocks) for load in scheduler.kv_loader.started]


def test_decode_role_loads_only_missing_blocks_then_decodes() -> None:
    scheduler = make_scheduler(num_blocks=16, block_size=4, role="decode")
    shared = list(range(100, 108))
    # A first request fully computed locally fills the prefix cache (recompute after a failed load).
    scheduler.add_request(make_request("a", shared + [1], first_token_id=50, max_tokens=3))
    assert scheduler.schedule().is_empty
    assert finish_load(scheduler, "a", error="unreachable") == []
    run_step(scheduler)
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    # The second shares two full blocks: only the third block's tokens are loaded.
    scheduler.add_request(make_request("b", shared + [2, 3, 4, 5, 6], first_token_id=51, max_tokens=3))
    assert scheduler.schedule().is_empty
    assert loads_started(scheduler)[-1] == ("b", 4, 2)
    request = scheduler.requests["b"]
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert finish_load(scheduler, "b") == []
    output = run_step(scheduler)
    assert [(s.num_new_tokens, s.samples) for s in output.scheduled] == [(1, True)]
    assert request.num_computed_tokens == 14 and request.output_token_ids == [51, 7]


def test_decode_role_abort_while_loading_frees_blocks_only_once_the_load_stopped() -> None:
    """The blocks of a request aborted mid-load may still be written: they stay allocated until
    the loader reports the load over, and are freed then, exactly once."""
    scheduler = make_scheduler(num_blocks=8, block_size=4, role="decode")
    scheduler.add_request(make_request("a", 9, first_token_id=50))
    scheduler.schedule()
    (ended,) = scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert ended.status is RequestStatus.FINISHED_ABORTED and scheduler.kv_loader.cancelled == ["a"]
    assert scheduler.kv_cache_manager.num_free_blocks == 8 - 3  # still the loader's to write
    assert scheduler.has_unfinished_requests()  # steps go on until they are freed
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("a", 4))
    assert finish_load(scheduler, "a", error="cancelled") == []
    assert_all_free(scheduler)
    assert not scheduler.has_unfinished_requests()
    assert finish_load(scheduler, "a") == []  # a late or repeated report changes nothing
    assert_all_free(scheduler)


def test_a_failed_load_ends_the_request_with_an_error_when_it_may_not_recompute() -> None:
    scheduler = make_scheduler(num_blocks=8, block_size=4, role="decode")
    scheduler.add_request(make_request("a", 9, first_token_id=50, kv_load_failure_policy="fail"))
    scheduler.schedule()
    (ended,) = finish_load(scheduler, "a", error="peer gone")
    assert ended.status is RequestStatus.FINISHED_ERROR and ended.error == "peer gone"
    assert ended.status.finish_reason == "error"
    assert_all_free(scheduler)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_handoff_whose_source_is_lost_while_it_queues_is_settled_without_blocks(policy: str) -> None:
    """P dropped the KV while the hand-off waited for blocks here: it ends at once (fail) or
    becomes an ordinary prompt to prefill here (recompute); no load is ever started for it."""
    scheduler = make_scheduler(num_blocks=4, block_size=4, role="decode", max_num_seqs=1)
    scheduler.add_request(make_request("running", 4, max_tokens=8))
    run_step(scheduler)
    scheduler.add_request(make_request("queued", 8, first_token_id=50, kv_load_failure_policy=policy))
    run_step(scheduler)  # max_num_seqs: the hand-off waits
    ended = finish_load(scheduler, "queued", error="prefill instance dropped the KV")
    queued = scheduler.requests.get("queued")
    if policy == "fail":
        assert [r.request_id for r in ended] == ["queued"] and queued is None
    else:
        assert ended == [] and queued is not None and queued.num_external_tokens == 0
    scheduler.finish_requests(["running"], RequestStatus.FINISHED_ABORTED)
    while scheduler.requests:
        run_step(scheduler)
    assert loads_started(scheduler) == []
    assert_all_free(scheduler)


def test_handoffs_are_admitted_in_queue_order_until_one_does_not_fit() -> None:
    """schedule() gives queued hand-offs their blocks and starts their loads without token
    budget, stops at the first one that does not fit or at max_num_seqs, and leaves the rest
    queued for a later step."""
    scheduler = make_scheduler(num_blocks=6, block_size=4, role="decode", max_num_seqs=3)
    scheduler.add_request(make_request("a", 8, first_token_id=50))  # 2 blocks
    scheduler.add_request(make_request("b", list(range(30, 42)), first_token_id=51))  # 3 blocks
    scheduler.add_request(make_request("c", list(range(60, 64)), first_token_id=52))  # 1 block, behind b
    assert scheduler.schedule().is_empty  # loads take no step of the model
    assert loads_started(scheduler) == [("a", 2, 0), ("b", 3, 0), ("c", 1, 0)]
    assert all(scheduler.requests[r].status is RequestStatus.WAITING_FOR_REMOTE_KV for r in "abc")
    assert not scheduler.waiting
    scheduler.add_request(make_request("d", 4, first_token_id=53))
    scheduler.schedule()
    assert len(loads_started(scheduler)) == 3  # max_num_seqs: three are loading
    scheduler.finish_requests(["a", "b", "c"], RequestStatus.FINISHED_ABORTED)
    for request_id in "abc":
        finish_load(scheduler, request_id, error="cancelled")
    scheduler.add_request(make_request("e", 30, first_token_id=54))  # 8 blocks: never fits
    scheduler.add_request(make_request("f", 4, first_token_id=55))
    scheduler.schedule()
    assert [load[0] for load in loads_started(scheduler)[3:]] == ["d"]  # e waits at the head; f behind it
    assert [r.request_id for r in scheduler.waiting] == ["e", "f"]
    scheduler.finish_requests(["d", "e", "f"], RequestStatus.FINISHED_ABORTED)
    finish_load(scheduler, "d", error="cancelled")
    assert_all_free(scheduler)


def test_a_handoff_behind_a_preempted_request_is_admitted_after_it() -> None:
    scheduler = make_scheduler(num_blocks=16, block_size=4, role="decode")
    preempted = make_request("preempted", 8, max_tokens=8)
    preempted.status = RequestStatus.PREEMPTED
    scheduler.add_request(preempted)
    scheduler.add_request(make_request("handoff", 8, first_token_id=50))
    output = scheduler.schedule()  # the step admits both, the recompute first
    assert [s.request.request_id for s in output.scheduled] == ["preempted"]
    assert [load[0] for load in loads_started(scheduler)] == ["handoff"]


def test_once_a_step_thread_claims_the_scheduler_no_other_thread_may_change_it() -> None:
    """One writer: every mutating call of the scheduler and its block pool from a thread other
    than the one that claimed them raises, and changes nothing; reads stay open to all."""
    scheduler = make_scheduler(num_blocks=8, block_size=4, role="decode")
    scheduler.add_request(make_request("queued", 4))  # unclaimed: the caller's thread is the step thread
    errors: dict[str, BaseException] = {}

    def from_another_thread(name: str, call) -> None:
        def run() -> None:
            try:
                call()
            except BaseException as error:
                errors[name] = error

        thread = threading.Thread(target=run, name=f"not-the-step-thread-{name}")
        thread.start()
        thread.join()

    scheduler.owner.claim()
    mutations = {
        "add_request": lambda: scheduler.add_request(make_request("late", 4)),
        "finish_requests": lambda: scheduler.finish_requests(["queued"], RequestStatus.FINISHED_ABORTED),
        "schedule": scheduler.schedule,
        "kv_load_finished": lambda: finish_load(scheduler, "queued", error="gone"),
        "block_pool": lambda: scheduler.kv_cache_manager.block_pool.get_new_blocks(1),
    }
    for name, call in mutations.items():
        from_another_thread(name, call)
    assert sorted(errors) == sorted(mutations)
    assert all(isinstance(error, RuntimeError) and "step thread" in str(error) for error in errors.values())
    assert list(scheduler.requests) == ["queued"] and scheduler.kv_cache_manager.num_free_blocks == 8
    from_another_thread("read", lambda: (scheduler.num_waiting, scheduler.kv_cache_manager.num_free_blocks))
    assert "read" not in errors
    run_step(scheduler)  # the claiming thread itself goes on
    assert scheduler.requests["queued"].status is RequestStatus.RUNNING


def test_prefill_cap_leaves_decodes_their_step_and_chunks_the_rest() -> None:
    """A decode instance recomputing a prompt (a failed pull) computes at most one chunk per
    step beside its running decodes, however large the step budget."""
    scheduler = make_scheduler(
        num_blocks=64,
        block_size=4,
        max_num_batched_tokens=64,
        max_model_len=128,
        role="decode",
        max_num_prefill_tokens=8,
    )
    for index in range(2):
        scheduler.add_request(make_request(f"stream-{index}", 5, first_token_id=50, max_tokens=40))
    scheduler.add_request(make_request("recompute", 30, first_token_id=51, max_tokens=40))
    scheduler.schedule()
    assert [load[0] for load in loads_started(scheduler)] == ["stream-0", "stream-1", "recompute"]
    finish_load(scheduler, "stream-0")
    finish_load(scheduler, "stream-1")
    finish_load(scheduler, "recompute", error="unreachable")  # 31 tokens to compute here
    chunks = []
    while scheduler.requests["recompute"].num_output_tokens == 1:
        output = run_step(scheduler)
        assert [s.request.request_id for s in output.scheduled[:2]] == ["stream-0", "stream-1"]
        assert output.num_decodes == 2  # every stream advances in every step
        chunks += [s.num_new_tokens for s in output.scheduled[2:]]
    assert chunks == [8, 8, 8, 7] and sum(chunks) == 31


def test_prefill_cap_spans_requests_and_admissions() -> None:
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_prefill_tokens=10)
    scheduler.add_request(make_request("a", list(range(10, 17)), max_tokens=2))
    scheduler.add_request(make_request("b", list(range(20, 27)), max_tokens=2))
    output = run_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled] == [("a", 7), ("b", 3)]
    output = run_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled] == [("a", 1), ("b", 4)]


def test_a_long_prompt_goes_in_capped_chunks_and_a_later_short_one_shares_its_next_step() -> None:
    """A prefill instance with a per-request cap: the long prompt never takes a whole step, so
    a short prompt that arrives during one of its chunks is computed in the very next step,
    beside the long prompt's following chunk; every block comes back at the end."""
    scheduler = make_scheduler(
        num_blocks=32, block_size=4, max_num_batched_tokens=64, max_model_len=64, long_prefill_token_threshold=8
    )
    scheduler.role = "prefill"
    scheduler.add_request(make_request("long", 30, max_tokens=4))
    output = run_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens, s.samples) for s in output.scheduled] == [("long", 8, False)]
    # Arrives during the long prompt's first chunk (no prefix in common with it).
    scheduler.add_request(make_request("short", list(range(100, 106)), max_tokens=4))
    output = run_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens, s.samples) for s in output.scheduled] == [
        ("long", 8, False),
        ("short", 6, True),
    ]
    assert scheduler.requests["short"].status is RequestStatus.FINISHED_PREFILLED
    chunks = [s.num_new_tokens for _ in range(2) for s in run_step(scheduler).scheduled]
    assert chunks == [8, 6]  # 30 = 8 + 8 + 8 + 6
    assert scheduler.requests["long"].status is RequestStatus.FINISHED_PREFILLED
    scheduler.finish_requests(["long", "short"], RequestStatus.FINISHED_ABORTED)
    assert_all_free(scheduler)


def test_the_chunk_cap_is_per_request_and_leaves_decodes_and_short_prompts_whole() -> None:
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=64, long_prefill_token_threshold=8)
    scheduler.add_request(make_request("stream", 3, max_tokens=10))
    run_step(scheduler)
    for first, name in ((200, "long-a"), (300, "long-b")):
        scheduler.add_request(make_request(name, list(range(first, first + 20)), max_tokens=2))
    scheduler.add_request(make_request("short", list(range(100, 108)), max_tokens=2))
    output = run_step(scheduler)
    # Each long prompt gets its own chunk of 8; a prompt of exactly 8 tokens goes in one; the decode its one token.
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled] == [
        ("stream", 1),
        ("long-a", 8),
        ("long-b", 8),
        ("short", 8),
    ]
    assert output.num_scheduled_tokens == 25


def test_a_pulled_request_preempted_on_decode_recomputes_and_never_pulls_again() -> None:
    """After its pull, a request's KV is local: P has released it, so a preemption must
    recompute here (prefix-cache hits first) rather than ask P for the blocks again."""
    scheduler = make_scheduler(num_blocks=5, block_size=4, role="decode", max_model_len=64)
    scheduler.add_request(make_request("old", 8, first_token_id=50, max_tokens=8))
    scheduler.schedule()
    finish_load(scheduler, "old")
    scheduler.add_request(make_request("new", list(range(30, 38)), first_token_id=51, max_tokens=8))
    scheduler.schedule()
    finish_load(scheduler, "new")
    output = run_step(scheduler)  # two blocks each, and both need a third: the later one yields
    assert output.preempted_request_ids == ["new"] and scheduler.num_preemptions == 1
    new = scheduler.requests["new"]
    assert new.status is RequestStatus.PREEMPTED and new.num_external_tokens == 0
    outputs = []
    while scheduler.requests:
        outputs.append(run_step(scheduler))
    assert [load[0] for load in loads_started(scheduler)] == ["old", "new"]  # no second load of "new"
    recompute = [
        s.num_new_tokens for output in outputs for s in output.scheduled if s.request is new and s.num_new_tokens > 1
    ]
    assert recompute == [5]  # 9 tokens, the first block a prefix-cache hit
    assert new.output_token_ids == [51] + [7] * 7
    assert_all_free(scheduler)


def test_pending_prefill_tokens_count_queued_and_unfinished_prompts() -> None:
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=6, role="decode")
    scheduler.add_request(make_request("a", list(range(10, 20)), max_tokens=2))
    scheduler.add_request(make_request("b", list(range(20, 25)), max_tokens=2))
    # A hand-off: its prompt is loaded, not prefill work.
    scheduler.add_request(make_request("pulled", list(range(30, 39)), first_token_id=50))
    assert scheduler.num_pending_prefill_tokens == 15
    run_step(scheduler)  # 6 of a's 10
    assert scheduler.num_pending_prefill_tokens == 4 + 5
    run_step(scheduler)  # a finishes its prompt and samples; b gets 2
    assert scheduler.num_pending_prefill_tokens == 3


def test_a_waiting_prompts_cached_prefix_is_not_pending_work() -> None:
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=64)
    scheduler.add_request(make_request("a", list(range(10, 22)), max_tokens=1))
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    scheduler.add_request(
        make_request("b", list(range(10, 18)) + [90, 91, 92], max_tokens=1)
    )  # two cached blocks, then 3 new tokens
    assert scheduler.num_pending_prefill_tokens == 3
    scheduler.add_request(make_request("c", list(range(40, 51)), max_tokens=1))
    assert scheduler.num_pending_prefill_tokens == 3 + 11


# ---------------------------------------------------------- batches in flight (pipeline parallel)


def test_batches_in_flight_take_turns_in_equal_shares_of_the_requests() -> None:
    """Two pipeline stages: a batch is scheduled before the one before it is updated; it takes
    the requests that are in none (their next token is known) and at most half of all, so two
    batches of two alternate rather than one of four and an empty one."""
    scheduler = make_scheduler(max_batches_in_flight=2)
    for name in "abcd":
        scheduler.add_request(make_request(name, 3, max_tokens=5))
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert [s.request.request_id for s in first.scheduled] == ["a", "b"]
    assert [s.request.request_id for s in second.scheduled] == ["c", "d"]
    assert scheduler.schedule().is_empty  # everyone is in flight
    scheduler.update(first, sample(first))
    third = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in third.scheduled] == [("a", 1), ("b", 1)]
    for output in (second, third):
        scheduler.update(output, sample(output))
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert all(r.num_output_tokens == 5 for r in (first.scheduled[0].request, second.scheduled[1].request))
    assert_all_free(scheduler)


def test_a_request_aborted_in_flight_keeps_its_blocks_until_its_batch_is_updated() -> None:
    """The stages may still be writing its KV: its blocks are freed when its batch comes back,
    not when it ends; its batch's other request advances as usual."""
    scheduler = make_scheduler(max_batches_in_flight=2)
    scheduler.add_request(make_request("a", list(range(10, 16)), max_tokens=5))
    scheduler.add_request(make_request("b", list(range(20, 26)), max_tokens=5))  # no block shared with a
    in_flight = scheduler.schedule()
    assert [s.request.request_id for s in in_flight.scheduled] == ["a"]
    other = scheduler.schedule()
    assert [s.request.request_id for s in other.scheduled] == ["b"]
    held, num_blocks_of_a = scheduler.kv_cache_manager.num_free_blocks, len(block_ids(scheduler, "a"))
    (aborted,) = scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache_manager.num_free_blocks == held and "a" not in scheduler.requests
    scheduler.update(in_flight, sample(in_flight))
    assert aborted.num_output_tokens == 0  # nothing sampled for it is kept
    assert scheduler.kv_cache_manager.num_free_blocks == held + num_blocks_of_a == held + 2  # back, once
    scheduler.update(other, sample(other))
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert_all_free(scheduler)


def test_a_request_in_flight_is_never_preempted() -> None:
    """Out of blocks, a request scheduled beside a batch in flight preempts one that is not in
    flight (here itself), never the later arrival whose KV a stage may be writing."""
    scheduler = make_scheduler(num_blocks=4, block_size=4, enable_prefix_caching=False, max_batches_in_flight=2)
    scheduler.add_request(make_request("first", 8, max_tokens=4))
    scheduler.add_request(make_request("second", 7, max_tokens=4))
    prefill_first = scheduler.schedule()  # its share: one of the two
    in_flight = scheduler.schedule()  # "second": two blocks, the last ones
    assert [s.request.request_id for s in in_flight.scheduled] == ["second"]
    scheduler.update(prefill_first, sample(prefill_first))
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    output = scheduler.schedule()  # "first" decodes at position 8: it needs a third block
    assert output.preempted_request_ids == ["first"] and output.is_empty
    assert scheduler.requests["second"].status is RequestStatus.RUNNING
    scheduler.update(in_flight, sample(in_flight))
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert scheduler.requests == {} and scheduler.num_preemptions == 1
    assert_all_free(scheduler)
