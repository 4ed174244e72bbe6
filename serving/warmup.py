"""One prefill before an instance takes requests: it builds the native kernels and warms
the model's first-call paths (so the first client does not pay for them), and it measures
the instance's prefill rate, which its load report carries from the start. Without a rate
the gateway's admission control cannot tell how long a queue is, and it would admit every
request that arrives while the first prefill runs."""

from __future__ import annotations

import logging
import random
import time

from engine.async_engine import AsyncEngine
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

WARMUP_PROMPT_TOKENS = 512


async def warm_up(engine: AsyncEngine) -> None:
    """Prefill one prompt of random tokens (not shared with any real one) and sample one token."""
    core = engine.core
    num_tokens = max(1, min(WARMUP_PROMPT_TOKENS, core.config.max_num_batched_tokens, core.max_model_len - 2))
    rng = random.Random(0x5EED)
    prompt = [rng.randrange(core.vocab_size) for _ in range(num_tokens)]
    started = time.perf_counter()
    async for _ in engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1), request_id="warmup"):
        pass
    rate = engine.latest_load_report().prefill_tokens_per_s
    logger.info(
        "warm-up prefill of %d tokens took %.2f s (%.0f prompt tokens/s)",
        num_tokens,
        time.perf_counter() - started,
        rate,
    )
