"""Speculative decoding against plain decoding, single stream, side by side in one run.

Two engines on the same model and dtype, one with n-gram speculation (or a draft model) and
one without, run the same request side by side in one process, their steps interleaved one
for one and each timed on its own (which steps first alternates by round), so load from
elsewhere on the machine lands on both alike. Workloads:

- ``code``: a source file of this repository, then the instruction to write it out again
  with a function renamed: the output copies its prompt, as code edits do;
- ``random``: random token ids, decoded greedily (a small model's greedy output soon loops,
  which lookups then predict);
- ``random-sampled``: the same prompt sampled at temperature 1 (seeded, the same seeds on
  both sides): output that rarely repeats, so drafts are few and mostly rejected —
  speculation's worst case;
- ``chat``: a question through the model's chat template, answered greedily: what Medusa
  heads trained on the model's chat (``splitserve train-heads``) are for.

``--streams N`` runs the chat questions as N concurrent requests on each engine (one workload,
``chat-xN``), for the batch at which speculation stops paying (``disable_by_batch_size``).

``--speculative-config`` takes any method as the serving commands do (Medusa heads:
``'{"method": "medusa", "model": "HEADS"}'``); the acceptance rate at each depth of the draft
chain and the mean accepted length close the report.

Each request yields exactly ``--output-len`` tokens (EOS ignored). Reported per workload
and engine: median ms per output token after the first (the single-stream inter-token
latency), the speedup, and the drafts verified / accepted and acceptance rate::

    python -m microbench.spec_decode --output-len 256 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from engine.spec_decode.config import SpeculativeConfig
from engine_args.config import speculative_config_from_json
from engine_args.flags import add_dtype_argument

logger = logging.getLogger(__name__)

_REPO = Path(__file__).resolve().parent.parent
_CODE_FILE = _REPO / "engine" / "kv_cache_utils.py"
# The chat workload's question: none of the shipped text's paragraphs the heads trained on.
CHAT_QUESTION = "Explain how a hash table works, then show a short Python example that counts words with one."
_TOKEN_ID_MARGIN = 100  # random ids keep clear of the special tokens at both ends of the vocabulary


@dataclass(slots=True)
class RunResult:
    workload: str
    engine: str  # "spec" or "plain"
    round: int
    ms_per_token: float  # this engine's step time after the first token / (output tokens - 1)
    cpu_ms_per_token: float  # the same in this process's CPU time (less swayed by other load)
    ttft_ms: float
    num_output_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int


def code_edit_prompt(tokenizer: object) -> list[int]:
    code = _CODE_FILE.read_text()
    text = f"# kv_cache_utils.py\n{code}\n\n# kv_cache_utils.py, after renaming hash_block_tokens to hash_block\n"
    return list(tokenizer.encode(text))  # type: ignore[attr-defined]


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(_TOKEN_ID_MARGIN, vocab_size - _TOKEN_ID_MARGIN) for _ in range(length)]


@dataclass(slots=True)
class _Timing:
    """One engine's clock over its requests, summed over that engine's own steps only."""

    first_tokens: set[str] = field(default_factory=set)  # the requests that have theirs
    ttft_s: float = 0.0
    decode_s: float = 0.0  # steps after every request had its first token
    decode_cpu_s: float = 0.0
    num_tokens: int = 0


def run_side_by_side(
    engines: dict[str, EngineCore],
    prompts: list[list[int]],
    output_len: int,
    temperature: float,
    seed: int,
) -> dict[str, _Timing]:
    """The same concurrent requests (one per prompt) on every engine at once, their steps
    interleaved one for one, each step timed on its own: load from elsewhere on the machine lands
    on both sides alike, which alternating whole requests does not give on a busy shared machine.
    A side's decode time starts once every one of its requests has its first token."""
    timings = {name: _Timing() for name in engines}
    for core in engines.values():
        for prompt_ids in prompts:
            params = SamplingParams(temperature=temperature, seed=seed, max_tokens=output_len, ignore_eos=True)
            core.add_request(prompt_ids, params, request_id=uuid.uuid4().hex)
    while any(core.has_unfinished_requests() for core in engines.values()):
        for name, core in engines.items():
            if not core.has_unfinished_requests():
                continue
            timing = timings[name]
            wall, cpu = time.perf_counter(), time.process_time()
            outputs = core.step()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if len(timing.first_tokens) == len(prompts):  # every request had its first token before
                timing.decode_s += wall
                timing.decode_cpu_s += cpu
            else:
                timing.ttft_s += wall
            timing.num_tokens += sum(len(output.new_token_ids) for output in outputs)
            timing.first_tokens.update(output.request_id for output in outputs if output.new_token_ids)
    for name, timing in timings.items():
        if timing.num_tokens != output_len * len(prompts):
            raise RuntimeError(
                f"{name} gave {timing.num_tokens} tokens, expected {output_len * len(prompts)} with ignore_eos: a bug"
            )
    return timings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m microbench.spec_decode", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="local Hugging Face folder (default: embedded SmolLM2-135M-Instruct)"
    )
    add_dtype_argument(parser, default="float32")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--speculative-ngram-min", type=int, default=2)
    parser.add_argument("--speculative-ngram-max", type=int, default=4)
    parser.add_argument("--speculative-model", default=None, help="draft model folder (default: n-gram drafting)")
    parser.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help="as the serving commands take it; overrides the above",
    )
    parser.add_argument(
        "--workloads", default="code,random,random-sampled", help="comma-separated: code, random, random-sampled, chat"
    )
    parser.add_argument(
        "--chat-question",
        action="append",
        default=None,
        metavar="TEXT",
        help="the chat workload's question; repeated, one workload each (chat-1, chat-2, ...) (default: one "
        "that none of the shipped prompts asks)",
    )
    parser.add_argument(
        "--streams",
        type=int,
        default=1,
        help="chat: this many concurrent requests on each engine, the questions in turn (one workload, "
        "chat-xN); ms per token is then each stream's: the batch's decode time over its steps' tokens per stream",
    )
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument(
        "--random-input-len", type=int, default=736, help="tokens of the random prompt (the code prompt's length)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="requests per workload and engine, alternating engines")
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 28)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    parser.add_argument("--output-json", type=Path, default=None)
    return parser.parse_args(argv)


def summarize(results: list[RunResult]) -> list[dict[str, object]]:
    rows = []
    for workload in dict.fromkeys(r.workload for r in results):
        by_engine = {e: [r for r in results if r.workload == workload and r.engine == e] for e in ("plain", "spec")}
        plain = statistics.median(r.ms_per_token for r in by_engine["plain"])
        spec = statistics.median(r.ms_per_token for r in by_engine["spec"])
        plain_cpu = statistics.median(r.cpu_ms_per_token for r in by_engine["plain"])
        spec_cpu = statistics.median(r.cpu_ms_per_token for r in by_engine["spec"])
        drafts = sum(r.num_draft_tokens for r in by_engine["spec"])
        accepted = sum(r.num_accepted_tokens for r in by_engine["spec"])
        rows.append(
            {
                "workload": workload,
                "plain_ms_per_token": plain,
                "spec_ms_per_token": spec,
                # Per round, the two sides saw the same load: the median of the rounds' ratios.
                "speedup": statistics.median(
                    p.ms_per_token / s.ms_per_token for p, s in zip(by_engine["plain"], by_engine["spec"])
                ),
                "plain_cpu_ms_per_token": plain_cpu,
                "spec_cpu_ms_per_token": spec_cpu,
                "cpu_speedup": statistics.median(
                    p.cpu_ms_per_token / s.cpu_ms_per_token for p, s in zip(by_engine["plain"], by_engine["spec"])
                ),
                "num_draft_tokens": drafts,
                "num_accepted_tokens": accepted,
                "acceptance_rate": accepted / drafts if drafts else 0.0,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    if args.output_len < 2:
        raise ValueError("--output-len must be >= 2: ms per token is measured between tokens")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    spec = SpeculativeConfig(
        method="draft_model" if args.speculative_model else "ngram",
        num_speculative_tokens=args.num_speculative_tokens,
        ngram_min=args.speculative_ngram_min,
        ngram_max=args.speculative_ngram_max,
        model=args.speculative_model,
    )
    if args.speculative_config is not None:
        spec = speculative_config_from_json(args.speculative_config)
    common = dict(model=args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=False)
    # The speculating engine is created first: of two plain engines in one process, the one created
    # second runs identical steps faster (docs/benchmarks.md, "Speculative decoding"), so that bias
    # counts against speculation.
    spec_core = EngineCore(EngineConfig(**common, speculative=spec))  # type: ignore[arg-type]
    engines = {"plain": EngineCore(EngineConfig(**common)), "spec": spec_core}  # type: ignore[arg-type]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(engines["plain"].metadata_path))  # a GGUF file's too
    rng = random.Random(args.seed)
    prompts: dict[str, list[list[int]]] = {}  # a workload's concurrent requests
    for workload in args.workloads.split(","):
        if workload == "code":
            prompts["code"] = [code_edit_prompt(tokenizer)]
        elif workload == "chat":
            questions = args.chat_question or [CHAT_QUESTION]
            encoded_questions = []
            for question in questions:
                messages = [{"role": "user", "content": question}]
                encoded = tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=True
                )
                encoded_questions.append(list(encoded["input_ids"]))
            if args.streams > 1:
                prompts[f"chat-x{args.streams}"] = [
                    encoded_questions[i % len(encoded_questions)] for i in range(args.streams)
                ]
            else:
                for number, prompt_ids in enumerate(encoded_questions, start=1):
                    prompts["chat" if len(questions) == 1 else f"chat-{number}"] = [prompt_ids]
        elif workload in ("random", "random-sampled"):
            prompts[workload] = [
                random_prompt(random.Random(args.seed), args.random_input_len, engines["plain"].vocab_size)
            ]
        else:
            raise ValueError(f"unknown workload {workload!r}; use code, random, random-sampled, chat")
        if args.streams > 1 and workload != "chat":
            raise ValueError("--streams runs the chat workload's questions concurrently: use --workloads chat")
    run_side_by_side(engines, [random_prompt(rng, 64, engines["plain"].vocab_size)], 8, 0.0, 0)  # warm-up, untimed

    results: list[RunResult] = []
    for round_index in range(args.rounds):
        for workload, workload_prompts in prompts.items():
            # Which engine steps first alternates by round.
            order = ("plain", "spec") if round_index % 2 == 0 else ("spec", "plain")
            stats = engines["spec"].scheduler.spec_stats
            drafts_before, accepted_before = stats.num_draft_tokens, stats.num_accepted_tokens
            temperature = 1.0 if workload == "random-sampled" else 0.0
            timings = run_side_by_side(
                {name: engines[name] for name in order}, workload_prompts, args.output_len, temperature, round_index
            )
            for name in ("plain", "spec"):
                t = timings[name]
                streams = len(workload_prompts)
                per_token = 1e3 * streams / (t.num_tokens - streams)  # each stream's, after its first token
                spec_side = name == "spec"
                result = RunResult(
                    workload,
                    name,
                    round_index,
                    t.decode_s * per_token,
                    t.decode_cpu_s * per_token,
                    t.ttft_s * 1e3,
                    t.num_tokens,
                    stats.num_draft_tokens - drafts_before if spec_side else 0,
                    stats.num_accepted_tokens - accepted_before if spec_side else 0,
                )
                logger.info("%s", result)
                results.append(result)

    summary = summarize(results)
    lines = [
        f"{'workload':<16}{'plain ms/tok':>14}{'spec ms/tok':>13}{'speedup':>9}{'cpu speedup':>13}"
        f"{'drafts':>8}{'accepted':>10}{'accept rate':>13}"
    ]
    for row in summary:
        lines.append(
            f"{row['workload']:<16}{row['plain_ms_per_token']:>14.2f}{row['spec_ms_per_token']:>13.2f}{row['speedup']:>8.2f}x"
            f"{row['cpu_speedup']:>12.2f}x{row['num_draft_tokens']:>8}{row['num_accepted_tokens']:>10}{row['acceptance_rate']:>13.1%}"
        )
    stats = engines["spec"].scheduler.spec_stats  # every workload's, the warm-up's too
    lines.append(
        "acceptance at each draft depth: "
        + ", ".join(f"{rate:.1%}" for rate in stats.acceptance_rate_at)
        + f"; mean accepted length {stats.mean_accepted_length:.2f}"
    )
    sys.stdout.write("\n".join(lines) + "\n")
    if args.output_json is not None:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "summary": summary,
            "acceptance_rate_at": stats.acceptance_rate_at,
            "accepted_length_counts": stats.accepted_length_counts,
            "mean_accepted_length": stats.mean_accepted_length,
            "runs": [asdict(r) for r in results],
        }
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
        logger.info("wrote %s", args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
