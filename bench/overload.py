"""Chatty streams beside long prompts, measured from the client side.

A server serves two independent load generators at once: chatty requests (128 prompt
tokens -> 128 output tokens, Poisson) and long prompts (2048 -> 16 by default) that
together ask more prefill than one core can do. Before that, the chatty stream runs
alone on the same server for the baseline (and, with ``--single-stream N``, N requests
one after another). Then the server's logs say what the hand-off did: pulls cut off,
failed ReleaseKV calls, lease expiries, prompts recomputed or prefilled again on
decode, preemptions::

    python -m bench.overload --output-dir results/overload --label after
    python -m bench.overload --output-dir results/overload --label before --source-dir ../before
    python -m bench.overload --output-dir results/overload --label after-admission --max-queue-delay 20
    python -m bench.overload --output-dir results/overload --label gaps --skip-alone --explain-slow-tokens

The server is ``splitserve up`` with prefill pinned to one core and decode to the other
(``--server pd``), ``splitserve up --colocated`` (``colocated``), vLLM's OpenAI server
from another Python environment (``vllm --vllm-python VENV/bin/python``), or llama.cpp's
``llama-server`` (``llama --llama-server PATH``: ``--llama-threads`` threads, ``--llama-slots``
slots batched continuously), each on the same model (the embedded one by default; ``--model``
a folder or a GGUF file, which llama-server needs) and dtype, so they compare in one run::

    python -m bench.overload --server llama --llama-server build/bin/llama-server \
        --model SmolLM2-135M-Instruct.Q4_1.gguf --output-dir results/llama --label llama-q4_1
``--source-dir`` serves splitserve from another checkout (``git worktree add``), so that
two commits are measured side by side. ``--explain-slow-tokens`` traces every request to a
receiver in this process and files each token gap over 200 ms under what the decode step
that ended it held (``bench/slow_tokens.py``). Figures are latencies: run it on a quiet machine.
The client shares the host's cores with the server, so each phase's summary sets splitserve's
own token gaps (``server_*``: when its gateway wrote each chunk, bench/token_gaps.py) beside
the client's, and says whether the client lagged behind them (``client_lagged``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import IO, Any

import numpy as np

from bench import slow_tokens
from bench.splitserve_up import start_up, wait_ready
from engine_args.flags import add_dtype_argument, add_model_argument, add_quant_activations_argument
from launcher.processes import embedded_model, free_port, splitserve_command

# What the server logs when the hand-off goes wrong (the wording of both commits measured).
LOG_EVENTS = {
    "pulls cut off": r"pull of \S+ cut off",
    "failed ReleaseKV calls": r"ReleaseKV (of \S+ )?(to|on) \S+ failed",
    "lease expiries": r"KV lease of \S+ expired",
    "recomputes on decode": r"KV pull for \S+ failed, recomputing",
    "hand-backs to prefill": r"handing it back for another prefill",
    "preemptions": r"preempted \S+",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--label", default="run")
    parser.add_argument("--source-dir", type=Path, default=None, help="serve from this checkout")
    parser.add_argument("--chatty-rate", type=float, default=1.0)
    parser.add_argument("--long-rate", type=float, default=0.25)
    parser.add_argument("--num-chatty", type=int, default=60, help="chatty requests per phase")
    parser.add_argument("--long-input-len", type=int, default=2048)
    parser.add_argument("--prefill-cpus", default="0")
    parser.add_argument("--decode-cpus", default="1")
    add_dtype_argument(parser, default="float32")
    parser.add_argument("--max-queue-delay", type=float, default=None, help="gateway admission control (seconds)")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="splitserve: the engines' step token budget"
    )
    parser.add_argument(
        "--long-prefill-token-threshold", default=None, help="splitserve: one request's prompt tokens a step (N|auto|0)"
    )
    parser.add_argument("--skip-alone", action="store_true", help="no chatty-alone baseline")
    parser.add_argument(
        "--single-stream", type=int, default=0, metavar="N", help="first, N chatty requests one at a time"
    )
    parser.add_argument(
        "--otlp-traces-endpoint", default=None, help="splitserve: trace every request to this OTLP/gRPC collector"
    )
    parser.add_argument(
        "--explain-slow-tokens",
        action="store_true",
        help="splitserve: trace to a receiver in this process and say what each token gap over 200 ms held",
    )
    add_model_argument(parser)
    add_quant_activations_argument(parser, default=None)
    parser.add_argument("--server", choices=["pd", "colocated", "vllm", "llama"], default="pd")
    parser.add_argument("--vllm-python", default=None, help="the Python of an environment with vLLM (--server vllm)")
    parser.add_argument("--vllm-cpus", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    parser.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary (--server llama)")
    parser.add_argument("--llama-threads", type=int, default=2, help="llama-server --threads")
    parser.add_argument("--llama-slots", type=int, default=8, help="llama-server --parallel")
    args = parser.parse_args(argv)
    args.model = Path(args.model) if args.model is not None else None  # a folder or a .gguf file
    return args


def start_server(args: argparse.Namespace, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    log = open(log_path, "w")  # noqa: SIM115 - the child holds it; closed with the process
    if args.server == "vllm":
        return start_vllm(args, port, log)
    if args.server == "llama":
        return start_llama(args, port, log)
    if args.server == "colocated":
        flags = ["--colocated"]
    else:
        flags = ["--prefill-cpus", args.prefill_cpus, "--decode-cpus", args.decode_cpus]
    if args.max_queue_delay is not None:
        flags += ["--max-queue-delay", str(args.max_queue_delay)]
    if args.max_num_batched_tokens is not None:
        flags += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.long_prefill_token_threshold is not None:
        flags += ["--long-prefill-token-threshold", args.long_prefill_token_threshold]
    if args.otlp_traces_endpoint is not None:
        flags += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    if args.model is not None:
        flags += ["--model", str(args.model)]
    if args.quant_activations is not None:
        flags += ["--quant-activations", args.quant_activations]
    # INFO: the server log is parsed afterwards for cut-off pulls, failed releases and the like.
    return start_up(port, args.dtype, flags, log, log_level="INFO", source_dir=args.source_dir)


def start_vllm(args: argparse.Namespace, port: int, log: IO[str]) -> subprocess.Popen[bytes]:
    """vLLM's CPU server on the embedded model's converted folder, as its docs run it."""
    if args.vllm_python is None:
        raise ValueError("--server vllm needs --vllm-python (an environment with vllm-cpu installed)")
    command = [
        args.vllm_python,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(args.model or embedded_model("safetensors", args.dtype)[0]),
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--served-model-name",
        "SmolLM2-135M-Instruct",
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": args.vllm_cpus}
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def start_llama(args: argparse.Namespace, port: int, log: IO[str]) -> subprocess.Popen[bytes]:
    """llama.cpp's server on a GGUF file: every slot with room for the long prompts and their
    output, batched continuously, under the embedded model's name."""
    if args.llama_server is None or args.model is None or args.model.suffix != ".gguf":
        raise ValueError("--server llama needs --llama-server (its binary) and --model FILE.gguf")
    slot_tokens = args.long_input_len + 128 + 256  # the longest request, and room for its tokenization
    command = [
        args.llama_server,
        "--model",
        str(args.model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--threads",
        str(args.llama_threads),
        "--threads-batch",
        str(args.llama_threads),
        "--parallel",
        str(args.llama_slots),
        "--ctx-size",
        str(slot_tokens * args.llama_slots),
        "--cont-batching",
        "--alias",
        "SmolLM2-135M-Instruct",
    ]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def bench_command(
    url: str,
    args: argparse.Namespace,
    name: str,
    input_len: int,
    output_len: int,
    rate: float,
    num: int,
    seed: int,
    max_concurrency: int | None = None,
) -> list[str]:
    concurrency = ["--max-concurrency", str(max_concurrency)] if max_concurrency else []
    # Prompt lengths are measured with the model folder's tokenizer, else the embedded model's (its GGUF file's too).
    embedded = args.model is None or not args.model.is_dir()
    tokenizer = embedded_model("safetensors", args.dtype)[0] if embedded else args.model
    return splitserve_command(
        "bench",
        "serve",
        "--base-url",
        url,
        "--tokenizer",
        str(tokenizer),
        "--dataset",
        "random",
        *concurrency,
        "--input-len",
        str(input_len),
        "--output-len",
        str(output_len),
        "--request-rate",
        str(rate),
        "--num-prompts",
        str(num),
        "--num-warmups",
        "0",
        "--seed",
        str(seed),
        "--label",
        f"{args.label}-{name}",
        "--metric-percentiles",
        "50,99,99.9",
        "--save-result",
        "--result-dir",
        str(args.output_dir),
        "--result-filename",
        f"{args.label}-{name}.json",
        "--disable-tqdm",
        "--request-timeout",
        "900",
    )


def gap_figures(itls: list[list[float]]) -> dict[str, Any]:
    """Token-gap figures (ms) of the streams' gaps (seconds): percentiles, gaps over 200 ms, and
    where long gaps sit: the first gap of a stream spans the hand-off (the first token comes
    from prefill, the second from decode after the KV pull); later ones are decode steps."""
    gaps_ms = np.array([gap * 1000 for itl in itls for gap in itl])
    if not gaps_ms.size:
        return {}
    row: dict[str, Any] = {
        f"itl_{name}_ms": float(np.percentile(gaps_ms, p)) for name, p in (("p50", 50), ("p99", 99), ("p99.9", 99.9))
    }
    row.update(itl_max_ms=float(gaps_ms.max()), gaps_over_200ms=int((gaps_ms > 200).sum()), num_gaps=int(gaps_ms.size))
    first_ms = np.array([itl[0] * 1000 for itl in itls if itl])
    later_ms = np.array([gap * 1000 for itl in itls for gap in itl[1:]])
    row.update(handoff_gap_p50_ms=float(np.percentile(first_ms, 50)), handoff_gap_max_ms=float(first_ms.max()))
    if later_ms.size:
        row.update(
            decode_gap_p99_ms=float(np.percentile(later_ms, 99)),
            decode_gap_max_ms=float(later_ms.max()),
            decode_gaps_over_200ms=int((later_ms > 200).sum()),
        )
    return row


def summarize(path: Path) -> dict[str, Any]:
    result = json.loads(path.read_text())
    ok = [not error for error in result["errors"]]
    ttfts_ms = np.array([t * 1000 for t, good in zip(result["ttfts"], ok) if good])
    rejected = sum(1 for error in result["errors"] if error.startswith("HTTP 429"))
    row: dict[str, Any] = {
        "completed": result["completed"],
        "failed": result["failed"],
        "rejected_429": rejected,
        "tpot_p50_ms": result["median_tpot_ms"],
    }
    row.update(gap_figures(result["itls"]))
    # The same figures from when splitserve's gateway wrote each chunk (bench/token_gaps.py), and
    # whether the client lagged behind it: then the client-side figures above measure the client.
    gaps = result.get("token_gaps")
    if gaps:
        server_itls = [itl for itl in result.get("server_itls", []) if itl is not None]
        row.update({f"server_{name}": value for name, value in gap_figures(server_itls).items()})
        row.update(client_lagged=gaps["client_lagged"], client_lagged_at=gaps["lagged_at"])
    if ttfts_ms.size:
        row.update(
            ttft_p50_ms=float(np.percentile(ttfts_ms, 50)),
            ttft_p99_ms=float(np.percentile(ttfts_ms, 99)),
            ttft_max_ms=float(ttfts_ms.max()),
        )
    # splitserve's account of where TTFT went at its percentiles (x-splitserve-timing).
    if result.get("ttft_phase_breakdown_ms"):
        row["ttft_phases_ms"] = {
            key: {phase: round(ms, 1) for phase, ms in phases.items()}
            for key, phases in result["ttft_phase_breakdown_ms"].items()
        }
    return row


def log_events(log_path: Path) -> dict[str, int]:
    text = log_path.read_text(errors="replace")
    return {name: len(re.findall(pattern, text)) for name, pattern in LOG_EVENTS.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    if not args.explain_slow_tokens:
        return run(args)
    with slow_tokens.receiving() as (receiver, endpoint):
        args.otlp_traces_endpoint = endpoint
        returncode = run(args)  # the server has exported its spans when it exits
    gaps = slow_tokens.summarize(receiver.slow_tokens)
    (args.output_dir / f"{args.label}-slow-tokens.json").write_text(json.dumps(gaps, indent=2))
    print(f"{receiver.num_spans} spans received\n{slow_tokens.table(gaps)}")
    return returncode


def run(args: argparse.Namespace) -> int:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = args.output_dir / f"{args.label}-server.log"
    server = start_server(args, port, log_path)
    summary: dict[str, object] = {
        "label": args.label,
        "source": str(args.source_dir or "."),
        "max_queue_delay": args.max_queue_delay,
    }
    num_long = max(1, round(args.num_chatty * args.long_rate / args.chatty_rate))
    try:
        wait_ready(url, server, "/health" if args.server in ("vllm", "llama") else "/ready")
        if args.single_stream:
            subprocess.run(
                bench_command(
                    url, args, "single", 128, 128, float("inf"), args.single_stream, seed=4, max_concurrency=1
                ),
                check=True,
            )
        if not args.skip_alone:
            subprocess.run(
                bench_command(url, args, "chatty-alone", 128, 128, args.chatty_rate, args.num_chatty, seed=1),
                check=True,
            )
        # The two generators run at once, on their own arrival processes.
        loads = [
            subprocess.Popen(bench_command(url, args, "chatty", 128, 128, args.chatty_rate, args.num_chatty, seed=2)),
            subprocess.Popen(
                bench_command(url, args, "long", args.long_input_len, 16, args.long_rate, num_long, seed=3)
            ),
        ]
        for load in loads:
            if load.wait() != 0:
                raise RuntimeError("a load generator failed")
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
                (args.output_dir / f"{args.label}-metrics.txt").write_bytes(response.read())
        except OSError:
            pass
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=180)
    for name in ("single", "chatty-alone", "chatty", "long"):
        path = args.output_dir / f"{args.label}-{name}.json"
        if path.exists():
            summary[name] = summarize(path)
    summary["server_log"] = log_events(log_path)
    (args.output_dir / f"{args.label}-summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
