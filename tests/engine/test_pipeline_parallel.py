"""Pipeline parallelism: the stage plan's arithmetic and refusals, the flags, the activation
channel between real processes, and greedy output at PP 2 and 3 and TP 2 x PP 2 (one process per
rank, activations through shared memory) equal to PP 1 and to transformers, token for token, on
tiny random checkpoints (Llama with 4 and 8 KV heads, Qwen2), with no block left in use; a stage
process that dies ends the engine at once, naming it, and leaves no process and no segment."""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import signal
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.config import EngineConfig
from engine.llm import LLM
from engine.models.quantized_linear import QuantizedLinear
from engine.pipeline_parallel.activation_channel import ActivationReceiver, ActivationSender, StageGone
from engine.pipeline_parallel.stages import PipelineStage, plan_stages
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ModelOutput, PendingStep, SchedulerOutput
from engine.tensor_parallel.executor import TensorParallelExecutor
from engine.tensor_parallel.rank_context import RankContext
from engine.tensor_parallel.worker import STAGE_GONE_EXIT_CODE
from engine_args.config import engine_fields
from engine_args.flags import add_device_argument, add_engine_arguments, engine_argv
from tests.checkpoints import make_checkpoint, random_prompts
from tests.engine.gguf_checkpoints import Q, make_gguf, uniform
from tests.engine.stage_exits import exits_after_its_link, killed_when_closed
from tests.engine.test_tensor_parallel import transformers_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = random_prompts([5, 17, 33], seed=67)
NUM_LAYERS = 6
SHM = Path("/dev/shm")


# ------------------------------------------------------------------ the stage plan


def layer_counts(num_layers: int, num_stages: int, stage_layers: tuple[int, ...] | None = None) -> list[int]:
    return [len(stage.layers) for stage in plan_stages(num_layers, num_stages, stage_layers)]


def test_stages_are_contiguous_and_the_extra_layers_go_before_the_last() -> None:
    assert layer_counts(30, 3) == [10, 10, 10]
    assert layer_counts(8, 3) == [3, 3, 2]
    assert layer_counts(7, 4) == [2, 2, 2, 1]
    stages = plan_stages(8, 3)
    assert [stage.layers for stage in stages] == [range(0, 3), range(3, 6), range(6, 8)]
    assert [(stage.is_first, stage.is_last) for stage in stages] == [(True, False), (False, False), (False, True)]
    assert plan_stages(5, 1) == [PipelineStage.whole(5)]


def test_named_layer_counts_override_the_split() -> None:
    assert [stage.layers for stage in plan_stages(30, 3, (12, 10, 8))] == [range(0, 12), range(12, 22), range(22, 30)]


@pytest.mark.parametrize(
    ("num_layers", "num_stages", "stage_layers", "message"),
    [
        (2, 3, None, "more than the model's 2 layers"),
        (6, 2, (3, 2), "adds up to 5 layers, the model has 6"),
        (6, 2, (2, 2, 2), "names 3 stages, --pipeline-parallel-size is 2"),
        (6, 2, (6, 0), "every stage needs at least one layer"),
        (6, 0, None, "at least 1"),
    ],
)
def test_splits_the_model_cannot_take_are_refused_naming_the_counts(
    num_layers: int, num_stages: int, stage_layers: tuple[int, ...] | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        plan_stages(num_layers, num_stages, stage_layers)


def test_each_stage_loads_its_own_tensors_only() -> None:
    first, middle, last = plan_stages(6, 3)
    names = ["model.embed_tokens.weight", "model.layers.2.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight"]
    assert [first.holds(name) for name in names] == [True, False, True, False]
    assert [middle.holds(name) for name in names] == [False, True, True, False]
    assert [last.holds(name) for name in names] == [False, False, True, True]


# ------------------------------------------------------------------ flags and config


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    add_device_argument(parser)
    return parser.parse_args(list(argv))


def test_the_flags_reach_the_engine_config_and_pass_on_as_given() -> None:
    args = parse("-pp", "3", "--pipeline-stage-layers", "2,2,2")
    fields = engine_fields(args)
    assert (fields["pipeline_parallel_size"], fields["pipeline_stage_layers"]) == (3, (2, 2, 2))
    argv = engine_argv(args)
    assert argv[argv.index("--pipeline-parallel-size") + 1] == "3"
    assert argv[argv.index("--pipeline-stage-layers") + 1] == "2,2,2"
    assert engine_fields(parse())["pipeline_parallel_size"] == 1


@pytest.mark.parametrize("text", ["10,x", "4,0", ""])
def test_stage_layers_that_are_not_counts_are_refused(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--pipeline-stage-layers", text)
    assert "--pipeline-stage-layers" in capsys.readouterr().err


def test_what_pipeline_parallelism_does_not_take_yet_is_refused_with_the_way_out() -> None:
    # Prefill and decode engines take stages now (their KV crosses stages: kv_connector/layer_plan.py).
    assert EngineConfig(role="decode", pipeline_parallel_size=2).world_size == 2
    with pytest.raises(ValueError, match="names 3 stages"):
        EngineConfig(pipeline_parallel_size=2, pipeline_stage_layers=(1, 1, 1))
    assert EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=3).world_size == 6


# ------------------------------------------------------------------ the activation channel

HIDDEN = 24
TOKEN_COUNTS = [7, 1, 32, 3, 32, 5, 2]  # more messages than slots, sizes changing


def activations(step: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(num_tokens, HIDDEN, generator=generator), torch.randn(num_tokens, HIDDEN, generator=generator)


def _wait(link: Connection) -> None:
    if not link.poll(60):
        raise RuntimeError("the test's peer sent nothing for 60 s")


def _send_all(link: Connection, then_hang: bool) -> None:
    sender = ActivationSender.create(link, 32, HIDDEN, torch.float32, _wait, "the test's receiver")
    for step, num_tokens in enumerate(TOKEN_COUNTS):
        sender.send(*activations(step, num_tokens))
    if then_hang:
        signal.pause()  # until the test kills this process
    sender.close()


def test_activations_arrive_exact_in_order_and_the_segment_is_gone() -> None:
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=_send_all, args=(theirs, False))
    process.start()
    theirs.close()
    receiver = ActivationReceiver.connect(ours, _wait, "the test's sender")
    assert not list(SHM.glob(f"splitserve-pp-{process.pid}-*"))  # unlinked once both ends mapped it
    for step, num_tokens in enumerate(TOKEN_COUNTS):
        hidden, residual = receiver.receive(num_tokens, torch.device("cpu"))
        expected_hidden, expected_residual = activations(step, num_tokens)
        assert torch.equal(hidden, expected_hidden) and torch.equal(residual, expected_residual)
    process.join(60)
    assert process.exitcode == 0
    receiver.close()


def test_a_sender_that_dies_is_its_receivers_error_at_once() -> None:
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=_send_all, args=(theirs, True))
    process.start()
    theirs.close()
    receiver = ActivationReceiver.connect(ours, _wait, "the test's sender")
    for num_tokens in TOKEN_COUNTS:
        receiver.receive(num_tokens, torch.device("cpu"))
    os.kill(process.pid, signal.SIGKILL)
    with pytest.raises(StageGone, match="the test's sender is gone"):
        receiver.receive(1, torch.device("cpu"))
    process.join(60)
    receiver.close()


# ------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def llama_4_kv_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(
        tmp_path_factory.mktemp("pp-llama4"), num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=NUM_LAYERS
    )


@pytest.fixture(scope="module")
def llama_8_kv_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(
        tmp_path_factory.mktemp("pp-llama8"), num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=NUM_LAYERS
    )


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Q/K/V biases and tied embeddings: the last stage's LM head comes from the embedding."""
    return make_checkpoint(
        tmp_path_factory.mktemp("pp-qwen2"),
        "Qwen2ForCausalLM",
        num_attention_heads=8,
        num_key_value_heads=4,
        num_hidden_layers=NUM_LAYERS,
    )


_expected: dict[Path, list[list[int]]] = {}


def expected_greedy(model_path: Path) -> list[list[int]]:
    """Transformers' greedy tokens, checked equal to the engine's at PP 1, once per checkpoint."""
    if model_path not in _expected:
        expected = transformers_greedy(model_path, PROMPTS, GREEDY.max_tokens)
        assert greedy(model_path, 1, 1) == expected
        _expected[model_path] = expected
    return _expected[model_path]


def greedy(model_path: Path, tensor_parallel_size: int, pipeline_parallel_size: int) -> list[list[int]]:
    # A step budget under the longest prompt: chunked prefill, and steps mixing prompt chunks
    # with decodes, so the activations handed between stages change size from step to step.
    with LLM(
        model=str(model_path),
        dtype="float32",
        kv_cache_memory=1 << 22,
        max_num_batched_tokens=24,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
    ) as llm:
        tokens = [output.outputs[0].token_ids for output in llm.generate(PROMPTS, GREEDY)]
        report = llm.engine.load_report()
        assert report.num_free_blocks == report.num_total_blocks  # no block left in use
    return tokens


@pytest.mark.parametrize("checkpoint", ["llama_4_kv_heads", "llama_8_kv_heads", "qwen2"])
@pytest.mark.parametrize(("tensor_parallel_size", "pipeline_parallel_size"), [(1, 2), (1, 3), (2, 2)])
def test_greedy_output_equals_pp1_and_transformers(
    request: pytest.FixtureRequest, checkpoint: str, tensor_parallel_size: int, pipeline_parallel_size: int
) -> None:
    model_path = request.getfixturevalue(checkpoint)
    expected = expected_greedy(model_path)
    assert greedy(model_path, tensor_parallel_size, pipeline_parallel_size) == expected


def test_named_stage_sizes_give_the_same_tokens(llama_4_kv_heads: Path) -> None:
    with LLM(
        model=str(llama_4_kv_heads),
        dtype="float32",
        kv_cache_memory=1 << 22,
        pipeline_parallel_size=2,
        pipeline_stage_layers=(5, 1),
    ) as llm:
        runner = llm.engine.runner
        assert runner.model.stage.layers == range(5, 6) and runner.kv_cache.shape[1] == 1  # its layer's KV only
        assert [output.outputs[0].token_ids for output in llm.generate(PROMPTS, GREEDY)] == expected_greedy(
            llama_4_kv_heads
        )


def _pp1_tokens(model_path: Path, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    with LLM(model=str(model_path), dtype="float32", kv_cache_memory=1 << 22) as llm:
        return [output.outputs[0].token_ids for output in llm.generate(prompts, params)]


def test_two_batches_are_in_flight_at_pp2_and_the_tokens_are_pp1s(llama_4_kv_heads: Path) -> None:
    """Batches in flight: at PP 2 the runner holds two dispatched batches at once (stage 0
    computes the next while this process computes the last stage of the one before), each
    with its share of the requests, and greedy output is PP 1's token for token."""
    prompts = random_prompts([5, 9, 13, 17, 21, 25], seed=68)
    with LLM(model=str(llama_4_kv_heads), dtype="float32", kv_cache_memory=1 << 22, pipeline_parallel_size=2) as llm:
        runner = llm.engine.runner
        dispatch, complete = runner.dispatch, runner.complete
        outstanding = most = 0

        def counted_dispatch(output: SchedulerOutput) -> PendingStep:
            nonlocal outstanding, most
            outstanding += 1
            most = max(most, outstanding)
            return dispatch(output)

        def counted_complete(pending: PendingStep, eos_token_ids: frozenset[int]) -> ModelOutput:
            nonlocal outstanding
            outstanding -= 1
            return complete(pending, eos_token_ids)

        runner.dispatch, runner.complete = counted_dispatch, counted_complete  # type: ignore[method-assign]
        tokens = [output.outputs[0].token_ids for output in llm.generate(prompts, GREEDY)]
        report = llm.engine.load_report()
    assert most == 2
    assert report.num_free_blocks == report.num_total_blocks
    assert tokens == _pp1_tokens(llama_4_kv_heads, prompts, GREEDY)


def test_a_request_aborted_while_its_batch_is_in_flight_frees_its_blocks_once_it_returns(
    llama_4_kv_heads: Path,
) -> None:
    """The abort applies at a step boundary with the request's batch still in the pipeline: its
    blocks stay held until that batch completes (a stage may be writing them), then come back;
    every other request's tokens are PP 1's."""
    prompts = random_prompts([6, 10, 14, 18], seed=69)
    with LLM(model=str(llama_4_kv_heads), dtype="float32", kv_cache_memory=1 << 22, pipeline_parallel_size=2) as llm:
        core = llm.engine
        for index, prompt in enumerate(prompts):
            core.add_request(prompt, GREEDY, request_id=str(index))
        tokens: dict[str, list[int]] = {str(index): [] for index in range(len(prompts))}
        while not core.scheduler.in_flight:
            for output in core.step():
                tokens[output.request_id].extend(output.new_token_ids)
        victim = sorted(core.scheduler.in_flight)[0]
        core.abort([victim])
        while core.has_unfinished_requests():
            for output in core.step():
                tokens[output.request_id].extend(output.new_token_ids)
        report = core.load_report()
    assert report.num_free_blocks == report.num_total_blocks
    expected = _pp1_tokens(llama_4_kv_heads, prompts, GREEDY)
    survivors = [index for index in range(len(prompts)) if str(index) != victim]
    assert [tokens[str(index)] for index in survivors] == [expected[index] for index in survivors]
    assert len(tokens[victim]) < GREEDY.max_tokens


@pytest.fixture(scope="module")
def tied_q4_1_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's layout as a GGUF file: Q4_1 layers, a Q8_0 embedding the head is tied to (the
    first stage looks it up, the last multiplies by its blocks)."""
    return make_gguf(
        tmp_path_factory.mktemp("pp-gguf"), uniform(Q.Q4_1, Q.Q8_0), tie_word_embeddings=True, num_hidden_layers=4
    ).path


@pytest.mark.parametrize("load", ["gguf", "int8"])
def test_quantized_weights_split_into_stages_give_the_same_tokens(
    request: pytest.FixtureRequest, llama_4_kv_heads: Path, load: str
) -> None:
    """Weights kept in their blocks, each stage its own layers': GGUF (a tied quantized head on the
    last stage) and --quantization int8 at PP 2 equal PP 1."""
    if load == "gguf":
        model_path, quantization = request.getfixturevalue("tied_q4_1_gguf"), None
    else:
        model_path, quantization = llama_4_kv_heads, "int8"

    def greedy_at(pipeline_parallel_size: int) -> list[list[int]]:
        with LLM(
            model=str(model_path),
            dtype="float32",
            quantization=quantization,
            kv_cache_memory=1 << 22,
            pipeline_parallel_size=pipeline_parallel_size,
        ) as llm:
            if pipeline_parallel_size > 1:  # this process: the last stage, its head kept quantized
                assert isinstance(llm.engine.runner.model.lm_head, QuantizedLinear)
            return [output.outputs[0].token_ids for output in llm.generate(PROMPTS, GREEDY)]

    assert greedy_at(2) == greedy_at(1)


def report_place(context: RankContext) -> None:
    """A worker extension: says which stage and rank it runs as and what its cache holds."""
    shape = ",".join(str(n) for n in context.kv_cache.shape)
    place = f"stage {context.pipeline_stage} rank {context.rank}"
    context.channel.send_bytes(f"{place} {list(context.kv_heads)} {shape}".encode())


def test_a_worker_extension_runs_in_every_rank_of_every_stage_beside_its_layers(llama_4_kv_heads: Path) -> None:
    """Prefill and decode instances run a KV connector in each rank this way (serving/ranked_connector.py)."""
    with LLM(
        model=str(llama_4_kv_heads),
        kv_cache_memory=1 << 22,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        pipeline_stage_layers=(1, NUM_LAYERS - 1),
        worker_extension=report_place,
    ) as llm:
        executor = llm.engine.runner.tensor_parallel
        assert executor is not None
        num_blocks = llm.engine.runner.num_blocks
        said = {name: channel.recv_bytes().decode() for name, channel in executor.named_extension_channels}
    # Every rank but rank 0 (stage 1's rank 0): its heads of its stage's layers, block size 16, head dim 8;
    # each channel named as errors name the rank at its other end (serving/ranked_connector.py).
    assert said == {
        "pipeline stage 0 tensor-parallel rank 0": f"stage 0 rank 0 [0, 1] {num_blocks},1,2,16,2,8",
        "pipeline stage 0 tensor-parallel rank 1": f"stage 0 rank 1 [2, 3] {num_blocks},1,2,16,2,8",
        "pipeline stage 1 tensor-parallel rank 1": f"stage 1 rank 1 [2, 3] {num_blocks},{NUM_LAYERS - 1},2,16,2,8",
    }


def test_a_split_the_model_cannot_take_is_refused_before_any_process_starts(llama_4_kv_heads: Path) -> None:
    with pytest.raises(ValueError, match="more than the model's 6 layers"):
        LLM(model=str(llama_4_kv_heads), kv_cache_memory=1 << 22, pipeline_parallel_size=7)
    assert not multiprocessing.active_children()


@pytest.mark.parametrize(
    ("tensor_parallel_size", "pipeline_parallel_size", "victim"),
    [(1, 3, "pipeline stage 0"), (2, 2, "pipeline stage 0 tensor-parallel rank 1")],
)
def test_a_stage_that_dies_mid_stream_ends_the_engine_naming_it_and_leaves_nothing(
    llama_4_kv_heads: Path, tensor_parallel_size: int, pipeline_parallel_size: int, victim: str
) -> None:
    """PP 3, stage 0 killed: stage 1 ends too (its link closes) and rank 0's step fails at once.
    TP 2 x PP 2, a rank of stage 0 killed: its stage peer, waiting in a collective, gives up when
    rank 0 stops."""
    params = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)

    async def main() -> None:
        config = EngineConfig(
            model=str(llama_4_kv_heads),
            kv_cache_memory=1 << 22,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
        )
        engine = AsyncEngine(config)
        executor = engine.core.runner.tensor_parallel
        assert executor is not None
        workers = {process.name.replace("-", " "): process for process, _ in executor._workers}
        assert len(workers) == tensor_parallel_size * pipeline_parallel_size - 1
        await engine.start()
        try:
            stream = engine.generate(PROMPTS[0], params)
            await anext(stream)
            os.kill(workers[victim.replace("-", " ")].pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            assert not engine.is_alive
            assert f"{victim} (pid" in str(engine.error) and "died with exit code -9" in str(engine.error)
        finally:
            await engine.stop()
        assert not any(process.is_alive() for process in workers.values())
        assert not [path for process in workers.values() for path in SHM.glob(f"splitserve-pp-{process.pid}-*")]

    asyncio.run(main())


def test_a_chain_of_stage_exits_is_traced_back_to_the_rank_that_died_first() -> None:
    """Rank 0 sees its link close while the ranks before it have not been reaped yet: it waits
    for them, down the chain, and names stage 0 (killed) before the stage that followed it out."""
    context = multiprocessing.get_context("spawn")  # each process holds only the pipe ends it is given
    control_parent, control_child = context.Pipe()
    link_from_stage_one, link_to_rank_zero = context.Pipe(duplex=False)
    from_stage_zero, to_stage_one = context.Pipe(duplex=False)
    stage_zero = context.Process(target=killed_when_closed, args=(control_child,), daemon=True)
    stage_one = context.Process(target=exits_after_its_link, args=(link_to_rank_zero, from_stage_zero), daemon=True)
    stage_zero.start()
    stage_one.start()
    for end in (control_child, link_to_rank_zero, from_stage_zero, to_stage_one):
        end.close()  # each end now lives in its process alone
    conns = [context.Pipe()[0] for _ in range(2)]
    executor = TensorParallelExecutor(
        None,
        [(stage_zero, conns[0]), (stage_one, conns[1])],
        ["pipeline stage 0", "pipeline stage 1"],
        [],
        PipelineStage(2, 3, range(4, 6)),
        None,
    )
    try:
        with pytest.raises(EOFError):
            link_from_stage_one.recv_bytes()  # stage 1's link closed: both ranks still live
        control_parent.close()  # stage 0 dies now, stage 1 after it
        executor._reap_gone_stages()
        dead = executor._dead_workers()
        assert f"pipeline stage 0 (pid {stage_zero.pid}) died with exit code -9" in dead
        assert f"pipeline stage 1 (pid {stage_one.pid}) died with exit code {STAGE_GONE_EXIT_CODE}" in dead
    finally:
        executor.close()
        link_from_stage_one.close()
    assert not stage_zero.is_alive() and not stage_one.is_alive()


@pytest.mark.slow
def test_smollm2_at_pp3_equals_pp1() -> None:
    """The embedded model's 30 layers in stages of 10, from its safetensors folder (float32)."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    config = dict(dtype="float32", kv_cache_memory=64 << 20, max_model_len=256)
    with LLM(model=None, **config) as whole:
        expected = [output.outputs[0].token_ids for output in whole.generate(prompts, params)]
    with LLM(model=None, pipeline_parallel_size=3, **config) as split:
        assert split.engine.runner.model.stage.layers == range(20, 30)  # this process: the last stage
        assert [output.outputs[0].token_ids for output in split.generate(prompts, params)] == expected
