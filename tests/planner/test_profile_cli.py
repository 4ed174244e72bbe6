"""``splitserve profile --simulate-profile``: it starts simulated instances, sweeps the load on
one instance of each role, writes a capacity profile the planner reads, and stops what it
started. Run on the same timing profile at two time scales, the slower instances measure less
capacity in both roles, and the planner's capacity follows the measurement.

The two runs go at once: each spends its time waiting out simulated steps, not on the CPU."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from launcher.processes import splitserve_command
from planner.capacity import Slo, Workload, scaled_profile
from planner.capacity_profile import calibrated_capacity, check_slo, load_capacity_profile
from simulator.timing_model import load_profile
from tests.gateway.test_tensor_parallel_up import alive, descendants
from tests.services.processes import SERVICE_ENV
from tests.simulator.cluster import write_profile

# The test profile (tests/simulator/cluster.py) with ten times its KV read per context token, so
# that each stream weighs on a step: with 1,024-token prompts a decode step of n streams takes
# about (10 + 5.3 n) ms times the scale, and a lone prompt's prefill 0.07 s times the scale. At
# an ITL SLO of 0.2 s one instance holds 17 streams at scale 2 and 7 at scale 4 by the model
# (planner/capacity.py), and one stream leaves the SLO a wide margin over a loaded machine's delays.
# Four levels a role bracket both capacities (each sweep's first level scales with the instance,
# so the slow one's rates are the fast one's halved, and it misses one doubling sooner) and
# bisect the prefill rate once; further levels only narrow what the assertions do not compare.
CONTEXT_S = 5e-6
SLO = Slo(ttft_s=1.5, itl_s=0.2)
PROMPT_TOKENS, OUTPUT_TOKENS = 1024, 32
FAST_SCALE, SLOW_SCALE = 2.0, 4.0


def profile_command(timing_profile: Path, time_scale: float, output: Path) -> list[str]:
    return splitserve_command(
        "profile", "--simulate-profile", str(timing_profile), "--time-scale", str(time_scale),
        "--ttft-slo", str(SLO.ttft_s), "--itl-slo", str(SLO.itl_s),
        "--prompt-tokens", str(PROMPT_TOKENS), "--output-tokens", str(OUTPUT_TOKENS),
        "--seconds-per-level", "4", "--min-requests-per-level", "10", "--max-levels", "4",
        "--output", str(output),
    )  # fmt: skip


@pytest.mark.timeout(600)
def test_profiles_of_a_slower_instance_measure_less_and_the_planner_reads_them(tmp_path: Path) -> None:
    timing_profile = write_profile(tmp_path, context_s=CONTEXT_S, step_fixed_s=0.01)
    outputs = {scale: tmp_path / f"capacity-{scale}.json" for scale in (FAST_SCALE, SLOW_SCALE)}
    logs = {scale: open(tmp_path / f"profile-{scale}.log", "wb") for scale in outputs}  # noqa: SIM115 - closed below
    runs = {
        scale: subprocess.Popen(
            profile_command(timing_profile, scale, output),
            stdout=logs[scale],
            stderr=subprocess.STDOUT,
            env={**os.environ, **SERVICE_ENV},
        )
        for scale, output in outputs.items()
    }
    below: set[int] = set()
    try:
        # Until both end (a bound on a hang: four levels a role of a few seconds each, and a
        # start-up), noting every process they started, to check that none outlives them.
        deadline = time.monotonic() + 480
        while any(run.poll() is None for run in runs.values()) and time.monotonic() < deadline:
            for run in runs.values():
                below.update(descendants(run.pid))
            time.sleep(0.5)
        for scale, run in runs.items():
            assert run.poll() == 0, (tmp_path / f"profile-{scale}.log").read_text()[-3000:]
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
                run.wait()
        for log in logs.values():
            log.close()
    assert not [pid for pid in below if alive(pid)], "splitserve profile left processes behind"

    fast, slow = (load_capacity_profile(outputs[scale]) for scale in (FAST_SCALE, SLOW_SCALE))
    for measured in (fast, slow):
        check_slo(measured, SLO)
        assert measured.prefill_sweep and measured.decode_sweep
        assert any(p.met for p in measured.prefill_sweep) and any(p.met for p in measured.decode_sweep)
    assert 0 < slow.capacity.prefill_rate < fast.capacity.prefill_rate
    # Streams are counted whole, and a loaded machine's delays can hold both to few: the rate,
    # priced from the measured step time as well, is what must fall.
    assert 0 < slow.capacity.decode_streams <= fast.capacity.decode_streams
    assert 0 < slow.capacity.decode_rate < fast.capacity.decode_rate

    # The planner, pricing by the fast instances' timing profile, reads each measurement: at the
    # measured mix it is the measurement, and at another mix the slower one still gives less.
    timing = scaled_profile(load_profile(str(timing_profile)), FAST_SCALE)
    at_mix = Workload(1.0, PROMPT_TOKENS, OUTPUT_TOKENS)
    assert calibrated_capacity(timing, at_mix, SLO, slow) == slow.capacity
    other_mix = Workload(1.0, 512, 128)
    fast_other, slow_other = (calibrated_capacity(timing, other_mix, SLO, m) for m in (fast, slow))
    assert slow_other.prefill_rate < fast_other.prefill_rate
    assert slow_other.decode_rate < fast_other.decode_rate
