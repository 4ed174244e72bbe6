"""A real colocated instance at ``--pipeline-parallel-size 2`` (issue 41): its Generate streams
give the offline engine's greedy tokens, no block is left in use, and stopping the instance, or
killing it outright, leaves none of its stage processes behind. (Prefill and decode instances at
PP 2, over UCX and LMCache: tests/services/test_pipeline_parallel_pd.py.)"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from engine import LLM
from splitserve.v1 import generation_pb2, generation_pb2_grpc
from tests.checkpoints import random_prompts
from tests.services.client import GREEDY, expected_tokens
from tests.services.processes import Service

PROMPTS = random_prompts([6, 21, 40], seed=71)


def stage_workers_of(pid: int) -> list[int]:
    """The process's children that multiprocessing spawned to run a target (its stage workers;
    not its resource tracker)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(child) for child in (task / "children").read_text().split()]
    return [child for child in children if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()]


def exists(pid: int) -> bool:
    """Alive, and not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_colocated_instance_at_pp2_streams_the_offline_tokens(model: Path, colocated: LLM) -> None:
    service = Service("colocated", model, "--dtype", "float32", "--pipeline-parallel-size", "2")
    try:
        workers = stage_workers_of(service.process.pid)
        assert len(workers) == 1  # the first stage's (the instance's own process is the last)
        stub = generation_pb2_grpc.GenerationStub(service.channel)
        for index, prompt in enumerate(PROMPTS):
            request = generation_pb2.GenerateRequest(
                request_id=f"pp-{index}", token_ids=generation_pb2.TokenIds(ids=prompt), sampling=GREEDY
            )
            responses = list(stub.Generate(request, timeout=60))
            assert [token for response in responses for token in response.token_ids] == expected_tokens(
                colocated, prompt
            )
        report = service.wait_all_free()
        assert report.num_free_blocks == report.num_total_blocks
    finally:
        assert service.stop() == 0
    assert not survivors(workers)


def survivors(pids: list[int], timeout_s: float = 120.0) -> list[int]:
    """Those of ``pids`` still running once they have all exited or ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while any(exists(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if exists(pid)]


def test_an_instance_killed_outright_takes_its_stages_with_it(model: Path) -> None:
    service = Service("colocated", model, "--dtype", "float32", "--pipeline-parallel-size", "2")
    workers = stage_workers_of(service.process.pid)
    assert len(workers) == 1
    assert service.stop(signal.SIGKILL) == -signal.SIGKILL
    assert not survivors(workers)
