"""``splitserve bench serve|sweep|plot``: load-test any OpenAI-compatible server.

    splitserve bench serve --base-url http://127.0.0.1:8000 --dataset mixed \\
        --mix 1024-2048:32:0.5,128:256:0.5 --num-prompts 200 --request-rate 4 \\
        --goodput ttft:500 tpot:50 --save-result --result-dir results/
    splitserve bench sweep --request-rates 1,2,4,inf --dataset random --input-len 512 --result-dir results/
    splitserve bench plot results/*.json --output-dir figures/
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, get_args

from bench.client import ENDPOINTS
from bench.datasets import DatasetName, WorkloadSpec, parse_mix, random_class
from bench.metrics import parse_goodput

if TYPE_CHECKING:
    from bench.serve import ServeConfig

logger = logging.getLogger(__name__)

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_INPUT_LEN = 1024
DEFAULT_OUTPUT_LEN = 128


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="bench_command", required=True, metavar="BENCH_COMMAND")
    _add_serve_arguments(commands.add_parser("serve", help="benchmark one server at one request rate"), sweep=False)
    _add_serve_arguments(
        commands.add_parser("sweep", help="bench serve at several request rates, a result JSON each"), sweep=True
    )

    plot = commands.add_parser("plot", help="PNG figures from result JSONs: TTFT/ITL CDFs, ITL over time, sweeps")
    plot.add_argument("results", nargs="+", metavar="RESULT.json")
    plot.add_argument("--output-dir", required=True, help="folder for the PNG files")
    plot.add_argument(
        "--label",
        action="append",
        default=None,
        help="a name per result file, in order (repeat it); default: the file's label or name",
    )


def _add_serve_arguments(parser: argparse.ArgumentParser, sweep: bool) -> None:
    target = parser.add_argument_group("server")
    target.add_argument("--base-url", default=DEFAULT_BASE_URL, help=f"server root (default {DEFAULT_BASE_URL})")
    target.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS)
    target.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY") or None,
        help="sent as 'Authorization: Bearer KEY' (default: env OPENAI_API_KEY)",
    )
    target.add_argument("--model", default=None, help="model name to request (default: the first GET /v1/models lists)")
    target.add_argument(
        "--tokenizer",
        default=None,
        help="Hugging Face folder whose tokenizer measures prompt lengths "
        "(default: --model if it is a local folder, else the embedded SmolLM2-135M-Instruct)",
    )
    target.add_argument("--request-timeout", type=float, default=3600.0, help="seconds one request may take")
    target.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for exactly max_tokens output tokens (default on)",
    )
    target.add_argument(
        "--extra-body",
        type=json.loads,
        default=None,
        help="JSON merged into every request body, e.g. '{\"temperature\": 0}'",
    )

    workload = parser.add_argument_group("workload")
    workload.add_argument("--dataset", default="random", choices=get_args(DatasetName))
    workload.add_argument("--num-prompts", type=int, default=100, help="measured requests")
    workload.add_argument("--input-len", type=int, default=DEFAULT_INPUT_LEN, help="random: prompt tokens")
    workload.add_argument(
        "--output-len",
        type=int,
        default=None,
        help=f"output tokens (random, shared-prefix: default {DEFAULT_OUTPUT_LEN}; "
        "sharegpt: default the recorded answer's length)",
    )
    workload.add_argument(
        "--range-ratio", type=float, default=0.0, help="random: lengths uniform in [L*(1-r), L*(1+r)]"
    )
    workload.add_argument(
        "--mix",
        default=None,
        metavar="IN:OUT:WEIGHT,...",
        help="mixed: classes, a length N or LO-HI, e.g. 1024-2048:32:0.5,128:256:0.5",
    )
    workload.add_argument("--num-prefixes", type=int, default=8, help="shared-prefix: groups (distinct system prompts)")
    workload.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: tokens of each shared prompt")
    workload.add_argument("--suffix-len", type=int, default=128, help="shared-prefix: tokens after it, per request")
    workload.add_argument("--dataset-path", default=None, help="sharegpt: a local ShareGPT JSON file")
    workload.add_argument("--seed", type=int, default=0, help="prompts and arrival times follow from it")

    load = parser.add_argument_group("load")
    if sweep:
        load.add_argument("--request-rates", required=True, help="comma-separated request rates, e.g. 1,2,4,inf")
    else:
        load.add_argument(
            "--request-rate",
            type=float,
            default=float("inf"),
            help="requests per second, Poisson (gamma with --burstiness); inf sends all at once",
        )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the gaps between requests: 1 Poisson, <1 bursty, >1 regular",
    )
    load.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    load.add_argument("--num-warmups", type=int, default=0, help="requests sent first and not measured")

    report = parser.add_argument_group("report")
    report.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="SLOs a request must all meet to count as good: ttft:MS tpot:MS e2el:MS",
    )
    report.add_argument("--metric-percentiles", default="90,99", help="percentiles to report, e.g. 50,90,99,99.9")
    report.add_argument("--label", default=None, help="a name for the run, saved in the result and used by plots")
    report.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    if sweep:
        report.add_argument("--result-dir", default=".", help="folder for the result JSONs (always written)")
    else:
        report.add_argument("--save-result", action="store_true", help="write the result JSON (vLLM's keys)")
        report.add_argument("--result-dir", default=".", help="folder for the result JSON")
        report.add_argument(
            "--result-filename",
            default=None,
            help="file name (default {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json)",
        )


def run(args: argparse.Namespace) -> int:
    if args.bench_command == "plot":
        from bench.plot import load_runs, plot_runs

        for path in plot_runs(load_runs(args.results, args.label), args.output_dir):
            logger.info("wrote %s", path)
        return 0

    from bench.report import format_result, format_sweep
    from bench.serve import benchmark, result_path, save_result
    from bench.sweep import parse_rates, run_sweep

    config = serve_config(args)
    if args.bench_command == "sweep":
        results = []
        for result, _ in run_sweep(config, parse_rates(args.request_rates), args.result_dir):
            print(format_result(result), flush=True)
            results.append(result)
        print(format_sweep(results))
        return 0 if all(r["completed"] for r in results) else 1
    result = benchmark(config)
    print(format_result(result))
    if args.save_result:
        save_result(result, result_path(result, args.result_dir, args.result_filename))
    return 0 if result["completed"] else 1


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The ``ServeConfig`` the serve and sweep arguments describe (imported late: ``plot``
    needs neither aiohttp nor transformers)."""
    from bench.serve import ServeConfig

    return ServeConfig(
        base_url=args.base_url.rstrip("/"),
        endpoint=args.endpoint,
        workload=workload_spec(args),
        model=args.model,
        api_key=args.api_key,
        tokenizer=args.tokenizer,
        num_prompts=args.num_prompts,
        num_warmups=args.num_warmups,
        request_rate=getattr(args, "request_rate", float("inf")),
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        goodput_slos_ms=parse_goodput(args.goodput),
        percentiles=parse_percentiles(args.metric_percentiles),
        ignore_eos=args.ignore_eos,
        extra_body=args.extra_body,
        request_timeout_s=args.request_timeout,
        label=args.label,
        show_progress=not args.disable_tqdm,
    )


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    if args.mix is not None and args.dataset != "mixed":
        raise ValueError("--mix goes with --dataset mixed")
    if args.dataset_path is not None and args.dataset != "sharegpt":
        raise ValueError("--dataset-path goes with --dataset sharegpt")
    output_len = args.output_len if args.output_len is not None else DEFAULT_OUTPUT_LEN
    if args.dataset == "mixed":
        if args.mix is None:
            raise ValueError("--dataset mixed needs --mix, e.g. --mix 1024-2048:32:0.5,128:256:0.5")
        return WorkloadSpec("mixed", parse_mix(args.mix))
    if args.dataset == "random":
        return WorkloadSpec("random", [random_class(args.input_len, output_len, args.range_ratio)])
    if args.dataset == "shared-prefix":
        return WorkloadSpec(
            "shared-prefix",
            [],
            num_prefixes=args.num_prefixes,
            prefix_len=args.prefix_len,
            suffix_len=args.suffix_len,
            output_len=output_len,
        )
    if args.dataset_path is None:
        raise ValueError("--dataset sharegpt needs --dataset-path FILE.json (no downloads)")
    return WorkloadSpec("sharegpt", [], output_len=args.output_len, dataset_path=Path(args.dataset_path))


def parse_percentiles(text: str) -> tuple[float, ...]:
    try:
        percentiles = tuple(float(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise ValueError(f"--metric-percentiles takes numbers like 90,99; got {text!r}") from None
    if not percentiles or not all(0 < p < 100 for p in percentiles):
        raise ValueError(f"--metric-percentiles must be in (0, 100), got {text!r}")
    return percentiles
