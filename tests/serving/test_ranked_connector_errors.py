"""How rank 0's connector names another rank in its errors (``serving/ranked_connector.py``):
as the rank's worker is named (engine/tensor_parallel/worker.py ``rank_name``), its stage and
tensor-parallel rank, never by the number of its channel. Over a pipe standing for the agent's
channel, no process started."""

from __future__ import annotations

import asyncio
import json
import multiprocessing

import pytest

from kv_connector.base import KVTransferError
from serving.ranked_connector import _RankChannel

# At PP 2 x TP 2 (stage 1's rank 0 is rank 0 itself), this rank's channel is the second of three.
NAME = "pipeline stage 0 tensor-parallel rank 1"


def test_a_failed_call_and_a_rank_that_died_are_named_by_stage_and_rank() -> None:
    ours, theirs = multiprocessing.Pipe()

    async def run() -> list[str]:
        rank = _RankChannel(NAME, ours)
        rank.start(asyncio.get_running_loop())
        errors: list[str] = []
        # The agent answers a call with its connector's error.
        call = asyncio.create_task(rank.call("publish", request_id="r"))
        sent = json.loads(await asyncio.to_thread(theirs.recv_bytes))
        theirs.send_bytes(json.dumps({"id": sent["id"], "ok": False, "error": "no such blocks"}).encode())
        with pytest.raises(KVTransferError) as refused:
            await call
        errors.append(str(refused.value))
        # The rank's process dies with a call unanswered.
        call = asyncio.create_task(rank.call("pull", request_id="r"))
        assert json.loads(await asyncio.to_thread(theirs.recv_bytes))["op"] == "pull"
        theirs.close()
        with pytest.raises(KVTransferError) as died:
            await call
        errors.append(str(died.value))
        # Any later call fails at once (the reader marked the rank gone before failing the calls).
        with pytest.raises(KVTransferError) as later:
            await rank.call("unpublish", request_id="r")
        errors.append(str(later.value))
        return errors

    assert asyncio.run(run()) == [f"{NAME}: no such blocks", f"{NAME} is gone", f"{NAME} is gone"]
