"""The decision function: each rule on its own, then recorded sequences of metrics (a step up
and back down, a flapping load) through the loop's bookkeeping of cooldowns."""

from __future__ import annotations

from planner.capacity import InstanceCapacity, Slo, Workload
from planner.decision import Cooldowns, Decision, Observed, decide, instances_needed
from tests.planner.factories import make_bounds

# One prefill instance takes 5 requests a second, one decode instance 2.
CAPACITY = InstanceCapacity(prefill_rate=5.0, decode_rate=2.0, decode_streams=8)
SLO = Slo(ttft_s=1.0, itl_s=0.05)


def load(rate: float) -> Workload:
    return Workload(request_rate=rate, prompt_tokens=512, output_tokens=128)


def pools(prefill: int, decode: int, ttft: float | None = None, itl: float | None = None) -> Observed:
    return Observed(prefill, decode, ttft, itl)


def test_instances_needed_rounds_up_and_keeps_one() -> None:
    assert instances_needed(0.0, 2.0) == 1
    assert instances_needed(4.0, 2.0) == 2
    assert instances_needed(4.1, 2.0) == 3


def test_scales_each_role_up_to_what_the_rate_needs() -> None:
    decision = decide(load(9.0), CAPACITY, SLO, pools(1, 1), make_bounds(), Cooldowns(), now=0.0)
    # 9 / 5 -> 2 prefill; 9 / 2 -> 5 decode.
    assert (decision.prefill.desired, decision.prefill.reason) == (2, "load_up")
    assert (decision.decode.desired, decision.decode.reason) == (5, "load_up")


def test_scales_down_only_past_the_margin() -> None:
    # 7 a second needs 4 decode; with the 20% margin 8.4 needs 5: the pool of 5 stays.
    decision = decide(load(7.0), CAPACITY, SLO, pools(2, 5), make_bounds(), Cooldowns(), now=0.0)
    assert (decision.decode.desired, decision.decode.reason) == (5, "steady")
    # 6 a second: 7.2 with the margin needs 4: down to 4, though 6 alone needs 3.
    decision = decide(load(6.0), CAPACITY, SLO, pools(2, 5), make_bounds(), Cooldowns(), now=0.0)
    assert (decision.decode.desired, decision.decode.needed, decision.decode.reason) == (4, 3, "load_down")


def test_bounds_win_over_the_rate() -> None:
    bounds = make_bounds(prefill=(2, 3), decode=(1, 4))
    decision = decide(load(50.0), CAPACITY, SLO, pools(2, 2), bounds, Cooldowns(), now=0.0)
    assert (decision.prefill.desired, decision.prefill.reason) == (3, "max")
    assert (decision.decode.desired, decision.decode.reason) == (4, "max")
    decision = decide(load(0.0), CAPACITY, SLO, pools(3, 4), bounds, Cooldowns(), now=0.0)
    assert (decision.prefill.desired, decision.prefill.reason) == (2, "min")
    assert decision.decode.desired == 1


def test_cooldowns_hold_a_pool_that_just_changed() -> None:
    bounds = make_bounds(up_cooldown_s=10.0, down_cooldown_s=30.0)
    cooldowns = Cooldowns({"decode": 100.0})
    up = decide(load(9.0), CAPACITY, SLO, pools(2, 1), bounds, cooldowns, now=105.0)
    assert (up.decode.desired, up.decode.reason) == (1, "cooldown")
    assert decide(load(9.0), CAPACITY, SLO, pools(2, 1), bounds, cooldowns, now=110.0).decode.desired == 5
    down = decide(load(0.0), CAPACITY, SLO, pools(1, 5), bounds, cooldowns, now=120.0)
    assert (down.decode.desired, down.decode.reason) == (5, "cooldown")
    assert decide(load(0.0), CAPACITY, SLO, pools(1, 5), bounds, cooldowns, now=130.0).decode.desired == 1


def test_a_missed_slo_adds_an_instance_the_model_thinks_unneeded() -> None:
    decision = decide(load(1.0), CAPACITY, SLO, pools(1, 1, ttft=1.5, itl=0.04), make_bounds(), Cooldowns(), now=0.0)
    assert (decision.prefill.desired, decision.prefill.reason) == (2, "slo_miss")
    assert (decision.decode.desired, decision.decode.reason) == (1, "steady")


def test_the_budget_goes_to_the_role_short_by_the_larger_share() -> None:
    bounds = make_bounds(max_total=6)
    # 20 a second wants 4 prefill and 10 decode; 6 in all: 1 + 1 first, then the larger shortfall
    # each time: decode 1->2->3, prefill 1->2, decode 3->4 (10/3 > 4/2)...
    decision = decide(load(20.0), CAPACITY, SLO, pools(1, 1), bounds, Cooldowns(), now=0.0)
    assert decision.prefill.desired + decision.decode.desired == 6
    assert (decision.prefill.desired, decision.decode.desired) == (2, 4)
    assert decision.decode.reason == "budget" and decision.prefill.reason == "budget"


def replay(rates: list[float], bounds=None, interval_s: float = 5.0) -> list[Decision]:
    """The planner loop's bookkeeping over a recorded rate sequence: each decision applied at
    once, its change recorded in the cooldowns."""
    bounds = bounds or make_bounds(up_cooldown_s=5.0, down_cooldown_s=20.0)
    cooldowns, prefill, decode, decisions = Cooldowns(), 1, 1, []
    for step, rate in enumerate(rates):
        now = step * interval_s
        decision = decide(load(rate), CAPACITY, SLO, pools(prefill, decode), bounds, cooldowns, now)
        for role, current in (("prefill", prefill), ("decode", decode)):
            if decision.of(role).desired != current:
                cooldowns.changed_at[role] = now
        prefill, decode = decision.prefill.desired, decision.decode.desired
        decisions.append(decision)
    return decisions


def test_a_load_step_up_and_back_down() -> None:
    decisions = replay([1.0] * 3 + [9.0] * 6 + [1.0] * 10)
    decode = [d.decode.desired for d in decisions]
    assert decode[:3] == [1, 1, 1]
    assert decode[3] == 5  # at once: the last change was long ago
    # Down only once the down cooldown (20 s, 4 intervals) since the step up has passed.
    assert decode[9:12] == [1, 1, 1]  # 45 s: 30 s after the change at 15 s
    assert max(decode) == 5


def test_a_flapping_load_does_not_flap_the_pools() -> None:
    decisions = replay([3.9, 4.1] * 12)  # 4.1 needs 3 decode, 3.9 needs 2; with the margin 2 is never enough
    decode = [d.decode.desired for d in decisions]
    assert decode[0] == 2 and decode[1] == 3
    assert decode[1:] == [3] * (len(decode) - 1)
