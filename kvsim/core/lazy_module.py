"""A module imported on first use.

torch (about 2 s to import on a 2-core host), numba (0.5 s) and Triton (0.2 s) are
needed to encode and decode, not to know a codec's streams and sizes. The simulator builds
codecs only for their size tables, so a `kvsim sim` process (and every worker of a sweep)
should not pay for them. Codec modules therefore bind those names to a `LazyModule`:

    if TYPE_CHECKING:
        import torch
    else:
        torch = lazy_module("torch")

Annotations stay unevaluated (`from __future__ import annotations`), so `torch.Tensor` in a
signature costs nothing; the first `torch.<attr>` read at run time imports torch.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any


class LazyModule:
    """Stands for the module `name` until one of its attributes is read. The import goes
    through `importlib.import_module`, so Python's import lock makes a first use from two
    threads at once safe, and both see the same module. Attributes are not cached here:
    a monkeypatch on the real module is seen through this object."""

    __slots__ = ("_lazy_name", "_lazy_module")

    def __init__(self, name: str) -> None:
        self._lazy_name = name
        self._lazy_module: types.ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        module = self._lazy_module
        if module is None:
            module = importlib.import_module(self._lazy_name)
            self._lazy_module = module
        return getattr(module, attr)

    def __repr__(self) -> str:
        state = "imported" if self._lazy_module is not None else "not imported yet"
        return f"<lazy module {self._lazy_name!r} ({state})>"


def lazy_module(name: str) -> Any:
    """`name` itself if it is already imported, else a `LazyModule` for it (typed Any so a
    call site reads like the module; type checkers see the real import under TYPE_CHECKING)."""
    return sys.modules.get(name) or LazyModule(name)
