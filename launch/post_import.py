"""Post-import hooks: run a callback on a module right after the script imports it (dpro-launch's auto-attach).

``finder()`` returns the process's one ``PostImportFinder`` (first on ``sys.meta_path``); a plugin registers
``when_imported("torch.nn.parallel.distributed", patch)``. Nothing is imported ahead of the script: the
finder only wraps the real loader of a module the script imports anyway. A failing callback is reported and
never breaks the user's import. Standard library only: this runs at every interpreter start.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["PostImportFinder", "finder"]


class _ThenLoader(importlib.abc.Loader):
    """Runs the real loader, then a callback on the fresh module; the module keeps the real loader."""

    def __init__(self, inner: Any, callback: Callable[[ModuleType], None]) -> None:
        self.inner = inner
        self.callback = callback

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.inner
        if module.__spec__ is not None:
            module.__spec__.loader = self.inner
        self.inner.exec_module(module)
        _run_callback(self.callback, module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _run_callback(callback: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        callback(module)
    except Exception as err:  # never break the user's import
        print(f"[dpro] could not attach to {module.__name__}: {type(err).__name__}: {err}", file=sys.stderr,
              flush=True)


class PostImportFinder(importlib.abc.MetaPathFinder):
    """On ``sys.meta_path``: calls ``callbacks[name](module)`` once module ``name`` has been executed."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callable[[ModuleType], None]]] = {}

    def when_imported(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        """``callback(module)`` once ``name`` is imported (at once if it already is)."""
        module = sys.modules.get(name)
        if module is not None:
            _run_callback(callback, module)
        else:
            self.callbacks.setdefault(name, []).append(callback)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        callbacks = self.callbacks.pop(fullname, None)
        if not callbacks:
            return None
        for other in sys.meta_path:
            if other is self or not hasattr(other, "find_spec"):
                continue
            spec = other.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec

        def run_all(module: ModuleType) -> None:
            for callback in callbacks:
                _run_callback(callback, module)

        spec.loader = _ThenLoader(spec.loader, run_all)
        return spec


def finder() -> PostImportFinder:
    """The process's post-import finder, put first on ``sys.meta_path`` the first time."""
    for existing in sys.meta_path:
        if isinstance(existing, PostImportFinder):
            return existing
    new = PostImportFinder()
    sys.meta_path.insert(0, new)
    return new
