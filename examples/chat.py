"""`make chat`: the engine answering real questions with a real model (SmolLM2-135M-Instruct).

    python -m examples.chat [--model smollm2-135m-instruct] [--max-tokens 96] [--temperature 0] [QUESTION ...]

Every question is one conversation, all batched into one `LLM.chat` call (continuous batching
serves them together); each answer stops at the chat template's end-of-turn token. Prints each
answer with its token count and finish reason, then the batch's output throughput.
"""
from __future__ import annotations

import argparse
import textwrap
import time

from engine_core.entrypoints.llm import LLM
from engine_core.request import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Explain in two sentences what a KV cache is in a transformer.",
    "Give me three tips for writing clear Python code.",
    "Why is the sky blue?",
]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("questions", nargs="*", help="your own questions (default: four built-in ones)")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a preset name or a checkpoint folder")
    ap.add_argument("--system", help="a system prompt (default: the model's own, from its chat template)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    llm = LLM(a.model)
    questions = a.questions or QUESTIONS
    system = [{"role": "system", "content": a.system}] if a.system else []
    conversations = [system + [{"role": "user", "content": q}] for q in questions]
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, seed=a.seed)
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for question, out in zip(questions, outputs):
        answer = out.outputs[0]
        print(f"\nUser: {question}")
        lines = f"Assistant: {answer.text.strip()}".splitlines() or [""]
        print("\n".join(textwrap.fill(line, width=100, subsequent_indent="  ") for line in lines))
        print(f"  [{len(answer.token_ids)} tokens, finish_reason={answer.finish_reason}]")
    total = sum(len(o.outputs[0].token_ids) for o in outputs)
    plural = "s" * (len(outputs) != 1)
    print(f"\n{len(outputs)} conversation{plural}, {total} output tokens in {elapsed:.1f} s "
          f"({total / elapsed:.1f} tok/s)")


if __name__ == "__main__":
    main()
