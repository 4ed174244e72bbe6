"""What a JSON schema costs: one batch of N requests decoded with and without it.

    python -m microbench.structured_output --batch-size 32 --output-len 64 --runs 3

Same N random-token prompts, greedy, ``ignore_eos``, ``max_tokens`` = ``--output-len``
in both phases, run through the engine step by step. The schema (an array of at least 20 objects) never completes
within the budget, so every constrained row runs to ``--output-len`` too and both
phases generate exactly N x output-len tokens: the throughput ratio is the grammar's
cost alone. Each phase is timed ``--runs`` times after a warm-up run of each (which
also compiles the schema once; the compile time is reported apart).

Beside wall time and CPU time it reports the decode step's minimum and median duration
(the minimum is what a shared machine's other work cannot improve, so it is the figure
to compare there), and, per decode step with constrained rows, the time the
worker spent filling and unpacking bitmasks, the time the engine thread still waited
for them after its forward pass (what the overlap did not hide), and the sampler's
batched add of the mask; and what an unconstrained step pays for the feature: the check that no
row has a grammar (``ModelRunner._start_bitmask`` on N rows without one).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import time
import timeit

import llguidance
import llguidance.numpy
import numpy as np
import torch

from engine import LLM, SamplingParams
from engine.request import Request
from engine.structured_output import StructuredOutputSpec
from engine.structured_output import bitmask as bitmask_module
from engine.structured_output.compiler import GrammarCompiler
from engine_args.flags import add_dtype_argument

logger = logging.getLogger(__name__)

SCHEMA = {
    "type": "array",
    "minItems": 20,  # a model would close an empty array at once; 20 objects outlast the budget
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "email": {"type": "string", "format": "email"},
            "admin": {"type": "boolean"},
        },
        "required": ["name", "age", "email", "admin"],
        "additionalProperties": False,
    },
}


class _Timed:
    """Wraps the bitmask worker's fill and the sampler's wait to add up their times."""

    def __init__(self) -> None:
        self.fill_s: list[float] = []
        self.wait_s: list[float] = []
        fill, result = bitmask_module.BitmaskWorker._fill, bitmask_module.PendingBitmask.result
        self.apply_s: list[float] = []
        apply = bitmask_module.apply_token_bitmask

        def timed_apply(logits, rows, bias):
            start = time.perf_counter()
            try:
                return apply(logits, rows, bias)
            finally:
                self.apply_s.append(time.perf_counter() - start)

        def timed_fill(worker, states):
            start = time.perf_counter()
            try:
                return fill(worker, states)
            finally:
                self.fill_s.append(time.perf_counter() - start)

        def timed_result(pending):
            start = time.perf_counter()
            try:
                return result(pending)
            finally:
                self.wait_s.append(time.perf_counter() - start)

        bitmask_module.BitmaskWorker._fill = timed_fill  # type: ignore[method-assign]
        bitmask_module.PendingBitmask.result = timed_result  # type: ignore[method-assign]
        # The sampler imported the function itself: patch its name there.
        import engine.sampler

        engine.sampler.apply_token_bitmask = timed_apply  # type: ignore[assignment]

    def reset(self) -> None:
        self.fill_s.clear()
        self.wait_s.clear()
        self.apply_s.clear()


def run_batch(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], list[float], float]:
    """Every prompt through the engine at once, step by step. Returns each request's output
    tokens, the durations of the steps in which every request decoded, and the wall time."""
    engine = llm.engine
    request_ids = [engine.add_request(prompt, params) for prompt in prompts]
    token_ids: dict[str, list[int]] = {request_id: [] for request_id in request_ids}
    step_s: list[float] = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        outputs = engine.step()
        duration = time.perf_counter() - step_start
        # The first such step is the batch's prefill; after it, every step is a decode step.
        if len(outputs) == len(prompts) and any(token_ids.values()):
            step_s.append(duration)
        for output in outputs:
            token_ids[output.request_id].extend(output.new_token_ids)
    return list(token_ids.values()), step_s, time.perf_counter() - start


def time_components(llm: LLM, spec: StructuredOutputSpec, token_ids: list[list[int]]) -> dict[str, float]:
    """The grammar work of one decode step for these rows, each part timed alone on this
    thread (minimum of many repeats, milliseconds): llguidance's bitmask fill for every row,
    the worker's whole job (fill and unpacking into the additive bias), the sampler's add.
    ``token_ids``: each row's output so far (the states are advanced over it: mid-JSON, as
    in the runs)."""
    manager = llm.engine.structured_output
    states = []
    for index, tokens in enumerate(token_ids):
        state = manager.new_state(spec, str(index))
        state.sync(tokens[:-1])
        states.append(state)
    worker = bitmask_module.BitmaskWorker(manager.compiler.vocab_size, manager.vocab_size)
    executor = llguidance.LLExecutor()
    bitmask = np.zeros((len(states), (manager.compiler.vocab_size + 31) // 32), dtype=np.int32)
    bias = worker._fill(states).clone()
    logits, work = torch.randn(len(states), manager.vocab_size), torch.empty(len(states), manager.vocab_size)
    rows = list(range(len(states)))

    def best_ms(function: object, number: int = 20) -> float:
        return round(min(timeit.repeat(function, number=number, repeat=15)) / number * 1e3, 3)  # type: ignore[arg-type]

    def apply() -> None:
        work.copy_(logits)
        bitmask_module.apply_token_bitmask(work, rows, bias)

    components = {
        "fill_ms": best_ms(
            lambda: llguidance.numpy.fill_next_token_bitmask_par(
                executor, [(s.matcher, i) for i, s in enumerate(states)], bitmask
            )
        ),
        "worker_fill_and_bias_ms": best_ms(lambda: worker._fill(states)),
        "apply_add_ms": best_ms(apply) - best_ms(lambda: work.copy_(logits)),
    }
    worker.close()
    return {name: round(value, 3) for name, value in components.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local HF folder; default: the embedded SmolLM2-135M-Instruct")
    add_dtype_argument(parser)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_memory=256 << 20)
    rng = random.Random(args.seed)
    vocab = llm.tokenizer.vocab_size
    prompts = [[rng.randrange(100, vocab - 1) for _ in range(args.input_len)] for _ in range(args.batch_size)]
    spec = StructuredOutputSpec.from_json_schema(SCHEMA)
    free = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, structured=spec)

    start = time.perf_counter()
    GrammarCompiler.from_hf_tokenizer(llm.tokenizer).compile(spec)  # type: ignore[arg-type]
    compile_s = time.perf_counter() - start

    timed = _Timed()
    results: dict[str, list[float]] = {"free": [], "json_schema": []}
    # CPU seconds the whole process used (every thread): the work a format adds, which a
    # busy machine's scheduling cannot hide the way it blurs wall time.
    cpu: dict[str, list[float]] = {"free": [], "json_schema": []}
    # Durations of the steps where every row decodes: their minimum is the figure that
    # other work on a shared machine can only make worse, never better.
    steps: dict[str, list[float]] = {"free": [], "json_schema": []}
    for params in (free, constrained):
        llm.generate(prompts[:4], params)  # warm-up (and, constrained, the instance's compile)
    for _ in range(args.runs):
        for name, params in (("free", free), ("json_schema", constrained)):
            timed.reset()
            cpu_start = time.process_time()
            token_ids, step_s, elapsed = run_batch(llm, prompts, params)
            cpu_s = time.process_time() - cpu_start
            cpu[name].append(cpu_s)
            num_tokens = sum(map(len, token_ids))
            if num_tokens != args.batch_size * args.output_len:
                raise RuntimeError(f"{name}: {num_tokens} tokens, expected {args.batch_size * args.output_len}")
            results[name].append(num_tokens / elapsed)
            steps[name].extend(step_s)
            steps_line = f"decode step min {min(step_s) * 1e3:.1f} / median {statistics.median(step_s) * 1e3:.1f} ms"
            if name == "json_schema":
                logger.warning("a constrained output: %r", llm.tokenizer.decode(token_ids[0])[:120])
                print(
                    f"json_schema run: {elapsed:.2f} s, {num_tokens / elapsed:.1f} tok/s, {cpu_s:.1f} CPU s, "
                    f"{steps_line}; bitmask fill per step "
                    f"min {min(timed.fill_s) * 1e3:.2f} / median {statistics.median(timed.fill_s) * 1e3:.2f} ms, "
                    "engine wait "
                    f"after the forward pass median {statistics.median(timed.wait_s) * 1e3:.2f} ms, sampler mask "
                    "(add) min "
                    f"{min(timed.apply_s) * 1e3:.2f} / median {statistics.median(timed.apply_s) * 1e3:.2f} ms, over "
                    f"{len(timed.fill_s)} steps"
                )
            else:
                print(f"free run: {elapsed:.2f} s, {num_tokens / elapsed:.1f} tok/s, {cpu_s:.1f} CPU s, {steps_line}")
    free_rate, json_rate = statistics.median(results["free"]), statistics.median(results["json_schema"])
    components = time_components(llm, spec, token_ids)
    unconstrained = [
        Request(
            request_id=str(i),
            prompt_token_ids=p,
            sampling_params=free,
            max_tokens=args.output_len,
            eos_token_ids=frozenset(),
        )
        for i, p in enumerate(prompts)
    ]
    runner = llm.engine.runner
    check_us = min(timeit.repeat(lambda: runner._start_bitmask(unconstrained), number=10_000, repeat=5)) / 10_000 * 1e6
    median_cpu = {kind: statistics.median(seconds) for kind, seconds in cpu.items()}
    print(
        json.dumps(
            {
                **components,
                "unconstrained_step_check_us": round(check_us, 2),
                "torch_threads": torch.get_num_threads(),
                "load_average_1m_at_end": os.getloadavg()[0],  # other work on the machine skews every figure
                "batch_size": args.batch_size,
                "output_len": args.output_len,
                "schema_compile_s": round(compile_s, 3),
                "free_tok_s": [round(r, 1) for r in results["free"]],
                "json_schema_tok_s": [round(r, 1) for r in results["json_schema"]],
                "free_cpu_s": [round(c, 1) for c in cpu["free"]],
                "json_schema_cpu_s": [round(c, 1) for c in cpu["json_schema"]],
                "free_step_ms_min_median": [
                    round(min(steps["free"]) * 1e3, 1),
                    round(statistics.median(steps["free"]) * 1e3, 1),
                ],
                "json_schema_step_ms_min_median": [
                    round(min(steps["json_schema"]) * 1e3, 1),
                    round(statistics.median(steps["json_schema"]) * 1e3, 1),
                ],
                "min_step_cost": f"{(min(steps['json_schema']) / min(steps['free']) - 1) * 100:.1f}%",
                "median_cost": f"{(1 - json_rate / free_rate) * 100:.1f}%",
                "median_cpu_cost": f"{(median_cpu['json_schema'] / median_cpu['free'] - 1) * 100:.1f}%",
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
