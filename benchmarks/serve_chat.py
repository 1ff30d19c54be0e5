"""The chat workload of `benchmarks.serve --workload chat`: /v1/chat/completions conversations whose
system prompt is one of a few shared ones and whose user turn varies.

Real chat traffic looks like this: an application sends the same long system prompt with every
user question, so requests share their leading KV blocks. That shared prefix is what the prefix
cache (`--enable-prefix-caching`) and the prefix-aware router save; the varied question is what
they cannot. The texts are plain English so the real model's chat template and tokenizer see
what an application would send; everything is drawn from `random.Random(seed)`.
"""
from __future__ import annotations

import random

SYSTEM_PROMPTS = (
    "You are a patient tutor for a university course on operating systems. Explain every idea from first "
    "principles, define each term the first time you use it, and give one small concrete example. Keep answers "
    "short: at most three paragraphs. If the question is ambiguous, state the reading you chose before answering.",
    "You are the support assistant of an online bookshop. Answer politely and precisely. You may talk about "
    "orders, deliveries, returns within thirty days, gift cards and the loyalty programme. Never invent an order "
    "number or a price; when you do not know, say so and suggest contacting a human agent by e-mail.",
    "You are a senior software engineer reviewing code for a team that writes Python services. Point out bugs "
    "first, then performance problems, then style. Quote the line you talk about, explain why it matters, and "
    "propose the smallest change that fixes it. Prefer the standard library over new dependencies.",
    "You are a travel planner. Suggest itineraries that respect the traveller's budget and pace, mention how "
    "to get from one place to the next by public transport, and warn about seasonal closures. Answer in a short "
    "list of days, each with a morning, an afternoon and an evening.",
)

_TOPICS = ("virtual memory", "a delayed parcel", "a dictionary lookup", "three days in Lisbon", "page faults",
           "a damaged book", "a slow SQL query", "a weekend in the Alps", "thread scheduling", "a refund",
           "an unclosed file handle", "a rainy week in Kyoto")
_FORMS = ("Can you explain {} to me?", "What should I know about {}?", "I have a question about {}: where do I start?",
          "Give me a short answer about {}.", "What is the most common mistake with {}?",
          "Walk me through {} step by step.")

Message = dict[str, str]


def chat_workload(n: int, num_system_prompts: int, output_len: tuple[int, int],
                  seed: int) -> tuple[list[list[Message]], list[int]]:
    """n conversations [system, user] and their output lengths (uniform in `output_len`): the system
    prompt uniformly one of the first `num_system_prompts`, the user question a topic in a phrasing."""
    if not 1 <= num_system_prompts <= len(SYSTEM_PROMPTS):
        raise ValueError(f"--system-prompts must be in [1, {len(SYSTEM_PROMPTS)}], got {num_system_prompts}")
    rng = random.Random(seed)
    conversations, output_lens = [], []
    for _ in range(n):
        system = SYSTEM_PROMPTS[rng.randrange(num_system_prompts)]
        user = rng.choice(_FORMS).format(rng.choice(_TOPICS))
        conversations.append([{"role": "system", "content": system}, {"role": "user", "content": user}])
        output_lens.append(rng.randint(*output_len))
    return conversations, output_lens
