"""Measure a timing profile for simulated instances from the real engine on this host::

    python -m simulator.measure_profile --model PATH --output FILE.json [--dtype float32]

The one simulator module that loads torch and the engine. In call order:

1. Load ``--model`` into :class:`engine.engine_core.EngineCore` with prefix caching off (every
   repeat computes every token) and prompts chunked at ``--chunk`` tokens, so that chunks with
   earlier context are measured too. Every ``runner.execute`` is timed, with its rows
   (``(num_new_tokens, num_context_tokens)`` per scheduled request): the model's time alone, as
   the simulated instance runs the real scheduler around its timing model.
2. The workload once, not recorded: a step of a shape the host has not run yet pays one-time
   costs (oneDNN builds its kernels for each new matrix shape on its first calls).
3. The workload, ``--repeats`` times: one prompt at a time of each ``--prompt-lens`` length, each
   then decoding ``--decode-steps`` tokens alone; then each ``--batches`` shape ``BxC``: B prompts
   of C tokens that prefill together (mixed steps, as the step budget splits them) and decode
   ``--decode-steps`` tokens each.
4. Each step's time is its minimum over the repeats (other work on a shared host only ever adds
   time); the schedule is identical in every repeat, which is checked.
5. Fit the step coefficients by non-negative least squares of the relative error
   (simulator/profile_fit.py), print how far each group of steps is from its prediction, and
   write the profile with the steps it was fitted on (``measured_steps``).

The pull figures are not measured here: ``--link-bytes-per-s`` and ``--pull-fixed-s`` default
to UCX over loopback TCP on the project's VM (docs/benchmarks.md, "KV pulls per KV dtype, again:
the time ratio is the bytes' ratio within this VM's noise (2026-12-05)"); give your link's.
The figures of the shipped CPU profile and the command that made them: docs/simulator.md.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ModelOutput, SchedulerOutput
from engine_args.flags import add_device_argument, add_dtype_argument
from simulator.profile_fit import StepFit, fit_step_coefficients
from simulator.timing_model import MeasuredStep, TimingProfile

logger = logging.getLogger(__name__)

# UCX on loopback TCP, the project's VM: a one-block pull's fixed part and the rate between the
# 2,048- and 8,000-token pulls (docs/benchmarks.md, the section named in the module docstring).
LOOPBACK_LINK_BYTES_PER_S = 2.0e9
LOOPBACK_PULL_FIXED_S = 0.002
LOOPBACK_SOURCE = (
    "UCX over loopback TCP on the project's 2-core VM (docs/benchmarks.md, 'KV pulls per KV dtype, again'): "
    "a one-block pull's fixed part and the rate between 2,048- and 8,000-token pulls"
)

Row = tuple[int, int]


class StepRecorder:
    """Times each ``runner.execute`` of an engine and notes its rows. Installed on the runner
    itself (an instance attribute shadowing the method), the engine's own step loop unchanged."""

    def __init__(self, runner: ModelRunner) -> None:
        self._execute = runner.execute
        runner.execute = self.execute  # type: ignore[method-assign]
        self.steps: list[MeasuredStep] = []

    def execute(self, output: SchedulerOutput, eos_token_ids: frozenset[int]) -> ModelOutput:
        # num_computed_tokens advances in the scheduler's update, after the model ran.
        rows = tuple((s.num_new_tokens, s.request.num_computed_tokens + s.num_new_tokens) for s in output.scheduled)
        started = time.perf_counter()
        model_output = self._execute(output, eos_token_ids)
        self.steps.append(MeasuredStep(rows, time.perf_counter() - started))
        return model_output


def run_to_completion(engine: EngineCore, prompts: list[list[int]], num_output_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=num_output_tokens, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.error or output.refusal:
                raise RuntimeError(f"bug: a measuring request failed: {output.error or output.refusal}")


def run_workload(engine: EngineCore, args: argparse.Namespace, rng: random.Random) -> None:
    """Step 3 of the module docstring, once."""
    low, high = engine.vocab_size // 4, 3 * engine.vocab_size // 4  # clear of special tokens at either end

    def prompts(count: int, length: int) -> list[list[int]]:
        return [[rng.randrange(low, high) for _ in range(length)] for _ in range(count)]

    for length in args.prompt_lens:
        run_to_completion(engine, prompts(1, length), args.decode_steps + 1)
    for batch_size, context in args.batches:
        run_to_completion(engine, prompts(batch_size, context), args.decode_steps + 1)


def check_fits(engine: EngineCore, args: argparse.Namespace) -> None:
    """Refuse a workload the engine would truncate or preempt (the repeats would then differ)."""
    shapes = [(1, length) for length in args.prompt_lens] + list(args.batches)
    longest = max(context for _, context in shapes) + args.decode_steps + 1
    if longest > engine.max_model_len:
        raise ValueError(
            f"the workload needs {longest} tokens of context, the model serves {engine.max_model_len}; lower "
            "--prompt-lens or --batches"
        )
    block_size = engine.config.block_size
    capacity = engine.runner.num_blocks * block_size
    needed = max(b * (c + args.decode_steps + block_size) for b, c in shapes)
    if needed > capacity:
        raise ValueError(
            f"the largest batch holds about {needed} tokens of KV, the cache {capacity}; lower --batches or "
            "--prompt-lens, or raise --kv-cache-memory"
        )
    if max(b for b, _ in shapes) > engine.config.max_num_seqs:
        raise ValueError("a --batches batch is larger than --max-num-seqs; lower it or raise --max-num-seqs")


def measure(engine: EngineCore, args: argparse.Namespace) -> list[MeasuredStep]:
    """Steps 2 to 4 of the module docstring: each step's minimum time over the repeats."""
    check_fits(engine, args)
    run_workload(engine, args, random.Random(args.seed))  # warm-up
    recorder = StepRecorder(engine.runner)
    repeats: list[list[MeasuredStep]] = []
    for repeat in range(args.repeats):
        recorder.steps = []
        run_workload(engine, args, random.Random(args.seed))
        repeats.append(recorder.steps)
        logger.info("repeat %d of %d: %d steps", repeat + 1, args.repeats, len(recorder.steps))
    schedules = {tuple(step.rows for step in steps) for steps in repeats}
    if len(schedules) != 1:
        raise RuntimeError("bug: the repeats scheduled different steps; the workload must not preempt or share cache")
    return [MeasuredStep(steps[0].rows, min(step.seconds for step in steps)) for steps in zip(*repeats, strict=True)]


# ------------------------------------------------------------------ reporting


def describe(rows: Sequence[Row]) -> tuple[str, ...]:
    """A step's group: consecutive steps with the same key are reported together."""
    if all(n == 1 for n, _ in rows):
        return ("decode", str(len(rows)))
    if len(rows) == 1:
        return ("prefill", str(rows[0][0]), str(rows[0][1] - rows[0][0]))
    return ("mixed", str(len(rows)), str(sum(n for n, _ in rows)))


def residual_report(steps: Sequence[MeasuredStep], fit: StepFit) -> str:
    """One line per group of consecutive like steps: measured time and predicted / measured."""
    lines = [
        f"{'steps':<44} {'count':>5} {'measured ms (median)':>21} {'predicted / measured':>22}",
    ]
    index = 0
    while index < len(steps):
        key = describe(steps[index].rows)
        end = index
        while end < len(steps) and describe(steps[end].rows) == key:
            end += 1
        group = steps[index:end]
        contexts = [c for step in group for _, c in step.rows]
        match key:
            case ("decode", batch):
                label = f"decode, batch {batch}, context {min(contexts)}-{max(contexts)}"
            case ("prefill", tokens, earlier):
                label = f"prefill of {tokens} tokens" + (f" after {earlier}" if earlier != "0" else "")
            case _:
                label = f"mixed, {key[1]} rows, {key[2]} tokens"
        ratios = fit.ratios[index:end]
        measured_ms = statistics.median(step.seconds for step in group) * 1e3
        lines.append(f"{label:<44} {len(group):>5} {measured_ms:>21.3f} {min(ratios):>10.2f} - {max(ratios):<9.2f}")
        index = end
    lines.append(f"worst step: predicted {fit.worst_ratio:.2f}x off its measured time (either way)")
    return "\n".join(lines)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


# ----------------------------------------------------------------------- main


def parse_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"a comma-separated list of whole numbers >= 1, got {text!r}")
    return counts


def parse_batches(text: str) -> list[tuple[int, int]]:
    """``4x128,16x64``: batches of 4 prompts of 128 tokens, of 16 of 64."""
    try:
        batches = [(int(b), int(c)) for b, c in (part.split("x") for part in text.split(",") if part.strip())]
    except ValueError:
        batches = []
    if not batches or min(min(b, c) for b, c in batches) < 1:
        raise argparse.ArgumentTypeError(f"a comma-separated list of BATCHxCONTEXT, e.g. 4x128,16x64; got {text!r}")
    return batches


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m simulator.measure_profile",
        description="Measure a simulated instance's timing profile from the real engine on this host.",
    )
    parser.add_argument("--model", required=True, help="a Hugging Face folder or GGUF file the engine loads")
    parser.add_argument("--output", required=True, type=Path, help="where to write the profile (JSON)")
    parser.add_argument("--name", help="the profile's name (default: the output file's name without .json)")
    add_dtype_argument(parser)
    add_device_argument(parser)
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV cache (default: the engine's)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the step budget, in tokens")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="requests one step may hold")
    parser.add_argument("--chunk", type=int, default=512, help="the most tokens of one prompt a step computes")
    parser.add_argument(
        "--prompt-lens",
        type=parse_counts,
        default=parse_counts("16,128,512,2048"),
        help="prompts run alone, prefilled then decoded (default 16,128,512,2048)",
    )
    parser.add_argument(
        "--batches",
        type=parse_batches,
        default=parse_batches("4x128,16x128,32x64,8x512"),
        help="BATCHxCONTEXT: prompts prefilled and decoded together (default 4x128,16x128,32x64,8x512)",
    )
    parser.add_argument("--decode-steps", type=int, default=8, help="tokens each request decodes after its prompt")
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs of the workload after the warm-up; each step keeps its fastest"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch's CPU threads (default: torch's own choice); 1 as one core"
    )
    parser.add_argument(
        "--link-bytes-per-s",
        type=float,
        default=None,
        help=f"the P->D link's rate for KV pulls (default {LOOPBACK_LINK_BYTES_PER_S:g}: {LOOPBACK_SOURCE})",
    )
    parser.add_argument(
        "--pull-fixed-s",
        type=float,
        default=None,
        help=f"each pull's fixed cost in seconds (default {LOOPBACK_PULL_FIXED_S:g}, as above)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if min(args.decode_steps, args.repeats, args.chunk) < 1:
        raise SystemExit("error: --decode-steps, --repeats and --chunk must be >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        kv_cache_memory=args.kv_cache_memory,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        long_prefill_token_threshold=args.chunk,
        enable_prefix_caching=False,
    )
    try:
        engine = EngineCore(config)
        try:
            steps = measure(engine, args)
        finally:
            engine.close()
    except ValueError as error:  # the user's to fix: say how, without a traceback
        raise SystemExit(f"error: {error}") from error
    fit = fit_step_coefficients(steps)
    sys.stdout.write(residual_report(steps, fit) + "\n")
    runner = engine.runner
    dtype, threads = str(runner.dtype).removeprefix("torch."), torch.get_num_threads()
    device = f"{runner.device.type}: {cpu_name() if runner.device.type == 'cpu' else torch.cuda.get_device_name()}"
    given_link = args.link_bytes_per_s is not None or args.pull_fixed_s is not None
    profile = TimingProfile(
        name=args.name or args.output.name.removesuffix(".json"),
        source=(
            f"Measured with python -m simulator.measure_profile on {Path(args.model).name} ({dtype}, "
            f"{device}, {threads} thread{'' if threads == 1 else 's'}) on {datetime.date.today().isoformat()}: "
            f"{len(steps)} steps, each its fastest of {args.repeats} repeats, fitted by non-negative least "
            f"squares of the relative error (worst step {fit.worst_ratio:.2f}x off). Pulls: "
            + ("as given on the command line." if given_link else LOOPBACK_SOURCE + ".")
        ),
        block_size=config.block_size,
        num_kv_blocks=runner.num_blocks,
        kv_bytes_per_token=runner.bytes_per_block // config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        step_fixed_s=fit.coefficients["step_fixed_s"],
        token_s=fit.coefficients["token_s"],
        attention_s=fit.coefficients["attention_s"],
        context_s=fit.coefficients["context_s"],
        link_bytes_per_s=LOOPBACK_LINK_BYTES_PER_S if args.link_bytes_per_s is None else args.link_bytes_per_s,
        pull_fixed_s=LOOPBACK_PULL_FIXED_S if args.pull_fixed_s is None else args.pull_fixed_s,
        measured_steps=tuple(steps),
    )
    args.output.write_text(profile.to_json())
    sys.stdout.write(
        "".join(f"{name} = {value:.4g}\n" for name, value in fit.coefficients.items()) + f"wrote {args.output}\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
