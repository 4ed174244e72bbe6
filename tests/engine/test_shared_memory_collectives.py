"""The CPU ranks' shared-memory collectives (engine/tensor_parallel/shared_memory_collectives.py),
between real processes: sums and gathers equal the inputs' in rank order and bit-identical on
every rank, through both slot sets many times over, tensors larger than a slot go through
gloo, and a rank waiting in a collective is released when rank 0 closes the group."""

from __future__ import annotations

import multiprocessing
from multiprocessing.queues import Queue

import pytest
import torch

from engine import cpu_kernels
from engine.tensor_parallel.group import TensorParallelGroup, host_store

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: gloo alone, nothing to test")

WORLD_SIZE = 3
SHAPES = [(1, 512), (7, 96), (1, 3), (64, 1000)]


def _part(rank: int, step: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * step + rank)).to(dtype)


def _run_rank(rank: int, port: int, results: Queue) -> None:
    torch.set_num_threads(1)
    store = host_store(WORLD_SIZE) if rank == 0 else None
    if store is not None:
        results.put(("port", store.port))
    group = TensorParallelGroup(rank, WORLD_SIZE, port if store is None else store.port, torch.device("cpu"), store)
    assert group._shared is not None
    outcome = []
    for step in range(40):  # both slot sets, many times, shapes and dtypes changing
        shape = SHAPES[step % len(SHAPES)]
        dtype = torch.bfloat16 if step % 3 == 0 else torch.float32
        tensor = _part(rank, step, shape, dtype)
        group.all_reduce(tensor)
        outcome.append(tensor)
        outcome.append(group.all_gather_last_dim(_part(rank, step, shape, dtype)))
    large = torch.full((group._shared.slot_bytes // 4 + 1,), float(rank + 1))  # beyond a slot: gloo
    group.all_reduce(large)
    outcome.append(large)
    results.put((rank, [tensor.double().numpy() for tensor in outcome]))  # by value: the process exits


def test_sums_and_gathers_are_exact_and_the_same_on_every_rank() -> None:
    context = multiprocessing.get_context("spawn")
    results: Queue = context.Queue()
    root = context.Process(target=_run_rank, args=(0, 0, results))
    root.start()
    kind, port = results.get(timeout=120)
    assert kind == "port"
    others = [context.Process(target=_run_rank, args=(rank, port, results)) for rank in range(1, WORLD_SIZE)]
    for process in others:
        process.start()
    outcomes = dict(results.get(timeout=300) for _ in range(WORLD_SIZE))
    for process in [root, *others]:
        process.join(timeout=60)
        assert process.exitcode == 0
    for step in range(40):
        shape = SHAPES[step % len(SHAPES)]
        dtype = torch.bfloat16 if step % 3 == 0 else torch.float32
        parts = [_part(rank, step, shape, dtype) for rank in range(WORLD_SIZE)]
        expected_sum = parts[0].clone()
        for part in parts[1:]:
            expected_sum.add_(part)  # rank order
        expected_gather = torch.cat(parts, dim=-1)
        for rank in range(WORLD_SIZE):
            assert (outcomes[rank][2 * step] == expected_sum.double().numpy()).all(), (step, rank)
            assert (outcomes[rank][2 * step + 1] == expected_gather.double().numpy()).all(), (step, rank)
    for rank in range(WORLD_SIZE):
        assert (outcomes[rank][-1] == 6.0).all()


def _wait_alone(port: int, results: Queue) -> None:
    group = TensorParallelGroup(1, 2, port, torch.device("cpu"))
    results.put("joined")
    try:
        group.all_reduce(torch.ones(4))  # rank 0 never joins this one
    except RuntimeError as error:
        results.put(str(error))


def test_closing_the_group_releases_a_rank_waiting_in_a_collective() -> None:
    context = multiprocessing.get_context("spawn")
    results: Queue = context.Queue()
    store = host_store(2)
    worker = context.Process(target=_wait_alone, args=(store.port, results))
    worker.start()
    try:
        group = TensorParallelGroup(0, 2, store.port, torch.device("cpu"), store)
        assert results.get(timeout=120) == "joined"
        group.close()
        assert "closing" in results.get(timeout=60)
    finally:
        worker.join(timeout=60)
        if worker.is_alive():
            worker.kill()
    assert worker.exitcode == 0
