"""Keep the process's open-file limit when ``mlx_lm.utils`` is imported.

On import, ``mlx_lm.utils`` sets ``RLIMIT_NOFILE`` to (2048, 4096), for reading models made
of many files. A server holds one descriptor per connection, and a lowered hard limit cannot
be raised again without privileges: a server the operator allowed 20,000 connections would
refuse the 2,049th, and so would what it starts (a load balancer in the tests). The hook here
runs that one import with ``resource.setrlimit`` turned into a no-op for ``RLIMIT_NOFILE``;
it costs nothing until mlx_lm is imported, wherever that happens first.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import resource
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

_TARGET = "mlx_lm.utils"


class _KeepLimit(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self._loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        real = resource.setrlimit

        def keep_nofile(which: int, limits: tuple[int, int]) -> None:
            if which != resource.RLIMIT_NOFILE:
                real(which, limits)

        resource.setrlimit = keep_nofile
        try:
            self._loader.exec_module(module)
        finally:
            resource.setrlimit = real


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _KeepLimit(spec.loader)
                return spec
        return None


def install() -> None:
    """Before anything imports mlx_lm (idempotent)."""
    if _TARGET not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
