"""Timed KV pulls between real ``splitserve prefill`` and ``splitserve decode`` processes on
loopback over UCX, for the benchmarks that compare pulls across settings (tensor-parallel
pairs: ``microbench.tensor_parallel_pulls``; KV dtypes: ``microbench.kv_cache_dtype``).

Each repeat prefills a fresh random prompt (no prefix-cache hit on D) and decodes two tokens
from its handle; the figures are D's own account of the pull (``KVTransfer.seconds``: the KV
loader's pull, every rank's at once, and ``num_bytes``), median and best of the repeats after
one untimed warm-up.
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from launcher.processes import free_port, splitserve_command
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc, generation_pb2

_ENV = {"UCX_TLS": "tcp,sm,self", "UCX_RNDV_SCHEME": "put_zcopy", "UCX_WARN_UNUSED_ENV_VARS": "n"}
_START_TIMEOUT_S = 600.0
_CALL_TIMEOUT_S = 600.0
_TOKEN_ID_MARGIN = 100  # random ids keep clear of the special tokens at both ends of the vocabulary


@dataclass(frozen=True, slots=True)
class PullFigures:
    pull_ms_median: float
    pull_ms_min: float
    num_bytes: float  # median
    num_blocks: int
    fingerprint_dtype: str  # the KV format, as the handle's fingerprint names it
    prefill_shape: tuple[int, int]  # (tensor parallel size, stages), as the handle's fingerprint names it


@contextmanager
def instances(roles: list[tuple[str, list[str]]], log_dir: Path) -> Iterator[list[grpc.Channel]]:
    """A ``splitserve`` instance of each (role, flags) on a free loopback port, all started at
    once (their start-ups overlap), serving until the block ends; their logs in ``log_dir``."""
    with ExitStack() as stack:
        started = [stack.enter_context(_process(role, flags, log_dir)) for role, flags in roles]
        for (role, _), (process, channel, log_name) in zip(roles, started, strict=True):
            _wait_until_serving(role, process, channel, log_name)
        yield [channel for _, channel, _ in started]


@contextmanager
def _process(role: str, flags: list[str], log_dir: Path) -> Iterator[tuple[subprocess.Popen, grpc.Channel, str]]:
    port = free_port()
    command = splitserve_command(role, "--port", str(port), *flags)
    with (log_dir / f"{role}-{port}.log").open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **_ENV})
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        try:
            yield process, channel, log.name
        finally:
            channel.close()
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_until_serving(role: str, process: subprocess.Popen, channel: grpc.Channel, log_name: str) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + _START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{role} exited with {process.returncode}; see {log_name}")
        try:
            serving = health_pb2.HealthCheckResponse.SERVING
            if health.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == serving:
                return
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def measure_pulls(
    prefill_flags: list[str],
    decode_flags: list[str],
    input_len: int,
    repeats: int,
    seed: int,
    log_dir: Path,
    vocab_size: int = 49152,
) -> PullFigures:
    """Start a prefill and a decode instance, time ``repeats`` pulls of ``input_len``-token prompts."""
    rng = random.Random(seed)
    greedy = generation_pb2.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    seconds: list[float] = []
    num_bytes: list[int] = []
    with instances([("prefill", prefill_flags), ("decode", decode_flags)], log_dir) as (prefill, decode):
        for repeat in range(repeats + 1):  # the first warms both sides up, untimed
            prompt = [rng.randrange(_TOKEN_ID_MARGIN, vocab_size - _TOKEN_ID_MARGIN) for _ in range(input_len)]
            request_id = f"pull-{repeat}"
            prefilled = disaggregation_pb2_grpc.PrefillStub(prefill).Prefill(
                disaggregation_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling=greedy),
                timeout=_CALL_TIMEOUT_S,
            )
            call = disaggregation_pb2.DecodeRequest(
                request_id=request_id,
                prompt_token_ids=prompt,
                first_token_id=prefilled.first_token_id,
                sampling=greedy,
                kv=prefilled.kv,
            )
            responses = list(disaggregation_pb2_grpc.DecodeStub(decode).Decode(call, timeout=_CALL_TIMEOUT_S))
            transfer = responses[0].kv_transfer
            if transfer.recomputed or transfer.num_pulled_blocks != len(prefilled.kv.block_ids):
                raise RuntimeError(f"pulled {transfer.num_pulled_blocks} of {len(prefilled.kv.block_ids)} blocks")
            if repeat:
                seconds.append(transfer.seconds)
                num_bytes.append(transfer.num_bytes)
    return PullFigures(
        pull_ms_median=1000 * statistics.median(seconds),
        pull_ms_min=1000 * min(seconds),
        num_bytes=statistics.median(num_bytes),
        num_blocks=len(prefilled.kv.block_ids),
        fingerprint_dtype=prefilled.kv.fingerprint.dtype,
        prefill_shape=(
            prefilled.kv.fingerprint.tensor_parallel_size or 1,
            len(prefilled.kv.fingerprint.stage_first_layers) or 1,
        ),
    )
