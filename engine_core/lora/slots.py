"""The GPU slot pool: which adapter sits in which of the `max_loras` slots of the stacked
LoRA weights. Pure bookkeeping (the manager copies the weights), so it is testable alone."""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable


class LoRASlotPool:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    # seam: lab 09 (grader/seams.py)
    def assign(self, needed: Iterable[int], pinned: set[int]) -> list[tuple[int, int]]:
        """Give every adapter in `needed` (one step's) a slot; returns the (lora_int_id, slot) pairs
        whose weights must be copied into their slot now.

        Resident adapters keep their slot and become most recently used. A missing one takes a free
        slot, else evicts the least recently used adapter that is neither needed now nor `pinned`
        (the adapters of running requests). RuntimeError when none can go: the scheduler let more
        distinct adapters run than there are slots. Nothing changes on error."""
        needed = list(dict.fromkeys(needed))
        missing = [i for i in needed if i not in self.slot_of]
        keep = set(needed) | pinned
        victims = [i for i in self.slot_of if i not in keep][:max(0, len(missing) - len(self.free_slots))]
        if len(self.free_slots) + len(victims) < len(missing):
            raise RuntimeError(f"adapters {missing} need slots but all {self.num_slots} (max_loras) hold adapters of "
                               f"running requests {sorted(self.slot_of)}; the scheduler must keep at most max_loras "
                               f"distinct adapters running")
        for i in victims:
            self.free_slots.append(self.slot_of.pop(i))
        for i in needed:
            if i in self.slot_of:
                self.slot_of.move_to_end(i)
        loads = []
        for i in missing:
            self.slot_of[i] = self.free_slots.pop()
            loads.append((i, self.slot_of[i]))
        return loads

    def clear(self) -> None:
        """Every slot free: after a run that raised part-way, a slot may hold half of an adapter's
        weights, so none is trusted and the next step copies its adapters again."""
        self.slot_of.clear()
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
