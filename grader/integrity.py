"""Tamper evidence for batch grading.

The learner's code runs in the same process as the tests, so nothing here can stop a
determined attacker (an OS sandbox would); it catches the usual tricks and names them:
replacing grader or pytest functions (`snapshot` / `changed_callables`), editing the kit's
files (`tree_digest`), forging the result the child hands back (`sign` / `verify`).
"""
from __future__ import annotations

import hashlib
import hmac
import sys
from pathlib import Path

GUARDED_PREFIXES = ("grader", "_pytest", "pytest", "pluggy")


def _guarded(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in GUARDED_PREFIXES)


def snapshot() -> dict[str, int]:
    """id of every function/class (and their methods and properties) in the guarded modules."""
    found: dict[str, int] = {}
    for mod_name, module in list(sys.modules.items()):
        if module is None or not _guarded(mod_name) or mod_name.startswith("grader.labtests"):
            continue
        for attr, value in list(vars(module).items()):
            if callable(value):
                found[f"{mod_name}.{attr}"] = id(getattr(value, "__code__", value))
            if isinstance(value, type) and getattr(value, "__module__", None) == mod_name:
                for name, member in list(vars(value).items()):
                    if callable(member) or isinstance(member, (property, staticmethod, classmethod)):
                        found[f"{mod_name}.{attr}.{name}"] = id(getattr(member, "__code__", member))
    return found


def changed_callables(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """Names replaced or deleted since `before` (new names are fine: lazy imports add them)."""
    return sorted(name for name, ident in before.items() if after.get(name) != ident)


def tree_digest(root: Path) -> dict[str, bytes]:
    """Contents of every file under `root` (no caches), to compare and to restore."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def changed_files(before: dict[str, bytes], root: Path) -> list[str]:
    after = tree_digest(root)
    return sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))


def restore(before: dict[str, bytes], root: Path) -> None:
    """Puts the kit back as it was (a tampering submission must not affect the next one)."""
    for name in changed_files(before, root):
        path = root / name
        if name in before:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(before[name])
        else:
            path.unlink()


def sign(key: bytes, payload: str) -> str:
    return hmac.new(key, payload.encode(), hashlib.sha256).hexdigest()


def verify(key: bytes, payload: str, signature: str) -> bool:
    return hmac.compare_digest(sign(key, payload), signature)
