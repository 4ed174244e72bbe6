"""What a large request body costs the gateway's event loop (gateway/body_check.py)::

    python -m microbench.request_bodies --output-json request_bodies.json

For each body (an 8 MiB chat of 240,000 messages, a prompt of 4,000,000 token ids, an 8 KiB
prompt of nulls that fails validation in every member of the prompt's union, and a valid 8 MiB
prompt string), three ways of parsing it, each timed by how long the event loop could not run
(the largest gap between the 1 ms ticks of a task on the loop, in ms; the median over
``--rounds``):

- ``on_loop``: as FastAPI parses a body, ``json.loads`` then pydantic, on the loop;
- ``in_thread``: the same on a worker thread (the GIL: the loop waits about as long);
- ``checked``: as the gateway does now: :func:`gateway.body_check.check_body` in a worker
  process, then, for a body it accepts, FastAPI's parse on the loop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

from pydantic import BaseModel, ValidationError

from gateway.body_check import INLINE_MAX_BYTES, check_body
from gateway.flags import DEFAULT_MAX_JSON_VALUES
from gateway.protocol import ChatCompletionRequest, CompletionRequest


def bodies(scale: float) -> dict[str, tuple[type[BaseModel], bytes]]:
    """The bodies, their sizes times ``scale`` (1: the measurement; less: a smoke run)."""
    chat = {"messages": [{"role": "user", "content": "x"}] * int(240_000 * scale)}
    ids = {"prompt": [1] * int(4_000_000 * scale)}
    nulls = {"prompt": [None] * ((INLINE_MAX_BYTES - 16) // 5)}  # parsed inline, whatever the scale
    return {
        "chat_240k_messages": (ChatCompletionRequest, json.dumps(chat).encode()),
        "prompt_4m_ids": (CompletionRequest, json.dumps(ids, separators=(",", ":")).encode()),
        "prompt_8k_nulls": (CompletionRequest, json.dumps(nulls, separators=(",", ":")).encode()),
        "prompt_8m_chars": (CompletionRequest, json.dumps({"prompt": "x" * int(8_000_000 * scale)}).encode()),
    }


def parse_as_fastapi(model: type[BaseModel], body: bytes) -> None:
    try:
        model.model_validate(json.loads(body))
    except ValidationError as error:
        error.errors()  # FastAPI reads them to answer


async def loop_gap_ms(work: Callable[[], Awaitable[object]]) -> float:
    """The longest the loop went without running a 1 ms ticker while ``work`` ran."""
    done, longest = False, 0.0

    async def ticker() -> None:
        nonlocal longest
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            longest, last = max(longest, now - last), now

    ticking = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    await work()
    done = True
    await ticking
    return longest * 1000


async def measure(rounds: int, scale: float) -> dict[str, dict[str, float]]:
    loop = asyncio.get_running_loop()
    results: dict[str, dict[str, float]] = {}
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as processes:
        await loop.run_in_executor(processes, len, b"")  # started before the first timing

        async def checked(model: type[BaseModel], body: bytes) -> None:
            """As the gateway: a small body straight to FastAPI, a large one checked first."""
            if len(body) > INLINE_MAX_BYTES:
                refused = await loop.run_in_executor(processes, check_body, model, body, DEFAULT_MAX_JSON_VALUES)
                if refused is not None:
                    return
            parse_as_fastapi(model, body)

        for name, (model, body) in bodies(scale).items():

            async def on_loop(model: type[BaseModel] = model, body: bytes = body) -> None:
                parse_as_fastapi(model, body)

            async def in_thread(model: type[BaseModel] = model, body: bytes = body) -> None:
                await asyncio.to_thread(parse_as_fastapi, model, body)

            async def in_process(model: type[BaseModel] = model, body: bytes = body) -> None:
                await checked(model, body)

            results[name] = {
                way: statistics.median([await loop_gap_ms(work) for _ in range(rounds)])
                for way, work in (("on_loop", on_loop), ("in_thread", in_thread), ("checked", in_process))
            }
            results[name]["body_mib"] = len(body) / 2**20
            print(name, {key: round(value, 1) for key, value in results[name].items()}, file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0, help="body sizes times this (less than 1: a smoke run)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    results = asyncio.run(measure(args.rounds, args.scale))
    if args.output_json:
        with open(args.output_json, "w") as output:
            json.dump(results, output, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
