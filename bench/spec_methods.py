"""Every speculative decoding method served as users serve it, side by side in one run (issue
40): colocated and disaggregated (P/D), one chat stream and several at once, ms per output token
and the mean accepted length, each beside no speculation in the same deployment and concurrency::

    python -m bench.spec_methods --output-dir /tmp/spec-methods \\
        --method none \\
        --method ngram:'{"method": "ngram", "num_speculative_tokens": 3}' \\
        --method medusa:'{"method": "medusa", "model": "/tmp/heads/smollm2-medusa", "num_speculative_tokens": 1}' \\
        --method eagle3:'{"method": "eagle3", "model": "/tmp/heads/smollm2-eagle3", "num_speculative_tokens": 2}' \\
        --deployments colocated,pd --concurrency 1,8 --output-len 128

``--method LABEL[:JSON]``: ``none`` serves without speculation; any other label passes its JSON
to ``splitserve up --speculative-config``. For each deployment (``colocated``: ``splitserve up
--colocated``; ``pd``: up's default, one prefill and one decode instance, each on half of the
CPUs with ``--pin``), and in it each method, ``none`` first:

1. start ``splitserve up`` (bench/splitserve_up.py) with the method's flags and wait until ready;
2. send one chat request of ``--output-len`` tokens, not measured, so that no measured request
   pays for the server's first steps;
3. for each concurrency C: ``splitserve bench serve`` on ``/v1/chat/completions``, C streams,
   C x ``--rounds`` greedy requests of ``--output-len`` tokens (EOS ignored), the chat questions
   of a ShareGPT file this module writes (each asked equally often when C x ``--rounds`` is a
   multiple of their number: always, by default);
4. stop the server (SIGINT, its process group killed past a bound) before the next starts.

Per run it keeps mean and median TPOT (ms per output token after the first), mean ITL, median
TTFT and output tokens/s from the result JSON, and from the server's own speculative-decoding
counts over the run (the result's ``spec_decode``: bench/spec_decode_metrics.py) the acceptance
rate per draft position and the mean accepted length: tokens a verification step yields,
accepted drafts + 1. It writes every run's figures to
``results.json`` and prints the CPU (``lscpu``) and a markdown table: a row per method, per
deployment and concurrency "mean TPOT ms (ratio to none), mean accepted length".

The configurations run one after another, not interleaved: whatever else loads the machine
lands on some of them and not on others, so the bench must run alone on the host. Figures and
their dates go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, cast, get_args

from bench.routing import cpu_line
from bench.splitserve_up import start_up, wait_ready
from engine_args.flags import add_dtype_argument
from launcher.processes import UP_STOP_TIMEOUT_S, free_port, splitserve_command

Deployment = Literal["colocated", "pd"]
NO_SPECULATION = "none"

# docs/benchmarks.md's issue-40 questions (two of the package's shipped chat questions, which the
# trained drafts saw, and two they did not), then four more that none of them saw.
DEFAULT_QUESTIONS = (
    "What is the difference between a list and a tuple in Python?",
    "How do I reverse a string in JavaScript?",
    "Explain how a hash table works, then show a short Python example that counts words with one.",
    "What are the main causes of inflation?",
    "What is the difference between a process and a thread?",
    "How does a refrigerator keep food cold?",
    "What are some tips for writing a clear cover letter?",
    "Write a Python function that removes duplicate items from a list while keeping their order.",
)


@dataclass(frozen=True, slots=True)
class Method:
    label: str
    speculative_config: str | None  # JSON for --speculative-config; None: no speculation

    @property
    def up_flags(self) -> list[str]:
        return [] if self.speculative_config is None else ["--speculative-config", self.speculative_config]


def parse_method(text: str) -> Method:
    """``none``, or ``LABEL:JSON`` with JSON a speculative config object."""
    label, colon, config_text = text.partition(":")
    label = label.strip()
    if not re.fullmatch(r"[\w.-]+", label):  # it names result files
        raise ValueError(f"--method needs a label of letters, digits, '_', '-' or '.', LABEL[:JSON]; got {text!r}")
    if label == NO_SPECULATION:
        if colon:
            raise ValueError(f"--method {NO_SPECULATION} serves without speculation and takes no config; got {text!r}")
        return Method(label, None)
    if not colon:
        raise ValueError(
            f"--method {label} needs its speculative config, e.g. "
            f'{label}:\'{{"method": "ngram", "num_speculative_tokens": 3}}\' (or the label {NO_SPECULATION})'
        )
    try:
        config = json.loads(config_text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--method {label}: its config is not JSON ({error}): {config_text!r}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--method {label}: the config must be a JSON object, got {config_text!r}")
    return Method(label, json.dumps(config))


def sweep_order(methods: Sequence[Method]) -> list[Method]:
    """The methods as given, with no speculation first: a deployment's baseline runs before the
    methods compared with it. Labels name result files and table rows, so they must differ."""
    labels = [m.label for m in methods]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(f"--method labels must differ; repeated: {', '.join(repeated)}")
    return sorted(methods, key=lambda m: m.label != NO_SPECULATION)


def parse_deployments(text: str) -> list[Deployment]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in get_args(Deployment)]
    if not names or unknown:
        raise ValueError(f"--deployments takes a comma-separated subset of colocated,pd; got {text!r}")
    return [cast(Deployment, name) for name in dict.fromkeys(names)]


def parse_concurrencies(text: str) -> list[int]:
    try:
        values = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise ValueError(f"--concurrency takes stream counts like 1,8; got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--concurrency takes stream counts >= 1, like 1,8; got {text!r}")
    return list(dict.fromkeys(values))


def write_sharegpt(path: Path, questions: Sequence[str], num_conversations: int) -> Path:
    """``num_conversations`` ShareGPT conversations cycling through ``questions``: bench serve
    draws each conversation once, so a run of N requests needs N of them. The recorded answer
    is empty: ``--output-len`` sets every request's length."""
    if not questions:
        raise ValueError("no chat questions to ask; pass --question TEXT")
    conversations = [
        {
            "id": f"question{index % len(questions)}-{index // len(questions)}",
            "conversations": [
                {"from": "human", "value": questions[index % len(questions)]},
                {"from": "gpt", "value": ""},
            ],
        }
        for index in range(num_conversations)
    ]
    path.write_text(json.dumps(conversations, indent=1) + "\n", encoding="utf-8")
    return path


@dataclass(slots=True)
class RunFigures:
    """One deployment x method x concurrency run: its bench serve result and the server's counts."""

    deployment: str
    method: str
    concurrency: int
    completed: int
    failed: int
    mean_tpot_ms: float | None
    median_tpot_ms: float | None
    mean_itl_ms: float | None
    median_ttft_ms: float | None
    output_throughput: float
    # Tokens a verification step yields (accepted drafts + 1); None where the server drafted nothing.
    mean_accepted_length: float | None
    acceptance_rate_per_position: list[float | None] | None


def run_figures(
    deployment: str, method: str, concurrency: int, result: dict[str, Any], spec: dict[str, Any] | None
) -> RunFigures:
    """From a bench serve result JSON and the run's speculative decoding (``over_run``'s figures,
    the shape of the result's ``spec_decode``; None where nothing was drafted)."""
    accepted_drafts = spec["mean_accepted_length"] if spec else None
    return RunFigures(
        deployment=deployment,
        method=method,
        concurrency=concurrency,
        completed=result["completed"],
        failed=result["failed"],
        mean_tpot_ms=result["mean_tpot_ms"],
        median_tpot_ms=result["median_tpot_ms"],
        mean_itl_ms=result["mean_itl_ms"],
        median_ttft_ms=result["median_ttft_ms"],
        output_throughput=result["output_throughput"],
        mean_accepted_length=accepted_drafts + 1 if accepted_drafts is not None else None,
        acceptance_rate_per_position=spec["acceptance_rate_per_position"] if spec else None,
    )


def streams(count: int) -> str:
    return f"{count} stream{'s' if count > 1 else ''}"


def _columns(runs: Sequence[RunFigures]) -> list[tuple[str, int]]:
    return list(dict.fromkeys((run.deployment, run.concurrency) for run in runs))


def _header(first: str, columns: list[tuple[str, int]]) -> list[str]:
    names = [f"{deployment}, {streams(count)}" for deployment, count in columns]
    return [f"| {first} | " + " | ".join(names) + " |", "|---" * (len(columns) + 1) + "|"]


def markdown_table(runs: Sequence[RunFigures]) -> str:
    """A row per method (in run order), a column per deployment and concurrency; each cell:
    mean TPOT in ms, its ratio to no speculation's in the same column (under 1: faster), and
    the mean accepted length (tokens per verification step; '-' where nothing was drafted)."""
    columns = _columns(runs)
    by_key = {(run.method, run.deployment, run.concurrency): run for run in runs}

    def cell(run: RunFigures | None) -> str:
        if run is None:
            return "not run"
        if run.mean_tpot_ms is None:
            return f"no TPOT ({run.failed} failed)"
        baseline = by_key.get((NO_SPECULATION, run.deployment, run.concurrency))
        ratio = (
            f" ({run.mean_tpot_ms / baseline.mean_tpot_ms:.2f}x)"
            if baseline is not None and baseline.mean_tpot_ms
            else ""
        )
        accepted = f"{run.mean_accepted_length:.2f}" if run.mean_accepted_length is not None else "-"
        failed = f", {run.failed} failed" if run.failed else ""
        return f"{run.mean_tpot_ms:.1f}{ratio}, {accepted}{failed}"

    methods = list(dict.fromkeys(run.method for run in runs))
    rows = [
        f"| {method} | " + " | ".join(cell(by_key.get((method, *column))) for column in columns) + " |"
        for method in methods
    ]
    return "\n".join([*_header("method: mean TPOT ms (x none), mean accepted length", columns), *rows])


def acceptance_table(runs: Sequence[RunFigures]) -> str:
    """The drafts accepted at each position, per method that drafted, in the same columns."""
    columns = _columns(runs)
    by_key = {(run.method, run.deployment, run.concurrency): run for run in runs}
    methods = [m for m in dict.fromkeys(run.method for run in runs) if m != NO_SPECULATION]

    def cell(run: RunFigures | None) -> str:
        if run is None or run.acceptance_rate_per_position is None:
            return "-"
        return ", ".join("-" if rate is None else f"{rate:.0%}" for rate in run.acceptance_rate_per_position)

    rows = [
        f"| {method} | " + " | ".join(cell(by_key.get((method, *column))) for column in columns) + " |"
        for method in methods
    ]
    return "\n".join([*_header("method: drafts accepted by position", columns), *rows])


def summary_line(run: RunFigures) -> str:
    accepted = "-" if run.mean_accepted_length is None else f"{run.mean_accepted_length:.2f}"
    tpot = "-" if run.mean_tpot_ms is None else f"{run.mean_tpot_ms:.1f}"
    return f"{run.completed} done, {run.failed} failed, mean TPOT {tpot} ms, mean accepted length {accepted}"


def pd_cpu_flags(cpus: set[int]) -> list[str]:
    """The prefill instance on the first half of ``cpus``, the decode instance on the rest
    ('0' and '1' on two cores); none with one CPU."""
    ordered = sorted(cpus)
    half = len(ordered) // 2
    if half == 0:
        return []
    return [
        "--prefill-cpus",
        ",".join(map(str, ordered[:half])),
        "--decode-cpus",
        ",".join(map(str, ordered[half:])),
    ]


def up_flags(deployment: Deployment, method: Method, args: argparse.Namespace) -> list[str]:
    flags = ["--model", args.model] if args.model else []
    if deployment == "colocated":
        flags.append("--colocated")
    elif args.pin:
        flags += pd_cpu_flags(os.sched_getaffinity(0))
    return [*flags, *shlex.split(args.up_flags), *method.up_flags]


def stop_server(server: subprocess.Popen[bytes]) -> None:
    """SIGINT, as a user stops up; its whole process group killed if it has not exited in time."""
    if server.poll() is None:
        server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout=UP_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"splitserve up did not stop in {UP_STOP_TIMEOUT_S:.0f} s; killing its process group", flush=True)
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)


def warm_up(url: str, question: str, output_len: int) -> None:
    """One greedy chat request of ``output_len`` tokens, not measured."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
        model = json.load(response)["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        response.read()


def bench_serve(url: str, dataset: Path, concurrency: int, result_path: Path, args: argparse.Namespace) -> None:
    """``splitserve bench serve``: ``concurrency`` greedy chat streams, ``--rounds`` requests each."""
    options = {
        "--base-url": url,
        "--endpoint": "/v1/chat/completions",
        "--dataset": "sharegpt",
        "--dataset-path": str(dataset),
        "--max-concurrency": str(concurrency),
        "--request-rate": "inf",
        "--num-prompts": str(concurrency * args.rounds),
        "--output-len": str(args.output_len),
        "--extra-body": json.dumps({"temperature": 0}),
        "--label": result_path.stem,
        "--result-dir": str(result_path.parent),
        "--result-filename": result_path.name,
    }
    flags = [item for pair in options.items() for item in pair]
    command = splitserve_command("bench", "serve", *flags, "--ignore-eos", "--save-result", "--disable-tqdm")
    log_path = result_path.with_suffix(".log")
    with log_path.open("w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)
    if not result_path.is_file():
        raise RuntimeError(f"bench serve wrote no result; see {log_path}")


def run_deployment(
    deployment: Deployment, method: Method, args: argparse.Namespace, datasets: dict[int, Path]
) -> list[RunFigures]:
    """Serve ``method`` in ``deployment`` and measure it at each concurrency."""
    folder = args.output_dir / deployment
    folder.mkdir(parents=True, exist_ok=True)
    flags = up_flags(deployment, method, args)
    print(f"[{deployment} {method.label}] splitserve up --dtype {args.dtype} {shlex.join(flags)}", flush=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    runs = []
    with (folder / f"{method.label}-server.log").open("w") as log:
        server = start_up(port, args.dtype, flags, log, new_session=True)
        try:
            wait_ready(url, server)
            warm_up(url, args.questions[0], args.output_len)
            for concurrency in args.concurrency:
                result_path = folder / f"{method.label}-c{concurrency}.json"
                bench_serve(url, datasets[concurrency], concurrency, result_path, args)
                result = json.loads(result_path.read_text())
                runs.append(run_figures(deployment, method.label, concurrency, result, result.get("spec_decode")))
                print(f"[{deployment} {method.label}] {streams(concurrency)}: {summary_line(runs[-1])}", flush=True)
        finally:
            stop_server(server)
    return runs


T = TypeVar("T")


def _argument(parse: Callable[[str], T]) -> Callable[[str], T]:
    """``parse`` for argparse, whose usage error then says what the ValueError says."""

    def checked(text: str) -> T:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return checked


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument(
        "--method",
        dest="methods",
        type=_argument(parse_method),
        action="append",
        required=True,
        metavar="LABEL[:JSON]",
        help=f"repeat: {NO_SPECULATION}, or a label and its --speculative-config JSON",
    )
    parser.add_argument(
        "--deployments", type=_argument(parse_deployments), default=["colocated", "pd"], help="colocated,pd"
    )
    parser.add_argument(
        "--concurrency", type=_argument(parse_concurrencies), default=[1, 8], help="chat streams, e.g. 1,8"
    )
    parser.add_argument("--output-len", type=int, default=128, help="tokens each answer (EOS ignored)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="requests per stream (default: one per question, so one stream asks each once)",
    )
    parser.add_argument(
        "--question",
        dest="questions",
        action="append",
        default=None,
        help="a chat question to ask (repeat; replaces the default eight)",
    )
    parser.add_argument("--model", default=None, help="served model (default: up's, the embedded one)")
    parser.add_argument("--pin", action="store_true", help="pd: prefill on the first half of the CPUs, decode the rest")
    parser.add_argument("--up-flags", default="", help="more splitserve up flags for every server, one string")
    add_dtype_argument(parser, default="float32")
    args = parser.parse_args(argv)
    args.questions = args.questions or list(DEFAULT_QUESTIONS)
    args.rounds = args.rounds if args.rounds is not None else len(args.questions)
    if args.rounds < 1 or args.output_len < 1:
        parser.error("--rounds and --output-len must be >= 1")
    try:
        args.methods = sweep_order(args.methods)
    except ValueError as error:
        parser.error(str(error))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command_line = sys.argv[1:] if argv is None else argv
    args.output_dir.mkdir(parents=True, exist_ok=True)
    cpu = cpu_line()
    print(cpu, flush=True)
    datasets = {
        concurrency: write_sharegpt(
            args.output_dir / f"questions-{concurrency * args.rounds}.json", args.questions, concurrency * args.rounds
        )
        for concurrency in args.concurrency
    }
    runs: list[RunFigures] = []
    for deployment in args.deployments:
        for method in args.methods:
            runs += run_deployment(deployment, method, args, datasets)
            (args.output_dir / "results.json").write_text(
                json.dumps({"cpu": cpu, "argv": command_line, "runs": [asdict(run) for run in runs]}, indent=1) + "\n"
            )
    tables = f"{cpu}\n\n{markdown_table(runs)}\n\n{acceptance_table(runs)}\n"
    (args.output_dir / "summary.md").write_text(tables)
    print(tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
