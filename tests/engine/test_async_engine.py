"""The asyncio engine: streaming, concurrent requests, abort on early exit, bad input, roles."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Callable
from pathlib import Path

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.kv_cache_utils import cdiv
from engine.llm import LLM
from engine.load_report import EngineLoad
from engine.outputs import EngineCoreOutput
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ModelOutput, SchedulerOutput
from tests.checkpoints import make_checkpoint, random_prompts
from tests.engine.kv_loaders import ManualKVLoader

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"))


def config(model_path: Path, **overrides: object) -> EngineConfig:
    return EngineConfig(**{"model": str(model_path), "kv_cache_memory": 1 << 22, **overrides})  # type: ignore[arg-type]


async def collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    tokens: list[int] = []
    async for output in engine.generate(prompt, params):
        tokens.extend(output.new_token_ids)
    return tokens


def assert_all_free(engine: AsyncEngine) -> None:
    report = engine.core.load_report()
    assert report.num_free_blocks == report.num_total_blocks


async def report_when(engine: AsyncEngine, condition: Callable[[EngineLoad], bool]) -> EngineLoad:
    """The engine's published load report once ``condition`` holds for it (the engine thread
    publishes one after applying messages and after every step); fails if it never does."""
    for _ in range(6000):  # a minute at the least: a generous guard, not a timing assertion
        if condition(report := engine.latest_load_report()):
            return report
        await asyncio.sleep(0.01)
    raise AssertionError(f"the load report never met the condition; last: {report}")


def all_free(report: EngineLoad) -> bool:
    return report.num_free_blocks == report.num_total_blocks and not report.num_running and not report.num_waiting


def test_concurrent_streams_match_the_offline_engine(model_path: Path) -> None:
    prompts = random_prompts([3, 17, 30, 50], seed=7)
    expected = [o.outputs[0].token_ids for o in LLM(model=str(model_path)).generate(prompts, GREEDY)]

    async def main() -> list[list[int]]:
        async with AsyncEngine(config(model_path)) as engine:
            results = await asyncio.gather(*(collect(engine, p) for p in prompts))
            assert_all_free(engine)
            return results

    assert asyncio.run(main()) == expected


def test_consumer_leaving_early_aborts_and_frees(model_path: Path) -> None:
    async def main() -> None:
        async with AsyncEngine(config(model_path)) as engine:
            params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
            stream = engine.generate(random_prompts([40], seed=8)[0], params)
            async for _ in stream:
                break
            await stream.aclose()  # what a disconnecting client's handler does
            await report_when(engine, all_free)  # once the abort message has been applied on the step thread

    asyncio.run(main())


def test_bad_request_fails_alone(model_path: Path) -> None:
    async def main() -> None:
        async with AsyncEngine(config(model_path)) as engine:
            good = asyncio.create_task(collect(engine, [5, 6, 7]))
            with pytest.raises(ValueError, match="prompt is empty"):
                await collect(engine, [])
            with pytest.raises(ValueError, match="maximum context length"):
                await collect(engine, [5] * 10, SamplingParams(max_tokens=100_000))
            assert len(await good) == GREEDY.max_tokens
            assert_all_free(engine)

    asyncio.run(main())


def test_abort_by_id(model_path: Path) -> None:
    async def main() -> None:
        async with AsyncEngine(config(model_path)) as engine:
            params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
            outputs = []

            async def consume() -> None:
                async for output in engine.generate([5, 6, 7], params, request_id="r1"):
                    outputs.append(output)

            task = asyncio.create_task(consume())
            while not outputs:
                await asyncio.sleep(0.01)
            engine.abort("r1")
            await task
            assert outputs[-1].finish_reason == "abort"
            assert_all_free(engine)

    asyncio.run(main())


def test_prefill_role_hands_off_and_releases(model_path: Path) -> None:
    async def main() -> None:
        async with AsyncEngine(config(model_path, role="prefill")) as engine:
            prompt = random_prompts([40], seed=9)[0]
            outputs = [o async for o in engine.generate(prompt, GREEDY)]
            (output,) = outputs
            assert output.kv_handoff is not None and output.finish_reason is None
            assert len(output.new_token_ids) == 1
            assert output.kv_handoff.num_tokens == 40 and len(output.kv_handoff.block_ids) == 3
            report = engine.latest_load_report()  # published before the output went out
            assert report.num_total_blocks - report.num_free_blocks == 3
            engine.release_kv(output.request_id)
            engine.release_kv(output.request_id)  # a second release changes nothing
            await report_when(engine, all_free)
            assert_all_free(engine)

    asyncio.run(main())


def test_latest_load_report_follows_the_steps_without_waiting_for_one(model_path: Path) -> None:
    async def main() -> None:
        async with AsyncEngine(config(model_path)) as engine:
            total = engine.latest_load_report().num_total_blocks
            params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            stream = engine.generate(random_prompts([32], seed=9)[0], params)
            await anext(stream)
            running = engine.latest_load_report()
            # The report is the latest step's, whichever that is when the loop reads it: the prompt's
            # (2 blocks), or one of the decode steps the engine went on with meanwhile (on a loaded
            # machine, many, with this tiny model): at most the blocks of all 232 tokens.
            block_size = config(model_path).block_size
            assert running.num_running == 1
            assert 32 // block_size <= total - running.num_free_blocks <= cdiv(32 + 200, block_size)
            await stream.aclose()  # aborts, at the step thread's next boundary
            idle = await report_when(engine, lambda report: report.num_running == 0)
            assert (idle.num_running, idle.num_waiting, idle.num_free_blocks) == (0, 0, total)

    asyncio.run(main())


def test_a_consumer_that_falls_behind_gets_the_waiting_tokens_at_once(model_path: Path) -> None:
    """Outputs that queued up while the consumer was busy arrive merged, in order, with
    nothing lost: one message downstream instead of one per token."""
    prompt = random_prompts([12], seed=14)[0]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = LLM(model=str(model_path)).generate([prompt], params)[0].outputs[0].token_ids

    async def main() -> list[list[int]]:
        async with AsyncEngine(config(model_path)) as engine:
            batches = []
            async for output in engine.generate(prompt, params):
                batches.append(output.new_token_ids)
                if len(batches) == 1:
                    while engine.latest_load_report().num_running:  # the rest is computed meanwhile
                        await asyncio.sleep(0.01)
            return batches

    batches = asyncio.run(main())
    assert [t for batch in batches for t in batch] == expected
    # Merged: 24 tokens in at most three messages (the first may itself hold several when the
    # event loop is slow to reach it on a loaded machine), not one message per token.
    assert len(batches) <= 3, [len(batch) for batch in batches]


def test_requests_queued_during_a_step_count_in_the_load_report_at_once(model_path: Path) -> None:
    """A request's add runs between steps, which can be seconds apart on a long prefill;
    the load report must count it from the moment it arrives, or the gateway's admission
    control would see an empty queue behind every long step."""
    prompts = random_prompts([40, 24], seed=15)

    async def main() -> None:
        async with AsyncEngine(config(model_path, role="prefill")) as engine:
            step_boundary = hold_next_step(engine)  # the step thread is busy until set
            streams = [engine.generate(prompt, GREEDY) for prompt in prompts]
            tasks = [asyncio.ensure_future(anext(stream)) for stream in streams]
            queued = await report_when(engine, lambda report: report.num_waiting == 2)
            assert (queued.num_waiting, queued.num_pending_prefill_tokens) == (2, 64)
            step_boundary.set()
            for task in tasks:
                await task
            prefilled = engine.latest_load_report()
            assert (prefilled.num_waiting, prefilled.num_pending_prefill_tokens) == (0, 0)
            for stream in streams:
                await stream.aclose()

    asyncio.run(main())


def test_a_queued_request_counts_only_what_the_prefix_cache_lacks(model_path: Path) -> None:
    """A request waiting for the engine thread behind a step shares a prompt prefix the cache
    holds: the report counts its uncached tokens only, as the scheduler does once it is added
    (counted in full, a prefill instance serving one system prompt looked seconds busier than
    it was, and cache-aware routing sent that prompt's next request elsewhere)."""
    cached, fresh = random_prompts([40, 16], seed=21)

    async def main() -> None:
        async with AsyncEngine(config(model_path, role="prefill", enable_prefix_caching=True)) as engine:
            await collect(engine, cached, SamplingParams(temperature=0.0, max_tokens=1))
            block_size = engine.core.kv_cache_manager.block_size
            num_cached = (len(cached) - 1) // block_size * block_size
            step_boundary = hold_next_step(engine)  # the step thread is busy until set
            stream = engine.generate(cached[:num_cached] + fresh, GREEDY)
            task = asyncio.ensure_future(anext(stream))
            queued = await report_when(engine, lambda report: report.num_waiting == 1)
            assert queued.num_pending_prefill_tokens == len(fresh)
            step_boundary.set()
            await task
            await stream.aclose()

    asyncio.run(main())


def hold_next_step(engine: AsyncEngine) -> threading.Event:
    """The step thread's next step waits, before it applies any message, until the returned
    event is set: messages posted meanwhile stay queued in the inbox."""
    release = threading.Event()
    step = engine.core.step

    def held() -> list:
        engine.core.step = step  # type: ignore[method-assign]
        assert release.wait(60)
        return step()

    engine.core.step = held  # type: ignore[method-assign]
    return release


class _HeldSteps:
    """Wraps the runner's execute: while ``hold`` is set, a step waits inside its model
    execution (a long step, on demand); records which requests each step scheduled."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.execute = engine.core.runner.execute
        self.hold = threading.Event()
        self.entered = threading.Event()
        self.release = threading.Event()
        self.scheduled: list[list[str]] = []
        self.threads: list[str] = []  # the thread each step's model ran on, by name
        engine.core.runner.execute = self  # type: ignore[method-assign]

    def __call__(self, output: SchedulerOutput, eos_token_ids: frozenset[int]) -> ModelOutput:
        self.scheduled.append([s.request.request_id for s in output.scheduled])
        self.threads.append(threading.current_thread().name)
        if self.hold.is_set():
            self.hold.clear()
            self.entered.set()
            assert self.release.wait(10)
        return self.execute(output, eos_token_ids)


def test_a_request_shows_in_the_load_report_during_the_step_that_computes_it(model_path: Path) -> None:
    """Its add ran between steps (no longer queued), and the step that prefills it can take
    seconds: the report published before that step must already count it."""
    prompt = random_prompts([40], seed=20)[0]

    async def main() -> None:
        async with AsyncEngine(config(model_path, role="prefill")) as engine:
            steps = _HeldSteps(engine)
            steps.hold.set()
            stream = engine.generate(prompt, GREEDY)
            first = asyncio.ensure_future(anext(stream))
            assert await asyncio.to_thread(steps.entered.wait, 60)  # inside the step's model
            report = engine.latest_load_report()  # waiting as the step was scheduled: published before it
            assert (report.num_waiting + report.num_running, report.num_pending_prefill_tokens) == (1, 40)
            steps.release.set()
            await first
            await stream.aclose()

    asyncio.run(main())


async def started_decode_engine(model_path: Path) -> tuple[AsyncEngine, ManualKVLoader]:
    engine = AsyncEngine(config(model_path, role="decode"))
    loader = ManualKVLoader()
    await engine.start(loader)
    return engine, loader


async def wait_for_load(loader: ManualKVLoader) -> None:
    assert await asyncio.to_thread(loader.load_started.wait, 60), "no load was started"
    loader.load_started.clear()


async def step_held_beside_a_running_request(
    engine: AsyncEngine, prompt: list[int], params: SamplingParams
) -> tuple[_HeldSteps, AsyncGenerator[EngineCoreOutput, None]]:
    """A request ("running") prefilled here and decoding, and the engine's next step held inside
    its model until ``release`` is set: whatever arrives now arrives mid-step."""
    steps = _HeldSteps(engine)
    running = engine.generate(prompt, params, request_id="running")
    await anext(running)
    steps.hold.set()
    assert await asyncio.to_thread(steps.entered.wait, 60)  # a step is now inside its model
    return steps, running


def test_a_handoff_arriving_mid_step_is_admitted_by_the_step_thread_while_the_model_computes(
    model_path: Path,
) -> None:
    """One writer, and no step lost: a hand-off that arrives while a step's model computes (on
    the decode engine's model thread) is added and its load started then, by the step thread,
    not at the boundary; its load's result waits for the boundary, and it decodes in the very
    next step. Any change to the scheduler from this (the event loop's) thread meanwhile raises."""
    running_prompt, handoff_prompt = random_prompts([20, 40], seed=16)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main() -> None:
        engine, loader = await started_decode_engine(model_path)
        try:
            steps, running = await step_held_beside_a_running_request(engine, running_prompt, params)
            held = len(steps.scheduled)
            num_free = engine.core.kv_cache_manager.num_free_blocks
            handoff = engine.generate(handoff_prompt, params, request_id="handoff", first_token_id=7)
            first = asyncio.ensure_future(anext(handoff))
            await wait_for_load(loader)  # the held step has not ended
            assert loader.started_on == ["engine-step-loop"] and steps.threads[-1].startswith("engine-model")
            num_blocks = cdiv(40, config(model_path).block_size)
            assert len(loader.load("handoff").block_ids) == num_blocks
            assert engine.core.kv_cache_manager.num_free_blocks == num_free - num_blocks
            with pytest.raises(RuntimeError, match="step thread"):
                engine.core.scheduler.finish_requests(["running"], RequestStatus.FINISHED_ABORTED)
            assert engine.core.scheduler.requests["running"].status is RequestStatus.RUNNING
            loader.finish("handoff")  # before the boundary: it joins the running ones there
            steps.release.set()
            output = await asyncio.wait_for(first, 60)
            assert output.new_token_ids
            assert "handoff" in steps.scheduled[held]  # the step right after the held one decodes it
            await handoff.aclose()
            await running.aclose()
            await report_when(engine, all_free)
        finally:
            await engine.stop()

    asyncio.run(main())


def test_a_handoff_that_would_take_the_running_requests_next_blocks_waits_for_the_boundary(
    model_path: Path,
) -> None:
    """Admitted while a step computes, a hand-off takes its blocks before the running requests
    take theirs for the next step; where that could leave one of them short (and so preempt
    it), the hand-off waits for the boundary, where the running requests come first."""
    small = config(model_path, role="decode", kv_cache_memory=1 << 17)
    running_prompt, other_prompt = random_prompts([20, 8], seed=22)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def main() -> None:
        engine = AsyncEngine(small)
        loader = ManualKVLoader()
        await engine.start(loader)
        try:
            steps, running = await step_held_beside_a_running_request(engine, running_prompt, params)
            num_free = engine.core.kv_cache_manager.num_free_blocks
            # Its prompt fills every free block: it fits, but leaves none for the running request.
            handoff_prompt = random_prompts([num_free * small.block_size - 1], seed=23)[0]
            handoff = engine.generate(handoff_prompt, GREEDY, request_id="handoff", first_token_id=7)
            first = asyncio.ensure_future(anext(handoff))
            # A hand-off behind it shows the step thread has looked at the inbox meanwhile.
            other = engine.generate(other_prompt, GREEDY, request_id="other", first_token_id=7)
            other_first = asyncio.ensure_future(anext(other))
            await report_when(engine, lambda report: report.num_waiting == 2)
            assert loader.started == []  # neither: "other" queues behind "handoff"
            steps.release.set()
            await running.aclose()  # its blocks come back at the boundary
            await wait_for_load(loader)
            loader.finish("handoff")
            assert (await asyncio.wait_for(first, 60)).new_token_ids
            await handoff.aclose()
            await report_when(engine, lambda _: [load.request_id for load in loader.started] == ["handoff", "other"])
            loader.finish("other")
            assert (await asyncio.wait_for(other_first, 60)).new_token_ids
            await other.aclose()
            await report_when(engine, all_free)
        finally:
            await engine.stop()

    asyncio.run(main())


def test_an_abort_that_arrived_before_a_handoff_of_its_id_keeps_its_place(model_path: Path) -> None:
    """Messages apply in arrival order even when some apply mid-step: an abort held for the
    boundary is applied before the hand-off of that id that came after it (which then runs),
    while a hand-off of another id that came later still starts its load at once."""
    first_prompt, second_prompt, running_prompt = random_prompts([24, 24, 20], seed=24)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main() -> None:
        engine, loader = await started_decode_engine(model_path)
        try:
            steps, running = await step_held_beside_a_running_request(engine, running_prompt, params)
            engine.abort("first")  # an id nobody holds yet: nothing to end
            first = engine.generate(first_prompt, GREEDY, request_id="first", first_token_id=7)
            first_output = asyncio.ensure_future(anext(first))
            second = engine.generate(second_prompt, GREEDY, request_id="second", first_token_id=7)
            second_output = asyncio.ensure_future(anext(second))
            await wait_for_load(loader)
            assert [load.request_id for load in loader.started] == ["second"]  # "first" waits behind the abort
            steps.release.set()
            await wait_for_load(loader)
            assert [load.request_id for load in loader.started] == ["second", "first"]
            loader.finish("first")
            loader.finish("second")
            for stream, output in ((first, first_output), (second, second_output)):
                assert (await asyncio.wait_for(output, 60)).new_token_ids
                await stream.aclose()
            await running.aclose()
            await report_when(engine, all_free)
        finally:
            await engine.stop()

    asyncio.run(main())


def test_a_handoff_arriving_between_steps_is_admitted_at_the_next_boundary(model_path: Path) -> None:
    """With no step computing, the hand-off goes in as a message, and the step thread starts
    its load when it schedules it. A failed load with
    the recompute policy prefills the prompt here."""
    prompt = random_prompts([24], seed=17)[0]

    async def main() -> None:
        engine, loader = await started_decode_engine(model_path)
        try:
            handoff = engine.generate(prompt, GREEDY, request_id="handoff", first_token_id=7)
            first = asyncio.ensure_future(anext(handoff))
            await wait_for_load(loader)
            assert loader.started_on == ["engine-step-loop"]
            loader.finish("handoff", error="unreachable")  # recompute here
            assert (await asyncio.wait_for(first, 60)).new_token_ids
            await handoff.aclose()
            await report_when(engine, all_free)
        finally:
            await engine.stop()

    asyncio.run(main())


def test_a_handoff_aborted_during_its_load_keeps_its_blocks_until_the_load_stops(model_path: Path) -> None:
    """A client gone while its KV loads: the request ends at once, but the blocks the load
    writes into stay allocated until the loader says it stopped, then come back exactly once."""
    prompt = random_prompts([40], seed=18)[0]

    async def main() -> None:
        engine, loader = await started_decode_engine(model_path)
        try:
            handoff = engine.generate(prompt, GREEDY, request_id="handoff", first_token_id=7)
            first = asyncio.ensure_future(anext(handoff))
            await wait_for_load(loader)
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            await handoff.aclose()  # the client left
            report = await report_when(engine, lambda _: loader.cancelled == ["handoff"])
            num_blocks = len(loader.load("handoff").block_ids)
            assert report.num_total_blocks - report.num_free_blocks == num_blocks  # still the loader's
            assert (report.num_running, report.num_waiting) == (0, 0)
            loader.finish("handoff", error="cancelled")  # wakes the idle engine, which frees them
            await report_when(engine, all_free)
        finally:
            await engine.stop()

    asyncio.run(main())


def test_a_failed_load_that_may_not_recompute_ends_the_stream_with_an_error(model_path: Path) -> None:
    prompt = random_prompts([24], seed=19)[0]

    async def main() -> None:
        engine, loader = await started_decode_engine(model_path)
        try:
            stream = engine.generate(
                prompt, GREEDY, request_id="handoff", first_token_id=7, kv_load_failure_policy="fail"
            )
            first = asyncio.ensure_future(anext(stream))
            await wait_for_load(loader)
            loader.finish("handoff", error="the prefill instance is gone")
            output = await asyncio.wait_for(first, 60)
            assert (output.finish_reason, output.error, output.new_token_ids) == (
                "error",
                "the prefill instance is gone",
                [],
            )
            await stream.aclose()
            await report_when(engine, all_free)
        finally:
            await engine.stop()

    asyncio.run(main())
