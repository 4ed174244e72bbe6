"""A prefill-side UCX connector in its own process, for tests: fills a KV cache with
seeded random data, publishes blocks for requests "r", "slow" and "run" (any pull may
read them; "drafted" with an EAGLE draft KV attached, :func:`seeded_draft_kv`) and "guarded"
(only a pull presenting ``GUARDED_TOKEN``), prints its
address, and serves until stdin closes; then it waits up to ``--drain-seconds`` for
connections to close and prints its connector's state as one JSON line
(:class:`PeerState`). Run as ``python -m tests.kv_connector.ucx_peer``.

Commands on stdin, one per line, each answered with one line once done: ``drop`` closes
every connection from a decode side (``dropped``); ``unpublish NAME`` unpublishes a
request (``unpublished``); ``state`` prints the state as at exit; ``held`` answers
``holding`` once the message ``--hold`` names is held back; ``release`` lets it go, and
answers once its send is over (``released sent`` or ``released failed``).

``--hold NAME:K`` holds back message K (from 0) of the first pull of request NAME until
the ``release`` command, without blocking the peer's event loop: the other messages of that
pull go out, that one does not.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import sys
import time
from dataclasses import asdict, dataclass

import torch

from engine.spec_decode.prompt_draft_kv import DraftKVShape, PromptDraftKV
from kv_connector.fingerprint import Fingerprint
from kv_connector.ucx import UCXConnector
from kv_connector.wire import PullReply, PullRequest

SHAPE = (12, 2, 2, 16, 2, 8)  # blocks, layers, K/V, block_size, kv_heads, head_dim (block-major)
PUBLISHED_BLOCKS = [5, 2, 9, 7]
SLOW_BLOCKS = [1, 10, 3, 11]  # request "slow", for stalls
RUN_BLOCKS = [6, 7, 8, 9]  # request "run": consecutive ids
GUARDED_BLOCKS = [0, 4]  # request "guarded", published with a pull token
GUARDED_TOKEN = bytes(range(16))
DRAFTED_BLOCKS = [3, 4]  # request "drafted": a prompt of DRAFTED_TOKENS, with a draft KV from DRAFT_START
DRAFTED_TOKENS = 32
DRAFT_START = 8  # as if P's prefix cache had held the prompt's first 8 tokens
DRAFT_SHAPE = DraftKVShape(num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float32, device=torch.device("cpu"))


@dataclass(frozen=True, slots=True)
class PeerState:
    transfers_in_flight: int
    serving_connections: int
    messages_sent: int = 0
    refused: int = 0  # connections and pulls refused


def fingerprint(model: str = "tiny-0123") -> Fingerprint:
    return Fingerprint(
        model=model,
        dtype="bfloat16",
        block_size=SHAPE[3],
        num_layers=SHAPE[1],
        num_kv_heads=SHAPE[4],
        head_dim=SHAPE[5],
    )


def seeded_cache(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def seeded_draft_kv(seed: int) -> PromptDraftKV:
    """The draft KV "drafted" carries: positions DRAFT_START .. DRAFTED_TOKENS - 1."""
    draft = DRAFT_SHAPE.empty(DRAFT_START, DRAFTED_TOKENS - DRAFT_START)
    draft.kv.copy_(torch.randn(draft.kv.shape, generator=torch.Generator().manual_seed(seed + 1)))
    return draft


_SENDING = contextvars.ContextVar("request id of the pull whose messages this task sends", default="")


class StallingConnector(UCXConnector):
    """Counts the messages it sends, and holds back message ``hold_index`` of the first pull of
    ``hold_request`` until :attr:`release` is set."""

    def __init__(self, *args, hold: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._hold_request, _, hold_index = hold.partition(":")
        self._hold_index = int(hold_index or -1)
        self.release = asyncio.Event()
        self.holding = asyncio.Event()
        self.held: asyncio.Future | None = None  # the held-back send, once asked for
        self.num_sends = 0

    async def _send_blocks(
        self,
        endpoint,
        pull_number: int,
        reply: PullReply,
        request: PullRequest,
        draft_kv: PromptDraftKV | None = None,
    ) -> None:
        _SENDING.set(request.request_id)  # this pull's own task: its context only
        await super()._send_blocks(endpoint, pull_number, reply, request, draft_kv)

    def _send(self, endpoint, blocks: object, tag: int) -> asyncio.Future:
        self.num_sends += 1
        index = tag & 0xFFFFFFFF
        if self.held is None and _SENDING.get() == self._hold_request and index == self._hold_index:

            async def held() -> None:
                await self.release.wait()
                await super(StallingConnector, self)._send(endpoint, blocks, tag)

            self.held = asyncio.ensure_future(held())
            self.holding.set()
            return self.held
        return super()._send(endpoint, blocks, tag)

    def state(self) -> PeerState:
        return PeerState(self.num_transfers_in_flight, self.num_connections, self.num_sends, self.num_refused)

    async def drop_connections(self) -> None:
        """Close every decode-side connection, as a restarted prefill instance would have."""
        for endpoint in list(self._serving):
            await endpoint.close()


async def serve(args: argparse.Namespace) -> None:
    cache = seeded_cache(args.seed)
    connector = StallingConnector(
        cache,
        fingerprint(args.model),
        hold=args.hold,
        idle_timeout_s=args.idle_timeout,
        max_connections=args.max_connections,
        first_frame_timeout_s=args.first_frame_timeout,
    )
    address = await connector.start("127.0.0.1", args.port)
    for name, blocks in (("r", PUBLISHED_BLOCKS), ("slow", SLOW_BLOCKS), ("run", RUN_BLOCKS)):
        await connector.publish(name, blocks, token_ids=list(range(60)))
    await connector.publish("guarded", GUARDED_BLOCKS, token_ids=list(range(30)), pull_token=GUARDED_TOKEN)
    await connector.publish("drafted", DRAFTED_BLOCKS, token_ids=list(range(DRAFTED_TOKENS)))
    connector.attach_draft_kv("drafted", seeded_draft_kv(args.seed))
    print(address, flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):  # "" once the test closes stdin
        command, *operands = line.split()
        if command == "drop":
            await connector.drop_connections()
            while connector.num_connections:
                await asyncio.sleep(0.01)
            print("dropped", flush=True)
        elif command == "unpublish":
            await connector.unpublish(operands[0])
            print("unpublished", flush=True)
        elif command == "state":
            print(json.dumps(asdict(connector.state())), flush=True)
        elif command == "held":
            await connector.holding.wait()
            print("holding", flush=True)
        elif command == "release":
            connector.release.set()
            if connector.held is None:
                raise ValueError("release: no send is held back (bug in the test)")
            outcome = (await asyncio.gather(connector.held, return_exceptions=True))[0]
            print("released " + ("failed" if isinstance(outcome, BaseException) else "sent"), flush=True)
        else:
            raise ValueError(f"unknown command {line!r}")
    deadline = time.monotonic() + args.drain_seconds  # connections the test closed end on their own, soon
    while connector.num_connections and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    print(json.dumps(asdict(connector.state())), flush=True)
    await connector.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="tiny-0123")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--hold", default="", metavar="NAME:K", help="hold message K of NAME's first pull")
    parser.add_argument("--max-connections", type=int, default=1024)
    parser.add_argument("--first-frame-timeout", type=float, default=10.0)
    parser.add_argument(
        "--drain-seconds",
        type=float,
        default=0.0,
        help="wait up to this long for open connections to end before reporting",
    )
    parser.add_argument(
        "--idle-timeout", type=float, default=60.0, help="close connections that carried no pull for this long"
    )
    asyncio.run(serve(parser.parse_args()))
