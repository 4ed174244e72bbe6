"""A model runner without a model: the engine core of a simulated instance runs its real
scheduler, block pool, prefix cache, KV events and load reports on top of it, and each step
takes the time a :class:`~simulator.timing_model.TimingProfile` says that step would take on
the hardware it describes.

What it stands in for, and how:

- ``execute``: the step's rows (new tokens and context of each scheduled request) priced by the
  profile, waited out on an event (so that closing the engine cuts a long step short), then
  one token for each request that samples. The tokens are a pure function of the request id
  and position, never an EOS id: a simulated request runs to its ``max_tokens`` (or a stop
  token id it asked for), which is what a load test wants to control.
- The KV cache: a tensor on torch's ``meta`` device, with the real layout and byte counts (the
  fingerprint and the connectors read them) and no memory behind it. It holds the profile's KV
  capacity in tokens unless ``--num-blocks`` says otherwise.
- The model's shape, vocabulary and context length: the model's ``config.json`` (a folder's, or
  a GGUF file's metadata; no weights are read), so that the gateway's tokenizer and the
  instances agree on token ids.

Not simulated (refused at start): tensor parallelism, speculative decoding; a structured-output
request is served as any other (its grammar is not applied to the simulated tokens).
"""

from __future__ import annotations

import logging
import threading
import zlib
from pathlib import Path

import torch
from transformers import AutoConfig

from engine.config import EngineConfig
from engine.engine_core import RunnerFactory
from engine.gguf_files import metadata_folder
from engine.kv_cache_dtype import KVCacheFormat
from engine.kv_cache_utils import kv_cache_bytes_per_block
from engine.model_runner import ModelRunner
from engine.models.llama import ModelShape
from engine.scheduler_output import ModelOutput, SchedulerOutput
from simulator.timing_model import TimingProfile

logger = logging.getLogger(__name__)

SIMULATED_DTYPE = torch.bfloat16  # what a GPU serves; only the KV byte counts depend on it


class SimulatedRunner(ModelRunner):
    """Stands in for :class:`~engine.model_runner.ModelRunner` in an
    :class:`~engine.engine_core.EngineCore`: the attributes the core and the services read,
    set from the folder's config and the profile, and a timed ``execute``. Built by
    :func:`simulated_runner_factory`; deliberately does not run ModelRunner's loading."""

    def __init__(self, config: EngineConfig, model_path: Path, profile: TimingProfile, time_scale: float) -> None:
        if config.world_size != 1 or config.speculative is not None:
            raise ValueError(
                "a simulated instance runs at tensor and pipeline parallel size 1 and without speculative decoding"
            )
        if time_scale <= 0:
            raise ValueError(f"--time-scale must be > 0 (1: the profile's speed), got {time_scale}")
        self.config = config
        self.profile = profile
        self.time_scale = time_scale
        self.device = torch.device("meta")
        self.block_size = config.block_size
        self.tensor_parallel = None
        self.draft_model = None
        self.eagle = None  # no drafter: nothing of one crosses a simulated hand-off
        self.structured_output = None  # set by the engine core; the simulated tokens ignore it
        self.hf_config = AutoConfig.from_pretrained(str(metadata_folder(model_path)))
        self.architecture = (getattr(self.hf_config, "architectures", None) or ["LlamaForCausalLM"])[0]
        self.shape = ModelShape.from_config(self.hf_config, self.architecture)
        self.dtype = SIMULATED_DTYPE
        self.backend_name = "simulated"
        self.kv_format = KVCacheFormat(config.kv_cache_dtype, self.dtype, self.shape.head_dim)
        self.bytes_per_block = kv_cache_bytes_per_block(
            self.shape.num_layers,
            self.block_size,
            self.shape.num_kv_heads,
            self.kv_format.row_elements,
            self.kv_format.cache_dtype.itemsize,
        )
        # The profile's capacity in this engine's block size (the same tokens either way).
        self.num_blocks = config.num_blocks_override or profile.num_kv_blocks * profile.block_size // self.block_size
        self.kv_cache = torch.empty(
            (
                self.num_blocks,
                self.shape.num_layers,
                2,
                self.block_size,
                self.shape.num_kv_heads,
                self.kv_format.row_elements,
            ),
            dtype=self.kv_format.cache_dtype,
            device=self.device,
        )
        model_len = int(getattr(self.hf_config, "max_position_embeddings", 0) or self.num_blocks * self.block_size)
        if config.max_model_len is not None:
            model_len = min(model_len, config.max_model_len)
        self.max_model_len = min(model_len, self.num_blocks * self.block_size)
        self._closed = threading.Event()
        self.num_simulated_seconds = 0.0  # the steps' simulated time, since start
        logger.info(
            "simulated runner: profile %s at time scale %g, %d KV blocks x %d tokens, context %d",
            profile.name,
            time_scale,
            self.num_blocks,
            self.block_size,
            self.max_model_len,
        )

    def execute(self, output: SchedulerOutput, eos_token_ids: frozenset[int]) -> ModelOutput:
        rows = [
            (item.num_new_tokens, item.request.num_computed_tokens + item.num_new_tokens) for item in output.scheduled
        ]
        seconds = self.profile.step_seconds(rows) * self.time_scale
        self.num_simulated_seconds += seconds
        self._closed.wait(seconds)
        sampled = [
            self.token_for(item.request.request_id, item.request.num_tokens, eos_token_ids)
            for item in output.scheduled
            if item.samples
        ]
        return ModelOutput(sampled_token_ids=sampled, logprobs=[None] * len(sampled))

    def token_for(self, request_id: str, position: int, eos_token_ids: frozenset[int]) -> int:
        """The simulated token at ``position`` of a request: spread over the vocabulary, never EOS."""
        token = zlib.crc32(f"{request_id}:{position}".encode()) % self.shape.vocab_size
        while token in eos_token_ids:
            token = (token + 1) % self.shape.vocab_size
        return token

    def close(self) -> None:
        self._closed.set()


def simulated_runner_factory(profile: TimingProfile, time_scale: float = 1.0) -> RunnerFactory:
    """An :data:`engine.engine_core.RunnerFactory` that builds a :class:`SimulatedRunner`."""

    def factory(config: EngineConfig, model_path: Path) -> ModelRunner:
        return SimulatedRunner(config, model_path, profile, time_scale)

    return factory
