"""Runs a token-id workload through `vllm.LLM`, in vLLM's own virtual environment.

Standalone on purpose (no engine_core imports): `vs_vllm.py` starts it with the vLLM venv's
python, sends the workload once as a JSON line on stdin, then one line per timed round; each
round answers one JSON line on stdout (wall seconds, output token ids). Greedy, ignore_eos, no
tokenizer (token ids in and out), as the engine's side of the benchmark.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any


def main() -> None:
    spec: dict[str, Any] = json.loads(sys.stdin.readline())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=0, skip_tokenizer_init=True,
              max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"],
              enable_prefix_caching=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
              for n in spec["output_lens"]]
    warm = [TokensPrompt(prompt_token_ids=p) for p in spec["warm_up_prompts"]]
    llm.generate(warm, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False),
                 use_tqdm=False)
    _reply({"ready": True, "start_s": time.perf_counter() - t0})
    for _ in sys.stdin:
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
        _reply({"wall_s": wall, "token_ids": [list(o.outputs[0].token_ids) for o in outs]})


def _reply(obj: dict[str, Any]) -> None:
    """One JSON line, marked so that vLLM's own prints on stdout cannot be mistaken for it."""
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
