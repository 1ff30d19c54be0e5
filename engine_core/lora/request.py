"""`LoRARequest`: which adapter a request runs with (vLLM's names and rules)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from engine_core.validation import check_int, fail


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter folder under a name and an int id. The id is the adapter's identity in the
    engine (prefix-cache key, slot owner): one id, one folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if isinstance(self.lora_path, os.PathLike):
            object.__setattr__(self, "lora_path", os.fspath(self.lora_path))
        if not isinstance(self.lora_name, str) or not self.lora_name:
            fail("lora_name", "a non-empty str", self.lora_name)
        object.__setattr__(self, "lora_int_id", check_int("lora_int_id", self.lora_int_id, 1))
        if not isinstance(self.lora_path, str) or not self.lora_path:
            fail("lora_path", "a non-empty str", self.lora_path, hint="a PEFT adapter folder")
