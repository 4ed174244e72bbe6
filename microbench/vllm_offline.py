"""vLLM's offline ``LLM.generate`` on the prompts ``microbench.throughput`` drew, run in an
environment where vLLM is installed (a separate virtualenv: its CPU build pins its own
torch). It imports nothing from this project, so that environment needs only vLLM::

    VENV/bin/python microbench/vllm_offline.py REQUEST.json RESULT.json

``REQUEST.json`` holds ``model``, ``dtype``, ``prompts``, ``warmup_prompts``,
``output_len`` and ``warmup_output_len``; the script writes ``{"elapsed_s": ...,
"num_output_tokens": ...}`` for the timed run only to ``RESULT.json``. A file, not
stdout: vLLM logs to stdout, down to its engine processes' shutdown after the run.
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    request = json.loads(open(argv[1]).read())  # noqa: SIM115 - a one-shot read
    llm = LLM(model=request["model"], dtype=request["dtype"], max_model_len=request["max_model_len"], seed=0)

    def generate(prompts: list[list[int]], output_len: int) -> int:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    if request["warmup_prompts"]:
        generate(request["warmup_prompts"], request["warmup_output_len"])
    start = time.perf_counter()
    num_output_tokens = generate(request["prompts"], request["output_len"])
    elapsed = time.perf_counter() - start
    with open(argv[2], "w") as result:
        json.dump({"elapsed_s": elapsed, "num_output_tokens": num_output_tokens}, result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
