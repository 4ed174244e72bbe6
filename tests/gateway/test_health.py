"""The gateway's ``/health`` follows its own discovery loop: once that loop has died the
gateway no longer learns of instances coming and going, and says so with a 503."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from gateway.app import create_app
from gateway.discovery import DiscoveryLoop
from gateway.generation import GenerationService
from gateway.instances import InstancePool
from gateway.metrics import GatewayMetrics
from gateway.tokenizer import ModelTokenizer
from tests.checkpoints import make_checkpoint


class CrashingDiscovery:
    """Polls until told to fail, then raises as a bug in a discovery would."""

    def __init__(self) -> None:
        self.crash = asyncio.Event()

    async def run(self) -> None:
        await self.crash.wait()
        raise RuntimeError("a bug in instance discovery")


def test_health_answers_503_once_discovery_has_died(tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path)

    async def scenario() -> None:
        pool = InstancePool(stale_after_s=5.0)
        tokenizer = ModelTokenizer(model)
        service = GenerationService(pool, tokenizer, GatewayMetrics(pool), 4, 60.0, None, False)
        discovery = CrashingDiscovery()
        loop = DiscoveryLoop(discovery)  # type: ignore[arg-type] - anything with run()
        app = create_app(service, "tiny", None, discovery_alive=lambda: loop.alive)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
                assert (await client.get("/health")).status_code == 200
                discovery.crash.set()
                await asyncio.gather(loop.task, return_exceptions=True)
                health = await client.get("/health")
                assert health.status_code == 503 and "discovery has stopped" in health.text
                assert (await client.get("/ready")).status_code == 503
        finally:
            await loop.stop()
            await pool.close()
            tokenizer.close()

    asyncio.run(scenario())
