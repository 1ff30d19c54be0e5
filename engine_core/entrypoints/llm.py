"""The offline facade: `LLM(model=..., **engine args).generate(prompts, sampling_params)`, and `.chat(messages)`."""
from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

from tqdm.auto import tqdm

from engine_core.engine import LLMEngine
from engine_core.guard import ThreadGuard, guarded_session
from engine_core.lora.request import LoRARequest
from engine_core.prompts import PromptType, as_prompt_list
from engine_core.request import Request, RequestOutput, SamplingParams
from engine_core.validation import fail

ChatMessage = dict[str, Any]  # {"role": "system" | "user" | "assistant", "content": str}


class GenerationError(RuntimeError):
    """Requests of one `LLM.generate` call finished with an error (a fault in their forward, NaN
    logits). Raised once the whole batch has run: `outputs` holds every output in prompt order,
    the failed ones (finish_reason "error", `.error` says why) included; `failed` their indices."""

    def __init__(self, outputs: list[RequestOutput], failed: list[int]) -> None:
        self.outputs, self.failed = outputs, failed
        shown = "; ".join(f"prompt {i}: {outputs[i].error}" for i in failed[:3])
        super().__init__(f"{len(failed)} of {len(outputs)} request(s) failed: {shown}{' ...' if len(failed) > 3 else ''}")


class LLM:
    """`model` is a checkpoint folder or a preset name (engine_core.presets); keyword arguments are
    EngineConfig fields (vLLM's names)."""

    def __init__(self, model: str = "tiny-llama", **engine_args: Any) -> None:
        self.engine = LLMEngine.from_kwargs(model, **engine_args)
        self._ids = itertools.count()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order. A prompt is a string, a list of token ids,
        {"prompt": text} or {"prompt_token_ids": ids} (mixed is fine); one SamplingParams for all, or
        one per prompt; likewise one LoRARequest (or None: the base model) for all, or one per prompt.
        Every prompt is validated before any is queued: a ValueError (naming the prompt's index)
        leaves the engine as it was. Whatever ends the call early (an exception, KeyboardInterrupt)
        aborts its requests, so the engine is left as it was found. A request aborted elsewhere
        (`engine.abort_request` from another thread) comes back with finish_reason "abort"; requests
        that fail raise GenerationError once the batch is done. One call at a time: a second,
        concurrent or from inside a step, gets EngineBusyError."""
        prompt_list = as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        loras = _as_lora_list(lora_request, len(prompt_list))
        outputs = self._generate(prompt_list, params, loras, use_tqdm)
        failed = [i for i, out in enumerate(outputs) if out.outputs[0].finish_reason == "error"]
        if failed:
            raise GenerationError(outputs, failed)
        return outputs

    def chat(self, messages: Sequence[ChatMessage] | Sequence[Sequence[ChatMessage]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"} dicts) or a list of them,
        rendered with the tokenizer's chat template (or `chat_template`), then generated like `generate`
        (one RequestOutput per conversation, `.prompt` the rendered text). Generation stops at the
        model's EOS, which for a chat model is the template's end-of-turn token (SmolLM2: `<|im_end|>`)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError(f"LLM.chat needs a tokenizer with a chat template; model folder "
                             f"{str(self.engine.model_config.path)!r} has none")
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat_template must be given: the model's tokenizer has no chat template")
        if chat_template is not None and not isinstance(chat_template, str):
            fail("chat_template", "a Jinja template str or None (the tokenizer's own)", chat_template)
        for name, flag in (("add_generation_prompt", add_generation_prompt),
                           ("continue_final_message", continue_final_message)):
            if not isinstance(flag, bool):
                fail(name, "a bool", flag)
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message must not both be True "
                             "(continue the last message, or open a new assistant turn)")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            fail("chat_template_kwargs", "a dict or None", chat_template_kwargs)
        conversations = _as_conversations(messages)
        texts = [tokenizer.apply_chat_template(conv, chat_template=chat_template, tokenize=False,
                                               add_generation_prompt=add_generation_prompt,
                                               continue_final_message=continue_final_message,
                                               **(chat_template_kwargs or {}))
                 for conv in conversations]
        # the template writes the special tokens itself: tokenize without adding BOS again (vLLM does the same)
        prompts = [{"prompt_token_ids": tokenizer.encode(t, add_special_tokens=False)} for t in texts]
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        for out, text in zip(outputs, texts):
            out.prompt = text
        return outputs

    def shutdown(self) -> None:
        """Stop the worker processes of a parallel engine (tensor/pipeline_parallel_size > 1); garbage
        collection and interpreter exit do it too."""
        self.engine.shutdown()

    @property
    def guard(self) -> ThreadGuard:
        return self.engine.guard

    @guarded_session("LLM.generate()")
    def _generate(self, prompts: list[PromptType], params: list[SamplingParams], loras: list[LoRARequest | None],
                  use_tqdm: bool) -> list[RequestOutput]:
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        added: dict[str, tuple[Request, str | None]] = {}  # id -> (request, prompt text)
        done: dict[str, RequestOutput] = {}
        try:
            for i, (rid, prompt, sp, lora) in enumerate(zip(ids, prompts, params, loras)):
                try:
                    request = self.engine.add_request(rid, prompt, sp, lora_request=lora)
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}") from e
                added[rid] = (request, self.engine.requests[rid][1])
            self._run(added, done, use_tqdm)
        finally:  # all of them: an interrupt may land between add_request and `added`
            self.engine.abort_request([rid for rid in ids if rid not in done])  # holds Ctrl-C itself
        return [done[rid] for rid in ids]

    def _run(self, added: dict[str, tuple[Request, str | None]], done: dict[str, RequestOutput],
             use_tqdm: bool) -> None:
        """Step until every request in `added` has its final output in `done`."""
        pending = set(added)
        aborts_seen = self.engine.num_aborted
        start, num_tokens = time.perf_counter(), 0
        with tqdm(total=len(added), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while pending:
                for out in self.engine.step():
                    if out.request_id in pending:
                        num_tokens += 1  # each step's output is one new token for its request
                        if out.finished:
                            pending.discard(out.request_id)
                            done[out.request_id] = out
                            bar.update(1)
                if self.engine.num_aborted != aborts_seen:  # aborted elsewhere: no output will come
                    aborts_seen = self.engine.num_aborted
                    for rid in [rid for rid in pending if added[rid][0].is_finished]:
                        pending.discard(rid)
                        done[rid] = self.engine.make_output(*added[rid])
                        bar.update(1)
                if pending and not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"requests {sorted(pending)[:4]} left the engine without a final output "
                                       f"(stepped or aborted by another caller?)")
                rate = num_tokens / max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(f"output {rate:.1f} tok/s", refresh=False)


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, (list, tuple)):
        fail("sampling_params", "a SamplingParams, a list of them (one per prompt) or None", params)
    if len(params) != n:
        raise ValueError(f"sampling_params must be one SamplingParams or a list of {n} (one per prompt), "
                         f"got {len(params)}")
    return list(params)


def _as_lora_list(lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int) -> list[LoRARequest | None]:
    """One per prompt; each is checked by add_request (a wrong type there names the prompt)."""
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    if not isinstance(lora, (list, tuple)):
        fail("lora_request", "a LoRARequest, a list of them (one per prompt; None: the base model) or None", lora)
    if len(lora) != n:
        raise ValueError(f"lora_request must be one LoRARequest, None, or a list of {n} (one per prompt), "
                         f"got {len(lora)}")
    return list(lora)


def _as_conversations(messages: Any) -> list[list[ChatMessage]]:
    """`LLM.chat`'s first argument: one conversation or a list of them; each message a dict with a str
    "role" and a str "content" (extra keys, such as "name", go to the template as they are)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        fail("messages", "a non-empty list of {'role': str, 'content': str} dicts, or a list of such lists",
             messages)
    batched = isinstance(messages[0], (list, tuple))
    conversations = list(messages) if batched else [messages]
    for i, conv in enumerate(conversations):
        where = f"messages[{i}]" if batched else "messages"
        if not isinstance(conv, (list, tuple)) or not conv:
            fail(where, "a non-empty list of {'role': str, 'content': str} dicts", conv)
        for j, msg in enumerate(conv):
            if not (isinstance(msg, dict) and isinstance(msg.get("role"), str) and isinstance(msg.get("content"), str)):
                fail(f"{where}[{j}]", "a dict with a str 'role' and a str 'content'", msg)
    return [list(conv) for conv in conversations]
