"""What a prompt may be, as vLLM accepts it: text, a list of token ids, `{"prompt": text}` or
`{"prompt_token_ids": ids}`.

Anything else is rejected by name, because each used to be taken silently as something else:
bytes iterate as ints (token ids), a numpy array or a tensor iterates as many prompts, a dict
iterates as its keys, `True` is an int. Token ids are checked for type here and for range by the
engine, which knows the vocabulary.
"""
from __future__ import annotations

from typing import Any, TypedDict, Union

from engine_core.validation import check_int_list, fail, is_int


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


PromptType = Union[str, list[int], TextPrompt, TokensPrompt]

_ONE_PROMPT = "a str, a list of int token ids, {'prompt': str} or {'prompt_token_ids': list of int}"


def _hint(value: Any) -> str:
    if isinstance(value, (bytes, bytearray)):
        return "decode bytes to a str first"
    if hasattr(value, "tolist"):
        return "token ids in an array or tensor: pass .tolist()"
    return ""


def parse_prompt(prompt: Any, name: str = "prompt") -> tuple[str | None, list[int] | None]:
    """(text, None) or (None, token ids); ValueError naming `name` for anything else."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        if set(prompt) == {"prompt"}:
            text = prompt["prompt"]
            if not isinstance(text, str):
                fail(f"{name}['prompt']", "a str", text)
            return text, None
        if set(prompt) == {"prompt_token_ids"}:
            return None, check_int_list(f"{name}['prompt_token_ids']", prompt["prompt_token_ids"])
        raise ValueError(f"{name} as a dict must have exactly one key, 'prompt' (text) or 'prompt_token_ids' "
                         f"(a list of ints), got keys {sorted(map(str, prompt))}")
    if isinstance(prompt, (list, tuple)):
        return None, check_int_list(name, prompt)
    fail(name, _ONE_PROMPT, prompt, _hint(prompt))


def as_prompt_list(prompts: Any) -> list[Any]:
    """`LLM.generate`'s first argument: one prompt, or a list (or tuple) of prompts."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(is_int(t) for t in prompts):  # one prompt of token ids
            return [list(prompts)]
        return list(prompts)
    hint = _hint(prompts) or ("an iterable of prompts: pass a list" if hasattr(prompts, "__iter__") else "")
    fail("prompts", f"one prompt ({_ONE_PROMPT}) or a list of them", prompts, hint)
