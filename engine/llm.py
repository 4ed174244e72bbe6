"""The offline Python API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.engine_core import EngineCore
from engine.outputs import CompletionOutput, EngineCoreOutput, RequestOutput
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | list[int]


@dataclass(slots=True)
class _Tracked:
    prompt: str | None
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    wants_logprobs: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    output: RequestOutput | None = None


class LLM:
    """Generate completions for a batch of prompts with continuous batching.

    ``model`` is a local Hugging Face folder or GGUF file, or None for the embedded default
    (SmolLM2-135M-Instruct); every other keyword is an :class:`EngineConfig` field.
    """

    def __init__(self, model: str | None = None, **config: object) -> None:
        self.engine = EngineCore(EngineConfig(model=model, **config))  # type: ignore[arg-type]
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(self.engine.metadata_path))

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (``with LLM(...) as llm:`` does it on leaving;
        otherwise they exit with this process)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt (text, or a list of token ids) to completion; outputs in prompt order.

        A prompt the engine cannot serve raises ValueError before any work runs,
        and leaves the engine as it was."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = _broadcast(sampling_params, len(prompts))
        tracked: dict[str, _Tracked] = {}
        try:
            for prompt, params in zip(prompts, params_list, strict=True):
                prompt_text, token_ids = self._tokenize(prompt)
                item = _Tracked(
                    prompt=prompt_text,
                    prompt_token_ids=token_ids,
                    detokenizer=IncrementalDetokenizer(self.tokenizer, token_ids, params),
                    wants_logprobs=params.logprobs is not None,
                )
                request_id = self.engine.add_request(token_ids, params, request_id=uuid.uuid4().hex)
                tracked[request_id] = item
        except ValueError:
            self.engine.abort(list(tracked))
            self.engine.step()  # drain the abort notices so the next call starts clean
            raise
        while self.engine.has_unfinished_requests():
            for core_output in self.engine.step():
                item = tracked.get(core_output.request_id)
                if item is not None and item.output is None:
                    item.output = self._absorb(item, core_output)
        # tracked is in prompt order already
        return [item.output for item in tracked.values() if item.output is not None]

    def chat(self, messages: list[dict[str, str]], sampling_params: SamplingParams | None = None) -> RequestOutput:
        """One conversation through the model's chat template."""
        encoded = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return self.generate([list(encoded["input_ids"])], sampling_params)[0]

    def _absorb(self, item: _Tracked, core_output: EngineCoreOutput) -> RequestOutput | None:
        """Fold one step's tokens into a request; returns its final output once it ends."""
        item.token_ids.extend(core_output.new_token_ids)
        item.logprobs.extend(core_output.new_logprobs)
        update = item.detokenizer.update(core_output.new_token_ids)
        finish_reason, stop_reason = core_output.finish_reason, core_output.stop_reason
        if update.stop_string is not None:
            if finish_reason is None:
                self.engine.finish_with_stop_string(core_output.request_id, update.stop_string)
            finish_reason, stop_reason = "stop", update.stop_string
        elif finish_reason is not None:
            item.detokenizer.flush()
        if finish_reason is None:
            return None
        return RequestOutput(
            request_id=core_output.request_id,
            prompt=item.prompt,
            prompt_token_ids=item.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=0,
                    text=item.detokenizer.output_text,
                    token_ids=list(item.token_ids),
                    finish_reason=finish_reason,
                    stop_reason=stop_reason,
                    logprobs=list(item.logprobs) if item.wants_logprobs else None,
                )
            ],
            finished=True,
            num_cached_tokens=core_output.num_cached_tokens,
        )

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)


def _broadcast(sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    if len(sampling_params) != count:
        raise ValueError(f"got {len(sampling_params)} SamplingParams for {count} prompts; pass one, or one per prompt")
    return list(sampling_params)
