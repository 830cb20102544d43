"""Shared figure plumbing: the Agg backend, per-codec colours stable across figures, saving."""

from __future__ import annotations

import zlib
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display (before pyplot is imported)
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

# Codec presets in a fixed order so a codec keeps its colour in every figure.
_ORDER = ["bf16", "int8", "int4", "kivi-2", "kivi-4", "kcvt-4", "gear", "gear-l", "oscar",
          "lynx", "lynx-int4", "lynx-int8", "lynx-2+6", "lynx-2+2+4", "lynx-oscar", "cachegen"]
_MARKERS = "osD^vP*Xhp<>"


def codec_color(label: str) -> tuple[float, float, float, float]:
    cmap = plt.get_cmap("tab20")
    index = _ORDER.index(label) if label in _ORDER else 16 + zlib.crc32(label.encode()) % 4
    return cmap(index % 20)


def codec_marker(label: str) -> str:
    index = _ORDER.index(label) if label in _ORDER else zlib.crc32(label.encode())
    return _MARKERS[index % len(_MARKERS)]


def new_figure(width_in: float, height_in: float, ncols: int = 1, sharey: bool = False):
    fig, axes = plt.subplots(1, ncols, figsize=(width_in, height_in), sharey=sharey,
                             squeeze=False)
    return fig, list(axes[0])


def save(fig: Figure, out: str | Path, formats: list[str], dpi: int) -> list[Path]:
    """Write `out` with each format's suffix (out=plots/x.png -> plots/x.png, plots/x.pdf)."""
    out = Path(out)
    stem = out.with_suffix("") if out.suffix.lower() in (".png", ".pdf", ".svg") else out
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        if fmt not in ("png", "pdf", "svg"):
            raise ValueError(f"unknown figure format {fmt!r}; use png, pdf or svg")
        path = stem.with_suffix(f".{fmt}")
        fig.savefig(path, dpi=dpi, bbox_inches="tight",
                    metadata={"Creator": "kvsim plot"} if fmt == "png" else None)
        paths.append(path)
    plt.close(fig)
    return paths


def tokens_label(tokens: float) -> str:
    return f"{tokens / 1024:g}K" if tokens >= 1024 and tokens % 1024 == 0 else f"{tokens:g}"
