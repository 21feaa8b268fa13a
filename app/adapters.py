"""Where LoRA adapters may come from: names in the config, paths confined to configured roots.

A path from a request is resolved (symlinks followed) and must land inside one of the roots, and so
must each file in it; the check only inspects paths, so a refused file is never opened.
"""
from __future__ import annotations

from pathlib import Path

from app.engine.errors import InvalidRequestError
from app.protocol.messages import AdapterRef


class AdapterPolicy:
    def __init__(self, roots: list[str], named: dict[str, str]):
        self.roots = [Path(r).expanduser().resolve() for r in roots]
        self.named = dict(named)

    def resolve(self, ref: AdapterRef) -> AdapterRef:
        """The adapter with an absolute, allowed path (or none: the engine may hold it already).
        A configured name keeps its configured path: another one is refused (409), not loaded."""
        path = self._allowed(ref.path, "lora_path") if ref.path is not None else None
        configured = self.named.get(ref.name)
        if configured is not None:
            configured = self._allowed(configured, "lora_adapters")
            if path not in (None, configured):
                raise InvalidRequestError(ref.field, f"LoRA adapter '{ref.name}' is configured with another path; "
                                                     "a name cannot be rebound: use a new name", status=409)
            path = configured
        return AdapterRef(ref.name, path, ref.field)

    def _allowed(self, path: str, field: str) -> str:
        if not self.roots:
            raise InvalidRequestError(field, "loading adapters by path is disabled: the config sets no lora_roots",
                                      status=403)
        candidate = Path(path)
        if not candidate.is_absolute():
            candidate = self.roots[0] / candidate
        resolved = candidate.resolve()
        if not self._inside(resolved):
            raise InvalidRequestError(field, f"{path!r} is outside the configured adapter roots", status=403)
        # The loader opens the files in it: one that links out of the roots is refused too.
        for entry in resolved.iterdir() if resolved.is_dir() else ():
            if not self._inside(entry.resolve()):
                raise InvalidRequestError(field, f"{path!r} holds {entry.name!r}, which links outside the configured "
                                                 "adapter roots", status=403)
        return str(resolved)

    def _inside(self, resolved: Path) -> bool:
        return any(resolved == root or root in resolved.parents for root in self.roots)
