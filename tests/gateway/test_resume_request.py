"""What a migrated request asks its new decode instance: the prompt plus every token sent
but the last (which becomes the new first token), with the output budget reduced so the
total stays what the client asked."""

from __future__ import annotations

from gateway.dispatch_request import DispatchRequest
from gateway.failover import resume_request
from splitserve.v1 import generation_pb2


def _request(**sampling: object) -> DispatchRequest:
    return DispatchRequest("r", [1, 2, 3], generation_pb2.SamplingParams(**sampling), priority=2, cache_salt="s")


def test_the_sent_tokens_but_the_last_move_into_the_prompt() -> None:
    resumed = resume_request(_request(max_tokens=10, min_tokens=4, temperature=0.0), [7, 8, 9])
    assert resumed is not None
    assert resumed.prompt_token_ids == [1, 2, 3, 7, 8]
    # The new D counts 9 as its first output token: 2 moved, so 8 more allowed, 2 still required.
    assert (resumed.sampling.max_tokens, resumed.sampling.min_tokens) == (8, 2)
    assert (resumed.request_id, resumed.priority, resumed.cache_salt) == ("r", 2, "s")


def test_no_budget_left_means_nothing_to_resume_and_an_unset_budget_stays_unset() -> None:
    assert resume_request(_request(max_tokens=3), [7, 8, 9]) is None
    resumed = resume_request(_request(), [7, 8, 9])
    assert resumed is not None and not resumed.sampling.HasField("max_tokens") and resumed.sampling.min_tokens == 0
