"""What knowing a codec costs: the simulator builds every codec for its streams and sizes,
and must not import torch, numba or Triton to do so (about 2.7 s per process here, paid by
every `kvsim sim` and every sweep worker). The codecs still encode and decode: the codec
tests run through the lazily imported modules."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvsim.core.lazy_module import LazyModule, lazy_module
from kvsim.kernels.codec import CODEC_MODULES

KERNELS = Path(__file__).resolve().parents[1] / "kvsim" / "kernels"


def _registers_a_codec(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.ClassDef)
               and any(isinstance(d, ast.Name) and d.id == "register"
                       for d in node.decorator_list)
               for node in ast.walk(tree))


def test_codec_modules_lists_every_module_that_registers_a_codec():
    registering = {".".join(p.relative_to(KERNELS).with_suffix("").parts)
                   for p in KERNELS.rglob("*.py") if _registers_a_codec(p)}
    assert registering == set(CODEC_MODULES)


def test_sizes_of_every_preset_import_neither_torch_nor_numba_nor_triton():
    script = textwrap.dedent("""
        import sys
        import kvsim.sim.run  # what `kvsim sim` imports
        from kvsim.kernels.presets import preset_names, resolve_codec
        from kvsim.core.layout import KVShape

        shape = KVShape(layers=4, kv_heads=2, tokens=1000, head_dim=64)
        for preset in preset_names():
            codec = resolve_codec(preset).build()
            assert codec.size_table(shape).total_bytes > 0, preset
        print(sorted(m for m in ("torch", "numba", "triton") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"


def test_lazy_module_imports_on_first_attribute_and_sees_patches(monkeypatch):
    proxy = LazyModule("colorsys")  # a stdlib module this suite never imports otherwise
    assert "not imported yet" in repr(proxy)
    assert proxy.rgb_to_hsv(1.0, 0.0, 0.0) == (0.0, 1.0, 1.0)
    assert "imported" in repr(proxy) and "not" not in repr(proxy)
    import colorsys

    monkeypatch.setattr(colorsys, "ONE_THIRD", 0.5)
    assert proxy.ONE_THIRD == 0.5  # not a cached copy
    with pytest.raises(AttributeError):
        proxy.no_such_attribute  # noqa: B018
    assert lazy_module("sys") is sys  # already imported: the module itself


def test_lazy_module_of_a_missing_module_fails_at_first_use():
    proxy = LazyModule("kvsim_no_such_module")
    with pytest.raises(ModuleNotFoundError):
        proxy.anything  # noqa: B018
