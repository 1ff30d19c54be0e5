"""Runs a token-id workload through llama.cpp (`llama-cpp-python`), in its own virtual environment.

Standalone on purpose (no engine_core imports), the protocol of `vllm_driver.py`: `vs_llamacpp.py` starts it
with `.venv-llamacpp`'s python, sends the workloads once as a JSON line on stdin (the GGUF path, threads, and
per workload name its token-id prompts and output lengths), then one line `run NAME` per timed run; each
answers one JSON line on stdout:
wall seconds, output token ids, and each request's time to its first token and its decode time. Greedy
(top_k 1), every prompt prefilled anew (`Llama.reset` first: no cached prefix), and EOS ignored as the engine's side does (`Llama.generate` yields until the caller stops).
llama-cpp-python's `Llama` serves one sequence at a time: a batch of requests runs one after the other.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any


def main() -> None:
    spec: dict[str, Any] = json.loads(sys.stdin.readline())
    from llama_cpp import Llama

    if not spec.get("extra_buffer_types", True):  # llama.cpp's --no-extra-bufts: no AMX, no weight repacking
        import llama_cpp.llama_cpp as bindings

        default_params = bindings.llama_model_default_params

        def params():  # Llama() reads its model parameters from this function of the bindings module
            p = default_params()
            p.use_extra_bufts = False
            return p

        bindings.llama_model_default_params = params

    t0 = time.perf_counter()
    llm = Llama(model_path=spec["gguf"], n_ctx=spec["n_ctx"], n_threads=spec["threads"],
                n_threads_batch=spec["threads"], n_batch=512, seed=0, verbose=False)
    run(llm, spec["warm_up_prompts"], [8] * len(spec["warm_up_prompts"]))
    _reply({"ready": True, "start_s": time.perf_counter() - t0, "version": __import__("llama_cpp").__version__})
    for line in sys.stdin:
        w = spec["workloads"][line.strip().partition(" ")[2]]
        t = time.perf_counter()
        tokens, first, decode = run(llm, w["prompts"], w["output_lens"])
        _reply({"wall_s": time.perf_counter() - t, "token_ids": tokens, "first_token_s": first, "decode_s": decode})


def run(llm: Any, prompts: list[list[int]], output_lens: list[int]) -> tuple[list[list[int]], list[float], list[float]]:
    tokens, first, decode = [], [], []
    for prompt, n in zip(prompts, output_lens):
        out: list[int] = []
        llm.reset()  # no prompt prefix reused from the previous request: every request prefills, as the engine's
        t = time.perf_counter()
        t_first = t
        for tok in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if len(out) == 1:
                t_first = time.perf_counter()
            if len(out) == n:
                break
        tokens.append(out)
        first.append(t_first - t)
        decode.append(time.perf_counter() - t_first)
    return tokens, first, decode


def _reply(obj: dict[str, Any]) -> None:
    """One JSON line, marked so that llama.cpp's own prints on stdout cannot be mistaken for it."""
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
