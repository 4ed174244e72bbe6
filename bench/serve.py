"""``splitserve bench serve``: send a workload to an OpenAI-compatible server on an
arrival schedule, measure every streamed request, and aggregate.

One run: resolve the model (``GET /v1/models``) and the tokenizer, build the
prompts, send the warm-ups (not measured), then start the clock and send each
request at its arrival offset, at most ``max_concurrency`` in flight (a request
waiting for a slot is sent, and timed, when it gets one). The run lasts until the
last response ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from tqdm import tqdm

from bench.arrivals import arrival_offsets
from bench.client import (
    Endpoint,
    RequestRecord,
    ServedModel,
    auth_headers,
    build_payload,
    fetch_model,
    request_headers,
    send_request,
)
from bench.datasets import SampleRequest, WorkloadSpec, sample_workload
from bench.metrics import DEFAULT_PERCENTILES, RunInfo, compute_metrics, result_json
from bench.prompt_text import is_gguf_file, load_tokenizer
from bench.spec_decode_metrics import over_run, settled_scrape
from launcher.processes import embedded_model

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ServeConfig:
    base_url: str
    endpoint: Endpoint
    workload: WorkloadSpec
    model: str | None = None  # None: the first model the server lists
    api_key: str | None = None
    tokenizer: str | None = None  # None: the model's folder if it is a local one, else the embedded default
    num_prompts: int = 100
    num_warmups: int = 0
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    goodput_slos_ms: dict[str, float] | None = None
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    ignore_eos: bool = True
    extra_body: dict[str, Any] | None = None
    request_timeout_s: float = 3600.0
    label: str | None = None
    show_progress: bool = True


@dataclass(slots=True)
class Target:
    """The served model and the tokenizer prompts are measured with; resolved once per sweep."""

    model_id: str
    tokenizer_id: str
    tokenizer: PreTrainedTokenizerFast


def validate(config: ServeConfig) -> None:
    if config.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {config.num_prompts}")
    if config.num_warmups < 0:
        raise ValueError(f"--num-warmups must be >= 0, got {config.num_warmups}")
    if config.max_concurrency is not None and config.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {config.max_concurrency}")
    if not config.request_timeout_s > 0:
        raise ValueError(f"--request-timeout must be > 0 s, got {config.request_timeout_s}")
    arrival_offsets(0, config.request_rate, config.burstiness)  # validates rate and burstiness


def resolve_target(config: ServeConfig) -> Target:
    """The model to ask for and the tokenizer that measures prompt lengths: ``--tokenizer``,
    else the model id when it is a folder here, else ``root`` in ``/v1/models`` when that is a
    folder or GGUF file here (a server older than the served-name ``root``), else the embedded
    model's file when the server serves it under its name (``splitserve up``'s default)."""
    served = None if config.model is not None and config.tokenizer is not None else asyncio.run(_first_model(config))
    model_id = config.model or served.model_id
    if config.model is None:
        logger.info("benchmarking model %r (the first /v1/models lists)", model_id)
    tokenizer_id = config.tokenizer
    if tokenizer_id is None:
        candidates = [model_id] + (
            [served.root] if served is not None and served.root and served.model_id == model_id else []
        )
        tokenizer_id = next((c for c in candidates if (Path(c) / "tokenizer.json").is_file() or is_gguf_file(c)), None)
        if tokenizer_id is None:
            tokenizer_id = _embedded_model_file(model_id)
        if tokenizer_id is None:
            raise ValueError(
                f"cannot measure prompt lengths: the server's model {model_id!r} is no folder with a tokenizer.json "
                "or .gguf file here; "
                "pass --tokenizer PATH (a local folder, or a Hugging Face name this host can load)"
            )
        logger.info("measuring prompt lengths with %s; pass --tokenizer for another", tokenizer_id)
    return Target(model_id, tokenizer_id, load_tokenizer(tokenizer_id))


def _embedded_model_file(model_id: str) -> str | None:
    """The embedded model's GGUF file (its tokenizer is in it) when ``model_id`` is the name it
    is served under (``splitserve up``'s default), else None. A server names only what it serves
    (``root`` is the served name, not the path it loaded), so a client on the same host finds the
    embedded model the way the launcher does."""
    try:
        path, name = embedded_model("gguf", "auto")
    except ValueError:
        return None
    return str(path) if name == model_id else None


async def _first_model(config: ServeConfig) -> ServedModel:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        return await fetch_model(session, config.base_url.rstrip("/"), auth_headers(config.api_key))


def benchmark(config: ServeConfig, target: Target | None = None) -> dict[str, Any]:
    """Run one benchmark and return its result (vLLM's JSON keys)."""
    validate(config)
    target = target or resolve_target(config)
    warmups, requests = sample_workload(
        config.workload, target.tokenizer, config.num_prompts, config.num_warmups, config.seed
    )
    records, duration_s, spec_decode = asyncio.run(run_requests(config, target.model_id, warmups, requests))
    _count_missing_usage(records, target.tokenizer)
    _check_output_lengths(config, records)
    metrics = compute_metrics(records, duration_s, config.percentiles, config.goodput_slos_ms)
    info = RunInfo(
        date=datetime.now().strftime("%Y%m%d-%H%M%S"),
        backend="openai-chat" if config.endpoint == "/v1/chat/completions" else "openai",
        label=config.label,
        model_id=target.model_id,
        tokenizer_id=target.tokenizer_id,
        num_prompts=config.num_prompts,
        request_rate=config.request_rate,
        burstiness=config.burstiness,
        max_concurrency=config.max_concurrency,
        base_url=config.base_url,
        endpoint=config.endpoint,
        dataset=config.workload.dataset,
        seed=config.seed,
        num_warmups=config.num_warmups,
        goodput_slos_ms=config.goodput_slos_ms or {},
    )
    result = result_json(info, records, metrics, duration_s)
    result["spec_decode"] = spec_decode
    return result


async def run_requests(
    config: ServeConfig, model_id: str, warmups: list[SampleRequest], requests: list[SampleRequest]
) -> tuple[list[RequestRecord], float, dict[str, Any] | None]:
    """Send the warm-ups, then the measured requests on schedule; (records in send order,
    seconds, the server's speculative decoding over the measured requests if it reports any:
    bench/spec_decode_metrics.py)."""
    url = config.base_url.rstrip("/") + config.endpoint
    headers = request_headers(config.api_key)
    # aiohttp's default pool caps connections at 100, which would silently throttle a
    # high-rate run: allow as many as the benchmark lets be in flight.
    connector = aiohttp.TCPConnector(limit=config.max_concurrency or 0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    slots = asyncio.Semaphore(config.max_concurrency or len(requests) + len(warmups) or 1)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def send(request: SampleRequest, not_before: float, run_started_at: float) -> RequestRecord:
            delay = not_before - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            payload = build_payload(config.endpoint, model_id, request, config.ignore_eos, config.extra_body)
            record = RequestRecord(
                prompt_len=request.prompt_len, output_len=request.output_len, workload=request.workload
            )
            async with slots:
                return await send_request(session, url, headers, payload, record, run_started_at)

        if warmups:
            started = time.perf_counter()
            warm = await asyncio.gather(*(send(request, started, started) for request in warmups))
            failed = [r for r in warm if not r.success]
            logger.info("warm-up: %d requests, %d failed", len(warm), len(failed))
            if failed:
                logger.warning("a warm-up request failed: %s", failed[0].error)

        base_url = config.base_url.rstrip("/")
        spec_before = await settled_scrape(session, base_url, auth_headers(config.api_key))
        offsets = arrival_offsets(len(requests), config.request_rate, config.burstiness, config.seed)
        with tqdm(total=len(requests), desc="bench serve", unit="req", disable=not config.show_progress) as bar:

            async def timed(request: SampleRequest, offset: float, started: float) -> RequestRecord:
                record = await send(request, started + offset, started)
                bar.update(1)
                return record

            started = time.perf_counter()
            records = await asyncio.gather(*(timed(r, offset, started) for r, offset in zip(requests, offsets)))
            duration_s = time.perf_counter() - started
        spec_after = await settled_scrape(session, base_url, auth_headers(config.api_key))
    return list(records), duration_s, over_run(spec_before, spec_after)


def _count_missing_usage(records: list[RequestRecord], tokenizer: PreTrainedTokenizerFast) -> None:
    """Servers that send no usage chunk: count output tokens by re-tokenizing the text."""
    missing = [r for r in records if r.success and r.output_tokens is None]
    if missing:
        logger.warning("%d responses had no usage chunk; counting their output tokens with the tokenizer", len(missing))
    for record in missing:
        record.output_tokens = len(tokenizer.encode(record.generated_text, add_special_tokens=False))


def _check_output_lengths(config: ServeConfig, records: list[RequestRecord]) -> None:
    if not config.ignore_eos:
        return
    short = [r for r in records if r.success and r.output_tokens != r.output_len]
    if short:
        logger.warning(
            "%d of %d responses did not have max_tokens output tokens (e.g. %s for %d): "
            "the server may not honour ignore_eos, so per-token figures mix lengths",
            len(short),
            len(records),
            short[0].output_tokens,
            short[0].output_len,
        )


def result_path(result: dict[str, Any], result_dir: str | Path, filename: str | None) -> Path:
    """``{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json`` (vLLM's pattern) unless named."""
    if filename is None:
        label = result["label"] or result["backend"]
        concurrency = f"-concurrency{result['max_concurrency']}" if result["max_concurrency"] else ""
        model = Path(str(result["model_id"])).name or "model"
        filename = f"{label}-{result['request_rate']}qps{concurrency}-{model}-{result['date']}.json"
    return Path(result_dir) / filename


def save_result(result: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, allow_nan=False) + "\n", encoding="utf-8")
    logger.info("result written to %s", path)
    return path
