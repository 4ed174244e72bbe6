"""What one instance sustains, on profiles whose arithmetic fits in a comment."""

from __future__ import annotations

import math

import pytest

from planner.capacity import (
    Slo,
    Workload,
    decode_capacity,
    decode_streams,
    instance_capacity,
    poisson_mean_within,
    prefill_capacity,
    prefill_service_rate,
    scaled_profile,
    wait_p90_s,
)
from simulator.timing_model import load_profile
from tests.planner.factories import make_profile


def test_prefill_packs_prompts_into_full_steps() -> None:
    # 10 prompts of 100 tokens fill a 1,000-token step of 1 s: 10 prompts a second.
    assert prefill_service_rate(make_profile(), 100) == pytest.approx(10.0)
    # 2,500 tokens are three chunked steps (1,000 + 1,000 + 500 tokens): 2.5 s a prompt.
    assert prefill_service_rate(make_profile(), 2500) == pytest.approx(1 / 2.5)


def test_wait_p90_is_the_mm1_tail() -> None:
    assert wait_p90_s(0.05, 10.0) == 0.0  # P(wait > 0) = rho < 10%
    assert wait_p90_s(0.5, 10.0) == pytest.approx(math.log(5) / 5)  # ln(10 * 0.5) / (10 * 0.5)
    with pytest.raises(ValueError):
        wait_p90_s(1.0, 10.0)


def test_prefill_capacity_is_the_rate_whose_ttft_p90_meets_the_slo() -> None:
    # A prompt alone takes 0.1 s; at rho 0.5 of mu 10/s the wait's p90 is ln(5) / 5 = 0.3219 s:
    # an SLO of 0.4219 s is met up to 5 requests a second.
    workload = Workload(request_rate=1.0, prompt_tokens=100, output_tokens=10)
    assert prefill_capacity(make_profile(), workload, 0.1 + math.log(5) / 5) == pytest.approx(5.0, rel=1e-6)
    # Below 0.1 s not even one prompt alone meets it.
    assert prefill_capacity(make_profile(), workload, 0.09) == 0.0
    # Just over 0.1 s: only while almost nobody waits (rho about 0.1), 1 request a second.
    assert prefill_capacity(make_profile(), workload, 0.1 + 1e-6) == pytest.approx(1.0, rel=1e-3)


def test_decode_holds_the_streams_whose_step_meets_the_itl_slo() -> None:
    profile = make_profile(step_fixed_s=0.01)  # a step of n rows: 10 ms + 1 ms a row
    workload = Workload(request_rate=1.0, prompt_tokens=100, output_tokens=100)
    assert decode_streams(profile, workload, 0.0265) == 16  # 10 + 16 = 26 ms; 17 rows, 27 ms
    assert decode_streams(profile, workload, 0.0099) == 0
    # A mean of L streams with L + 1.2816 sqrt(L) <= 16: sqrt(L) = (-1.2816 + sqrt(1.2816^2 + 64)) / 2.
    mean = poisson_mean_within(16)
    assert mean + 1.2816 * math.sqrt(mean) == pytest.approx(16)
    assert mean == pytest.approx(11.629, abs=1e-3)
    # 12 streams make 22 ms steps; 100 tokens each: 2.2 s a stream; 11.635 / 2.2 a second.
    rate, num_streams = decode_capacity(profile, workload, 0.0265)
    assert num_streams == 16
    assert rate == pytest.approx(mean / 2.2)


def test_decode_streams_are_bounded_by_the_kv_cache_and_max_num_seqs() -> None:
    workload = Workload(request_rate=1.0, prompt_tokens=100, output_tokens=100)  # 200 tokens: 13 blocks
    assert decode_streams(make_profile(num_kv_blocks=40), workload, 1.0) == 3
    assert decode_streams(make_profile(max_num_seqs=5), workload, 1.0) == 5


def test_scaled_profile_is_slower_by_the_factor() -> None:
    profile = load_profile("llama-3.1-8b-h100")
    slow = scaled_profile(profile, 10)
    rows = [(1, 1024)] * 8
    assert slow.step_seconds(rows) == pytest.approx(10 * profile.step_seconds(rows))
    assert slow.pull_seconds(1 << 20) == pytest.approx(10 * profile.pull_seconds(1 << 20))


def test_a_gpu_profile_gives_more_decode_than_prefill_per_request_for_long_prompts() -> None:
    profile = load_profile("llama-3.1-8b-h100")
    slo = Slo(ttft_s=0.5, itl_s=0.02)
    chatty = instance_capacity(profile, Workload(1.0, 128, 256), slo)
    long_prompt = instance_capacity(profile, Workload(1.0, 4096, 128), slo)
    assert long_prompt.prefill_rate < chatty.prefill_rate / 10  # 32x the tokens and quadratic attention
    assert long_prompt.decode_rate > 0 and chatty.decode_rate > 0
