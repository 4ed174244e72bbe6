"""KV loaders for engine tests (engine/kv_loader.py's contract, without a connector): one the
test drives by hand, and one that copies between two engines in this process."""

from __future__ import annotations

import threading

import torch

from engine.kv_loader import KVLoad, KVLoader, KVLoadResult
from engine.spec_decode.prompt_draft_kv import PromptDraftKV


class ManualKVLoader(KVLoader):
    """Records the loads the scheduler starts and the ones it cancels, on which thread, and
    reports only the results the test hands it."""

    def __init__(self) -> None:
        super().__init__()
        self.started: list[KVLoad] = []
        self.started_on: list[str] = []  # the thread each load was started on, by name
        self.cancelled: list[str] = []
        self.load_started = threading.Event()  # set at each start; the test clears it

    def start_load(self, load: KVLoad) -> None:
        self.started.append(load)
        self.started_on.append(threading.current_thread().name)
        self.load_started.set()

    def cancel_load(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    def load(self, request_id: str) -> KVLoad:
        """The load started for ``request_id`` (the latest, if several)."""
        return next(load for load in reversed(self.started) if load.request_id == request_id)

    def finish(self, request_id: str, error: str | None = None) -> None:
        """The load of ``request_id`` ended: loaded (``error`` None) or not."""
        self.report(KVLoadResult(request_id, error))


class InProcessKVLoader(KVLoader):
    """Copies a hand-off's KV from another engine's cache in this process as soon as the load
    starts (the KV connector's job, done by hand), or fails it when told to."""

    def __init__(self, source_kv_cache: torch.Tensor, kv_cache: torch.Tensor) -> None:
        super().__init__()
        self.source_kv_cache = source_kv_cache
        self.kv_cache = kv_cache
        self.sources: dict[str, list[int] | None] = {}
        self.prompt_draft_kvs: dict[str, PromptDraftKV] = {}
        self.started: list[KVLoad] = []

    def expect(
        self, request_id: str, source_block_ids: list[int] | None, prompt_draft_kv: PromptDraftKV | None = None
    ) -> None:
        """The hand-off ``request_id`` will load from these of the source's blocks (None: it fails),
        with the EAGLE draft's KV over the prompt if given (as a KV connector brings it)."""
        self.sources[request_id] = source_block_ids
        if prompt_draft_kv is not None:
            self.prompt_draft_kvs[request_id] = prompt_draft_kv

    def start_load(self, load: KVLoad) -> None:
        self.started.append(load)
        source_block_ids = self.sources.pop(load.request_id)
        if source_block_ids is None:
            self.report(KVLoadResult(load.request_id, "told to fail"))
            return
        skip = load.num_local_hit_blocks
        self.kv_cache[load.block_ids[skip:]] = self.source_kv_cache[source_block_ids[skip:]]
        draft = self.prompt_draft_kvs.pop(load.request_id, None)
        self.report(
            KVLoadResult(
                load.request_id, prompt_draft_kv=PromptDraftKV(draft.start, draft.kv.clone()) if draft else None
            )
        )

    def cancel_load(self, request_id: str) -> None:
        """Nothing to stop: a load is over by the time start_load returns."""
