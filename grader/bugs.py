"""Planted bugs: text edits of a solution notebook's graded cells that a lab's tests must catch."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PlantedBug:
    """`old` -> `new` in the solution cells (plus any `more` edits, applied in order)."""

    name: str
    old: str
    new: str
    more: tuple[tuple[str, str], ...] = field(default=())

    @property
    def edits(self) -> list[tuple[str, str]]:
        return [(self.old, self.new), *self.more]
