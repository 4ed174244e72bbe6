"""The simulated instance's parts on their own: the engine core over a simulated runner (real
scheduler and blocks, the profile's step times, never an EOS), and the simulated connector's
pull checks (a pull P never published, under a wrong token, after release, or from a P that
is gone fails as a real one does; a silent peer is cut off)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from kv_connector.base import KVSource, KVTransferError
from serving.instance import fingerprint_of
from simulator import connector as simulated_connector
from simulator.connector import SimulatedConnector
from simulator.runner import SimulatedRunner, simulated_runner_factory
from simulator.timing_model import TimingProfile
from tests.checkpoints import make_checkpoint
from tests.simulator.cluster import TEST_PROFILE

PROFILE = TimingProfile.from_json(json.dumps({**TEST_PROFILE, "step_fixed_s": 0.001, "num_kv_blocks": 64}))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"))


def simulated_core(model_path: Path, time_scale: float = 1.0) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model_path)), simulated_runner_factory(PROFILE, time_scale))


def test_a_simulated_core_runs_real_scheduling_for_the_profiles_time_and_frees_every_block(model_path: Path) -> None:
    core = simulated_core(model_path, time_scale=0.5)
    runner = core.runner
    assert isinstance(runner, SimulatedRunner) and runner.kv_cache.device.type == "meta"
    assert core.kv_cache_manager.num_total_blocks == PROFILE.num_kv_blocks
    eos = sorted(core.eos_token_ids)[0]
    prompts = [[eos, 5, 6, 7] * 10, [8, 9] * 30]
    for index, prompt in enumerate(prompts):
        core.add_request(prompt, SamplingParams(max_tokens=12), request_id=f"r{index}")
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for output in core.step():
            tokens[output.request_id] += output.new_token_ids
    assert [len(t) for t in tokens.values()] == [12, 12]  # never an EOS: each runs to max_tokens
    assert not core.eos_token_ids & {t for ts in tokens.values() for t in ts}
    assert tokens["r0"] != tokens["r1"]
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_total_blocks
    # The first step prefills both prompts, then each step decodes both: the profile's formula.
    expected_s = PROFILE.step_seconds([(40, 40), (60, 60)]) + sum(
        PROFILE.step_seconds([(1, 41 + k), (1, 61 + k)]) for k in range(11)
    )
    assert runner.num_simulated_seconds == pytest.approx(0.5 * expected_s)


def test_the_same_request_gets_the_same_simulated_tokens(model_path: Path) -> None:
    outputs = []
    for _ in range(2):
        core = simulated_core(model_path)
        core.add_request([3, 4, 5], SamplingParams(max_tokens=5), request_id="same")
        tokens: list[int] = []
        while core.has_unfinished_requests():
            tokens += [t for output in core.step() for t in output.new_token_ids]
        outputs.append(tokens)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 5


async def _connectors(model_path: Path) -> tuple[SimulatedConnector, SimulatedConnector, str, EngineCore]:
    core = simulated_core(model_path)
    fingerprint = fingerprint_of(core)
    prefill = SimulatedConnector(core.runner.kv_cache, fingerprint, PROFILE)
    decode = SimulatedConnector(core.runner.kv_cache, fingerprint, PROFILE)
    address = await prefill.start("127.0.0.1", 0)
    await decode.start("127.0.0.1", 0)
    return prefill, decode, address, core


def _source(address: str, core: EngineCore, request_id: str, token: bytes, num_blocks: int) -> KVSource:
    return KVSource(
        request_id,
        address,
        tuple(range(num_blocks)),
        num_blocks * 16,
        fingerprint_of(core),
        pull_token=token,
    )


def test_a_pull_is_served_only_for_what_p_published_under_that_token(model_path: Path) -> None:
    async def main() -> None:
        prefill, decode, address, core = await _connectors(model_path)
        try:
            await prefill.publish("r", [0, 1, 2, 3], list(range(64)), pull_token=b"secret")
            stats = await decode.pull(_source(address, core, "r", b"secret", 4), [10, 11, 12, 13], 1, timeout_s=10)
            assert (stats.num_blocks, stats.num_bytes) == (3, 3 * 16 * PROFILE.kv_bytes_per_token)
            for request_id, token, reason in (
                ("r", b"wrong", "wrong pull token"),
                ("unknown", b"secret", "not published"),
            ):
                with pytest.raises(KVTransferError, match=reason):
                    await decode.pull(_source(address, core, request_id, token, 4), [10, 11, 12, 13], 0, timeout_s=10)
            await prefill.unpublish("r")
            with pytest.raises(KVTransferError, match="not published"):
                await decode.pull(_source(address, core, "r", b"secret", 4), [10, 11, 12, 13], 0, timeout_s=10)
            await prefill.close()
            with pytest.raises(KVTransferError, match="cannot reach"):
                await decode.pull(_source(address, core, "r", b"secret", 4), [10, 11, 12, 13], 0, timeout_s=10)
        finally:
            await decode.close()

    asyncio.run(main())


def test_a_peer_that_never_sends_its_line_is_cut_off(model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(simulated_connector, "REQUEST_DEADLINE_S", 0.2)

    async def main() -> None:
        prefill, decode, address, _ = await _connectors(model_path)
        try:
            host, _, port = address.rpartition(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            assert await asyncio.wait_for(reader.read(), 30) == b""  # closed by P, with no answer
            writer.close()
        finally:
            await prefill.close()
            await decode.close()

    asyncio.run(main())


@pytest.mark.parametrize("sizes", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_a_simulated_instance_refuses_to_split_the_model(model_path: Path, sizes: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="tensor and pipeline parallel size 1"):
        EngineCore(EngineConfig(model=str(model_path), **sizes), simulated_runner_factory(PROFILE, 1.0))
