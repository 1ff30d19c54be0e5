"""Shared by the LoRA tests: Hugging Face + PEFT greedy references for the preset adapters."""
from __future__ import annotations

import peft
import torch
import transformers

from engine_core.presets import preset_path

NUM_NEW = 8


def make_prompts(vocab_size: int, lens: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lens]


@torch.inference_mode()
def hf_greedy(model, prompts: list[list[int]], num_new: int = NUM_NEW) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens and per-step logits of `model.generate`, one prompt at a time (no padding)."""
    tokens, logits = [], []
    for p in prompts:
        out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False,
                             return_dict_in_generate=True, output_logits=True, pad_token_id=0)
        tokens.append(out.sequences[0, len(p):].tolist())
        logits.append(torch.cat(out.logits).float())
    return tokens, logits


def peft_model(model_preset: str, adapter_folder) -> peft.PeftModel:
    base = transformers.AutoModelForCausalLM.from_pretrained(preset_path(model_preset), dtype=torch.float32)
    return peft.PeftModel.from_pretrained(base, str(adapter_folder)).eval()
